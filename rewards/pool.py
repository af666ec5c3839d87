"""Worker processes that run untrusted reward functions with a per-call timeout.

Why not `multiprocessing.Pool` or `ProcessPoolExecutor`: neither can kill one hung task and carry on; a
hung call would block the batch, and killing a worker breaks the executor. This pool owns its processes
and replaces any that hang or die.

How work travels. A batch is cut into a few chunks per worker (contiguous samples, every function). A chunk
goes to an idle worker in one message, so each sample's images are pickled and sent once, not once per
function or per round-trip. The worker streams back one small result per call as it finishes, which is
what makes per-call timeouts possible without a round-trip per call: the parent restarts a worker's clock
on every result it receives, so the clock always times the call the worker is on. When it runs out, that
call scores a timeout, the worker is killed and replaced, and the chunk's unfinished calls go back to the
front of the queue. The first call's clock starts once its chunk is sent, so it also covers unpickling the
chunk (milliseconds); later clocks start when the previous result arrives, a little after the call began,
so they err towards lenient.

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
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any, cast

from rewards.loader import load_reward_function
from rewards.outcome import Outcome, evaluate
from rewards.types import RewardInput

# (sample index, function index): one call of one reward function on one sample.
Call = tuple[int, int]

# Chunks per worker and batch: several, so a worker that drew slow samples does not hold up the batch.
_CHUNKS_PER_WORKER = 4
# A worker must report ready this soon after it is spawned; generous, as reward files may import big
# libraries.
_START_TIMEOUT_S = 120.0
# How long close() lets workers exit on their own before killing them.
_STOP_GRACE_S = 2.0


def _send(conn: Connection, message: object) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _serve(conn: Connection, functions: list[tuple[str, dict[str, Any]]]) -> None:
    """Worker process: load the functions, report ready, then score chunks until told to stop.

    SIGINT is ignored so that Ctrl-C in the trainer is handled by the trainer, not by each worker.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        loaded = [(load_reward_function(spec), kwargs) for spec, kwargs in functions]
    except Exception:
        _send(conn, ("start_failed", traceback.format_exc()))
        return
    _send(conn, ("ready", None))
    with contextlib.suppress(EOFError, BrokenPipeError):
        while (chunk := pickle.loads(conn.recv_bytes())) is not None:
            samples, calls = chunk
            for sample_index, function_index in calls:
                fn, kwargs = loaded[function_index]
                _send(conn, ("result", evaluate(fn, samples[sample_index], kwargs)))


class _Worker:
    """One worker process and the chunk it is working through."""

    def __init__(self, context: SpawnContext, functions: list[tuple[str, dict[str, Any]]]):
        self.conn, child_conn = context.Pipe()
        self.process: BaseProcess = context.Process(
            target=_serve, args=(child_conn, functions), name="mmrl-reward-worker", daemon=True
        )
        self.process.start()
        # Drop the parent's copy of the child's end, so the parent sees EOF as soon as the child dies.
        child_conn.close()
        self.ready = False
        self.calls: list[Call] = []
        self.done = 0
        self.deadline = time.monotonic() + _START_TIMEOUT_S

    @property
    def waiting_on(self) -> bool:
        """True while the parent expects a message: start-up or a chunk in flight."""
        return not self.ready or bool(self.calls)

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
        self.missing = len(samples) * num_functions

    def record(self, call: Call, outcome: Outcome) -> None:
        sample_index, function_index = call
        self.outcomes[function_index][sample_index] = outcome
        self.missing -= 1


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


class WorkerPool:
    """`num_workers` processes running the given `(spec, kwargs)` reward functions on demand."""

    def __init__(self, functions: list[tuple[str, dict[str, Any]]], num_workers: int, timeout_s: float):
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
            for worker in [w for w in self._workers if w.calls]:
                self._discard(worker)
            raise
        return cast(list[list[Outcome]], batch.outcomes)

    def _chunks(self, num_samples: int) -> list[list[Call]]:
        size = max(1, math.ceil(num_samples / (self._num_workers * _CHUNKS_PER_WORKER)))
        functions = range(len(self._functions))
        starts = range(0, num_samples, size)
        return [
            [(s, f) for s in range(start, min(start + size, num_samples)) for f in functions]
            for start in starts
        ]

    def _step(self, batch: _Batch) -> None:
        """Hand out chunks, then wait for messages or the nearest deadline and act on what happened."""
        for worker in list(self._workers):
            if batch.pending and not worker.waiting_on:
                self._assign(worker, batch.pending.popleft(), batch)
        if not self._workers:
            # Every worker failed to start; fail the remaining calls instead of retrying forever.
            detail = f"no reward worker could be started:\n{self._start_error}"
            while batch.pending:
                for call in batch.pending.popleft():
                    batch.record(call, Outcome("exception", detail=detail))
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
                timed_out = Outcome("timeout", detail=f"no result within {self._timeout_s:g}s")
                self._fail_current(worker, timed_out, batch)
            else:
                self._start_error = f"worker did not start within {_START_TIMEOUT_S:g}s"
                self._discard(worker)

    def _assign(self, worker: _Worker, chunk: list[Call], batch: _Batch) -> None:
        needed = {index: batch.samples[index] for index, _ in chunk}
        try:
            payload = pickle.dumps((needed, chunk), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            detail = f"samples could not be pickled for a reward worker:\n{traceback.format_exc()}"
            for call in chunk:
                batch.record(call, Outcome("exception", detail=detail))
            return
        try:
            worker.conn.send_bytes(payload)
        except OSError:
            # The worker died while idle; nothing of this chunk ran, so it simply goes back in the queue.
            batch.pending.appendleft(chunk)
            self._replace(worker)
            return
        worker.calls, worker.done = chunk, 0
        worker.deadline = time.monotonic() + self._timeout_s

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
                    batch.record(worker.calls[worker.done], payload)
                    worker.done += 1
                    worker.deadline = time.monotonic() + self._timeout_s
                    if worker.done == len(worker.calls):
                        worker.calls = []
        except (EOFError, OSError):
            worker.process.join(1.0)
            if not worker.ready:
                self._start_error = f"worker exited during start-up (exit code {worker.process.exitcode})"
                self._discard(worker)
            elif worker.calls:
                detail = f"reward worker died (exit code {worker.process.exitcode}) during this call"
                self._fail_current(worker, Outcome("exception", detail=detail), batch)
            else:
                self._replace(worker)

    def _fail_current(self, worker: _Worker, outcome: Outcome, batch: _Batch) -> None:
        """The worker's current call failed and the worker is unusable: record the failure, requeue the
        rest of its chunk and replace it."""
        batch.record(worker.calls[worker.done], outcome)
        if rest := worker.calls[worker.done + 1 :]:
            batch.pending.appendleft(rest)
        self._replace(worker)

    def _replace(self, worker: _Worker) -> None:
        self._discard(worker)
        self._workers.append(_Worker(self._context, self._functions))

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)

    def _top_up(self) -> None:
        """Start workers up to the configured count; workers lost to start-up failures are retried here,
        once per batch."""
        while len(self._workers) < self._num_workers:
            self._workers.append(_Worker(self._context, self._functions))
