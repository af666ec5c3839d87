"""The rollout engine of an overlapped run (`rollout.max_staleness` > 0): a Ray worker of its own.

`submit` sends a generation and returns at once, so the trainer updates while the worker generates;
`sync_weights` sends the trainer's weights after an update, and the worker loads them before any
generation submitted later. A worker that dies is replaced: the new one gets the newest weights and
every generation still owed is sent again (counted in `restarts`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mmrl.config import Config
from mmrl.data.batch import Batch
from mmrl.data.sample import PromptSample
from mmrl.errors import ResourceError, WorkerError
from mmrl.rollout.base import SamplingParams
from mmrl.workers.rollout import POLICY_VERSION

log = logging.getLogger("mmrl.workers.remote")
PLACEMENT_TIMEOUT_S = 120.0
MAX_DEATHS_IN_A_ROW = 3  # a worker that dies each time it generates one batch will not survive a fourth try


@dataclass(eq=False)  # owed generations are told apart by identity: their prompts hold tensors
class _Owed:
    """A submitted generation whose rows have not been collected yet."""

    prompts: list[PromptSample]
    params: SamplingParams
    seed: int
    ref: Any  # the Ray object the worker's batch will be


class Pending:
    """A generation in flight; `result()` waits for its rows."""

    def __init__(self, remote: RemoteRollout, owed: _Owed) -> None:
        self.remote, self.owed = remote, owed

    def result(self) -> Batch:
        return self.remote.collect(self.owed)


class RemoteRollout:
    """Generates on a `mmrl.workers.rollout.RolloutWorker` with the weights the trainer last sent."""

    logprobs_are_free = (
        True  # the worker's sampling log-probs travel with its rows, for the rollout correction
    )

    def __init__(self, cfg: Config, weights: Callable[[], Any]) -> None:
        """`weights()`: the trainer's whole current weights, LoRA merged, under the plain model's names, or
        a Ray reference to them (`mmrl.training.lora.merged_weights` in this process, `PolicyGroup.merged_weights`
        from FSDP workers)."""
        from mmrl.workers.cluster import connect

        connect(cfg.trainer.ray_address)
        self.cfg, self.current_weights = cfg, weights
        # The trainer keeps the cores the worker does not take, so update and generation do not compete.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - cfg.rollout.worker_cpus))
        self.version = -1  # the version of the weights last sent: the number of updates in them (0 first)
        self.weights: Any = None
        self.owed: list[_Owed] = []
        self.restarts = 0
        self.worker = self._start()

    def _start(self) -> Any:
        import ray

        from mmrl.workers.rollout import RolloutWorker

        gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
        cpus = self.cfg.rollout.worker_cpus
        worker = ray.remote(RolloutWorker).options(num_cpus=cpus, num_gpus=gpus, max_restarts=0).remote()
        placed, _ = ray.wait([worker.pid.remote()], timeout=PLACEMENT_TIMEOUT_S)
        if not placed:
            ray.kill(worker)
            raise ResourceError(
                f"the rollout worker (rollout.max_staleness) needs {cpus} CPU(s){' and a GPU' if gpus else ''} "
                f"that the trainer does not hold, and the Ray cluster had none free within {PLACEMENT_TIMEOUT_S:.0f} s "
                "(`ray status` shows who holds them). Free them, lower trainer.n_gpus_per_node or "
                "rollout.worker_cpus, or add a node."
            )
        try:
            ray.get(worker.setup.remote(self.cfg))
        except BaseException:
            ray.kill(worker)
            raise
        if self.weights is not None:
            worker.load_weights.remote(self.weights, self.version)
        return worker

    def submit(self, prompts: list[PromptSample], params: SamplingParams) -> Pending:
        seed = int(torch.randint(2**31 - 1, ()))  # from the trainer's RNG, which checkpoints restore
        owed = _Owed(prompts, params, seed, self.worker.generate.remote(prompts, params, seed))
        self.owed.append(owed)
        return Pending(self, owed)

    def generate(self, prompts: list[PromptSample], params: SamplingParams) -> Batch:
        return self.submit(prompts, params).result()

    def rollout_metrics(self, batch: Batch) -> dict[str, float]:
        """How many updates behind the trainer's weights each row was sampled, and the worker's restarts."""
        staleness = (self.version - batch[POLICY_VERSION]).float()
        return {
            "rollout/staleness_mean": float(staleness.mean()),
            "rollout/staleness_max": float(staleness.max()),
            "rollout/worker_restarts": self.restarts,
        }

    def collect(self, owed: _Owed) -> Batch:
        import ray

        deaths = 0
        while True:
            try:
                batch = ray.get(owed.ref)
            except ray.exceptions.RayActorError as err:
                deaths += 1
                if deaths == MAX_DEATHS_IN_A_ROW:
                    raise WorkerError(
                        f"the rollout worker died {deaths} times in a row generating the same batch (out of "
                        "memory? `dmesg` or Ray's logs say): lower data.train_batch_size, rollout.n or "
                        "rollout.max_new_tokens"
                    ) from err
                self._replace(err)
                continue
            self.owed = [o for o in self.owed if o is not owed]
            return batch

    def _replace(self, err: Exception) -> None:
        """A new worker with the newest weights, and every owed generation sent to it again in order."""
        self.restarts += 1
        log.warning(
            "the rollout worker died (%s); replacing it and generating its %d outstanding batch(es) again",
            type(err).__name__,
            len(self.owed),
        )
        self.shutdown()  # a worker that is only unreachable would otherwise keep its cores or GPU
        self.worker = self._start()
        for owed in self.owed:
            owed.ref = self.worker.generate.remote(owed.prompts, owed.params, owed.seed)

    def sync_weights(self) -> None:
        """Send the trainer's current weights (LoRA merged), loaded before any generation submitted later."""
        import ray

        self.version += 1
        weights = self.current_weights()  # FSDP workers hand back a reference to what they put in the store
        self.weights = weights if isinstance(weights, ray.ObjectRef) else ray.put(weights)
        self.worker.load_weights.remote(self.weights, self.version)

    def sleep(self) -> None:
        return None  # the worker's memory is its own: nothing of the trainer's to give back

    def shutdown(self) -> None:
        import ray

        ray.kill(self.worker)
