"""Worker processes that run untrusted reward functions with a per-call timeout.

Why not `multiprocessing.Pool` or `ProcessPoolExecutor`: neither can kill one hung task and carry on; a
hung call would block the batch, and killing a worker breaks the executor. This pool owns its processes
and replaces any that hang or die.

How work travels. A batch is cut into chunks of calls: a few chunks per worker for plain sync functions
(contiguous samples, every such function), one per worker for async functions (so each worker's event loop
runs its share of them at once), and one per call of a batched function (all samples). A chunk goes to an
idle worker in one message, so each sample's images are pickled and sent once per chunk, not once per
function or per round-trip. The worker runs a chunk's async calls first, all at once, then its sync calls
in order, and streams back each call's result as it finishes, tagged with the call's place in the chunk.

How calls are timed. Sync calls: the parent restarts a worker's clock on every result it receives, so the
clock always times the call the worker is on; when it runs out, that call scores a timeout, the worker is
killed and replaced, and the chunk's unfinished calls go back to the front of the queue. The first call's
clock starts once its chunk is sent, so it also covers unpickling the chunk (milliseconds); later clocks
start when the previous result arrives, a little after the call began, so they err towards lenient. Async
calls are cut off by the worker itself (see `Scorer.acall`), so one hung request costs neither the worker
nor the other calls; the parent only steps in, a grace period later, when a call blocks the worker's event
loop (a blocking call inside `async def`), and then every async call still open in that chunk times out.

Workers start with the "spawn" method (no inherited CUDA state or locks), load the functions once, and
report ready; start-up time (often imports of torch and friends) never counts against a call.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import pickle
import signal
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any, cast

from mmrl.rewards.loader import load_reward_function
from mmrl.rewards.outcome import EventLoop, Outcome, OutcomeKind, Scorer, run_calls
from mmrl.rewards.types import RewardInput


@dataclass(frozen=True)
class RemoteFunction:
    """A reward function as a worker loads it (`spec`, `kwargs`, `batched`) and as the parent schedules and
    times it (`is_async`, which the parent read off the function it loaded itself).

    `build`, a module-level function, makes the worker's callable from this entry instead of loading a
    reward function: how other untrusted user code (agent tools, `mmrl.agent.tools`) runs in the same
    pool. Its callable takes a list of samples and returns one `Outcome` each, as `Scorer` does."""

    spec: str
    kwargs: dict[str, Any]
    batched: bool = False
    is_async: bool = False
    build: Callable[[RemoteFunction], Any] | None = None


def _scorer(function: RemoteFunction) -> Any:
    if function.build is not None:
        return function.build(function)
    return Scorer(load_reward_function(function.spec), function.kwargs, function.batched)


@dataclass(frozen=True)
class Call:
    """One call of one reward function: on one sample, or on all of them for a batched function."""

    function: int
    samples: tuple[int, ...]


# Chunks per worker and batch for sync functions: several, so a worker that drew slow samples does not
# hold up the batch.
_CHUNKS_PER_WORKER = 4
# A worker must report ready this soon after it is spawned; generous, as reward files may import big
# libraries.
_START_TIMEOUT_S = 120.0
# How long close() lets workers exit on their own before killing them.
_STOP_GRACE_S = 2.0
# How long after an async call's own timeout the parent waits before it assumes the worker's event loop is
# blocked and kills the worker: enough for the worker to report its own timeouts first.
_ASYNC_GRACE_S = 1.0


def _send(conn: Connection, message: object) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _serve(conn: Connection, functions: list[RemoteFunction], timeout_s: float) -> None:
    """Worker process: load the functions, report ready, then score chunks until told to stop.

    SIGINT and SIGTERM are ignored: Ctrl-C, or a scheduler's SIGTERM to every process of the job, is the
    trainer's to handle (it finishes the step, scored by these workers, and saves), and the pool stops
    its workers itself (a message, then SIGKILL).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        scorers = [_scorer(f) for f in functions]
    except Exception:
        _send(conn, ("start_failed", traceback.format_exc()))
        return
    _send(conn, ("ready", None))
    loop = EventLoop()

    def report(position: int, outcomes: list[Outcome]) -> None:
        _send(conn, ("result", (position, outcomes)))

    with contextlib.suppress(EOFError, BrokenPipeError):
        while (chunk := pickle.loads(conn.recv_bytes())) is not None:
            samples, calls = chunk
            work = [
                (position, scorers[call.function], [samples[i] for i in call.samples])
                for position, call in enumerate(calls)
            ]
            run_calls(work, timeout_s, loop, report)
    loop.close()


class _Worker:
    """One worker process and the chunk it is working through."""

    def __init__(self, context: SpawnContext, functions: list[RemoteFunction], timeout_s: float):
        self.conn, child_conn = context.Pipe()
        self.process: BaseProcess = context.Process(
            target=_serve, args=(child_conn, functions, timeout_s), name="mmrl-reward-worker", daemon=True
        )
        self.process.start()
        # Drop the parent's copy of the child's end, so the parent sees EOF as soon as the child dies.
        child_conn.close()
        self.ready = False
        self.calls: list[Call] = []
        # Positions in `calls` not reported yet, in chunk order.
        self.open: list[int] = []
        self.deadline = time.monotonic() + _START_TIMEOUT_S

    @property
    def waiting_on(self) -> bool:
        """True while the parent expects a message: start-up or a chunk in flight."""
        return not self.ready or bool(self.open)

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.process.close()
        self.conn.close()


class _Batch:
    """One run's bookkeeping: its samples, the chunks not yet handed out, and the outcomes so far."""

    def __init__(self, samples: list[RewardInput], num_functions: int, chunks: list[list[Call]]):
        self.samples = samples
        self.pending = deque(chunks)
        self.outcomes: list[list[Outcome | None]] = [[None] * len(samples) for _ in range(num_functions)]
        self.missing = sum(len(call.samples) for chunk in chunks for call in chunk)

    def record(self, call: Call, outcomes: list[Outcome]) -> None:
        for sample_index, outcome in zip(call.samples, outcomes, strict=True):
            self.outcomes[call.function][sample_index] = outcome
        self.missing -= len(call.samples)

    def fail(self, call: Call, outcome: Outcome) -> None:
        self.record(call, [outcome] * len(call.samples))


def _stop(workers: list[_Worker]) -> None:
    """Ask every worker to exit, kill any that do not within the grace period, and reap them all."""
    for worker in workers:
        with contextlib.suppress(OSError):
            _send(worker.conn, None)
    deadline = time.monotonic() + _STOP_GRACE_S
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
        worker.kill()
    workers.clear()


def _spread(num_samples: int, functions: list[int], num_chunks: int) -> list[list[Call]]:
    """Contiguous runs of samples in about `num_chunks` chunks, each calling every one of `functions` on
    each of its samples."""
    if not functions:
        return []
    size = max(1, math.ceil(num_samples / num_chunks))
    return [
        [Call(f, (s,)) for s in range(start, min(start + size, num_samples)) for f in functions]
        for start in range(0, num_samples, size)
    ]


class WorkerPool:
    """`num_workers` processes running the given reward functions on demand."""

    def __init__(self, functions: list[RemoteFunction], num_workers: int, timeout_s: float):
        self._functions = functions
        self._num_workers = num_workers
        self._timeout_s = timeout_s
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        self._start_error = ""
        # Reaps the workers if the pool is garbage-collected or the interpreter exits without close().
        self._finalizer = weakref.finalize(self, _stop, self._workers)
        self._top_up()

    def close(self) -> None:
        """Stop and reap every worker; safe to call more than once."""
        self._finalizer()

    def run(self, samples: list[RewardInput]) -> list[list[Outcome]]:
        """Every function on every sample, as outcomes[function][sample]. Failures become outcomes; this
        only raises if the pool is closed (or on KeyboardInterrupt)."""
        if not self._finalizer.alive:
            raise RuntimeError("the reward worker pool is closed")
        batch = _Batch(samples, len(self._functions), self._chunks(len(samples)))
        self._top_up()
        try:
            while batch.missing:
                self._step(batch)
        except BaseException:
            # Interrupted mid-batch: results still in flight would be misread by the next batch.
            for worker in [w for w in self._workers if w.open]:
                self._discard(worker)
            raise
        return cast(list[list[Outcome]], batch.outcomes)

    def _chunks(self, num_samples: int) -> list[list[Call]]:
        """Batched calls first, as they are the longest, then async chunks, then sync ones."""
        if not num_samples:
            return []
        indices = range(len(self._functions))
        every_sample = tuple(range(num_samples))
        batched = [[Call(f, every_sample)] for f in indices if self._functions[f].batched]
        single = [f for f in indices if not self._functions[f].batched]
        concurrent = [f for f in single if self._functions[f].is_async]
        sequential = [f for f in single if not self._functions[f].is_async]
        return (
            batched
            + _spread(num_samples, concurrent, self._num_workers)
            + _spread(num_samples, sequential, self._num_workers * _CHUNKS_PER_WORKER)
        )

    def _step(self, batch: _Batch) -> None:
        """Hand out chunks, then wait for messages or the nearest deadline and act on what happened."""
        for worker in list(self._workers):
            if batch.pending and not worker.waiting_on:
                self._assign(worker, batch.pending.popleft(), batch)
        if not self._workers:
            # Every worker failed to start; fail the remaining calls instead of retrying forever.
            failed = Outcome("exception", detail=f"no reward worker could be started:\n{self._start_error}")
            while batch.pending:
                for call in batch.pending.popleft():
                    batch.fail(call, failed)
            return
        busy = [w for w in self._workers if w.waiting_on]
        if not busy:
            return
        timeout = max(0.0, min(w.deadline for w in busy) - time.monotonic())
        readable = wait([w.conn for w in busy], timeout)
        for worker in busy:
            if worker.conn in readable:
                self._receive(worker, batch)
        now = time.monotonic()
        for worker in [w for w in busy if w in self._workers and w.waiting_on and w.deadline <= now]:
            if worker.ready:
                self._fail_current(worker, "timeout", f"no result within {self._timeout_s:g}s", batch)
            else:
                self._start_error = f"worker did not start within {_START_TIMEOUT_S:g}s"
                self._discard(worker)

    def _assign(self, worker: _Worker, chunk: list[Call], batch: _Batch) -> None:
        needed = {index: batch.samples[index] for call in chunk for index in call.samples}
        try:
            payload = pickle.dumps((needed, chunk), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            failed = Outcome(
                "exception",
                detail=f"samples could not be pickled for a reward worker:\n{traceback.format_exc()}",
            )
            for call in chunk:
                batch.fail(call, failed)
            return
        try:
            worker.conn.send_bytes(payload)
        except OSError:
            # The worker died while idle; nothing of this chunk ran, so it simply goes back in the queue.
            batch.pending.appendleft(chunk)
            self._replace(worker)
            return
        worker.calls, worker.open = chunk, list(range(len(chunk)))
        grace = _ASYNC_GRACE_S if self._async_open(worker) else 0.0
        worker.deadline = time.monotonic() + self._timeout_s + grace

    def _receive(self, worker: _Worker, batch: _Batch) -> None:
        """Drain a worker's messages; a closed pipe means the worker died."""
        try:
            while worker.conn.poll():
                kind, payload = pickle.loads(worker.conn.recv_bytes())
                if kind == "ready":
                    worker.ready = True
                elif kind == "start_failed":
                    self._start_error = payload
                    self._discard(worker)
                    return
                else:
                    position, outcomes = payload
                    batch.record(worker.calls[position], outcomes)
                    worker.open.remove(position)
                    if not self._async_open(worker):  # the async calls share one fixed deadline
                        worker.deadline = time.monotonic() + self._timeout_s
        except (EOFError, OSError):
            worker.process.join(1.0)
            if not worker.ready:
                self._start_error = f"worker exited during start-up (exit code {worker.process.exitcode})"
                self._discard(worker)
            elif worker.open:
                detail = f"reward worker died (exit code {worker.process.exitcode}) during this call"
                self._fail_current(worker, "exception", detail, batch)
            else:
                self._replace(worker)

    def _async_open(self, worker: _Worker) -> list[int]:
        return [p for p in worker.open if self._functions[worker.calls[p].function].is_async]

    def _fail_current(self, worker: _Worker, kind: OutcomeKind, detail: str, batch: _Batch) -> None:
        """The worker's call in progress failed and the worker is unusable: record the failure, requeue the
        rest of its chunk and replace it. While async calls are open they are all in progress at once, and
        any of them may have blocked the loop, so all of them fail."""
        concurrent = self._async_open(worker)
        in_progress = concurrent or worker.open[:1]
        if concurrent and kind == "timeout":
            detail += "; the worker's event loop was blocked: is there a blocking call inside `async def`?"
        for position in in_progress:
            batch.fail(worker.calls[position], Outcome(kind, detail=detail))
        if rest := [worker.calls[p] for p in worker.open if p not in in_progress]:
            batch.pending.appendleft(rest)
        self._replace(worker)

    def _replace(self, worker: _Worker) -> None:
        self._discard(worker)
        self._workers.append(_Worker(self._context, self._functions, self._timeout_s))

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)

    def _top_up(self) -> None:
        """Start workers up to the configured count; workers lost to start-up failures are retried here,
        once per batch."""
        while len(self._workers) < self._num_workers:
            self._workers.append(_Worker(self._context, self._functions, self._timeout_s))
