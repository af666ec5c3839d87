"""A scale model of asynchronous RL: the step's events simulated, for 8 to 256 GPUs, in four modes.

Why: the speed-up of streamed rollouts over the synchronous loop depends on the response-length tail,
the split of GPUs between rollout and training and the cost of each phase, and cannot be measured on
a 2-core CPU machine at 256 GPUs. This model replays one RL step event by event, from costs measured on
the machine it runs on (`--measure`) or supplied for a GPU shape (`--costs FILE.json`, `--preset`):

- a rollout replica decodes with continuous batching: one decode step of `active` sequences takes
  `decode_a_s + decode_b_s * active` and gives each of them one token; a group admitted pays
  `prefill_s_per_token` per prompt token once (its n samples share the prefix); at most `max_seqs`
  sequences are in flight, and a group is admitted whole;
- the trainer's update costs `train_s_per_token` GPU-seconds per trained token (prompt + response),
  split over its GPUs; a synchronous step also pays `logprob_s_per_token` (the old-log-prob pass that
  the asynchronous modes take from the rollout instead, as verl's run did);
- a weight sync costs `sync_s_per_param * params` on the trainer and on each replica.

Modes, each for the same total number of GPUs G:

- `sync`: all G generate the batch, then all G train, then sync (colocated);
- `one_step`: R GPUs generate batch i+1 while G-R train batch i; the sync waits for both;
- `stream`: the trainer takes groups as they finish (`updates_per_sync` updates of `groups /
  updates_per_sync` groups each between syncs); at most `(1 + staleness) * groups` groups are
  dispatched and not yet trained, counting those trained since the last sync (mmrl's
  `rollout.max_staleness` K is staleness K); a replica asked to load weights finishes its in-flight
  sequences first (it admits no new group meanwhile), as mmrl's workers and verl's mode c do;
- `partial`: `stream`, but a replica pauses its in-flight sequences at the sync, loads the weights,
  prefills each one's prompt and tokens so far again, and continues them.

For each mode but `sync` the split R is searched (every R = G*k/16, the best kept) unless given.

    .venv/bin/python bench/async_scale.py --preset verl-dapo-7b      # the GPU table and check (a)
    .venv/bin/python bench/async_scale.py --measure                  # this machine's costs (< 60 s)
    .venv/bin/python bench/async_scale.py --check-real               # check (b): real mmrl runs
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MODES = ("sync", "one_step", "stream", "partial")
GPU_COUNTS = (8, 16, 32, 64, 128, 256)
Lengths = Callable[[np.random.Generator, int], np.ndarray]


# ---------------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Costs:
    """Seconds per unit of work on one GPU (or core); `source` says where each number comes from."""

    decode_a_s: float  # one decode step, whatever the batch
    decode_b_s: float  # one decode step, per sequence in flight
    prefill_s_per_token: float
    train_s_per_token: float  # GPU-seconds per trained token, every trainer phase of a step
    sync_s_per_param: float
    params: float
    max_seqs: int  # sequences one replica decodes at once
    logprob_s_per_token: float = 0.0  # the synchronous loop's old-log-prob pass, GPU-seconds per token
    source: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def sync_s(self) -> float:
        return self.sync_s_per_param * self.params


@dataclass(frozen=True)
class Shape:
    """What one step trains: `groups` prompts of `n` samples, and how the asynchronous modes run."""

    groups: int
    n: int
    prompt_len: int
    max_len: int
    staleness: float = 1.0  # stream/partial: (1 + this) * groups dispatched and not yet trained
    updates_per_sync: int = 1  # stream/partial: trainer updates between two weight syncs
    steps: int = 8  # syncs simulated; the first two are left out of the rate
    seed: int = 0


def lognormal_lengths(median: float, sigma: float, max_len: int) -> Lengths:
    """A heavy-tailed length distribution like DAPO's: lognormal, clipped to [1, max_len] (the clip is
    the truncated answers' spike at the maximum)."""

    def draw(rng: np.random.Generator, size: int) -> np.ndarray:
        return np.clip(rng.lognormal(math.log(median), sigma, size).round(), 1, max_len).astype(int)

    return draw


def empirical_lengths(values: list[int]) -> Lengths:
    """Lengths drawn with replacement from ones measured (sampled by mmrl's engine, or a run's)."""
    pool = np.asarray(values, dtype=int)

    def draw(rng: np.random.Generator, size: int) -> np.ndarray:
        return rng.choice(pool, size=size)

    return draw


# ----------------------------------------------------------------------------------- the rollout side
@dataclass(eq=False)
class Group:
    """One prompt's n samples, from dispatch to training."""

    lengths: np.ndarray
    prompt_len: int
    version: int = -1  # the weights its first token was sampled with
    partial: bool = False  # its tokens span more than one version
    left: int = 0  # samples still decoding
    done_at: float = math.inf

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum()) + self.prompt_len * len(self.lengths)


class Replica:
    """One rollout engine. `step` counts decode steps as a float, so a sync can land mid-step;
    between events the number in flight is constant, so time and steps convert linearly."""

    def __init__(self, costs: Costs) -> None:
        self.c = costs
        self.queue: deque[Group] = deque()
        self.active: list[tuple[float, int, float, Group]] = []  # (finish step, id, start step, group)
        self.step = 0.0
        self.clock = 0.0  # the time `step` is accounted to
        self.busy_until = 0.0  # prefill or weight load: no decoding before this
        self.version = 0
        self.pending: int | None = None  # weights to load once drained
        self.stamp = 0  # bumps on every change: older scheduled events are void
        self.ids = 0
        self.assigned = self.finished = 0

    @property
    def load(self) -> int:
        """Groups assigned and unfinished, for the least-loaded dispatch."""
        return self.assigned - self.finished

    def step_s(self) -> float:
        return self.c.decode_a_s + self.c.decode_b_s * len(self.active)

    def advance(self, t: float) -> None:
        start = max(self.clock, self.busy_until)
        if self.active and t > start:
            self.step += (t - start) / self.step_s()
        self.clock = max(self.clock, t)

    def next_event(self) -> float | None:
        """When the next sequence finishes, or a load ends with groups waiting."""
        begin = max(self.clock, self.busy_until)
        if self.active:
            return begin + max(0.0, self.active[0][0] - self.step) * self.step_s()
        if self.queue and self.pending is None:
            return begin
        return None

    def admit(self, t: float) -> None:
        """Whole groups from the queue while they fit, each prefilled once."""
        while (
            self.queue
            and self.pending is None
            and len(self.active) + len(self.queue[0].lengths)
            <= max(self.c.max_seqs, len(self.queue[0].lengths))
        ):
            group = self.queue.popleft()
            group.version, group.left = self.version, len(group.lengths)
            self.busy_until = max(self.busy_until, t) + self.c.prefill_s_per_token * group.prompt_len
            for length in group.lengths:
                self.ids += 1
                heapq.heappush(self.active, (self.step + float(length), self.ids, self.step, group))

    def finish(self, t: float) -> list[Group]:
        """Advance to `t`, retire what finished, load waiting weights once drained, admit more."""
        self.advance(t)
        done = []
        while self.active and self.active[0][0] <= self.step + 1e-6:
            *_, group = heapq.heappop(self.active)
            group.left -= 1
            if group.left == 0:
                group.done_at = t
                self.finished += 1
                done.append(group)
        if self.pending is not None and not self.active:
            self._load(t, self.pending, recompute=0)
        self.admit(t)
        self.stamp += 1
        return done

    def new_weights(self, t: float, version: int, partial: bool) -> None:
        """Partial: pause, load, prefill the in-flight sequences again, go on. Else drain, then load."""
        self.advance(t)
        if partial or not self.active:
            recompute = sum(g.prompt_len + (self.step - start) for _, _, start, g in self.active)
            for *_, g in self.active:
                g.partial = True
            self._load(t, version, recompute)
        else:
            self.pending = version
        self.stamp += 1

    def _load(self, t: float, version: int, recompute: float) -> None:
        self.busy_until = max(self.busy_until, t) + self.c.sync_s + self.c.prefill_s_per_token * recompute
        self.version, self.pending = version, None


class Events:
    """A time-ordered queue of (time, kind, payload); replica events carry the stamp they were made at."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, str, Any]] = []
        self.count = 0

    def push(self, t: float, kind: str, payload: Any) -> None:
        self.count += 1
        heapq.heappush(self.heap, (t, self.count, kind, payload))

    def replica(self, index: int, replica: Replica) -> None:
        t = replica.next_event()
        if t is not None:
            self.push(t, "replica", (index, replica.stamp))

    def pop(self) -> tuple[float, str, Any]:
        t, _, kind, payload = heapq.heappop(self.heap)
        return t, kind, payload


def draw_groups(shape: Shape, lengths: Lengths, rng: np.random.Generator, count: int) -> list[Group]:
    return [Group(lengths(rng, shape.n), shape.prompt_len) for _ in range(count)]


def generate_batch(groups: list[Group], replicas: int, costs: Costs) -> float:
    """Seconds for `replicas` fresh engines to finish every group, dispatched together at 0."""
    pool = [Replica(costs) for _ in range(replicas)]
    for group in groups:
        replica = min(pool, key=lambda r: r.load)
        replica.queue.append(group)
        replica.assigned += 1
    events = Events()
    for i, r in enumerate(pool):
        r.admit(0.0)
        events.replica(i, r)
    end = 0.0
    while events.heap:
        t, _, (i, stamp) = events.pop()
        if stamp != pool[i].stamp:
            continue
        if pool[i].finish(t):
            end = t
        events.replica(i, pool[i])
    return end


def train_s(groups: list[Group], gpus: int, costs: Costs, logprobs: bool) -> float:
    per_token = costs.train_s_per_token + (costs.logprob_s_per_token if logprobs else 0.0)
    return sum(g.tokens for g in groups) * per_token / gpus


# ------------------------------------------------------------------------------------------ the modes
@dataclass
class Result:
    """A mode's steady state: seconds per step (one sync's worth of groups) and what it is made of."""

    mode: str
    gpus: int
    rollout_gpus: int
    step_s: float
    samples_per_s: float
    trainer_idle: float = 0.0  # share of the trainer's time spent waiting
    staleness_max: int = 0
    partial_fraction: float = 0.0


def synchronous(shape: Shape, lengths: Lengths, costs: Costs, gpus: int) -> Result:
    """Generation's tail + update + sync, every GPU in each phase."""
    rng = np.random.default_rng(shape.seed)
    steps = []
    for _ in range(shape.steps):
        groups = draw_groups(shape, lengths, rng, shape.groups)
        steps.append(generate_batch(groups, gpus, costs) + train_s(groups, gpus, costs, True) + costs.sync_s)
    step = float(np.mean(steps[2:] or steps))
    return Result("sync", gpus, gpus, step, shape.groups * shape.n / step)


def one_step(shape: Shape, lengths: Lengths, costs: Costs, gpus: int, rollout: int) -> Result:
    """Batch i+1 generated with the weights before update i while batch i trains; the sync after
    update i waits for both (the rollout loads weights between batches), then batch i+2 starts."""
    rng = np.random.default_rng(shape.seed)
    batches = [draw_groups(shape, lengths, rng, shape.groups) for _ in range(shape.steps + 1)]
    gen = [generate_batch(b, rollout, costs) for b in batches]
    # Batch 0 alone, batch 1 right after it; from then on each sync starts the next batch and update.
    start = gen[0]
    rollout_free = gen[0] + gen[1]
    syncs = []
    for i in range(shape.steps):
        train_end = start + train_s(batches[i], gpus - rollout, costs, False)
        sync_end = max(train_end, rollout_free) + costs.sync_s
        syncs.append(sync_end)
        start = sync_end
        rollout_free = sync_end + (gen[i + 2] if i + 2 < len(gen) else gen[-1])
    return _rate("one_step", shape, gpus, rollout, syncs)


def _rate(mode: str, shape: Shape, gpus: int, rollout: int, syncs: list[float], **extra: Any) -> Result:
    """Seconds per step between the 2nd and the last sync (the first steps fill the pipeline)."""
    skip = min(2, len(syncs) - 2)
    step = (syncs[-1] - syncs[skip]) / (len(syncs) - 1 - skip)
    return Result(mode, gpus, rollout, step, shape.groups * shape.n / step, **extra)


def streaming(shape: Shape, lengths: Lengths, costs: Costs, gpus: int, rollout: int, partial: bool) -> Result:
    """Groups dispatched one at a time to the least-loaded replica inside the staleness window, taken
    by the trainer in the order they finish, weights sent to every replica after each sync."""
    rng = np.random.default_rng(shape.seed)
    pool = [Replica(costs) for _ in range(rollout)]
    trainers = gpus - rollout
    per_update = max(1, shape.groups // shape.updates_per_sync)
    window = math.ceil((1 + shape.staleness) * shape.groups)
    events = Events()
    ready: list[Group] = []
    state = {"out": 0, "taken": 0, "updates": 0, "version": 0, "busy": False, "idle": 0.0, "since": 0.0}
    syncs: list[float] = []
    trained: list[Group] = []
    staleness: list[int] = []

    def top_up(t: float) -> None:
        """Dispatch until the window is full: in flight and ready, plus taken since the last sync."""
        while state["out"] + state["taken"] < window:
            replica = min(range(rollout), key=lambda i: pool[i].load)
            pool[replica].advance(t)
            pool[replica].queue.append(draw_groups(shape, lengths, rng, 1)[0])
            pool[replica].assigned += 1
            pool[replica].admit(t)
            pool[replica].stamp += 1
            events.replica(replica, pool[replica])
            state["out"] += 1

    def try_update(t: float) -> None:
        if state["busy"] or len(ready) < per_update:
            return
        batch = [ready.pop(0) for _ in range(per_update)]
        state["out"] -= per_update
        state["taken"] += per_update
        trained.extend(batch)
        staleness.extend(state["version"] - g.version for g in batch)
        state["busy"] = True
        state["idle"] += t - state["since"]
        events.push(t + train_s(batch, trainers, costs, False), "update", batch)

    top_up(0.0)
    while len(syncs) < shape.steps:
        t, kind, payload = events.pop()
        if kind == "replica":
            index, stamp = payload
            if stamp != pool[index].stamp:
                continue
            ready.extend(pool[index].finish(t))
            events.replica(index, pool[index])
        elif kind == "update":
            state["updates"] += 1
            if state["updates"] % shape.updates_per_sync == 0:
                events.push(t + costs.sync_s, "sync", None)
                continue
            state["busy"], state["since"] = False, t
        elif kind == "sync":
            state["version"] += 1
            syncs.append(t)
            for i, replica in enumerate(pool):
                replica.new_weights(t, state["version"], partial)
                events.replica(i, replica)
            state["taken"] = 0
            state["busy"], state["since"] = False, t
            top_up(t)
        try_update(t)
    return _rate(
        "partial" if partial else "stream",
        shape,
        gpus,
        rollout,
        syncs,
        trainer_idle=state["idle"] / syncs[-1],
        staleness_max=max(staleness, default=0),
        partial_fraction=float(np.mean([g.partial for g in trained])) if trained else 0.0,
    )


def best_split(run: Callable[[int], Result], gpus: int, splits: list[int] | None = None) -> Result:
    """The fastest rollout/train split: R = G*k/8 for k = 1..7, then the G/16 steps either side of the
    best (or only the splits given)."""
    if splits is not None:
        return max((run(r) for r in splits), key=lambda r: r.samples_per_s)
    fine = max(1, gpus // 16)
    tried = {r: run(r) for r in sorted({max(1, min(gpus - 1, gpus * k // 8)) for k in range(1, 8)})}
    best = max(tried.values(), key=lambda r: r.samples_per_s).rollout_gpus
    for r in (best - fine, best + fine):
        if 0 < r < gpus and r not in tried:
            tried[r] = run(r)
    return max(tried.values(), key=lambda r: r.samples_per_s)


def run_mode(
    mode: str, shape: Shape, lengths: Lengths, costs: Costs, gpus: int, rollout: int | None = None
) -> Result:
    if mode == "sync":
        return synchronous(shape, lengths, costs, gpus)
    splits = [rollout] if rollout else None
    if mode == "one_step":
        return best_split(lambda r: one_step(shape, lengths, costs, gpus, r), gpus, splits)
    partial = mode == "partial"
    return best_split(lambda r: streaming(shape, lengths, costs, gpus, r, partial), gpus, splits)
