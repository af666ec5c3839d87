"""The LIBERO adapter on the real packaged LIBERO (robosuite 1.4, MuJoCo, LIBERO's asset tree): stored
initial states by seed, rendered views, success from LIBERO's own goal predicate, and clear errors."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from mmrl.envs import make_env, registered_envs
from mmrl.envs.libero import LiberoEnv

pytestmark = pytest.mark.slow  # building a LIBERO scene takes 10-20 s on a CPU


@pytest.fixture(scope="module")
def spatial() -> Iterator[LiberoEnv]:
    env = make_env("libero/spatial/0", image_size=32)
    assert isinstance(env, LiberoEnv)
    yield env
    env.close()


def _observe(env: LiberoEnv, seed: int) -> tuple[np.ndarray, np.ndarray]:
    obs, info = env.reset(seed=seed)
    assert info == {"success": False}
    return obs["image"], obs["state"]


def test_a_seed_is_one_of_libero_s_stored_initial_states_and_replays_exactly(spatial: LiberoEnv) -> None:
    assert spatial.num_initial_states == 50
    assert (
        spatial.instruction
        == "pick up the black bowl between the plate and the ramekin and place it on the plate"
    )
    image, state = _observe(spatial, 3)
    spatial.step(np.full(7, 0.5))  # leave the arm and gripper elsewhere: nothing may carry over
    other_image, _ = _observe(spatial, 4)
    spatial.step(-np.ones(7))
    again_image, again_state = _observe(spatial, 3)
    assert image.shape == (32, 64, 3) and image.dtype == np.uint8  # agent view | wrist view
    assert not np.array_equal(image[:, :32], image[:, 32:])
    assert image.std() > 10, "a rendered scene, not a blank frame"
    np.testing.assert_array_equal(image, again_image)
    np.testing.assert_array_equal(state, again_state)
    assert not np.array_equal(image, other_image), "another stored state places the objects elsewhere"
    assert state.shape == (4,) and state[2] > 0.9  # the hand above the table top (0.9 m)
    fresh = make_env("libero/spatial/0", image_size=32)  # another worker's env, with no history
    try:
        fresh_image, fresh_state = _observe(fresh, 3)
    finally:
        fresh.close()
    np.testing.assert_array_equal(image, fresh_image)
    np.testing.assert_array_equal(state, fresh_state)


def _move(env: LiberoEnv, target: np.ndarray, grip: float, steps: int) -> tuple[float, bool, bool, dict]:
    """Drive the hand to `target` with OSC_POSE position deltas (proportional, saturated) for at most
    `steps`, gripper held at `grip`; stops at the target or at the episode's end."""
    ended = (0.0, False, False, {"success": False})
    for _ in range(steps):
        error = target - env.raw_observation["robot0_eef_pos"]
        if np.linalg.norm(error) < 0.005:
            break
        action = np.r_[np.clip(error / 0.025, -1.0, 1.0), np.zeros(3), grip]
        _, *ended = env.step(action)  # type: ignore[assignment]
        if ended[1] or ended[2]:
            break
    return tuple(ended)  # type: ignore[return-value]


def _above(point: np.ndarray, height: float) -> np.ndarray:
    return point + np.array([0.0, 0.0, height])


def test_a_scripted_pick_and_place_succeeds_and_success_ends_the_episode(spatial: LiberoEnv) -> None:
    spatial.reset(seed=0)
    _, reward, terminated, truncated, info = spatial.step(np.r_[np.zeros(6), -1.0])
    assert (reward, terminated, truncated, info) == (0.0, False, False, {"success": False})
    raw = spatial.raw_observation
    # The bowl is grasped by its rim: 5 cm to the side of its centre, 3 cm up.
    rim = raw["akita_black_bowl_1_pos"] + np.array([0.0, 0.05, 0.03])
    plate = raw["plate_1_pos"] + np.array([0.0, 0.05, 0.0])
    _move(spatial, _above(rim, 0.09), -1.0, 40)
    _move(spatial, rim, -1.0, 30)
    for _ in range(10):
        spatial.step(np.r_[np.zeros(6), 1.0])
    _move(spatial, _above(rim, 0.12), 1.0, 30)
    assert spatial.raw_observation["akita_black_bowl_1_pos"][2] > raw["akita_black_bowl_1_pos"][2] + 0.08
    _move(spatial, _above(plate, 0.15), 1.0, 40)
    _move(spatial, _above(plate, 0.06), 1.0, 20)
    for _ in range(10):
        _, reward, terminated, truncated, info = spatial.step(np.r_[np.zeros(6), -1.0])
        if terminated:
            break
    assert (reward, terminated, truncated, info) == (1.0, True, False, {"success": True})
    with pytest.raises(RuntimeError, match="reset"):
        spatial.step(np.zeros(7))


def test_the_episode_is_cut_at_max_steps() -> None:
    env = make_env("libero/object/2", image_size=16, camera="agentview", max_steps=3, settle_steps=0)
    try:
        obs, _ = env.reset(seed=0)
        assert obs["image"].shape == (16, 16, 3)
        assert "basket" in obs["instruction"]
        ends = [env.step(np.zeros(7))[2:4] for _ in range(3)]
        assert ends == [(False, False), (False, False), (False, True)]
    finally:
        env.close()


def test_names_and_options_say_what_exists() -> None:
    assert "libero/<task>" in registered_envs()
    with pytest.raises(ValueError, match=r"unknown LIBERO task 'kitchen/0'.*spatial, object, goal, 10, 90"):
        make_env("libero/kitchen/0")
    with pytest.raises(ValueError, match="LIBERO-spatial has tasks 0 to 9, not 10"):
        make_env("libero/spatial/10")
