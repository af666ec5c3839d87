"""Scripted experts that read the true simulator state, and demo collection for SFT.

Their noise is deliberate: at each task's default level they succeed on only a part of the episodes,
so SFT on their demos gives a policy that is decent but leaves RL room to improve, the regime VLA RL
papers start from. Noise comes from its own seeded stream, so a demo set is reproducible from (seed, noise).
"""

from __future__ import annotations

import functools
import math
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmrl.envs.base import Env
from mmrl.envs.gridnav import GridNavEnv, gridnav_expert
from mmrl.envs.metaworld import MetaWorldEnv, metaworld_expert
from mmrl.envs.push import PushEnv
from mmrl.envs.reach import ELBOW_LIMIT, LINK, TIP_SPEED, TOUCH, ReachEnv, forward_kinematics, jacobian
from mmrl.envs.registry import make_env

__all__ = [
    "EXPERTS",
    "Demo",
    "ScriptedExpert",
    "collect_demos",
    "expert_action",
    "push_expert",
    "reach_expert",
    "scripted_expert",
]

# -- reach ------------------------------------------------------------------------------------------
_REACH_STEP = 0.3  # rad: joint error at which the expert moves at full speed (two steps at ±3 rad/s)
_REACH_CLEARANCE = TOUCH + 0.015  # keep the fingertip this far from distractors on the way
_SHOULDER_GRID = np.linspace(-math.pi, math.pi, 96, endpoint=False)
_ELBOW_GRID = np.linspace(-ELBOW_LIMIT, ELBOW_LIMIT, 64)
_INNER_RADIUS = 2 * LINK * math.cos(ELBOW_LIMIT / 2)  # m: the tip's least distance from the base
_LOOKAHEAD = 48  # path cells considered when shortcutting to the farthest one in a straight line


def reach_expert(env: ReachEnv) -> np.ndarray:
    """Plan in joint space around the distractors, then move in a straight joint-space line to the
    farthest point on the plan that the fingertip can reach without passing near a distractor.

    Straight lines alone fail on some layouts (every direct path sweeps past a distractor), so the
    plan is a breadth-first search over a joint-angle grid, cached per layout. Under tip control the
    same move is given as the fingertip velocity it produces (a straight tip line to the target alone
    touches a distractor on 15% of layouts).
    """
    q = env.joint_angles
    q = np.array([math.remainder(q[0], 2 * math.pi), q[1]])
    if not len(env.distractor_xy):  # nothing to steer round
        tip, target = env.tip_xy, env.target_xy
        if env.control == "tip" and _segment_clear_of_base(tip, target):
            return _tip_toward(env, target - tip)  # the move a wrist view shows: towards the ball
        return _joint_move_action(env, q, _straight_move(q, target))
    layout = np.concatenate([env.target_xy, env.distractor_xy.reshape(-1)])
    steps = _steps_to_goal(layout.tobytes())
    path = _descend(steps, _cell(q))
    if path is not None:
        waypoints = np.stack([_SHOULDER_GRID[path[:, 0]], _ELBOW_GRID[path[:, 1]]], axis=1)
        deltas = waypoints - q
        deltas[:, 0] = np.remainder(deltas[:, 0] + math.pi, 2 * math.pi) - math.pi
        clear = _clear(q, deltas, env.distractor_xy)
        delta = deltas[np.flatnonzero(clear)[-1]] if clear.any() else deltas[0]
    else:  # noise left the fingertip inside a distractor's margin, or cut off: head straight for it
        delta = _straight_move(q, env.target_xy)
    return _joint_move_action(env, q, delta)


def _joint_move_action(env: ReachEnv, q: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """The action that starts joint move ``delta`` from ``q``: the joint velocities themselves, or
    under tip control the fingertip velocity they produce. Full speed, slowing near the goal."""
    if env.control == "tip":
        return _tip_toward(env, jacobian(q) @ delta)
    largest = float(np.abs(delta).max())
    return delta / largest * min(1.0, largest / _REACH_STEP) if largest > 0 else np.zeros(2)


def _tip_toward(env: ReachEnv, direction: np.ndarray) -> np.ndarray:
    """The tip action along ``direction``: full speed, slowing within a step of the target."""
    speed = float(np.linalg.norm(direction))
    step = TIP_SPEED * env.model.opt.timestep * env.substeps  # metres a full action moves the tip
    return direction / speed * min(1.0, env.goal_distance() / step) if speed > 0 else np.zeros(2)


def _segment_clear_of_base(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether the straight tip path a -> b stays out of the disc round the base that the folded arm
    cannot reach (its radius set by the elbow's limit), with a margin."""
    d = b - a
    t = float(np.clip(-(a @ d) / max(float(d @ d), 1e-12), 0.0, 1.0))
    return float(np.linalg.norm(a + t * d)) >= _INNER_RADIUS + 0.02


@functools.lru_cache(maxsize=16)
def _steps_to_goal(layout: bytes) -> np.ndarray:
    """Grid steps from each (shoulder, elbow) cell to a cell touching the target, avoiding distractors.

    ``layout`` is the target x, y then the distractors' (as bytes, to be hashable); inf marks cells
    that are blocked or cut off.
    """
    points = np.frombuffer(layout).reshape(-1, 2)
    grid = np.stack(np.meshgrid(_SHOULDER_GRID, _ELBOW_GRID, indexing="ij"), axis=-1)
    tips = forward_kinematics(grid)
    free = np.linalg.norm(tips[:, :, None] - points[None, None, 1:], axis=-1).min(axis=-1) >= _REACH_CLEARANCE
    frontier = free & (np.linalg.norm(tips - points[0], axis=-1) < TOUCH / 2)
    steps = np.where(frontier, 0.0, np.inf)
    k = 0
    while frontier.any():
        k += 1
        grown = frontier.copy()
        for shift in (1, -1):  # 8-neighbour dilation; the shoulder wraps round, the elbow does not
            grown |= np.roll(frontier, shift, axis=0)
        for shift in (1, -1):
            rolled = np.roll(grown, shift, axis=1)
            rolled[:, 0 if shift == 1 else -1] = False
            grown |= rolled
        frontier = grown & free & np.isinf(steps)
        steps[frontier] = k
    return steps


def _cell(q: np.ndarray) -> tuple[int, int]:
    """The grid cell nearest to joint angles ``q`` (shoulder already wrapped to [-pi, pi))."""
    i = round((q[0] + math.pi) / (2 * math.pi) * len(_SHOULDER_GRID)) % len(_SHOULDER_GRID)
    j = round((q[1] + ELBOW_LIMIT) / (2 * ELBOW_LIMIT) * (len(_ELBOW_GRID) - 1))
    return i, int(np.clip(j, 0, len(_ELBOW_GRID) - 1))


def _descend(steps: np.ndarray, start: tuple[int, int]) -> np.ndarray | None:
    """The next ``_LOOKAHEAD`` cells downhill from ``start`` as an (n, 2) index array; None if unreachable."""
    if not np.isfinite(steps[start]):
        return None
    n_shoulder, n_elbow = steps.shape
    path = [start]
    while steps[path[-1]] > 0 and len(path) <= _LOOKAHEAD:
        i, j = path[-1]
        neighbours = [
            ((i + di) % n_shoulder, j + dj) for di in (-1, 0, 1) for dj in (-1, 0, 1) if 0 <= j + dj < n_elbow
        ]
        path.append(min(neighbours, key=lambda c: steps[c]))
    return np.array(path[1:] or path)


def _straight_move(q: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The smallest joint move onto an inverse-kinematics solution for ``target``."""
    cos_elbow = np.clip((target @ target - 2 * LINK**2) / (2 * LINK**2), -1.0, 1.0)
    moves = []
    for elbow in (math.acos(cos_elbow), -math.acos(cos_elbow)):
        shoulder = math.atan2(target[1], target[0]) - math.atan2(math.sin(elbow), 1 + math.cos(elbow))
        moves.append(np.array([math.remainder(shoulder - q[0], 2 * math.pi), elbow - q[1]]))
    return min(moves, key=lambda d: float(np.abs(d).max()))


def _clear(q: np.ndarray, deltas: np.ndarray, obstacles: np.ndarray, samples: int = 16) -> np.ndarray:
    """For each joint move in ``deltas`` (n, 2): does the fingertip stay clear of every obstacle?"""
    t = np.linspace(0.0, 1.0, samples)[None, :, None]
    tips = forward_kinematics(q + t * deltas[:, None, :])  # (n, samples, 2)
    gaps = np.linalg.norm(tips[:, :, None] - obstacles[None, None], axis=-1)
    return gaps.min(axis=(1, 2)) >= _REACH_CLEARANCE


# -- push -------------------------------------------------------------------------------------------
_PUSH_OFFSET = 0.03 + 0.02  # block radius + pusher radius: centre distance when they touch
_PUSH_STEP = 0.04  # m: position error at which the expert moves at full speed (two steps at 0.4 m/s)
_ALIGNED = 0.02  # m: lateral error below which the pusher pushes instead of repositioning
_DETOUR = 0.075  # m: how wide the pusher goes around the block to get behind it


def push_expert(env: PushEnv) -> np.ndarray:
    """Get behind the block on the line from the goal, going round it if needed, then push along it."""
    block, goal, pusher = env.block_xy, env.goal_xy, env.pusher_xy
    to_goal = goal - block
    u = to_goal / max(float(np.linalg.norm(to_goal)), 1e-9)
    rel = pusher - block
    along = float(rel @ u)
    lateral = rel - along * u  # the pusher's offset from the line through the block and the goal
    off_line = float(np.linalg.norm(lateral))
    if along < -0.5 * _PUSH_OFFSET and off_line < _ALIGNED:
        aim = goal - u * _PUSH_OFFSET - lateral  # push through to the goal, steering back onto the line
    elif along > -_PUSH_OFFSET and off_line < _DETOUR:
        side = lateral / off_line if off_line > 1e-6 else np.array([-u[1], u[0]])
        aim = block + side * _DETOUR - u * _PUSH_OFFSET  # round the block, not through it
    else:
        aim = block - u * (_PUSH_OFFSET + 0.01)  # just behind the block
    error = aim - pusher
    distance = float(np.linalg.norm(error))
    return error / distance * min(1.0, distance / _PUSH_STEP) if distance > 0 else np.zeros(2)


# -- any task ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScriptedExpert:
    """A task's controller and the noise std at which it succeeds on roughly 30-50% of episodes.

    The defaults differ because the controllers do: reach's saturates at full joint speed and steers
    back after every step, so only large i.i.d. noise makes it wander into a distractor or run out of
    time, while push fails as soon as noise knocks the pusher off the line behind the block.
    """

    act: Callable[[Any], np.ndarray]
    default_noise: float


METAWORLD_NOISE = 1.0

EXPERTS: dict[type[Env], ScriptedExpert] = {
    ReachEnv: ScriptedExpert(reach_expert, default_noise=3.0),
    PushEnv: ScriptedExpert(push_expert, default_noise=1.0),
    MetaWorldEnv: ScriptedExpert(metaworld_expert, default_noise=METAWORLD_NOISE),
    GridNavEnv: ScriptedExpert(gridnav_expert, default_noise=1.5),
}


def scripted_expert(env: Env) -> ScriptedExpert:
    """The expert for ``env``'s task, or a TypeError naming the tasks that have one."""
    for cls, expert in EXPERTS.items():
        if isinstance(env, cls):
            return expert
    known = ", ".join(cls.__name__ for cls in EXPERTS)
    raise TypeError(f"no scripted expert for {type(env).__name__}; experts exist for: {known}")


def expert_action(env: Env, rng: np.random.Generator, noise: float | None = None) -> np.ndarray:
    """The expert's action plus i.i.d. Gaussian noise of std ``noise`` (None: the task's default),
    clipped to [-1, 1]."""
    return _noisy(env, scripted_expert(env).act(env), rng, noise)


def _noisy(env: Env, clean: np.ndarray, rng: np.random.Generator, noise: float | None) -> np.ndarray:
    std = scripted_expert(env).default_noise if noise is None else noise
    return np.clip(clean + std * rng.standard_normal(env.action_dim), -1.0, 1.0)


@dataclass(frozen=True, eq=False)
class Demo:
    """One expert episode: ``frames[t]`` is the frame the expert saw when it chose ``actions[t]``, the
    action executed (noise included); ``expert_actions[t]`` is what the expert itself chose there, the
    noise-free label DART-style cloning trains on."""

    seed: int
    instruction: str
    frames: np.ndarray  # (T, H, W, 3) uint8
    actions: np.ndarray  # (T, action_dim) float32, in [-1, 1]
    success: bool
    states: np.ndarray  # (T, state_dim) float32: the proprioceptive state beside each frame
    expert_actions: np.ndarray  # (T, action_dim) float32: the noise-free expert action at each frame


def collect_demos(
    task: str,
    n: int,
    *,
    seed: int = 0,
    noise: float | None = None,
    workers: int = 1,
    progress: Callable[[], object] | None = None,
    **env_kwargs: object,
) -> list[Demo]:
    """Roll out the expert on env seeds ``seed .. seed + n - 1``; failed episodes are kept and flagged,
    so callers choose between success-only SFT data and the full mix. ``progress`` is called per episode.

    With ``workers`` > 1, processes collect slices of the seeds: a demo depends only on its seed, so
    the demos are the same as one process collects, in the same order."""
    if workers > 1 and n > 1:
        return _collect_in_processes(task, n, seed, noise, workers, progress, env_kwargs)
    demos = []
    with make_env(task, **env_kwargs) as env:
        for episode_seed in range(seed, seed + n):
            demos.append(_rollout(env, episode_seed, noise))
            if progress is not None:
                progress()
    return demos


def _collect_in_processes(
    task: str,
    n: int,
    seed: int,
    noise: float | None,
    workers: int,
    progress: Callable[[], object] | None,
    env_kwargs: dict[str, object],
) -> list[Demo]:
    # Spawned, not forked: the caller may hold torch's thread pool or a GL context, which a fork copies
    # half-alive. Slices of about a tenth of each worker's share keep the progress bar moving.
    size = max(1, math.ceil(n / (workers * 10)))
    starts = range(seed, seed + n, size)
    collect = functools.partial(collect_demos, task, noise=noise, **env_kwargs)
    demos: list[Demo] = []
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        slices = [pool.submit(collect, min(size, seed + n - start), seed=start) for start in starts]
        for done in slices:
            part = done.result()
            demos.extend(part)
            for _ in part if progress is not None else ():
                progress()
    return demos


def _rollout(env: Env, seed: int, noise: float | None) -> Demo:
    rng = np.random.default_rng([seed, 1])  # the noise stream, independent of the scene's
    obs, info = env.reset(seed=seed)
    act = scripted_expert(env).act
    frames, actions, states, clean_actions = [], [], [], []
    done = False
    while not done:
        clean = act(env)
        action = _noisy(env, clean, rng, noise)
        frames.append(obs["image"])
        states.append(obs["state"])
        actions.append(action)
        clean_actions.append(np.clip(clean, -1.0, 1.0))
        obs, _, terminated, truncated, info = env.step(action)
        done = terminated or truncated
    return Demo(
        seed=seed,
        instruction=obs["instruction"],
        frames=np.stack(frames),
        actions=np.asarray(actions, dtype=np.float32),
        success=bool(info["success"]),
        states=np.asarray(states, dtype=np.float32),
        expert_actions=np.asarray(clean_actions, dtype=np.float32),
    )
