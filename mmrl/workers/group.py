"""Ray worker groups: placement on the cluster's nodes, and coarse methods run on every rank.

The controller (the trainer's loop) stays a plain loop; `PolicyGroup` splits each batch across
the ranks and gathers the results, so the loop reads the same with one process or many.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mmrl.config import Config
from mmrl.data.batch import Batch, concat
from mmrl.data.sample import PromptSample
from mmrl.errors import ResourceError, WorkerError
from mmrl.rollout import SamplingParams, resolve_engine
from mmrl.rollout.base import GeneratesAtOnce
from mmrl.training.actor import needs_reference
from mmrl.training.critic import needs_critic
from mmrl.training.micro_batches import Layout, rank_rows, row_lengths, scatter_rows, worker_layouts
from mmrl.training.optim import MiniBatch, UpdateStats
from mmrl.training.prm import needs_prm
from mmrl.workers.cluster import connect
from mmrl.workers.policy import PolicyWorker
from mmrl.workers.remote import RemoteRollout

log = logging.getLogger("mmrl.workers")
PLACEMENT_TIMEOUT_S = 120.0
FAILURE_GRACE_S = 10.0  # after one rank fails, how long the others get to report theirs


def _error(ref: Any) -> Exception | None:
    """The error a finished call ended with, if any."""
    try:
        ray.get(ref)
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
        return err
    return None


def _describe(nodes: list[dict[str, Any]]) -> str:
    return ", ".join(
        f"{n['NodeManagerAddress']} ({n['Resources'].get('CPU', 0):g} CPUs, {n['Resources'].get('GPU', 0):g} GPUs)"
        for n in nodes
    )


def check_fits(bundle: dict[str, float], nnodes: int, per_node: int) -> None:
    """Refuse at once when no placement could ever hold the workers, instead of waiting for one.

    Each of `nnodes` nodes must hold `per_node` bundles; `trainer.n_gpus_per_node` is per node, as
    in a real multi-node job, so a node too small for its share fails here even if the cluster's
    total would do."""
    nodes = [n for n in ray.nodes() if n["Alive"]]
    fitting = [n for n in nodes if all(n["Resources"].get(k, 0) >= v * per_node for k, v in bundle.items())]
    if len(fitting) < nnodes:
        want = " + ".join(f"{v * per_node:g} {k}" for k, v in bundle.items())
        raise ResourceError(
            f"trainer.nnodes={nnodes} x trainer.n_gpus_per_node={per_node} needs {nnodes} node(s) with {want} each; "
            f"the Ray cluster has {len(nodes)} node(s): {_describe(nodes)}, and {len(fitting)} of them can hold that. "
            "Lower trainer.nnodes / trainer.n_gpus_per_node / trainer.cpus_per_worker, or add nodes "
            "(`ray start --address=<head>:6379` on each, then trainer.ray_address=auto)."
        )


class WorkerGroup:
    """`world_size` Ray actors of one class, `per_node` to a node, each pinned to one bundle of a
    per-node placement group (one GPU, or `cpus_per_worker` CPUs)."""

    def __init__(self, cls: type, cfg: Config, name: str) -> None:
        t = cfg.trainer
        self.name = name
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        bundle = {"CPU": float(t.cpus_per_worker), **({"GPU": 1.0} if use_gpu else {})}
        check_fits(bundle, t.nnodes, t.n_gpus_per_node)
        self.placements: list[PlacementGroup] = [
            placement_group([bundle] * t.n_gpus_per_node, strategy="STRICT_PACK") for _ in range(t.nnodes)
        ]
        ready, _ = ray.wait(
            [pg.ready() for pg in self.placements], num_returns=t.nnodes, timeout=PLACEMENT_TIMEOUT_S
        )
        if len(ready) < t.nnodes:
            self.shutdown()
            raise ResourceError(
                f"the Ray cluster could not place {t.nnodes} x {t.n_gpus_per_node} {name} workers ({bundle} each) "
                f"within {PLACEMENT_TIMEOUT_S:.0f} s: other jobs hold the resources. Free them (`ray status` "
                "shows who) or ask for fewer workers."
            )
        remote = ray.remote(cls)
        self.workers = [
            remote.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote()
            for pg in self.placements
            for i in range(t.n_gpus_per_node)
        ]
        self.places = self.run("where", [()] * len(self.workers), what="startup")

    def __len__(self) -> int:
        return len(self.workers)

    def run(self, method: str, args: list[tuple[Any, ...]], what: str | None = None) -> list[Any]:
        """`method(*args[rank])` on every rank at once; results in rank order.

        The first failure stops the whole group: the other ranks would wait in a collective for the
        failed one until the process-group timeout, so they are killed and the error names the rank."""
        refs = [getattr(w, method).remote(*a) for w, a in zip(self.workers, args, strict=True)]
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            if (err := _error(done[0])) is None:
                continue
            # A rank that dies breaks its peers' collectives, and their errors can arrive first: wait
            # a moment for the rest and name the dead rank, the cause, rather than a peer's symptom.
            failures = {rank_of[done[0]]: err}
            settled, _ = ray.wait(pending, num_returns=len(pending), timeout=FAILURE_GRACE_S)
            failures.update({rank_of[ref]: e for ref in settled if (e := _error(ref)) is not None})
            rank, cause = min(
                failures.items(), key=lambda kv: (not isinstance(kv[1], ray.exceptions.RayActorError), kv[0])
            )
            self.shutdown()
            raise WorkerError(self._failure(rank, what or method, cause)) from cause
        return ray.get(refs)

    def _failure(self, rank: int, what: str, err: Exception) -> str:
        place = self.places[rank] if getattr(self, "places", None) else {}
        where = f" (pid {place['pid']} on node {place['ip']})" if place else ""
        if isinstance(err, ray.exceptions.RayActorError):
            cause = "its process died (killed, out of memory, or crashed)"
        else:
            cause = f"it raised {err.cause!r}" if hasattr(err, "cause") else f"it raised {err}"
        return f"{self.name} worker {rank}{where} failed during {what}: {cause}"

    def shutdown(self) -> None:
        """Kill the workers and free their placement; safe to call twice."""
        for worker in getattr(self, "workers", []):
            ray.kill(worker)
        for pg in self.placements:
            remove_placement_group(pg)
        self.workers, self.placements = [], []


def _even_shares(count: int, world: int) -> list[list[int]]:
    """`count` items cut into `world` contiguous shares of equal length, short ones padded by
    repeating their last item (or item 0). Equal shares mean equal micro-batch counts on every rank,
    which FSDP's collectives need; the repeated items' results are dropped."""
    size = math.ceil(count / world)
    shares = []
    for rank in range(world):
        own = list(range(rank * size, min(count, (rank + 1) * size)))
        shares.append(own + [own[-1] if own else 0] * (size - len(own)))
    return shares


def _real(count: int, world: int) -> list[int]:
    """How many items of each `_even_shares` share are real."""
    size = math.ceil(count / world)
    return [max(0, min(count, (r + 1) * size) - r * size) for r in range(world)]


class PolicyGroup(GeneratesAtOnce):
    """The actor/rollout workers as the controller sees them: an engine (`generate`) and an actor
    (`logprobs`, `update`) whose batches are split across ranks and gathered back in order. It has the
    methods of `mmrl.workers.local.LocalPolicy`, so the loop reads the same wherever the policy runs."""

    def __init__(self, cfg: Config) -> None:
        self.logprobs_are_free = resolve_engine(cfg.rollout.engine) == "vllm"
        self.tensor_parallel = cfg.rollout.vllm.tensor_parallel_size if self.logprobs_are_free else 1
        self.max_tokens = cfg.actor.max_tokens_per_micro_batch
        connect(cfg.trainer.ray_address)
        cfg = cfg.model_copy(deep=True)
        cfg.model.path = str(Path(cfg.model.path).resolve())  # workers may start in another folder
        for section in (cfg.critic, cfg.prm):
            if section.model_path:
                section.model_path = str(Path(section.model_path).resolve())
        self.group = WorkerGroup(PolicyWorker, cfg, "actor")
        port = ray.get(self.group.workers[0].free_port.remote())
        world, ip = len(self.group), self.group.places[0]["ip"]
        self.group.run("setup", [(cfg, rank, world, ip, port) for rank in range(world)], what="startup")
        self.critic = CriticRole(self) if needs_critic(cfg) else None  # GAE: its shards on the same ranks
        self.prm = PRMRole(self) if needs_prm(cfg) else None  # PRIME: its shards on the same ranks too
        self.has_reference = needs_reference(cfg)  # each rank holds its shard of it
        # Overlapped: a rollout worker of its own, fed the whole weights gathered from the shards.
        self.engine: Any = self
        if cfg.rollout.remote:
            try:
                self.engine = RemoteRollout(cfg, self.merged_weights)
            except BaseException:
                self.group.shutdown()
                raise

    @property
    def world(self) -> int:
        return len(self.group)

    @property
    def nodes(self) -> list[str]:
        return [p["node"] for p in self.group.places]

    # ------------------------------------------------------------ engine
    def generate(self, prompts: list[PromptSample], params: SamplingParams) -> Batch:
        """Each engine generates its share of the prompts. A tensor-parallel vLLM engine spans
        `tensor_parallel` consecutive ranks, which all take the same prompts and seed and sample the
        same rows (checked); the controller keeps one copy."""
        seed = int(torch.randint(2**31 - 1, ()))  # from the controller's RNG, which checkpoints restore
        engines = self.world // self.tensor_parallel
        shares = _even_shares(len(prompts), engines)
        engine_of = [rank // self.tensor_parallel for rank in range(self.world)]
        parts = self.group.run(
            "generate", [([prompts[i] for i in shares[e]], params, seed + e) for e in engine_of], "rollout"
        )
        self._check_replicas(parts)
        kept = []
        for part, real in zip(parts[:: self.tensor_parallel], _real(len(prompts), engines), strict=True):
            if real:
                rows = (part["prompt_index"] < real).nonzero().squeeze(1)
                trimmed = part.select(rows)
                trimmed.prompts = part.prompts[:real]
                kept.append(trimmed)
        return concat(kept)

    def _check_replicas(self, parts: list[Batch]) -> None:
        """The ranks of one tensor-parallel engine run the same scheduler on the same inputs, so they
        must sample the same tokens; a difference would train on rows the others never saw."""
        for rank, part in enumerate(parts):
            leader = parts[rank - rank % self.tensor_parallel]
            if not torch.equal(part["response_ids"], leader["response_ids"]):
                raise WorkerError(
                    f"actor worker {rank} sampled other tokens than worker {rank - rank % self.tensor_parallel} "
                    "of the same tensor-parallel vLLM engine: their engines fell out of step. This is a bug; "
                    "please report it with your vLLM version."
                )

    def sync_weights(self) -> None:
        """vLLM: every rank gathers the whole weights from the shards into its engine (HF: nothing to do)."""
        self.group.run("sync_weights", [()] * self.world, "weight sync")

    def sleep(self) -> None:
        self.group.run("sleep", [()] * self.world)

    def merged_weights(self) -> ray.ObjectRef:
        """The whole policy with LoRA merged, gathered from the shards, as rank 0 put it in the object store
        (`PolicyWorker.merged_weights`)."""
        return self.group.run("merged_weights", [()] * self.world, "weight sync")[0]

    # ------------------------------------------------------------ actor
    def logprobs(self, batch: Batch) -> torch.Tensor:
        return self.rowwise("logprobs", batch)

    def ref_logprobs(self, batch: Batch) -> torch.Tensor:
        return self.rowwise("ref_logprobs", batch)

    def rowwise(self, method: str, batch: Batch) -> torch.Tensor:
        if self.max_tokens is not None:
            return self._rowwise_packed(method, batch, self.max_tokens)
        shares = _even_shares(len(batch), self.world)
        parts = self.group.run(method, [(batch.select(s).compact(),) for s in shares])
        reals = _real(len(batch), self.world)
        return torch.cat([part[:real] for part, real in zip(parts, reals, strict=True)])

    def _rowwise_packed(self, method: str, batch: Batch, max_tokens: int) -> torch.Tensor:
        """Under a token budget: rows dealt to ranks balanced by tokens, each rank's micro-batches chosen
        here so that every rank runs as many forwards; a blank one scores a row whose result is dropped."""
        layouts = worker_layouts(row_lengths(batch), self.world, max_tokens)
        shares = [rank_rows(layout, next((r for m in layout for r in m), 0)) for layout in layouts]
        parts = self.group.run(method, [(batch.select(rows).compact(), local) for rows, local in shares])
        owned, scored = [], []
        for layout, (_, local), part in zip(layouts, shares, parts, strict=True):
            for rows, positions in zip(layout, local, strict=True):
                if rows:
                    owned.append(rows)
                    scored.append(part[positions])
        return scatter_rows(len(batch), batch["response_ids"].shape[1], owned, scored)

    def update(self, batch: Batch, plan: list[MiniBatch]) -> UpdateStats:
        return self.split_update("update", batch, plan)

    def split_update(self, method: str, batch: Batch, plan: list[MiniBatch]) -> UpdateStats:
        """Each rank takes a share of every planned mini-batch, keeping the mini-batch's totals, so the
        summed gradient is the one-process gradient. Shares are equal in rows, or under a token budget
        equal in tokens with the same number of micro-batches (`mmrl.training.micro_batches.worker_layouts`).
        Short shares are padded with a row that carries no loss (no response tokens, zero advantage)."""
        blank = batch.select([0])
        blank.set(response_mask=torch.zeros_like(blank["response_mask"]))
        if "advantages" in blank:
            blank.set(advantages=torch.zeros_like(blank["advantages"]))
        padded = concat([batch, blank])
        lengths = row_lengths(batch) if self.max_tokens is not None else None
        rows: list[list[int]] = [[] for _ in range(self.world)]
        plans: list[list[MiniBatch]] = [[] for _ in range(self.world)]
        for step in plan:
            for rank, (local, micro) in enumerate(self._shares(step.rows.tolist(), lengths, len(batch))):
                start = len(rows[rank])
                rows[rank] += local
                plans[rank].append(MiniBatch(torch.arange(start, start + len(local)), step.totals, micro))
        results = self.group.run(
            method, [(padded.select(r).compact(), p) for r, p in zip(rows, plans, strict=True)]
        )
        metrics = {k: sum(r.metrics[k] for r in results) / self.world for k in results[0].metrics}
        return UpdateStats(metrics=metrics, skipped_steps=results[0].skipped_steps, steps=results[0].steps)

    def _shares(
        self, ids: list[int], lengths: list[tuple[int, int]] | None, pad_row: int
    ) -> list[tuple[list[int], Layout | None]]:
        """Each rank's rows of one mini-batch (`pad_row` for a blank) and, given the rows' lengths
        under a token budget, its micro-batches as positions in those rows."""
        if lengths is None or self.max_tokens is None:
            counts = zip(_even_shares(len(ids), self.world), _real(len(ids), self.world), strict=True)
            return [([ids[i] for i in s[:real]] + [pad_row] * (len(s) - real), None) for s, real in counts]
        layouts = worker_layouts([lengths[i] for i in ids], self.world, self.max_tokens)
        return [rank_rows([[ids[p] for p in micro] for micro in layout], pad_row) for layout in layouts]

    # ------------------------------------------------------------ state
    def save(self, folder: Path) -> None:
        """Sharded weights and optimizer state into `folder` (`PolicyWorker.save`)."""
        self.group.run("save", [(folder,)] * self.world, "checkpoint save")

    def state_dict(self) -> dict[str, Any]:
        """Nothing for the controller's trainer state: each rank saves its own shards (`save`)."""
        return {}

    def load(self, folder: Path, state: dict[str, Any] | None = None) -> None:
        """Every rank restores its shards of the weights, AdamW state, critic and PRM from `folder`."""
        self.group.run("load", [(folder,)] * self.world, "checkpoint load")

    def state(self) -> dict[str, torch.Tensor]:
        return self.group.run("state", [()] * self.world)[0]

    def shutdown(self) -> None:
        try:
            if self.engine is not self:
                self.engine.shutdown()
        finally:
            self.group.shutdown()


class CriticRole:
    """The critic on the policy's workers (`mmrl.workers.critic`), as the trainer calls an in-process
    `Critic`: its batches are split across ranks as the actor's are. Its state is saved and restored
    with the policy's (`PolicyGroup.save`, `PolicyGroup.load`)."""

    def __init__(self, group: PolicyGroup) -> None:
        self.group = group

    def values(self, batch: Batch) -> torch.Tensor:
        return self.group.rowwise("values", batch)

    def update(self, batch: Batch, plan: list[MiniBatch]) -> UpdateStats:
        return self.group.split_update("critic_update", batch, plan)

    def state(self) -> dict[str, torch.Tensor]:
        """The whole critic, unsharded (for parity checks and tests)."""
        return self.group.group.run("critic_state", [()] * self.group.world)[0]


class PRMRole:
    """PRIME's implicit PRM on the policy's workers (`mmrl.workers.second_models`), as the trainer calls an
    in-process `ImplicitPRM`: its batches are split across ranks as the actor's are. Its state is saved
    and restored with the policy's (`PolicyGroup.save`, `PolicyGroup.load`)."""

    def __init__(self, group: PolicyGroup) -> None:
        self.group = group

    def rewards(self, batch: Batch) -> torch.Tensor:
        return self.group.rowwise("prm_rewards", batch)

    def update(self, batch: Batch, plan: list[MiniBatch]) -> UpdateStats:
        return self.group.split_update("prm_update", batch, plan)

    def state(self) -> dict[str, torch.Tensor]:
        """The whole PRM, unsharded (for parity checks and tests)."""
        return self.group.group.run("prm_state", [()] * self.group.world)[0]
