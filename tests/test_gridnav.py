"""gridnav, the built-in grid game: seeded layouts, moves, walls, the decoy, rendering and its expert."""

from __future__ import annotations

import numpy as np
import pytest

from mmrl.envs import make_env
from mmrl.envs.experts import collect_demos, expert_action
from mmrl.envs.gridnav import MOVES, GridNavEnv, action_move, gridnav_expert

ACTION = {"up": [0.0, -1.0], "down": [0.0, 1.0], "left": [-1.0, 0.0], "right": [1.0, 0.0], None: [0.1, -0.2]}


def test_actions_map_to_moves_by_their_larger_axis() -> None:
    for move, action in ACTION.items():
        assert action_move(np.array(action)) == move
    assert action_move(np.array([0.6, -0.9])) == "up" and action_move(np.array([-0.5, 0.5])) == "left"


def test_layouts_are_seeded_and_the_goal_is_reachable_in_two_or_more_moves() -> None:
    with make_env("gridnav") as env, make_env("gridnav") as other:
        frames = set()
        for seed in range(50):
            obs, info = env.reset(seed=seed)
            again, _ = other.reset(seed=seed)
            assert np.array_equal(obs["image"], again["image"]) and obs["instruction"] == again["instruction"]
            assert 2 <= info["distance"] < 25 and obs["image"].shape == (60, 60, 3)
            frames.add(obs["image"].tobytes())
        assert len(frames) == 50


def test_walls_block_the_decoy_fails_the_goal_succeeds() -> None:
    env = GridNavEnv(size=3, walls=0, max_steps=5)
    env.place({(0, 1)}, agent=(0, 0), goal=(2, 2), decoy=(1, 0))
    _, reward, terminated, _, info = env.step(np.array(ACTION["right"]))  # into the wall: stays
    assert env.agent == (0, 0) and reward == 0.0 and not terminated
    _, _, terminated, _, info = env.step(np.array(ACTION["up"]))  # off the grid: stays
    assert env.agent == (0, 0) and not terminated
    _, reward, terminated, _, info = env.step(np.array(ACTION["down"]))
    assert terminated and not info["success"] and info["failure"] == "stepped on the decoy"

    env.place(set(), agent=(2, 0), goal=(2, 2), decoy=(0, 2))
    env.step(np.array(ACTION["right"]))
    _, reward, terminated, truncated, info = env.step(np.array(ACTION["right"]))
    assert reward == 1.0 and terminated and not truncated and info["success"]
    with pytest.raises(RuntimeError, match="reset"):
        env.step(np.zeros(2))


def test_episodes_end_at_max_steps_and_shaping_pays_progress() -> None:
    env = GridNavEnv(size=3, walls=0, max_steps=2, shaping=0.5)
    env.place(set(), agent=(0, 0), goal=(2, 2), decoy=(0, 2))
    assert env.step(np.array(ACTION["down"]))[1] == 0.5  # one move closer
    _, reward, terminated, truncated, _ = env.step(np.array(ACTION["up"]))
    assert reward == -0.5 and truncated and not terminated


def test_the_frame_shows_the_agent_goal_and_decoy_in_their_cells() -> None:
    with make_env("gridnav", image_size=50, size=5) as env:
        obs, _ = env.reset(seed=4)
        image = obs["image"]
        cell = lambda rc: image[rc[0] * 10 + 5, rc[1] * 10 + 5].tolist()  # noqa: E731 (cell centre)
        assert cell(env.agent) == [30, 70, 230]
        goal, decoy = (30, 170, 30), (215, 30, 30)
        if env.goal_colour == "red":
            goal, decoy = decoy, goal
        assert cell(env.goal) == list(goal) and cell(env.decoy) == list(decoy)
        assert f"go to the {env.goal_colour} square" == obs["instruction"]
        assert all(cell(w) == [70, 70, 70] for w in env.walls)


def test_without_a_decoy_only_the_goal_is_coloured() -> None:
    colours = {(30, 170, 30), (215, 30, 30)}
    with make_env("gridnav", size=3, walls=0, decoy=False) as env:
        for seed in range(20):
            obs, info = env.reset(seed=seed)
            shown = {tuple(p) for p in obs["image"].reshape(-1, 3).tolist()} & colours
            assert env.decoy is None and len(shown) == 1 and info["distance"] >= 2


def test_states_recur_so_decisions_from_one_state_can_be_compared() -> None:
    # GiGPO's premise: two episodes from one start meet the same frames again, and a wall bump repeats one.
    with make_env("gridnav") as env:
        seen: dict[bytes, int] = {}
        for episode in range(2):
            obs, _ = env.reset(seed=9)
            rng = np.random.default_rng(episode)
            done = False
            while not done:
                seen[obs["image"].tobytes()] = seen.get(obs["image"].tobytes(), 0) + 1
                obs, _, terminated, truncated, _ = env.step(rng.uniform(-1, 1, size=2))
                done = terminated or truncated
    assert max(seen.values()) >= 2 and len(seen) < 2 * env.max_steps


def test_the_expert_walks_shortest_paths_and_its_noise_makes_it_imperfect() -> None:
    with make_env("gridnav") as env:
        for seed in range(100):
            _, info = env.reset(seed=seed)
            for _ in range(int(info["distance"])):
                action = gridnav_expert(env)
                assert action_move(action) in MOVES
                _, _, terminated, _, info = env.step(action)
            assert terminated and info["success"], f"seed {seed}"
        rng = np.random.default_rng(0)
        assert expert_action(env, rng, noise=0.0).shape == (2,)
    rate = np.mean([d.success for d in collect_demos("gridnav", 100)])
    assert 0.3 <= rate <= 0.6, f"expert success {rate:.2f} at default noise"


def test_the_agent_view_centres_the_agent_and_walls_off_the_world_beyond_the_grid() -> None:
    env = GridNavEnv(image_size=45, size=5, walls=0, view="agent")  # 9 x 9 cells of 5 px
    env.reset(seed=0)
    env.place(set(), agent=(0, 0), goal=(0, 2), decoy=(4, 4))
    frame = env.render()
    at = lambda r, c: frame[r * 5 + 2, c * 5 + 2].tolist()  # noqa: E731 (a frame cell's centre)
    goal, decoy = ([30, 170, 30], [215, 30, 30])[:: 1 if env.goal_colour == "green" else -1]
    assert at(4, 4) == [30, 70, 230]  # the agent, in the centre
    assert at(4, 6) == goal and at(8, 8) == decoy  # two cells right; four down and right
    assert at(3, 4) == [70, 70, 70] and at(4, 3) == [70, 70, 70]  # beyond the top and left edges
    env.step(np.array(ACTION["right"]))
    frame = env.render()
    assert at(4, 5) == goal and at(3, 5) == [70, 70, 70]  # the goal now one cell right
