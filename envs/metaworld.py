"""Meta-World's 50 Sawyer tasks (metaworld 3.x, v3 environments) through the `Env` interface.

`make_env("metaworld/reach-v3", image_size=64)` builds one task. What the adapter adds to Meta-World:

- **Seeds.** Meta-World draws object and goal positions from a global NumPy stream or from 50 fixed
  tasks per environment. Here the positions come from the seed alone (uniform over the task's own
  reset space, redrawn from the same stream where they break the task's own rule), so `reset(seed)` is
  the same episode in any process, on any worker, after any history.
- **Frames.** Rendered offscreen with `mujoco.Renderer` at the policy's size, from any of the scene's
  cameras, turned so the world's up is up (Meta-World's corner cameras are mounted upside down). Shadows,
  reflections and multisampling are off: several times faster on a CPU, same geometry and colours.
  Several cameras (`camera=["corner", "gripperPOV"]`) are rendered side by side into one frame, so a
  third-person and a wrist view reach the policy as one image, through history, demos and GIFs alike.
- **Instructions.** Meta-World has none; each task gets one sentence (`INSTRUCTIONS`), the kind of
  instruction VLA papers pair with it.
- **Episodes.** Success terminates with reward 1, as in the built-in tasks; `shaping` adds Meta-World's
  own dense reward (scaled to [0, 1]) per step. `max_steps` cuts the 500-step horizon to what the task
  needs (the scripted reach expert succeeds within 70 steps on seeds 0-9).

The action is Meta-World's: end-effector xyz displacement and gripper effort, each in [-1, 1].
The state is the hand's xyz position and the gripper's opening (the first 4 numbers of Meta-World's
39-d observation); objects and goals are for the policy to see, not to read.
"""

from __future__ import annotations

import functools
import pickle
from typing import Any

import numpy as np

from mmrl.envs.base import NO_FRAME, Env, Info, Obs, StepResult
from mmrl.envs.gl import load_mujoco
from mmrl.envs.views import CameraViews

__all__ = ["INSTRUCTIONS", "MetaWorldEnv", "metaworld_expert"]

load_mujoco()  # picks the GL backend before Meta-World imports mujoco

INSTRUCTIONS: dict[str, str] = {
    "assembly-v3": "put the ring on the peg",
    "basketball-v3": "dunk the ball into the basket",
    "bin-picking-v3": "move the cube from one bin to the other",
    "box-close-v3": "put the lid on the box",
    "button-press-topdown-v3": "press the button from the top",
    "button-press-topdown-wall-v3": "press the button from the top, past the wall",
    "button-press-v3": "press the button",
    "button-press-wall-v3": "press the button behind the wall",
    "coffee-button-v3": "push the button on the coffee machine",
    "coffee-pull-v3": "pull the mug out of the coffee machine",
    "coffee-push-v3": "push the mug under the coffee machine",
    "dial-turn-v3": "turn the dial",
    "disassemble-v3": "pull the ring off the peg",
    "door-close-v3": "close the door",
    "door-lock-v3": "lock the door by turning the lock",
    "door-open-v3": "open the door",
    "door-unlock-v3": "unlock the door by turning the lock",
    "hand-insert-v3": "put the hand into the hole",
    "drawer-close-v3": "close the drawer",
    "drawer-open-v3": "open the drawer",
    "faucet-open-v3": "turn the faucet on",
    "faucet-close-v3": "turn the faucet off",
    "hammer-v3": "hammer the nail into the wall",
    "handle-press-side-v3": "press the handle down from the side",
    "handle-press-v3": "press the handle down",
    "handle-pull-side-v3": "pull the handle up from the side",
    "handle-pull-v3": "pull the handle up",
    "lever-pull-v3": "pull the lever up",
    "pick-place-wall-v3": "pick up the puck and place it at the goal behind the wall",
    "pick-out-of-hole-v3": "pick the peg out of the hole",
    "pick-place-v3": "pick up the puck and place it at the goal",
    "plate-slide-v3": "slide the plate into the goal",
    "plate-slide-side-v3": "slide the plate sideways into the goal",
    "plate-slide-back-v3": "slide the plate back out of the goal",
    "plate-slide-back-side-v3": "slide the plate sideways out of the goal",
    "peg-insert-side-v3": "insert the peg into the hole from the side",
    "peg-unplug-side-v3": "unplug the peg from the side",
    "soccer-v3": "kick the ball into the goal",
    "stick-push-v3": "push the bottle with the stick",
    "stick-pull-v3": "pull the bottle with the stick",
    "push-v3": "push the puck to the goal",
    "push-wall-v3": "push the puck around the wall to the goal",
    "push-back-v3": "push the puck back to the goal",
    "reach-v3": "reach the red goal",
    "reach-wall-v3": "reach the red goal over the wall",
    "shelf-place-v3": "place the puck on the shelf",
    "sweep-into-v3": "sweep the puck into the hole",
    "sweep-v3": "sweep the puck off the table",
    "window-open-v3": "slide the window open",
    "window-close-v3": "slide the window closed",
}

_HORIZON = 500  # Meta-World's own episode length; its envs refuse to step past it


def _metaworld() -> Any:
    try:
        import metaworld
        import metaworld.env_dict
        import metaworld.policies
    except ImportError as err:
        raise ImportError(
            f"the Meta-World tasks need the metaworld package ({err}); install mmrl's lockfile, "
            "or `pip install metaworld==3.1.1`"
        ) from err
    return metaworld


class MetaWorldEnv(Env):
    """One Meta-World v3 task; `reset(seed)` draws its object and goal positions from the seed."""

    action_dim = 4
    task_names = tuple(INSTRUCTIONS)

    def __init__(
        self,
        task: str = "reach-v3",
        *,
        image_size: int = 64,
        camera: str | list[str] = "corner",
        max_steps: int = 150,
        shaping: float = 0.0,
    ) -> None:
        if task not in INSTRUCTIONS:
            raise ValueError(f"unknown Meta-World task {task!r}; the tasks are: {', '.join(INSTRUCTIONS)}")
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or not 0 < max_steps <= _HORIZON:
            raise ValueError(f"max_steps must be an integer in [1, {_HORIZON}], got {max_steps!r}")
        metaworld = _metaworld()
        self._cls = metaworld.env_dict.ALL_V3_ENVIRONMENTS[task]
        self._task_kwargs = {
            k: v for k, v in metaworld.env_dict.MT50_V3_ARGS_KWARGS[task]["kwargs"].items() if k != "task_id"
        }
        self._task_type = metaworld.Task
        self.sim = self._cls()
        cameras = [camera] if isinstance(camera, str) else list(camera)
        self.views = CameraViews(self.sim.model, image_size, cameras, "Meta-World")
        self.task, self.image_size, self.cameras = task, image_size, cameras
        self.instruction = INSTRUCTIONS[task]
        self.max_steps, self.shaping = max_steps, float(shaping)
        self._rng = np.random.default_rng()
        self._steps = 0
        self._done = True

    def reset(self, seed: int | None = None) -> tuple[Obs, Info]:
        """A new episode with positions drawn from ``seed`` (or the env's own stream when None)."""
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        data = {
            **self._task_kwargs,
            "env_cls": self._cls,
            "rand_vec": self.sim._random_reset_space.low,  # a placeholder: the reset below draws
            "partially_observable": False,
        }
        self.sim.set_task(self._task_type(env_name=self.task, data=pickle.dumps(data)))
        # Draw positions from the seeded stream inside Meta-World's reset, which redraws those that break
        # the task's own rule (reach: the goal at least 15 cm from the object). A frozen draw that broke
        # it would be redrawn forever: 18 of reach's first 300 seeds hung that way.
        self.sim._freeze_rand_vec = False
        self.sim.seeded_rand_vec = True
        self.sim.np_random = self._rng
        self._raw, _ = self.sim.reset()
        self._steps = 0
        self._done = False
        return self._observe(), {"success": False}

    def step(self, action: np.ndarray, *, render: bool = True) -> StepResult:
        """Move the hand by ``action[:3]`` (clipped to [-1, 1]) and grip with ``action[3]``."""
        a = self._checked_action(action, self._done)
        self._raw, dense, _, _, sim_info = self.sim.step(a.astype(np.float32))
        self._steps += 1
        success = bool(sim_info["success"])
        reward = float(success) + self.shaping * float(dense) / 10.0  # Meta-World's rewards lie in [0, 10]
        truncated = not success and self._steps >= self.max_steps
        self._done = success or truncated
        info: Info = {"success": success, "distance": float(sim_info["obj_to_target"])}
        return self._observe(render), reward, success, truncated, info

    def render(self) -> np.ndarray:
        """The current frame, world-up at the top: image_size x (image_size x cameras) x 3 uint8."""
        return self.views.render(self.sim.data)

    @property
    def raw_observation(self) -> np.ndarray:
        """Meta-World's 39-d observation (hand, gripper, object poses, goal): what its scripted policies read."""
        return self._raw

    @functools.cached_property
    def scripted_policy(self) -> Any:
        """Meta-World's hand-written policy for this task (`get_action(raw_observation)`)."""
        return _metaworld().policies.ENV_POLICY_MAP[self.task]()

    def close(self) -> None:
        self.views.close()
        self.sim.close()

    def _observe(self, render: bool = True) -> Obs:
        return {
            "image": self.render() if render else NO_FRAME,
            "instruction": self.instruction,
            "state": self._raw[:4].astype(np.float32),
        }


def metaworld_expert(env: MetaWorldEnv) -> np.ndarray:
    """Meta-World's own scripted policy for the env's task, reading the true state."""
    return np.asarray(env.scripted_policy.get_action(env.raw_observation), dtype=np.float64)
