"""Optimizer, learning-rate schedule and the mini-batch update loop shared by the actor, the critic and
PRIME's PRM."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Protocol

import torch

from mmrl.data.batch import Batch
from mmrl.training.micro_batches import Layout, micro_batches, micro_layout
from mmrl.training.packing import runs_packed


class OptimSettings(Protocol):
    """The optimizer fields an actor, critic or PRM config section carries."""

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    warmup_steps: int
    lr_schedule: str
    min_lr_ratio: float
    max_grad_norm: float


def lr_factor(update: int, cfg: OptimSettings, total: int) -> float:
    """Linear warm-up, then constant or cosine decay to `min_lr_ratio` over `total` optimizer steps.

    Decay matters most for small models trained at large rates: without it the policy keeps
    moving after it has learned, and its entropy collapses."""
    if update < cfg.warmup_steps:
        return (update + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (update - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimSettings, total_updates: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over `params` with the warm-up/decay schedule of `lr_factor`."""
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, cfg=cfg, total=total_updates))
    return optimizer, scheduler


def apply_settings(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: OptimSettings
) -> None:
    """Put the config's lr, betas and weight decay over those a checkpoint's state restored.

    Loading an optimizer and schedule brings back the values they were saved with, so a resumed run
    would silently keep its old learning rate; the schedule's position (its step count) is kept."""
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group.update(
            initial_lr=cfg.lr,
            lr=cfg.lr * factor(scheduler.last_epoch),
            betas=cfg.betas,
            weight_decay=cfg.weight_decay,
        )


# (micro-batch, mini-batch totals) -> per-mini-batch metrics; backpropagates its own loss.
MicroStep = Callable[[Batch, dict[str, float]], dict[str, float]]


@dataclass
class UpdateStats:
    """What one update call did, for the step's metrics."""

    metrics: dict[str, float]
    skipped_steps: int
    steps: int  # optimizer steps attempted, skipped ones included


@dataclass
class MiniBatch:
    """One optimizer step's rows (indices into the batch) and the totals its losses are divided by.

    The totals are the whole mini-batch's, even where a worker holds only its share of the rows:
    summing the workers' gradients then gives exactly the one-process gradient. `micro` holds each
    micro-batch's positions in `rows` where the worker group chose them, so that every rank runs
    as many forwards as the others under a token budget."""

    rows: torch.Tensor
    totals: dict[str, float]
    micro: Layout | None = None


@dataclass(frozen=True)
class UpdatePlan:
    """How a batch becomes optimizer steps: `epochs` shuffles cut into mini-batches of `rows` rows.

    Its length is known before the shuffle, so whether the update needs π_old's log-probs (more than one
    optimizer step: after the first, the policy is no longer π_old) follows from it."""

    rows: int
    epochs: int
    horizon: int  # the longest response, for the length-normalised losses

    def steps(self, num_rows: int) -> int:
        return self.epochs * -(-num_rows // self.rows)

    def minibatches(self, batch: Batch) -> list[MiniBatch]:
        return plan_minibatches(batch, self.rows, self.epochs, self.horizon)


def plan_minibatches(batch: Batch, rows_per_step: int, epochs: int, horizon: int) -> list[MiniBatch]:
    """`epochs` shuffles of the batch cut into mini-batches of `rows_per_step` rows, in step order."""
    plan = []
    for _ in range(epochs):
        order = torch.randperm(len(batch))
        for start in range(0, len(batch), rows_per_step):
            rows = order[start : start + rows_per_step]
            mask = batch["response_mask"][rows]
            totals = {  # at least 1 token: mask_truncated may leave a mini-batch with none
                "num_tokens": max(1.0, float(mask.sum())),
                "num_seqs": float(len(rows)),
                "horizon": horizon,
            }
            if "scores" in batch:  # the tokens of positively rewarded responses (`positive_example_nll`)
                totals["num_positive_tokens"] = max(1.0, float(mask[batch["scores"][rows] > 0].sum()))
            plan.append(MiniBatch(rows, totals))
    return plan


def minibatch_updates(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: Batch,
    plan: list[MiniBatch],
    *,
    micro_batch_size: int,
    max_grad_norm: float,
    micro_step: MicroStep,
    prefix: str,
    max_tokens: int | None = None,
) -> UpdateStats:
    """One optimizer step per planned mini-batch.

    Micro-batches are `micro_batch_size` rows, or packed to `max_tokens` padded tokens when set
    (`mmrl.training.micro_batches`). Gradients accumulate over micro-batches whose losses are normalised by
    the mini-batch's totals (`num_tokens`, `num_seqs`, `horizon`), so micro-batching never changes
    the result. A non-finite gradient norm skips the step: it never reaches the weights, the
    optimizer moments or the learning-rate schedule, so a skipped step leaves the state exactly as
    it was."""
    model.train()
    sums: dict[str, float] = {}
    skipped = 0
    for step in plan:
        mini = batch.select(step.rows)
        optimizer.zero_grad(set_to_none=True)
        layout = step.micro if step.micro is not None else micro_layout(mini, max_tokens)
        for micro in mini.split(micro_batch_size) if layout is None else micro_batches(mini, layout):
            for key, value in micro_step(micro, step.totals).items():
                sums[key] = sums.get(key, 0.0) + value * len(micro) / len(mini)
        grad_norm = _total_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
        # The rate this step uses: after a resume that changed lr, the schedule still reports the old one.
        sums[f"{prefix}/lr"] = sums.get(f"{prefix}/lr", 0.0) + optimizer.param_groups[0]["lr"]
        if math.isfinite(grad_norm):
            optimizer.step()
            scheduler.step()
        else:
            skipped += 1
            optimizer.zero_grad(set_to_none=True)
        sums[f"{prefix}/grad_norm"] = sums.get(f"{prefix}/grad_norm", 0.0) + grad_norm
    count = len(plan)
    return UpdateStats(metrics={k: v / count for k, v in sums.items()}, skipped_steps=skipped, steps=count)


def _total_norm(norm: torch.Tensor) -> float:
    """The gradient norm as a float; under FSDP2 it is a DTensor whose full value needs the other shards."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full else norm)


def per_minibatch(stats: dict[str, float], rows: int, totals: dict[str, float]) -> dict[str, float]:
    """Losses of a micro-batch are already divided by mini-batch totals: scale them back to
    per-mini-batch values, so the row-weighted sum in `minibatch_updates` reports the mini-batch loss."""
    share = rows / totals["num_seqs"]
    return {k: (v / share if k.endswith(("loss", "entropy")) else v) for k, v in stats.items()}


class TrainedModel:
    """A model trained with an AdamW and schedule of its own, in planned mini-batches: the actor, and
    beside it the GAE critic and PRIME's PRM. A subclass gives `prefix` (its metrics' name, and a second
    model's folder in a sharded checkpoint) and `_micro_step`, which backpropagates one micro-batch's
    loss and returns its metrics. All three read token rows alike: `pad_id`, the forward's
    `compute_dtype`, and `padding_free` (`actor.padding_free`, resolved for this model)."""

    prefix: str

    def __init__(
        self,
        model: Any,
        cfg: OptimSettings,
        total_updates: int,
        micro_batch_size: int,
        max_tokens: int | None,
        pad_id: int,
        compute_dtype: torch.dtype,
        padding_free: bool | Literal["auto"],
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.pad_id = pad_id
        self.compute_dtype = compute_dtype
        self.padding_free = runs_packed(padding_free, model)
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens  # actor.max_tokens_per_micro_batch: micro-batches as the actor's
        self.optimizer, self.scheduler = make_optimizer(
            [p for p in model.parameters() if p.requires_grad], cfg, total_updates
        )

    def update(self, batch: Batch, plan: list[MiniBatch]) -> UpdateStats:
        """One optimizer step per planned mini-batch."""
        return minibatch_updates(
            self.model,
            self.optimizer,
            self.scheduler,
            batch,
            plan,
            micro_batch_size=self.micro_batch_size,
            max_grad_norm=self.cfg.max_grad_norm,
            micro_step=self._micro_step,
            prefix=self.prefix,
            max_tokens=self.max_tokens,
        )

    def _micro_step(self, micro: Batch, totals: dict[str, float]) -> dict[str, float]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Weights and optimizer together: a resumed model must continue, not restart."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        apply_settings(self.optimizer, self.scheduler, self.cfg)
