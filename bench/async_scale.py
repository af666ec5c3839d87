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
  split over its GPUs; a synchronous step also pays `sync_extra_s_per_token` (the old-log-prob pass that
  the asynchronous modes take from the rollout instead, as verl's run did: `sync_extra_s_per_token`);
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

import argparse
import heapq
import json
import math
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
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
    # What a synchronous step pays per token beyond the asynchronous trainer: verl's old-log-prob pass
    # (its asynchronous runs take the rollout's log-probs), GPU-seconds per token.
    sync_extra_s_per_token: float = 0.0
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


def train_s(groups: list[Group], gpus: int, costs: Costs, synchronous: bool) -> float:
    per_token = costs.train_s_per_token + (costs.sync_extra_s_per_token if synchronous else 0.0)
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


# ------------------------------------------------------------------------- verl's published DAPO run
# verl's `verl/experimental/fully_async_policy/README.md` (section "Asynchronous Training on 7B Model"):
# Qwen2.5-Math-7B, DAPO, H20 GPUs, vLLM + FSDP2, max response 28K, rollout.n 16, 512 prompts per step;
# fully_async_policy with require_batches 4 x ppo_mini_batch_size 32 prompts per update,
# trigger_parameter_sync_step 4, staleness_threshold 0.5, partial_rollout True, split half and half.
VERL_SYNC_ROWS = {  # GPUs: (step, gen, old_log_prob, update_actor) seconds, "colocate sync" rows
    32: (790.10, 357.41, 107.71, 269.80),
    64: (365.28, 150.72, 70.26, 133.41),
    128: (356.30, 177.85, 53.92, 113.81),
}
VERL_ASYNC_UPDATE_S = {32: 313.81, 64: 156.98, 128: 113.16}  # update_actor of the fully_async rows
VERL_SPEEDUP = {32: 2.66, 64: 1.92, 128: 2.35}  # total time of 400 steps, sync over fully_async
VERL_STREAM_ONLY_128 = (40 * 3600 + 48 * 60) / (25 * 3600 + 53 * 60)  # 1d16h48m / 1d1h53m: "about 1.6x"
H20_BW, H20_BF16 = 4.0e12, 148e12  # NVIDIA H20: 4.0 TB/s HBM3, 148 TFLOPS dense BF16 (data sheet)
QWEN7B_PARAMS = 7.62e9  # Qwen2.5-7B's model card
QWEN7B_KV_BYTES = 28 * 2 * 4 * 128 * 2  # per token: 28 layers x (K, V) x 4 KV heads x 128 x bf16


def verl_preset(train_from_async: int | None = None) -> tuple[Shape, Lengths, Costs]:
    """verl's DAPO 7B run as this model's inputs. The update cost per token is verl's own 32-GPU
    synchronous row; `train_from_async=G` takes it from the fully_async row at G GPUs instead (a
    number from the row the model then predicts: a fit, said as such where it is printed)."""
    shape = Shape(groups=512, n=16, prompt_len=200, max_len=28 * 1024, staleness=0.5, updates_per_sync=4)
    lengths = lognormal_lengths(median=2400, sigma=0.8, max_len=shape.max_len)
    mean_len = float(lengths(np.random.default_rng(1), 200_000).mean())
    tokens = shape.groups * shape.n * (shape.prompt_len + mean_len)
    _, _, logprob_s, update_s = VERL_SYNC_ROWS[32]
    train = sync_train = update_s * 32 / tokens
    if train_from_async:  # the asynchronous trainer's own cost; the synchronous step keeps its row's
        train = VERL_ASYNC_UPDATE_S[train_from_async] * (train_from_async // 2) / tokens
    flops = 2 * QWEN7B_PARAMS
    context = shape.prompt_len + mean_len / 2
    costs = Costs(
        decode_a_s=2 * QWEN7B_PARAMS / (0.6 * H20_BW) + 1e-3,
        decode_b_s=flops / (0.5 * H20_BF16) + QWEN7B_KV_BYTES * context / (0.6 * H20_BW),
        prefill_s_per_token=flops / (0.5 * H20_BF16),
        train_s_per_token=train,
        sync_extra_s_per_token=logprob_s * 32 / tokens + sync_train - train,
        sync_s_per_param=3.0 / QWEN7B_PARAMS,
        params=QWEN7B_PARAMS,
        max_seqs=256,
        source={
            "shape": "verl README: 512 prompts x 16, 28K max response, 4 updates per sync, staleness 0.5",
            "prompt_len": "assumed 200 tokens (a DAPO-Math-17k question with its instruction)",
            "lengths": f"assumed: lognormal, median 2400, sigma 0.8, clipped at 28K (mean {mean_len:.0f})",
            "decode_a_s": "bf16 weights read once per step at 60 % of the H20's 4.0 TB/s, + 1 ms (assumed)",
            "decode_b_s": "2 x params FLOPs per token at 50 % of 148 TFLOPS + its KV cache read (assumed)",
            "prefill_s_per_token": "2 x params FLOPs at 50 % of 148 TFLOPS (assumed)",
            "train_s_per_token": (
                f"verl fully_async {train_from_async}-GPU row, update_actor {VERL_ASYNC_UPDATE_S[train_from_async]} s"
                if train_from_async
                else "verl colocate sync 32-GPU row: update_actor 269.80 s x 32 GPUs / tokens"
            ),
            "sync_extra_s_per_token": "verl colocate sync 32-GPU row: old_log_prob 107.71 s x 32 / tokens"
            + (" + its update cost over the async row's" if train_from_async else ""),
            "sync_s_per_param": "assumed 3 s for 7.6 B parameters (verl's doc gives no absolute time)",
            "max_seqs": "assumed vLLM max_num_seqs 256, tensor parallel 1",
        },
    )
    return shape, lengths, costs


def check_verl() -> list[dict[str, Any]]:
    """Check (a): predicted speed-ups at verl's split (half and half) against its table."""
    rows = []
    for gpus, published in VERL_SPEEDUP.items():
        for variant in ("sync-row costs", "async-row update cost"):
            shape, lengths, costs = verl_preset(gpus if variant != "sync-row costs" else None)
            sync = synchronous(shape, lengths, costs, gpus)
            part = streaming(shape, lengths, costs, gpus, gpus // 2, partial=True)
            best = run_mode("partial", shape, lengths, costs, gpus)
            rows.append(
                {
                    "gpus": gpus,
                    "variant": variant,
                    "sync_step_s": sync.step_s,
                    "published_sync_step_s": VERL_SYNC_ROWS[gpus][0],
                    "partial_step_s": part.step_s,
                    "predicted": sync.step_s / part.step_s,
                    "predicted_best_split": sync.step_s / best.step_s,
                    "best_split": best.rollout_gpus,
                    "published": published,
                }
            )
        if gpus == 128:  # verl's stream-only row: staleness 0, no partial rollouts
            shape, lengths, costs = verl_preset()
            shape = replace(shape, staleness=0.0)
            sync = synchronous(shape, lengths, costs, gpus)
            stream = streaming(shape, lengths, costs, gpus, gpus // 2, partial=False)
            rows.append(
                {
                    "gpus": gpus,
                    "variant": "stream only, K=0 (sync-row costs)",
                    "sync_step_s": sync.step_s,
                    "published_sync_step_s": VERL_SYNC_ROWS[gpus][0],
                    "partial_step_s": stream.step_s,
                    "predicted": sync.step_s / stream.step_s,
                    "predicted_best_split": float("nan"),
                    "best_split": gpus // 2,
                    "published": VERL_STREAM_ONLY_128,
                }
            )
    return rows


# --------------------------------------------------------------------------------------- the table
def scale_table(
    shape: Shape, lengths: Lengths, costs: Costs, gpu_counts: tuple[int, ...] = GPU_COUNTS
) -> list[Result]:
    results = []
    for gpus in gpu_counts:
        for mode in MODES:
            results.append(run_mode(mode, shape, lengths, costs, gpus))
    return results


def print_table(results: list[Result], title: str) -> None:
    print(title)
    print(f"  {'GPUs':>5} {'mode':<9} {'rollout:train':>13} {'step s':>9} {'samples/s':>10} {'vs sync':>8}")
    sync = {r.gpus: r.step_s for r in results if r.mode == "sync"}
    for r in results:
        split = "all" if r.mode == "sync" else f"{r.rollout_gpus}:{r.gpus - r.rollout_gpus}"
        print(
            f"  {r.gpus:>5} {r.mode:<9} {split:>13} {r.step_s:>9.3f} {r.samples_per_s:>10.1f} "
            f"{sync[r.gpus] / r.step_s:>7.2f}x"
        )


def print_verl_check(rows: list[dict[str, Any]]) -> None:
    print("check (a): verl's Qwen2.5-Math-7B DAPO run, stream + partial at its split (half and half)")
    print(
        f"  {'GPUs':>5} {'costs':<36} {'sync step s':>15} {'predicted':>10} {'published':>10} "
        f"{'error':>7} {'best split':>14}"
    )
    for r in rows:
        error = r["predicted"] / r["published"] - 1
        sync = f"{r['sync_step_s']:.0f} ({r['published_sync_step_s']:.0f})"
        best = (
            f"{r['predicted_best_split']:.2f}x@{r['best_split']}"
            if not math.isnan(r["predicted_best_split"])
            else "-"
        )
        print(
            f"  {r['gpus']:>5} {r['variant']:<36} {sync:>15} {r['predicted']:>9.2f}x "
            f"{r['published']:>9.2f}x {error:>+7.0%} {best:>14}"
        )
    print("  (sync step: predicted (published); best split: the speed-up at the best rollout GPUs)")


# ------------------------------------------------------------------------ costs measured on this machine
def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares a, b of y = a + b x."""
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(a), float(b)


def measure(root: Path, max_new_tokens: int = 256, seed: int = 0) -> tuple[Costs, list[int], int, Path]:
    """This machine's costs on the tiny Qwen2.5-VL, one core each (a rollout worker's share): decode
    and prefill from mmrl's HF engine, the trainer's per-token time from mmrl's Trainer (3 steps), the
    weight sync as a rollout worker loads a state dict (serialised, read back and loaded). Also the
    lengths the engine samples after the quickstart's format warm-up (most short, some run on), the
    mean prompt length and the warmed model's folder, which `--check-real` trains from."""
    import io

    import torch

    from mmrl.models import load_policy, load_processor, save_model, tokenizer_of
    from mmrl.rollout.base import SamplingParams
    from mmrl.rollout.hf import HFEngine
    from mmrl.sources.prompts import build_datasets
    from mmrl.training.warmup import format_warmup

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    cfg, model_dir = _config(root, [])
    processor = load_processor(model_dir)
    model = load_policy(model_dir)
    train, _ = build_datasets(cfg, processor, model.config)
    warm = root / "warm-model"
    if not (warm / "config.json").exists():
        format_warmup(model, tokenizer_of(processor), train.prepare_all(limit=256), cfg.warmup, seed)
        save_model(model, processor, warm)
    model = load_policy(warm).eval()
    prompts = [p for p in (train.prepare(i) for i in range(32)) if p is not None]
    prompt_len = int(np.mean([len(p.prompt_ids) for p in prompts]))
    engine = HFEngine(model, processor)

    stops, engine.eos_ids = engine.eos_ids, []  # every row decodes exactly max_new_tokens
    sizes, steps, prefill = [1, 2, 4, 8, 16, 32], [], []
    for size in sizes:
        batch = [prompts[i % len(prompts)] for i in range(size)]
        short, long_ = (
            min(_time(engine.generate, batch, SamplingParams(max_new_tokens=t)) for _ in range(2))
            for t in (8, 40)
        )
        steps.append((long_ - short) / 32)
        prefill.append(max(0.0, short - 8 * steps[-1]) / (size * prompt_len))
    engine.eos_ids = stops
    a, b = fit_line(sizes, steps)

    lengths: list[int] = []
    for _ in range(2):
        out = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=max_new_tokens))
        lengths += out["response_mask"].sum(dim=1).tolist()

    state = {k: v.clone() for k, v in model.state_dict().items()}
    start = time.perf_counter()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    model.load_state_dict(torch.load(buffer))
    sync = time.perf_counter() - start
    params = sum(v.numel() for v in state.values())

    train_s, tokens = _trainer_cost(root, warm, max_new_tokens)
    costs = Costs(
        decode_a_s=a,
        decode_b_s=max(b, 0.0),
        prefill_s_per_token=float(np.median(prefill)),
        train_s_per_token=train_s / tokens,
        sync_s_per_param=sync / params,
        params=float(params),
        max_seqs=4,  # a rollout worker samples one group (n=4 here) at a time
        source={
            "decode": "mmrl HF engine, tiny Qwen2.5-VL, 1 thread, batch "
            + ", ".join(f"{s}: {t * 1e3:.2f} ms" for s, t in zip(sizes, steps, strict=True)),
            "prefill_s_per_token": "mmrl HF engine, (8-token call - 8 decode steps) / prompt tokens",
            "train_s_per_token": f"mmrl Trainer, 1 thread: every phase but rollout and sync, {tokens} tokens/step",
            "sync_s_per_param": "torch.save + torch.load + load_state_dict of the policy (a worker's load)",
            "max_seqs": "one group at a time per rollout worker, as mmrl's workers generate",
        },
    )
    return costs, lengths, prompt_len, warm


def _time(fn: Callable[..., Any], *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


CHECK_SHAPE = {"batch": 16, "n": 4, "image_size": 112}


def _config(root: Path, overrides: list[str], model: Path | None = None) -> tuple[Any, Path]:
    """The quickstart recipe on the tiny model and colour task under `root`."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import QUICKSTART, data_overrides, make_workspace

    from mmrl.config import load_config

    model_dir, data_dir = make_workspace(root, 1024, CHECK_SHAPE["image_size"])
    run = root / f"run-{time.strftime('%H%M%S')}-{len(list(root.glob('run-*')))}"
    b, n = CHECK_SHAPE["batch"], CHECK_SHAPE["n"]
    cfg = load_config(
        QUICKSTART,
        [
            *data_overrides(model or model_dir, data_dir, run, CHECK_SHAPE["image_size"]),
            f"model.path={model or model_dir}",
            f"data.train_batch_size={b}",
            f"actor.mini_batch_size={b}",
            f"actor.micro_batch_size={b * n}",
            f"rollout.n={n}",
            "warmup.steps=0",
            *overrides,
        ],
    )
    return cfg, model_dir


def _train(root: Path, model: Path, overrides: list[str]) -> list[dict[str, Any]]:
    """A short real run through mmrl's Trainer; its metrics.jsonl records."""
    from mmrl.run.logger import read_metrics
    from mmrl.trainer import Trainer

    cfg, _ = _config(root, overrides, model)
    Trainer(cfg).fit()
    return [r for r in read_metrics(Path(cfg.trainer.output_dir) / "metrics.jsonl") if "timing/step" in r]


def _trainer_cost(root: Path, model: Path, max_new_tokens: int) -> tuple[float, int]:
    """Median seconds of a synchronous step's trainer phases (all but rollout and sync) and its tokens."""
    records = _train(root, model, [f"rollout.max_new_tokens={max_new_tokens}", "trainer.total_steps=3"])[1:]
    seconds = [r["timing/step"] - r.get("timing/rollout", 0) - r.get("timing/sync", 0) for r in records]
    tokens = [r["throughput/tokens_per_s"] * r["timing/step"] for r in records]
    return float(np.median(seconds)), int(np.median(tokens))


# ------------------------------------------------------------------------------- check (b): real runs
REAL_CASES = (  # (name, rollout.workers, rollout.max_staleness); 0 workers: the in-process loop
    ("synchronous, in-process", 0, 0),
    ("1 worker, K=1", 1, 1),
    ("2 workers, K=0", 2, 0),
)


def check_real(
    root: Path, costs: Costs, lengths: list[int], prompt_len: int, warm: Path, max_new_tokens: int, steps: int
) -> list[dict[str, Any]]:
    """Check (b): real mmrl runs on this machine against the model's step time, same shape and costs.
    Each worker and the trainer get one core (the trainer keeps what the workers leave, at least one),
    so no case runs more threads than the 2 cores hold at once."""
    b, n = CHECK_SHAPE["batch"], CHECK_SHAPE["n"]
    rows = []
    for name, workers, k in REAL_CASES:
        overrides = [f"rollout.max_new_tokens={max_new_tokens}", f"trainer.total_steps={steps}"]
        if workers:
            overrides += [f"rollout.workers={workers}", f"rollout.max_staleness={k}"]
            overrides += ["actor.rollout_correction=tis"] if k else []
        records = _train(root, warm, overrides)[2:]  # the first steps start workers and fill the pipe
        shape = Shape(groups=b, n=n, prompt_len=prompt_len, max_len=max_new_tokens, staleness=k, steps=8)
        draw = empirical_lengths(lengths)
        if workers:
            predicted = streaming(
                shape, draw, replace(costs, max_seqs=n), workers + 1, workers, partial=False
            )
        else:  # the HF engine decodes the whole batch at once, finished rows dropped
            predicted = synchronous(shape, draw, replace(costs, max_seqs=b * n), 1)
        real = float(np.median([r["timing/step"] for r in records]))
        rows.append(
            {
                "case": name,
                "real_step_s": real,
                "predicted_step_s": predicted.step_s,
                "error": predicted.step_s / real - 1,
                "real_length_mean": float(np.mean([r["response_length/mean"] for r in records])),
                "real_length_max": float(np.max([r["response_length/max"] for r in records])),
                "sampled_length_mean": float(np.mean(lengths)),
                "real_trainer_idle_s": float(np.median([r.get("timing/trainer_idle", 0.0) for r in records])),
            }
        )
    return rows


def print_real_check(rows: list[dict[str, Any]], max_new_tokens: int) -> None:
    b, n = CHECK_SHAPE["batch"], CHECK_SHAPE["n"]
    print(f"check (b): real mmrl runs, {b} prompts x n={n}, max_new_tokens {max_new_tokens}, median step")
    print(f"  {'case':<26} {'real s':>8} {'model s':>8} {'error':>7} {'length mean/max (sampled)':>27}")
    for r in rows:
        lengths = f"{r['real_length_mean']:.1f}/{r['real_length_max']:.0f} ({r['sampled_length_mean']:.1f})"
        print(
            f"  {r['case']:<26} {r['real_step_s']:>8.3f} {r['predicted_step_s']:>8.3f} "
            f"{r['error']:>+7.0%} {lengths:>27}"
        )


# -------------------------------------------------------------------------------------------- the CLI
def load_costs(path: Path) -> tuple[Shape, Lengths, Costs]:
    """`--costs FILE.json`: {"costs": {Costs fields}, "shape": {Shape fields}, "lengths": {"values":
    [...]} or {"median": m, "sigma": s}} (lengths default to a lognormal of median max_len / 8)."""
    spec = json.loads(path.read_text())
    costs = Costs(**spec["costs"])
    shape = Shape(**spec["shape"])
    lengths = spec.get("lengths", {})
    if "values" in lengths:
        return shape, empirical_lengths(lengths["values"]), costs
    median = lengths.get("median", shape.max_len / 8)
    return shape, lognormal_lengths(median, lengths.get("sigma", 0.8), shape.max_len), costs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=["verl-dapo-7b"], default=None, help="verl's published run (default)")
    p.add_argument("--costs", type=Path, default=None, help="costs, shape and lengths as JSON")
    p.add_argument("--measure", action="store_true", help="measure this machine's costs (< 60 s)")
    p.add_argument("--check-real", action="store_true", help="measure, then real runs with 1 and 2 workers")
    p.add_argument("--check-verl", action="store_true", help="check (a) only (also printed with the preset)")
    p.add_argument("--gpus", type=int, nargs="+", default=list(GPU_COUNTS))
    p.add_argument("--max-new-tokens", type=int, default=256, help="measured runs' response budget")
    p.add_argument("--steps", type=int, default=8, help="real runs' steps (the first two left out)")
    p.add_argument("--workdir", type=Path, default=None, help="reuse a folder (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="write everything printed as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:]}
    gpus = tuple(args.gpus)
    if args.measure or args.check_real:
        with tempfile.TemporaryDirectory(prefix="mmrl-async-scale-") as tmp:
            root = args.workdir or Path(tmp)
            start = time.perf_counter()
            costs, lengths, prompt_len, warm = measure(root, args.max_new_tokens)
            out["measure_s"] = time.perf_counter() - start
            out["costs"], out["lengths"], out["prompt_len"] = asdict(costs), lengths, prompt_len
            print(f"costs measured in {out['measure_s']:.0f} s:")
            for key, value in asdict(costs).items():
                if key != "source":
                    print(f"  {key:<24} {value:.4g}")
            for key, value in costs.source.items():
                print(f"  ({key}: {value})")
            clipped = np.mean(np.asarray(lengths) >= args.max_new_tokens)
            print(
                f"  lengths sampled: {len(lengths)}, mean {np.mean(lengths):.1f}, median "
                f"{np.median(lengths):.0f}, max {max(lengths)}, {clipped:.0%} at max_new_tokens"
            )
            shape = Shape(groups=512, n=CHECK_SHAPE["n"], prompt_len=prompt_len, max_len=args.max_new_tokens)
            results = scale_table(shape, empirical_lengths(lengths), costs, gpus)
            print_table(
                results, "this machine's costs, one core per 'GPU', 512 prompts x 4, K=1, lengths as sampled"
            )
            out["table"] = [asdict(r) for r in results]
            if args.check_real:
                rows = check_real(root, costs, lengths, prompt_len, warm, args.max_new_tokens, args.steps)
                print_real_check(rows, args.max_new_tokens)
                out["check_real"] = rows
    else:
        if args.costs:
            shape, lengths_fn, costs = load_costs(args.costs)
            title = f"costs from {args.costs}"
        else:
            shape, lengths_fn, costs = verl_preset()
            title = (
                "preset verl-dapo-7b: Qwen2.5-Math-7B DAPO on H20s, 512 prompts x 16, 28K max, staleness 0.5"
            )
            for key, value in costs.source.items():
                print(f"  ({key}: {value})")
        if not args.check_verl:
            results = scale_table(shape, lengths_fn, costs, gpus)
            print_table(results, title)
            out["table"] = [asdict(r) for r in results]
        if not args.costs:
            rows = check_verl()
            print_verl_check(rows)
            out["check_verl"] = rows
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
