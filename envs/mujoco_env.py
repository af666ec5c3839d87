"""What every MuJoCo task shares: load the MJCF, seed the scene, step with action repeat, render, score.

A task subclass only says how to lay out a scene from a seed, what its proprioceptive state is, how far
it is from done, and when it has succeeded or failed; the episode bookkeeping (step limit, reward,
termination, error messages) lives here once, so every task behaves the same to the rollout loop.
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import ClassVar

import numpy as np

from mmrl.envs.base import NO_FRAME, Env, Info, Obs, StepResult
from mmrl.envs.gl import load_mujoco, make_renderer

__all__ = ["ASSETS", "COLOURS", "MujocoEnv"]

mujoco = load_mujoco()

ASSETS = Path(__file__).resolve().parent / "assets"
# Far apart in RGB and from the grey table, the grey arm and the brown block, so a tiny vision model
# can tell them apart at 64x64; the headlight renders camera-facing surfaces at exactly these values.
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.85, 0.1, 0.1),
    "green": (0.1, 0.7, 0.1),
    "blue": (0.1, 0.25, 0.9),
    "yellow": (0.9, 0.85, 0.1),
}


class MujocoEnv(Env):
    """A MuJoCo task with normalised actions mapped linearly onto the actuators' ``ctrlrange``.

    Reward: 1 on the step that succeeds (the episode then terminates), plus ``shaping`` times the
    decrease in the task's distance-to-goal, a potential-based term that leaves the best policy
    unchanged while giving RL a gradient before the first success.
    """

    asset: ClassVar[str]  # MJCF file name under envs/assets
    substeps: ClassVar[int] = 5  # physics steps per action: 0.01 s x 5 = 20 Hz control
    default_max_steps: ClassVar[int]

    def __init__(
        self,
        *,
        image_size: int = 64,
        camera: str = "top",
        max_steps: int | None = None,
        shaping: float = 0.0,
    ) -> None:
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size <= 0:
            raise ValueError(f"image_size must be a positive integer, got {image_size!r}")
        self.model = mujoco.MjModel.from_xml_path(str(ASSETS / self.asset))
        self.data = mujoco.MjData(self.model)
        cameras = [self.model.camera(i).name for i in range(self.model.ncam)]
        if camera not in cameras:
            raise ValueError(
                f"camera {camera!r} is not in {self.asset}; its cameras are: {', '.join(cameras)}"
            )
        self.max_steps = self.default_max_steps if max_steps is None else max_steps
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps <= 0:
            raise ValueError(f"max_steps must be a positive integer, got {self.max_steps!r}")
        self.camera = camera
        self.image_size = image_size
        self.shaping = float(shaping)
        self.action_dim = self.model.nu
        self._ctrl_low, self._ctrl_high = self.model.actuator_ctrlrange.T.copy()
        offscreen = self.model.vis.global_  # the offscreen buffer must hold a frame
        offscreen.offwidth = max(offscreen.offwidth, image_size)
        offscreen.offheight = max(offscreen.offheight, image_size)
        self._renderer = make_renderer(self.model, image_size, image_size)
        self._rng = np.random.default_rng()
        self.instruction = ""
        self.target_colour = ""  # the colour the instruction names, and the others in the scene
        self.distractor_colours: list[str] = []
        self._steps = 0
        self._done = True
        self._distance = 0.0

    # -- what a task defines -------------------------------------------------------------------------
    @abstractmethod
    def _layout(self, rng: np.random.Generator) -> str:
        """Place and colour the scene (qpos, geom positions, rgba, ``target_colour``,
        ``distractor_colours``) from ``rng``; return the instruction."""

    @abstractmethod
    def _state(self) -> np.ndarray:
        """The proprioceptive state vector given to the policy."""

    @abstractmethod
    def goal_distance(self) -> float:
        """Distance from the goal in metres: shaping, logging and the experts all use it."""

    @abstractmethod
    def _success(self) -> bool:
        """Whether the task is achieved in the current physics state."""

    def _failure(self) -> str | None:
        """A reason when the episode is lost early (e.g. touching the wrong object), else None."""
        return None

    # -- the gymnasium-like interface ---------------------------------------------------------------
    def reset(self, seed: int | None = None) -> tuple[Obs, Info]:
        """New scene from ``seed`` (or from the env's own stream when None, as gymnasium does)."""
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        mujoco.mj_resetData(self.model, self.data)
        self.instruction = self._layout(self._rng)
        mujoco.mj_forward(self.model, self.data)
        self._steps = 0
        self._done = False
        self._distance = self.goal_distance()
        return self._observe(), {"success": False, "distance": self._distance}

    def step(self, action: np.ndarray, *, render: bool = True) -> StepResult:
        """Apply ``action`` (clipped to [-1, 1]) for ``substeps`` physics steps and score the result."""
        a = self._checked_action(action, self._done)
        self.data.ctrl[:] = self._controls(a)
        mujoco.mj_step(self.model, self.data, nstep=self.substeps)
        self._steps += 1

        success = self._success()
        failure = None if success else self._failure()
        distance = self.goal_distance()
        reward, terminated, truncated, info = self._outcome(
            success, failure, distance, self._distance, self.shaping, self._steps
        )
        self._distance, self._done = distance, terminated or truncated
        return self._observe(render), reward, terminated, truncated, info

    def close(self) -> None:
        self._renderer.close()

    # -- helpers --------------------------------------------------------------------------------------
    def _controls(self, a: np.ndarray) -> np.ndarray:
        """Actuator controls for a clipped action: each dimension mapped linearly onto its ctrlrange."""
        return self._ctrl_low + (a + 1.0) * 0.5 * (self._ctrl_high - self._ctrl_low)

    def physics_state(self) -> np.ndarray:
        """The full MuJoCo physics state (time, qpos, qvel, actuator state), to check determinism."""
        spec = mujoco.mjtState.mjSTATE_FULLPHYSICS
        state = np.empty(mujoco.mj_stateSize(self.model, spec))
        mujoco.mj_getState(self.model, self.data, state, spec)
        return state

    def render(self) -> np.ndarray:
        """The current frame from ``camera``: image_size x image_size x 3 uint8."""
        self._renderer.update_scene(self.data, camera=self.camera)
        return self._renderer.render()

    def _observe(self, render: bool = True) -> Obs:
        return {
            "image": self.render() if render else NO_FRAME,
            "instruction": self.instruction,
            "state": self._state(),
        }

    def _set_rgba(self, geom: str, colour: str) -> None:
        self.model.geom(geom).rgba[:3] = COLOURS[colour]

    def _geom_xy(self, geom: str) -> np.ndarray:
        return self.data.geom(geom).xpos[:2].copy()
