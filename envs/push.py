"""push: a point-mass pusher slides a block onto the floor patch of the named colour.

Why this task: unlike reach, the agent moves the goal object only indirectly, through contact, so it
needs to get behind the block before pushing. A second patch of another colour makes the
instruction matter. The block is a squat cylinder, so a push moves it along the line between the
centres from any approach angle and the task stays about positioning, not about edge contacts.
"""

from __future__ import annotations

import numpy as np

from mmrl.envs.mujoco_env import COLOURS, MujocoEnv

__all__ = ["ON_PATCH", "PushEnv"]

ON_PATCH = 0.03  # block centre to patch centre (patch radius 0.05): most of the block is on the patch
_AREA = 0.17  # scene objects start within ±_AREA of the centre; the joints allow ±0.25
_PATCH_GAP = 0.13  # between patch centres: the patches never overlap
_BLOCK_TO_GOAL = (0.08, 0.16)
_BLOCK_TO_OTHER_PATCH = 0.07  # the distractor patch stays mostly visible
_PUSHER_TO_BLOCK = 0.08


class PushEnv(MujocoEnv):
    """Action: pusher x, y velocity, each in [-1, 1] (±0.4 m/s). Success: block centre within
    ``ON_PATCH`` of the target patch's centre. State: pusher x, y and its velocity (float32, 4 values).
    60 steps by default."""

    asset = "push.xml"
    default_max_steps = 60

    def _layout(self, rng: np.random.Generator) -> str:
        names = [str(c) for c in rng.permutation(list(COLOURS))[:2]]
        self.target_colour, *self.distractor_colours = names

        def point() -> np.ndarray:
            return rng.uniform(-_AREA, _AREA, size=2)

        while True:  # rejection sampling; a valid layout is found within a few tries
            goal, other, block, pusher = point(), point(), point(), point()
            to_goal = np.linalg.norm(block - goal)
            if (
                np.linalg.norm(goal - other) >= _PATCH_GAP
                and _BLOCK_TO_GOAL[0] <= to_goal <= _BLOCK_TO_GOAL[1]
                and np.linalg.norm(block - other) >= _BLOCK_TO_OTHER_PATCH
                and np.linalg.norm(pusher - block) >= _PUSHER_TO_BLOCK
            ):
                break
        for geom, xy, colour in (("patch0", goal, names[0]), ("patch1", other, names[1])):
            self.model.geom(geom).pos[:2] = xy
            self._set_rgba(geom, colour)
        self.data.qpos[:] = [*block, *pusher]  # joint order in push.xml: block x, y, pusher x, y
        return f"push the block onto the {self.target_colour} patch"

    # true state, read by the scripted experts and tests (the policy sees only the observation)
    @property
    def pusher_xy(self) -> np.ndarray:
        return self._geom_xy("pusher")

    @property
    def block_xy(self) -> np.ndarray:
        return self._geom_xy("block")

    @property
    def goal_xy(self) -> np.ndarray:
        return self._geom_xy("patch0")

    def goal_distance(self) -> float:
        return float(np.linalg.norm(self.block_xy - self.goal_xy))

    def _success(self) -> bool:
        return self.goal_distance() < ON_PATCH

    def _state(self) -> np.ndarray:
        return np.array([*self.pusher_xy, *self.data.qvel[2:4]], dtype=np.float32)
