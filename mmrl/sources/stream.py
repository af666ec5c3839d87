"""Prompt groups streamed through rollout workers: the trainer takes a step's groups as they finish.

The loader's prompts are numbered in the order drawn, and each is dispatched alone (its `rollout.n`
samples one group, on one worker, with a seed of its own from the trainer's RNG). Dispatch keeps the
workers fed ahead of the trainer by up to `rollout.max_staleness` batches: at most (K + 1) batches of
groups are dispatched and not yet taken, counting those this step has taken, so no group is dispatched
for a step more than K updates ahead. A step takes the first groups to finish (`ray.wait`), however
many it asks for (dynamic sampling asks again for what its filter dropped), and orders them by draw
number, so with K = 0 a step trains exactly the synchronous loop's batch. A group that finished more
than K updates behind the trainer is sampled again with the newest weights or dropped
(`rollout.stale`), and counted.

The data cursor a checkpoint keeps is the loader's state before the oldest drawn batch with a prompt not
yet taken, and the numbers of the prompts from there on that were taken (trained, or dropped by a
filter or as stale): a resumed run draws those batches again, skips what was taken and dispatches the
rest, so no prompt is trained twice or lost.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from mmrl.data.batch import Batch, concat
from mmrl.data.prefetch import PrefetchLoader
from mmrl.data.sample import PromptSample
from mmrl.rollout.base import SamplingParams, draw_seed
from mmrl.workers.rollout import POLICY_VERSION


@dataclass(eq=False)
class _Group:
    """A drawn prompt on its way: dispatched (`ticket`), then finished (`batch`)."""

    number: int  # its place in the order drawn
    prompt: PromptSample
    seed: int | None = None  # drawn at its first dispatch, kept when it is sampled again
    ticket: Any = None
    batch: Batch | None = None

    @property
    def version(self) -> int:
        assert self.batch is not None
        return int(self.batch[POLICY_VERSION].min())


@dataclass
class _Drawn:
    """One batch the loader handed out: its first prompt's number, its size, and the loader's state
    before and after it."""

    first: int
    size: int
    before: dict[str, Any]
    after: dict[str, Any]


class GroupStream:
    """Draws, dispatches and collects prompt groups for a `mmrl.workers.remote.RemoteRollout`."""

    def __init__(self, loader: PrefetchLoader, batch_size: int, max_staleness: int, stale: str) -> None:
        self.loader, self.batch_size, self.k, self.stale = loader, batch_size, max_staleness, stale
        self.drawn = 0  # prompts drawn so far: the next one's number
        self.waiting: deque[_Group] = deque()  # drawn, not dispatched
        self.in_flight: list[_Group] = []
        self.ready: list[_Group] = []  # finished, not taken, in the order they finished
        self.batches: deque[_Drawn] = deque()  # drawn batches with a prompt not yet taken, oldest first
        self.taken: set[int] = set()  # numbers taken, from the oldest of `batches` on
        self.skip: set[int] = set()  # numbers a resumed run's checkpoint had taken
        self.taken_this_step = 0
        self.step_counts = {"stale": 0, "idle_s": 0.0, "queue": 0}
        self.trained_state = loader.source_state()  # the loader after the batch of the newest group taken
        self.newest_taken = -1

    # ------------------------------------------------------------ the step
    def begin_step(self) -> None:
        """A new step: its groups count against the window from here; its counters start at 0."""
        self.taken_this_step = 0
        self.step_counts = {"stale": 0, "idle_s": 0.0, "queue": len(self.ready)}

    def take(self, engine: Any, params: SamplingParams, count: int) -> tuple[Batch, dict[str, Any]]:
        """`count` finished groups, the first to finish within the staleness bound, in draw order, and
        the engine's metrics of them."""
        got: list[_Group] = []
        while len(got) < count:
            self._top_up(engine, params, count - len(got))
            if not self.ready:
                self._collect(engine)
            group = self.ready.pop(0)
            if engine.version - group.version > self.k:
                self.step_counts["stale"] += 1
                if self.stale == "regenerate":  # again, first in line, with the newest weights
                    group.ticket, group.batch = None, None
                    self.waiting.appendleft(group)
                else:
                    self._mark_taken(group)
                continue
            self._mark_taken(group)
            self.taken_this_step += 1
            got.append(group)
        got.sort(key=lambda g: g.number)
        batch = concat([g.batch for g in got])  # type: ignore[misc]
        return batch, engine.rollout_metrics(batch)

    def step_metrics(self) -> dict[str, float]:
        """The step's queue, wait and stale groups (`rollout/staleness_*` come with each batch)."""
        return {
            "rollout/queue_groups": self.step_counts["queue"],
            "rollout/stale_groups": self.step_counts["stale"],
            "timing/trainer_idle": self.step_counts["idle_s"],
        }

    def _top_up(self, engine: Any, params: SamplingParams, need: int) -> None:
        """Dispatch until K + 1 batches of groups are out (this step's taken ones counted), or at least
        `need` are, when dynamic sampling asks for more than this step's share."""
        out = len(self.in_flight) + len(self.ready)
        target = max(need, (self.k + 1) * self.batch_size - min(self.taken_this_step, self.batch_size))
        for _ in range(target - out):
            if not self.waiting:
                self._draw()
            group = self.waiting.popleft()
            if group.seed is None:
                group.seed = draw_seed()
            group.ticket = engine.dispatch(group.prompt, params, group.seed)
            self.in_flight.append(group)

    def _collect(self, engine: Any) -> None:
        """Wait for the next groups to finish and move them to `ready` in the order they finished."""
        start = time.perf_counter()
        owner = {id(g.ticket): g for g in self.in_flight}
        for ticket in engine.wait([g.ticket for g in self.in_flight]):
            group = owner[id(ticket)]
            group.batch = engine.result(ticket)
            self.in_flight.remove(group)
            self.ready.append(group)
        self.step_counts["idle_s"] += time.perf_counter() - start

    # ------------------------------------------------------------ the data cursor
    def _draw(self) -> None:
        before = self.loader.source_state()
        prompts = self.loader.next_batch()
        drawn = _Drawn(self.drawn, len(prompts), before, self.loader.source_state())
        self.batches.append(drawn)
        for number, prompt in enumerate(prompts, start=self.drawn):
            if number in self.skip:
                self.taken.add(number)
            else:
                self.waiting.append(_Group(number, prompt))
        self.drawn += len(prompts)
        self._forget_taken()

    def _mark_taken(self, group: _Group) -> None:
        self.taken.add(group.number)
        if group.number > self.newest_taken:
            self.newest_taken = group.number
            drawn = next(d for d in self.batches if d.first <= group.number < d.first + d.size)
            self.trained_state = drawn.after
        self._forget_taken()

    def _forget_taken(self) -> None:
        """Drop the oldest batches once every prompt of theirs is taken."""
        while self.batches and all(
            n in self.taken
            for n in range(self.batches[0].first, self.batches[0].first + self.batches[0].size)
        ):
            gone = self.batches.popleft()
            self.taken -= set(range(gone.first, gone.first + gone.size))

    def state(self) -> dict[str, Any]:
        """The loader's state before the oldest batch with a prompt not yet taken, and what of it was."""
        if not self.batches:
            return {**self.loader.source_state(), "stream": {"drawn": self.drawn, "taken": []}}
        oldest = self.batches[0]
        return {**oldest.before, "stream": {"drawn": oldest.first, "taken": sorted(self.taken)}}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from `state()`, with the loader already restored to it."""
        stream = state.get("stream")
        if stream is not None:
            self.drawn, self.skip = int(stream["drawn"]), set(stream["taken"])
        self.newest_taken = self.drawn - 1
        self.trained_state = self.loader.source_state()
