"""reach: a planar two-link arm touches the ball of the named colour, among two distractors.

Why this task: it is the smallest one where the instruction matters. The arm can reach all three
balls, and touching a distractor ends the episode as a failure, so a policy has to read the colour in
the instruction and find it in the frame. ``distractors=0`` leaves the target alone, as in
Meta-World's reach: the policy then only has to find a ball, not ground a colour word in it.
"""

from __future__ import annotations

import math

import numpy as np

from mmrl.envs.mujoco_env import COLOURS, MujocoEnv

__all__ = ["ELBOW_LIMIT", "LINK", "TIP_SPEED", "TOUCH", "ReachEnv", "forward_kinematics", "jacobian"]

LINK = 0.12  # both links, metres (envs/assets/reach.xml)
ELBOW_LIMIT = 2.6  # rad, the elbow joint's range is ±ELBOW_LIMIT
TOUCH = 0.04  # fingertip-to-ball centre distance in the table plane that counts as a touch
_N_BALLS = 3
_BALL_RADII = (0.09, 0.21)  # ball distance from the base: inside the arm's reach at any elbow angle
_MIN_GAP = 0.09  # between balls, so one touch never grazes another
_START_CLEARANCE = 0.08  # fingertip to any ball at reset, so no episode starts touching
TIP_SPEED = 0.4  # m/s: the fingertip speed of a full action under control="tip" (2 cm a step)
_BALL_Z = 0.025  # ball centre height: resting on the table (envs/assets/reach.xml)
_DAMPING = 0.02  # m: damped least squares keeps joint speeds finite near the arm's singular poses


class ReachEnv(MujocoEnv):
    """Action under ``control="joint"``: shoulder and elbow velocity, each in [-1, 1] (±3 rad/s).
    Under ``control="tip"``: the fingertip's velocity in the table plane, x and y in [-1, 1]
    (±``TIP_SPEED``), turned into joint velocities through the arm's Jacobian, the end-effector
    delta actions LIBERO and Meta-World policies emit. Success: fingertip within ``TOUCH`` of the
    target ball; touching one of the ``distractors`` (0-2) fails. State: shoulder angle (wrapped),
    elbow angle, their velocities, fingertip x, y (float32, 6 values). 40 steps by default."""

    asset = "reach.xml"
    default_max_steps = 40

    def __init__(
        self,
        *,
        image_size: int = 64,
        camera: str = "top",
        max_steps: int | None = None,
        shaping: float = 0.0,
        control: str = "joint",
        distractors: int = _N_BALLS - 1,
    ) -> None:
        if control not in ("joint", "tip"):
            raise ValueError(f"control must be 'joint' or 'tip', got {control!r}")
        if not 0 <= distractors < _N_BALLS:
            raise ValueError(f"distractors must be 0 to {_N_BALLS - 1}, got {distractors}")
        super().__init__(image_size=image_size, camera=camera, max_steps=max_steps, shaping=shaping)
        self.control = control
        self.balls = 1 + distractors

    def _controls(self, a: np.ndarray) -> np.ndarray:
        if self.control == "joint":
            return super()._controls(a)
        # damped least squares: the joint velocities whose tip velocity is nearest the one asked for
        j = jacobian(self.data.qpos[:2])
        qdot = j.T @ np.linalg.solve(j @ j.T + _DAMPING**2 * np.eye(2), a * TIP_SPEED)
        largest = float(np.abs(qdot).max())
        limit = float(self._ctrl_high.min())
        return qdot * min(1.0, limit / largest) if largest > 0 else qdot  # slow down, keep direction

    def _layout(self, rng: np.random.Generator) -> str:
        n = self.balls
        names = [str(c) for c in rng.permutation(list(COLOURS))[:n]]
        self.target_colour, *self.distractor_colours = names
        q = np.array([rng.uniform(-math.pi, math.pi), rng.uniform(-2.0, 2.0)])
        self.data.qpos[:] = q
        tip = forward_kinematics(q)
        while True:  # rejection sampling; a valid layout is found within a few tries
            r = rng.uniform(*_BALL_RADII, size=n)
            phi = rng.uniform(-math.pi, math.pi, size=n)
            balls = np.stack([r * np.cos(phi), r * np.sin(phi)], axis=1)
            gaps = [np.linalg.norm(balls[i] - balls[j]) for i in range(n) for j in range(i)]
            if (
                min(gaps, default=_MIN_GAP) >= _MIN_GAP
                and np.linalg.norm(balls - tip, axis=1).min() >= _START_CLEARANCE
            ):
                break
        for i, (xy, colour) in enumerate(zip(balls, names, strict=True)):
            self.model.geom(f"ball{i}").pos[:] = (*xy, _BALL_Z)
            self._set_rgba(f"ball{i}", colour)
        for i in range(n, _N_BALLS):  # unused balls sink under the table, out of every camera's view
            self.model.geom(f"ball{i}").pos[:] = (0.0, 0.0, -1.0)
        return f"touch the {self.target_colour} ball"

    # true state, read by the scripted experts and tests (the policy sees only the observation)
    @property
    def joint_angles(self) -> np.ndarray:
        return self.data.qpos[:2].copy()

    @property
    def tip_xy(self) -> np.ndarray:
        return self.data.site("tip").xpos[:2].copy()

    @property
    def target_xy(self) -> np.ndarray:
        return self._geom_xy("ball0")

    @property
    def distractor_xy(self) -> np.ndarray:
        return np.array([self._geom_xy(f"ball{i}") for i in range(1, self.balls)]).reshape(-1, 2)

    def goal_distance(self) -> float:
        return float(np.linalg.norm(self.tip_xy - self.target_xy))

    def _success(self) -> bool:
        return self.goal_distance() < TOUCH

    def _failure(self) -> str | None:
        distances = np.linalg.norm(self.distractor_xy - self.tip_xy, axis=1)
        if not len(distances):
            return None
        hit = int(np.argmin(distances))
        return f"touched the {self.distractor_colours[hit]} ball" if distances[hit] < TOUCH else None

    def _state(self) -> np.ndarray:
        q, qd = self.data.qpos, self.data.qvel
        shoulder = math.remainder(q[0], 2 * math.pi)
        return np.array([shoulder, q[1], qd[0], qd[1], *self.tip_xy], dtype=np.float32)


def jacobian(q: np.ndarray) -> np.ndarray:
    """d(fingertip x, y) / d(shoulder, elbow) at joint angles ``q``."""
    shoulder, elbow = q[0], q[0] + q[1]
    return LINK * np.array(
        [
            [-math.sin(shoulder) - math.sin(elbow), -math.sin(elbow)],
            [math.cos(shoulder) + math.cos(elbow), math.cos(elbow)],
        ]
    )


def forward_kinematics(q: np.ndarray) -> np.ndarray:
    """Fingertip x, y for joint angles ``q[..., :2]`` (shoulder, elbow), matching reach.xml."""
    shoulder, elbow = q[..., 0], q[..., 0] + q[..., 1]
    return LINK * np.stack([np.cos(shoulder) + np.cos(elbow), np.sin(shoulder) + np.sin(elbow)], axis=-1)
