"""The env interface, registry, MuJoCo tasks (determinism, rendering, success) and scripted experts."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from mmrl import envs
from mmrl.envs import Env, Info, make_env, register_env, registered_envs, registry
from mmrl.envs.base import NO_FRAME
from mmrl.envs.experts import collect_demos, expert_action, push_expert, scripted_expert
from mmrl.envs.mujoco_env import COLOURS, MujocoEnv
from mmrl.envs.push import PushEnv
from mmrl.envs.reach import TIP_SPEED, ReachEnv
from mmrl.envs.registry import EnvOptionError

REPO = Path(__file__).resolve().parent.parent
TASKS = ("reach", "push")


@pytest.fixture(params=TASKS)
def task(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def env(task: str) -> Iterator[MujocoEnv]:
    with make_env(task) as e:
        yield e


def colour_pixels(image: np.ndarray, colour: str, tolerance: int = 30) -> int:
    """How many pixels show ``colour`` (its rgba renders unshaded on camera-facing surfaces)."""
    rgb = np.array(COLOURS[colour]) * 255
    return int((np.abs(image.astype(int) - rgb).max(axis=-1) < tolerance).sum())


def run_episode(env: Env, seed: int, policy: Callable[[Env], np.ndarray]) -> Info:
    env.reset(seed=seed)
    done = False
    while not done:
        _, _, terminated, truncated, info = env.step(policy(env))
        done = terminated or truncated
    return info


# -- registry ---------------------------------------------------------------------------------------
def test_builtin_tasks_are_registered() -> None:
    assert {"reach", "push"} <= set(registered_envs())
    with make_env("reach") as env:
        assert isinstance(env, ReachEnv)


def test_unknown_env_lists_the_registered_ones() -> None:
    with pytest.raises(KeyError, match=r"unknown env 'libero'; registered envs: .*push.*reach"):
        make_env("libero")


def test_unknown_option_lists_the_accepted_ones() -> None:
    with pytest.raises(TypeError, match=r"env 'reach': .*'img_size'.*accepts: image_size, camera, max_steps"):
        make_env("reach", img_size=32)


@pytest.mark.parametrize(
    "task, options, refused",
    [
        ("reach", {"max_steps": 0}, "max_steps must be a positive integer, got 0"),
        ("gridnav", {"max_steps": 0}, "max_steps must be a positive integer, got 0"),
        ("reach", {"camera": "side"}, "camera 'side' is not in"),
    ],
)
def test_an_option_value_the_env_refuses_names_the_env_and_its_options(task, options, refused) -> None:
    with pytest.raises(EnvOptionError) as caught:
        make_env(task, **options)
    shown = ", ".join(f"{key}={value!r}" for key, value in options.items())
    assert str(caught.value).startswith(f"env {task!r} cannot be built with {shown}: ")
    assert refused in str(caught.value)


def test_register_a_new_env_by_decorator_and_by_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # leave no test entries behind

    @register_env("test-reach-short")
    def short_reach(**kwargs: object) -> Env:
        return ReachEnv(max_steps=3, **kwargs)

    assert make_env("test-reach-short", image_size=16).max_steps == 3
    with pytest.raises(ValueError, match="already registered"):
        register_env("test-reach-short", "mmrl.envs.reach:ReachEnv")
    register_env("test-missing-sim", "no_such_simulator.adapter:Env")
    with pytest.raises(ImportError, match="install the simulator it needs"):
        make_env("test-missing-sim")


# -- interface ---------------------------------------------------------------------------------------
def test_observation_and_step_follow_the_interface(env: MujocoEnv) -> None:
    obs, info = env.reset(seed=0)
    assert obs["image"].shape == (64, 64, 3) and obs["image"].dtype == np.uint8
    assert obs["state"].dtype == np.float32 and obs["state"].ndim == 1
    assert isinstance(obs["instruction"], str) and obs["instruction"]
    assert info["success"] is False
    obs, reward, terminated, truncated, info = env.step(np.zeros(env.action_dim))
    assert isinstance(reward, float) and isinstance(info["success"], bool)
    assert not terminated and not truncated


def test_instructions_name_the_target_colour() -> None:
    with make_env("reach") as reach, make_env("push") as push:
        assert reach.reset(seed=0)[0]["instruction"] == f"touch the {reach.target_colour} ball"
        assert push.reset(seed=0)[0]["instruction"] == f"push the block onto the {push.target_colour} patch"


def test_image_size_and_camera_are_configurable() -> None:
    with make_env("push", image_size=96, camera="angled") as env:
        angled = env.reset(seed=1)[0]["image"]
    with make_env("push", image_size=96) as env:
        top = env.reset(seed=1)[0]["image"]
    assert angled.shape == top.shape == (96, 96, 3)
    assert not np.array_equal(angled, top)
    with pytest.raises(ValueError, match="its cameras are: top, angled"):
        make_env("reach", camera="side")


def test_misuse_fails_with_what_to_do(env: MujocoEnv) -> None:
    with pytest.raises(RuntimeError, match=r"call reset\(\)"):
        env.step(np.zeros(env.action_dim))
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        env.step(np.zeros(3))
    with pytest.raises(ValueError, match="finite"):
        env.step(np.array([np.nan, 0.0]))


def test_episode_truncates_at_the_step_limit() -> None:
    with make_env("push", max_steps=5) as env:
        env.reset(seed=0)
        flags = [env.step(np.zeros(2))[2:4] for _ in range(5)]
        assert flags == [(False, False)] * 4 + [(False, True)]
        with pytest.raises(RuntimeError, match="episode has ended"):
            env.step(np.zeros(2))


# -- determinism and rendering ---------------------------------------------------------------------
def test_same_seed_gives_identical_frames_and_states(task: str, env: MujocoEnv) -> None:
    actions = np.random.default_rng(0).uniform(-1, 1, (10, env.action_dim))

    def trace(e: MujocoEnv) -> list[bytes]:
        obs, _ = e.reset(seed=123)
        out = [obs["image"].tobytes(), obs["state"].tobytes(), e.physics_state().tobytes()]
        for a in actions:
            obs, *_ = e.step(a)
            out += [obs["image"].tobytes(), obs["state"].tobytes(), e.physics_state().tobytes()]
        return out

    first = trace(env)
    env.reset(seed=5)  # an episode in between must not leak into the next one
    assert trace(env) == first
    with make_env(task) as fresh:
        assert trace(fresh) == first
    other, _ = env.reset(seed=124)
    assert other["image"].tobytes() != first[0]


def test_frames_show_the_target_colour_and_change_with_it(env: MujocoEnv) -> None:
    frames = {}
    for seed in range(20):
        obs, _ = env.reset(seed=seed)
        assert colour_pixels(obs["image"], env.target_colour) >= 5
        frames.setdefault(env.target_colour, obs["image"])
    assert len(frames) >= 3  # every colour gets to be the target
    images = list(frames.values())
    assert not np.array_equal(images[0], images[1])


def test_recolouring_the_target_changes_only_its_pixels() -> None:
    with make_env("reach") as env:
        obs, _ = env.reset(seed=0)
        unused = next(c for c in COLOURS if c not in (env.target_colour, *env.distractor_colours))
        assert colour_pixels(obs["image"], unused) == 0
        env.model.geom("ball0").rgba[:3] = COLOURS[unused]
        recoloured = env.render()
        assert colour_pixels(recoloured, unused) >= 5
        assert colour_pixels(recoloured, env.target_colour) == 0


# -- success, failure and reward ----------------------------------------------------------------------
def place_fingertip(env: ReachEnv, xy: np.ndarray) -> None:
    """Set the arm's joints so the fingertip sits at ``xy`` (elbow-up inverse kinematics)."""
    link = 0.12
    elbow = np.arccos(np.clip((xy @ xy - 2 * link**2) / (2 * link**2), -1, 1))
    shoulder = np.arctan2(xy[1], xy[0]) - np.arctan2(np.sin(elbow), 1 + np.cos(elbow))
    env.data.qpos[:] = [shoulder, elbow]
    env.data.qvel[:] = 0


def test_reach_succeeds_when_the_fingertip_is_on_the_target() -> None:
    with make_env("reach") as env:
        env.reset(seed=3)
        place_fingertip(env, env.target_xy)
        _, reward, terminated, truncated, info = env.step(np.zeros(2))
        assert info["success"] and terminated and not truncated and reward == 1.0


def test_reach_fails_on_touching_a_distractor() -> None:
    with make_env("reach") as env:
        env.reset(seed=3)
        place_fingertip(env, env.distractor_xy[1])
        _, reward, terminated, _, info = env.step(np.zeros(2))
        assert terminated and not info["success"] and reward == 0.0
        assert info["failure"] == f"touched the {env.distractor_colours[1]} ball"


@pytest.mark.parametrize("direction", [(1.0, 0.0), (0.0, -1.0), (-0.5, 0.5)])
def test_tip_control_moves_the_fingertip_as_asked(direction: tuple[float, float]) -> None:
    asked = np.array(direction)
    with make_env("reach", control="tip") as env:
        env.reset(seed=0)
        env.data.qpos[:] = [0.3, 1.6]  # away from the arm's singular poses (straight or folded)
        env.data.qvel[:] = 0
        env.step(np.zeros(2))
        start = env.tip_xy
        for _ in range(5):
            env.step(asked)
        moved = env.tip_xy - start
    cosine = moved @ asked / (np.linalg.norm(moved) * np.linalg.norm(asked))
    speed = np.linalg.norm(moved) / (5 * 0.05)  # 5 steps of 0.05 s
    assert cosine > 0.98
    assert 0.6 * TIP_SPEED * np.linalg.norm(asked) < speed <= TIP_SPEED * np.linalg.norm(asked)
    with pytest.raises(ValueError, match="control must be 'joint' or 'tip'"):
        make_env("reach", control="cartesian")


def test_the_wrist_camera_centres_the_fingertip_and_shows_where_the_target_lies() -> None:
    with make_env("reach", camera="wrist", image_size=84) as env:
        for seed in range(5):
            frame = env.reset(seed=seed)[0]["image"]
            rgb = np.array(COLOURS[env.target_colour]) * 255
            rows, cols = np.nonzero(np.abs(frame.astype(int) - rgb).max(axis=-1) < 30)
            seen = np.array([cols.mean() - 41.5, 41.5 - rows.mean()])  # image right and up from the centre
            offset = env.target_xy - env.tip_xy
            assert seen @ offset / (np.linalg.norm(seen) * np.linalg.norm(offset)) > 0.97, f"seed {seed}"
            assert frame[40:44, 40:44].max(axis=-1).min() < 60, (
                f"seed {seed}: no black fingertip at the centre"
            )


@pytest.mark.parametrize("control", ["tip", "joint"])
def test_reach_without_distractors_shows_one_ball_and_the_expert_goes_straight_to_it(control: str) -> None:
    with make_env("reach", control=control, distractors=0) as env, make_env("reach") as full:
        for seed in range(5):
            frame = env.reset(seed=seed)[0]["image"]
            shown = [c for c in COLOURS if colour_pixels(frame, c) > 0]
            assert shown == [env.target_colour], f"seed {seed}: {shown} on screen"
            assert env.distractor_xy.shape == (0, 2) and env._failure() is None
            full.reset(seed=seed)  # the same seed starts the arm where the three-ball task does
            assert env.target_colour == full.target_colour
            np.testing.assert_allclose(env.joint_angles, full.joint_angles)
            info = run_episode(env, seed, lambda e: expert_action(e, np.random.default_rng(), noise=0.0))
            assert info["success"], f"seed {seed}: {info}"
    with pytest.raises(ValueError, match="distractors must be 0 to 2"):
        make_env("reach", distractors=3)


def test_the_tip_control_expert_succeeds_without_noise() -> None:
    with make_env("reach", control="tip") as env:
        for seed in range(10):
            info = run_episode(env, seed, lambda e: expert_action(e, np.random.default_rng(), noise=0.0))
            assert info["success"], f"seed {seed}: {info}"


def test_push_succeeds_when_the_block_is_on_the_patch() -> None:
    with make_env("push") as env:
        env.reset(seed=3)
        env.data.qpos[:2] = env.goal_xy  # block joints x, y: the block's centre in the table plane
        _, reward, terminated, _, info = env.step(np.zeros(2))
        assert info["success"] and terminated and reward == 1.0


def test_shaping_rewards_progress_towards_the_goal() -> None:
    with make_env("reach", shaping=2.0) as env:
        _, info = env.reset(seed=0)
        previous = info["distance"]
        for _ in range(5):
            _, reward, _, _, info = env.step(np.array([0.5, -0.5]))
            assert reward == pytest.approx(2.0 * (previous - info["distance"]))
            previous = info["distance"]


def test_expert_without_noise_succeeds(env: MujocoEnv) -> None:
    for seed in range(10):
        info = run_episode(env, seed, lambda e: expert_action(e, np.random.default_rng(), noise=0.0))
        assert info["success"], f"seed {seed}: {info}"


@pytest.mark.parametrize("task", TASKS)
def test_a_step_taken_unrendered_has_no_frame_and_the_same_outcome(task: str) -> None:
    with make_env(task, image_size=32) as seen, make_env(task, image_size=32) as unseen:
        seen.reset(seed=3), unseen.reset(seed=3)
        action = np.full(seen.action_dim, 0.7)
        for _ in range(3):
            drawn, skipped = seen.step(action), unseen.step(action, render=False)
            assert skipped[0]["image"] is NO_FRAME and drawn[0]["image"].shape == (32, 32, 3)
            assert np.array_equal(drawn[0]["state"], skipped[0]["state"]) and drawn[1:4] == skipped[1:4]
        # rendering is a view of the state: the next rendered frame is the same either way
        assert np.array_equal(seen.step(action)[0]["image"], unseen.step(action)[0]["image"])


def test_random_policy_mostly_fails(env: MujocoEnv) -> None:
    rng = np.random.default_rng(0)
    successes = sum(run_episode(env, seed, lambda e: rng.uniform(-1, 1, 2))["success"] for seed in range(20))
    assert successes <= 5


# -- experts and demos ----------------------------------------------------------------------------------
@pytest.mark.parametrize("task", TASKS)
def test_expert_success_rate_at_default_noise_is_deliberately_imperfect(task: str) -> None:
    demos = collect_demos(task, 50, image_size=16)
    rate = np.mean([d.success for d in demos])
    assert 0.2 <= rate <= 0.7, f"{task}: expert success {rate:.2f} at default noise"


def test_demos_are_aligned_and_reproducible() -> None:
    first = collect_demos("push", 3, seed=7, noise=0.5)
    again = collect_demos("push", 3, seed=7, noise=0.5)
    for d, e in zip(first, again, strict=True):
        assert d.frames.shape == (len(d.actions), 64, 64, 3) and d.frames.dtype == np.uint8
        assert d.actions.shape == (len(d.actions), 2) and np.abs(d.actions).max() <= 1.0
        assert d.instruction.startswith("push the block onto the")
        assert np.array_equal(d.frames, e.frames) and np.array_equal(d.actions, e.actions)
        # the noise-free labels are the expert's choice at each visited frame, not what was executed
        assert d.expert_actions.shape == d.actions.shape and not np.allclose(d.expert_actions, d.actions)
        with PushEnv(image_size=64) as env:
            env.reset(seed=d.seed)
            assert np.allclose(d.expert_actions[0], np.clip(push_expert(env), -1, 1))
    assert [d.seed for d in first] == [7, 8, 9]
    for clean in collect_demos("push", 2, seed=7, noise=0.0):
        assert np.array_equal(clean.expert_actions, clean.actions)


def test_demos_from_several_processes_are_those_one_process_collects() -> None:
    kwargs = {"seed": 11, "noise": 0.5, "image_size": 16}
    alone, shared = collect_demos("reach", 5, **kwargs), collect_demos("reach", 5, workers=2, **kwargs)
    assert [d.seed for d in shared] == [11, 12, 13, 14, 15]
    for d, e in zip(alone, shared, strict=True):
        assert np.array_equal(d.frames, e.frames) and np.array_equal(d.actions, e.actions)
        assert np.array_equal(d.expert_actions, e.expert_actions) and d.success == e.success


def test_expert_lookup_names_the_tasks_that_have_one() -> None:
    with PushEnv(image_size=16) as env:
        assert scripted_expert(env).default_noise > 0

    class Other(Env):
        action_dim, max_steps = 1, 1

        def reset(self, seed: int | None = None):  # pragma: no cover - never called
            raise NotImplementedError

        def step(self, action):  # pragma: no cover - never called
            raise NotImplementedError

    with pytest.raises(TypeError, match="experts exist for: ReachEnv, PushEnv"):
        scripted_expert(Other())


# -- headless OpenGL ---------------------------------------------------------------------------------------
def run_python(code: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("MUJOCO_GL", "PYOPENGL_PLATFORM")}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env={**environ, **env_vars}, capture_output=True, text=True
    )


def test_egl_is_the_default_backend() -> None:
    done = run_python(
        "import os; from mmrl import envs; envs.make_env('reach').reset(seed=0); print(os.environ['MUJOCO_GL'])"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "egl"


def test_a_backend_that_cannot_render_says_what_to_install() -> None:
    done = run_python("from mmrl import envs; envs.make_env('reach')", MUJOCO_GL="glfw", DISPLAY="")
    assert done.returncode != 0
    assert "MUJOCO_GL=glfw" in done.stderr and "apt-get install libegl1" in done.stderr


def test_without_egl_it_falls_back_to_osmesa_with_a_warning() -> None:
    # libOSMesa is not installed here either, so the import then fails: with what to install.
    code = (
        "import ctypes.util, os, warnings\n"
        "ctypes.util.find_library = lambda name: 'libOSMesa.so.8' if name == 'OSMesa' else None\n"
        "from mmrl.envs.gl import load_mujoco\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    try:\n"
        "        load_mujoco()\n"
        "    except RuntimeError as err:\n"
        "        print(err)\n"
        "print(os.environ['MUJOCO_GL']); print(caught[0].message)"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    *error, backend, warning = done.stdout.strip().splitlines()
    assert backend == "osmesa" and "install libegl1" in warning
    assert not error or "apt-get install libosmesa6" in error[0]


def test_import_envs_does_not_load_mujoco() -> None:
    done = run_python("import sys, envs; print('mujoco' in sys.modules)")
    assert done.stdout.strip() == "False", done.stderr
    assert envs.registered_envs()
