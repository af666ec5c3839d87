"""Rollout workers of their own (`rollout.workers`, `rollout.max_staleness`): a pool of Ray actors, each
with its own engine, generating prompt groups while the trainer updates.

`dispatch` sends one prompt group (its n samples stay on one worker, which shares its prefix) to the
worker with the fewest tokens in flight and returns at once; `wait` says which groups finished, in the
order they finished. `sync_weights` puts the trainer's weights in Ray's object store once per update,
and every worker loads that one object before any group dispatched later (Ray runs an actor's calls in
the order sent). One worker is the N = 1 case of this pool. A worker that dies is replaced: the new one
gets the newest weights and every group it still owed is sent again with its seed (`restarts`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mmrl.config import Config
from mmrl.data.batch import Batch, concat
from mmrl.data.sample import PromptSample
from mmrl.errors import ResourceError, WorkerError
from mmrl.rollout.base import SamplingParams, draw_seed
from mmrl.workers.rollout import POLICY_VERSION

log = logging.getLogger("mmrl.workers.remote")
PLACEMENT_TIMEOUT_S = 120.0
MAX_DEATHS_IN_A_ROW = 3  # a worker that dies each time it generates one group will not survive a fourth try


@dataclass(eq=False)  # groups in flight are told apart by identity: their prompts hold tensors
class Ticket:
    """One prompt group dispatched to a worker, until its rows are collected."""

    prompt: PromptSample
    params: SamplingParams
    seed: int
    worker: int  # index into `RemoteRollout.workers`
    tokens: int  # what it adds to its worker's load: prompt and response budget, n times
    ref: Any = None  # the Ray object its batch will be
    deaths: int = 0
    done: bool = False  # finished: no longer in its worker's load


class RemoteRollout:
    """Generates on `rollout.workers` `mmrl.workers.rollout.RolloutWorker`s with the weights last sent."""

    logprobs_are_free = (
        True  # the workers' sampling log-probs travel with their rows, for the rollout correction
    )

    def __init__(self, cfg: Config, weights: Callable[[], Any]) -> None:
        """`weights()`: the trainer's whole current weights, LoRA merged, under the plain model's names, or
        a Ray reference to them (`mmrl.training.lora.merged_weights` in this process, `PolicyGroup.merged_weights`
        from FSDP workers)."""
        from mmrl.workers.cluster import connect

        connect(cfg.trainer.ray_address)
        self.cfg, self.current_weights = cfg, weights
        r = cfg.rollout
        # The trainer keeps the cores the workers do not take, so update and generation do not compete.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - r.workers * r.worker_cpus))
        self.version = -1  # the version of the weights last sent: the number of updates in them (0 first)
        self.weights: Any = None
        self.owed: list[Ticket] = []
        self.restarts = 0
        self.sync_s = 0.0  # the last weight sync's seconds: gather (FSDP) and one put in the object store
        self.workers: list[Any] = []
        try:
            self.workers = self._start(r.workers)
        except BaseException:
            self.shutdown()
            raise
        self.load = [0] * len(self.workers)  # tokens in flight per worker

    def _start(self, count: int) -> list[Any]:
        """`count` new workers, placed and set up together, with the newest weights where there are any."""
        import ray

        from mmrl.workers.rollout import RolloutWorker

        gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
        cpus = self.cfg.rollout.worker_cpus
        actor = ray.remote(RolloutWorker).options(num_cpus=cpus, num_gpus=gpus, max_restarts=0)
        workers = [actor.remote() for _ in range(count)]
        placed, _ = ray.wait(
            [w.pid.remote() for w in workers], num_returns=count, timeout=PLACEMENT_TIMEOUT_S
        )
        if len(placed) < count:
            for worker in workers:
                ray.kill(worker)
            raise ResourceError(
                f"{count} rollout worker(s) (rollout.workers, rollout.max_staleness) need {cpus} CPU(s)"
                f"{' and a GPU' if gpus else ''} each that the trainer does not hold, and the Ray cluster had "
                f"room for {len(placed)} within {PLACEMENT_TIMEOUT_S:.0f} s (`ray status` shows who holds "
                "them). Free them, lower rollout.workers, trainer.n_gpus_per_node or rollout.worker_cpus, or "
                "add a node."
            )
        try:
            ray.get([w.setup.remote(self.cfg) for w in workers])
        except BaseException:
            for worker in workers:
                ray.kill(worker)
            raise
        if self.weights is not None:
            for worker in workers:
                worker.load_weights.remote(self.weights, self.version)
        return workers

    # ------------------------------------------------------------ groups
    def dispatch(self, prompt: PromptSample, params: SamplingParams, seed: int) -> Ticket:
        """Send one prompt group to the worker with the fewest tokens in flight (the first, on a tie)."""
        worker = min(range(len(self.workers)), key=self.load.__getitem__)
        tokens = params.n * (len(prompt.prompt_ids) + params.max_new_tokens)
        ticket = Ticket(prompt, params, seed, worker, tokens)
        self._send(ticket)
        self.owed.append(ticket)
        return ticket

    def _send(self, ticket: Ticket) -> None:
        self.load[ticket.worker] += ticket.tokens
        ticket.ref = self.workers[ticket.worker].generate.remote([ticket.prompt], ticket.params, ticket.seed)

    def wait(self, tickets: list[Ticket], timeout: float | None = None) -> list[Ticket]:
        """The groups of `tickets` that have finished (at least one, unless `timeout` runs out), in the
        order they finished as far as Ray tells them apart."""
        import ray

        owner = {t.ref: t for t in tickets}
        ready, rest = ray.wait(list(owner), num_returns=1, timeout=timeout)
        if rest and ready:  # others that finished meanwhile come along
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        done = [owner[ref] for ref in ready]
        for ticket in done:
            self._finished(ticket)
        return done

    def _finished(self, ticket: Ticket) -> None:
        if not ticket.done:
            ticket.done = True
            self.load[ticket.worker] -= ticket.tokens

    def result(self, ticket: Ticket) -> Batch:
        """The group's rows (waiting for them); a dead worker is replaced and its groups sent again."""
        import ray

        while True:
            try:
                batch = ray.get(ticket.ref)
            except ray.exceptions.RayActorError as err:
                ticket.deaths += 1
                if ticket.deaths == MAX_DEATHS_IN_A_ROW:
                    raise WorkerError(
                        f"a rollout worker died {ticket.deaths} times in a row generating the same group (out "
                        "of memory? `dmesg` or Ray's logs say): lower rollout.n or rollout.max_new_tokens"
                    ) from err
                self._replace(ticket.worker, err)
                continue
            self._finished(ticket)
            self.owed = [t for t in self.owed if t is not ticket]
            return batch

    def _replace(self, index: int, err: Exception) -> None:
        """A new worker in place of worker `index`, with the newest weights, and every group it owed sent
        to it again in order, with the same seeds."""
        import ray

        self.restarts += 1
        owed = [t for t in self.owed if t.worker == index]
        log.warning(
            "rollout worker %d died (%s); replacing it and generating its %d outstanding group(s) again",
            index,
            type(err).__name__,
            len(owed),
        )
        ray.kill(self.workers[index])  # a worker that is only unreachable would otherwise keep its cores
        self.workers[index] = self._start(1)[0]
        self.load[index] = 0
        for ticket in owed:
            ticket.done = False
            self._send(ticket)

    # ------------------------------------------------------------ whole batches
    def generate(self, prompts: list[PromptSample], params: SamplingParams) -> Batch:
        """All `prompts` (validation, a ReMax baseline), one group per dispatch, rows in prompt order."""
        tickets = [self.dispatch(p, params, draw_seed()) for p in prompts]
        return concat([self.result(t) for t in tickets])

    def rollout_metrics(self, batch: Batch) -> dict[str, float]:
        """How many updates behind the trainer's weights each row was sampled, the workers' restarts and
        the last weight sync's time."""
        staleness = (self.version - batch[POLICY_VERSION]).float()
        return {
            "rollout/staleness_mean": float(staleness.mean()),
            "rollout/staleness_max": float(staleness.max()),
            "rollout/worker_restarts": self.restarts,
            "timing/weight_sync": self.sync_s,
        }

    def sync_weights(self) -> None:
        """Put the trainer's current weights (LoRA merged) in the object store once; every worker loads that
        object before any group dispatched later."""
        import ray

        start = time.perf_counter()
        self.version += 1
        weights = self.current_weights()  # FSDP workers hand back a reference to what they put in the store
        self.weights = weights if isinstance(weights, ray.ObjectRef) else ray.put(weights)
        for worker in self.workers:
            worker.load_weights.remote(self.weights, self.version)
        self.sync_s = time.perf_counter() - start

    def sleep(self) -> None:
        return None  # the workers' memory is their own: nothing of the trainer's to give back

    def shutdown(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker)
