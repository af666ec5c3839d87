"""gridnav: walk a square through a small walled grid to the cell of the named colour.

Why this task: it is the smallest visual game whose states repeat. An agent that steps into a wall
stays where it was, and two episodes from one start meet the same cells again, so step-level credit
(GiGPO) has identical states to compare, as in the grid puzzles of verl-agent and VAGEN. It draws
with numpy alone: no simulator, thousands of steps a second.
"""

from __future__ import annotations

from collections import deque
from typing import ClassVar

import numpy as np

from mmrl.envs.base import NO_FRAME, Env, Info, Obs, StepResult

__all__ = ["MOVES", "GridNavEnv", "action_move", "gridnav_expert"]

MOVES: dict[str, tuple[int, int]] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_DEAD_ZONE = 0.25  # |a| below this on both axes: stay put
_FLOOR, _WALL, _AGENT = (225, 225, 225), (70, 70, 70), (30, 70, 230)
_GOALS: dict[str, tuple[int, int, int]] = {"green": (30, 170, 30), "red": (215, 30, 30)}


class GridNavEnv(Env):
    """Action: 2-D in [-1, 1]; the axis with the larger magnitude picks the move, its sign the
    direction (x: right/left, y: down/up), and a small action on both axes stays put. The scene: a
    `size` x `size` grid with `walls` wall cells, the agent (blue), the goal cell of the named colour
    and a decoy of the other colour (`decoy=False`: none, so the instruction need not be read).
    Success: the agent on the goal; stepping on the decoy ends the episode as a failure. Reward: 1 on success, plus `shaping` times the decrease in shortest-path
    distance. State: the agent's row and column, scaled to [0, 1].

    `view="top"` draws the whole grid; `view="agent"` draws the (2·size − 1)² cells around the agent,
    the agent always in the centre and cells beyond the edge as walls, so where the goal lies in the
    frame is the way to go (a policy need not relate two positions it must first find)."""

    action_dim = 2
    words: ClassVar[dict[str, np.ndarray]] = {
        move: np.array([dc, dr], dtype=float) for move, (dr, dc) in MOVES.items()
    }  # x is the column

    def __init__(
        self,
        *,
        image_size: int = 60,
        size: int = 5,
        walls: int = 4,
        max_steps: int = 12,
        shaping: float = 0.0,
        view: str = "top",
        decoy: bool = True,
    ) -> None:
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps <= 0:
            raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
        if size < 3 or not 0 <= walls <= size * size - 3:
            raise ValueError(f"gridnav needs size >= 3 and 0 <= walls <= size^2 - 3, got {size}, {walls}")
        if view not in ("top", "agent"):
            raise ValueError(f"gridnav view must be 'top' or 'agent', got {view!r}")
        shown = size if view == "top" else 2 * size - 1
        if image_size < shown:
            raise ValueError(f"image_size {image_size} cannot draw {shown}x{shown} cells")
        self.image_size, self.size, self.n_walls, self.view = image_size, size, walls, view
        self.max_steps, self.shaping, self.with_decoy = max_steps, float(shaping), decoy
        self._rng = np.random.default_rng()
        self._edges = np.linspace(0, image_size, shown + 1).round().astype(int)
        self._done = True
        self.walls: set[tuple[int, int]] = set()
        self.agent = self.goal = (0, 0)
        self.decoy: tuple[int, int] | None = None
        self.goal_colour = "green"
        self._steps = 0
        self._distance = 0

    def reset(self, seed: int | None = None) -> tuple[Obs, Info]:
        """A new layout from ``seed``: walls, start, goal and decoy (if any), the goal reachable in 2+
        moves."""
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        rng = self._rng
        cells = [(r, c) for r in range(self.size) for c in range(self.size)]
        while True:  # rejection sampling: most draws are valid
            picked = rng.permutation(len(cells))[: self.n_walls + 2 + self.with_decoy]
            chosen = [cells[i] for i in picked]
            decoy = chosen.pop() if self.with_decoy else None
            *walls, agent, goal = chosen
            self.place(set(walls), agent, goal, decoy)
            if 2 <= self._distance < len(cells):
                break
        self.goal_colour = str(rng.choice(list(_GOALS)))
        return self._observe(), {"success": False, "distance": float(self._distance)}

    def place(
        self,
        walls: set[tuple[int, int]],
        agent: tuple[int, int],
        goal: tuple[int, int],
        decoy: tuple[int, int] | None,
    ) -> None:
        """Set the layout (cells as (row, column)) and start a new episode on it; reset() draws one."""
        self.walls, self.agent, self.goal, self.decoy = walls, agent, goal, decoy
        self._steps, self._done, self._distance = 0, False, self.goal_distance()

    def step(self, action: np.ndarray, *, render: bool = True) -> StepResult:
        a = self._checked_action(action, self._done)
        move = action_move(a)
        if move is not None:
            dr, dc = MOVES[move]
            cell = (self.agent[0] + dr, self.agent[1] + dc)
            if self._free(cell):
                self.agent = cell
        self._steps += 1
        success = self.agent == self.goal
        failure = "stepped on the decoy" if self.agent == self.decoy else None
        distance = self.goal_distance()
        reward, terminated, truncated, info = self._outcome(
            success, failure, distance, self._distance, self.shaping, self._steps
        )
        self._distance, self._done = distance, terminated or truncated
        return self._observe(render), reward, terminated, truncated, info

    def goal_distance(self) -> int:
        """Moves on the shortest path from the agent to the goal, around walls and the decoy."""
        return self.distances()[self.agent]

    def distances(self) -> dict[tuple[int, int], int]:
        """Shortest-path moves to the goal from every cell that can reach it (breadth-first)."""
        found, queue = {self.goal: 0}, deque([self.goal])
        while queue:
            cell = queue.popleft()
            for dr, dc in MOVES.values():
                nxt = (cell[0] + dr, cell[1] + dc)
                if nxt not in found and self.passable(nxt):
                    found[nxt] = found[cell] + 1
                    queue.append(nxt)
        unreachable = self.size * self.size
        return {(r, c): found.get((r, c), unreachable) for r in range(self.size) for c in range(self.size)}

    def render(self) -> np.ndarray:
        # the frame's cell (0, 0) is grid cell `origin`: the grid's corner, or size - 1 up-left of the agent
        origin = (
            (0, 0) if self.view == "top" else (self.agent[0] - self.size + 1, self.agent[1] - self.size + 1)
        )
        shown = len(self._edges) - 1
        frame = np.empty((self.image_size, self.image_size, 3), np.uint8)
        frame[:] = _FLOOR
        decoy = next(v for k, v in _GOALS.items() if k != self.goal_colour)
        marked = {self.goal: _GOALS[self.goal_colour]}
        if self.decoy is not None:
            marked[self.decoy] = decoy
        for r in range(shown):
            for c in range(shown):
                cell = (origin[0] + r, origin[1] + c)
                colour = marked.get(cell)
                if not self._free(cell):
                    colour = _WALL
                if colour is not None:
                    frame[self._box((r, c))] = colour
        r, c = self.agent[0] - origin[0], self.agent[1] - origin[1]
        (r0, r1), (c0, c1) = self._edges[[r, r + 1]], self._edges[[c, c + 1]]
        inset = max(1, (r1 - r0) // 5)
        frame[r0 + inset : r1 - inset, c0 + inset : c1 - inset] = _AGENT
        return frame

    def _box(self, cell: tuple[int, int]) -> tuple[slice, slice]:
        """The pixels of the frame's cell (row, column)."""
        r, c = cell
        return slice(self._edges[r], self._edges[r + 1]), slice(self._edges[c], self._edges[c + 1])

    def _free(self, cell: tuple[int, int]) -> bool:
        return 0 <= cell[0] < self.size and 0 <= cell[1] < self.size and cell not in self.walls

    def passable(self, cell: tuple[int, int]) -> bool:
        """Inside the grid, not a wall, not the decoy: where a path to the goal may go."""
        return self._free(cell) and cell != self.decoy

    def _observe(self, render: bool = True) -> Obs:
        state = np.array(self.agent, dtype=np.float32) / (self.size - 1)
        return {
            "image": self.render() if render else NO_FRAME,
            "instruction": f"go to the {self.goal_colour} square",
            "state": state,
        }


def action_move(action: np.ndarray) -> str | None:
    """The move a 2-D action in [-1, 1] stands for, or None to stay put."""
    x, y = float(action[0]), float(action[1])
    if max(abs(x), abs(y)) < _DEAD_ZONE:
        return None
    if abs(x) >= abs(y):
        return "right" if x > 0 else "left"
    return "down" if y > 0 else "up"


def gridnav_expert(env: GridNavEnv) -> np.ndarray:
    """A shortest-path move as an action: +-1 on the move's axis (ties broken by `MOVES` order)."""
    distances = env.distances()
    best, best_distance = np.zeros(2), distances[env.agent]
    for dr, dc in MOVES.values():
        cell = (env.agent[0] + dr, env.agent[1] + dc)
        if env.passable(cell) and distances[cell] < best_distance:
            best_distance, best = distances[cell], np.array([dc, dr], dtype=float)  # x is the column
    return best
