"""Where the policy runs: in this process, or as FSDP2 shards on Ray workers (`trainer.ray_address`).

This is the one place that asks. Both placements start from the same weights: the configured model
or, when the run has a format warm-up, its output, which this process makes first (once) and saves
as `run_dir/warmup_model`, the RL starting point and the KL reference.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from rich.console import Console

from mmrl.config import Config
from mmrl.data.batch import Batch
from mmrl.models import save_model
from mmrl.rollout import RolloutEngine
from mmrl.run.warmup_cache import restore, store, warmup_key
from mmrl.training.optim import MiniBatch, UpdateStats
from mmrl.training.setup import load_trainable
from mmrl.workers.local import LocalPolicy

WARMUP_MODEL = "warmup_model"


class Policy(Protocol):
    """The actor and its KL reference as the loop calls them, with the engine that samples from them,
    under GAE the critic (`values`, `update`) and under PRIME the implicit PRM (`update`, `rewards`)."""

    engine: RolloutEngine
    critic: Any
    prm: Any
    has_reference: bool

    def logprobs(self, batch: Batch) -> torch.Tensor: ...

    def ref_logprobs(self, batch: Batch) -> torch.Tensor: ...

    def update(self, batch: Batch, plan: list[MiniBatch]) -> UpdateStats: ...

    def save(self, folder: Path) -> None:
        """The weights (and sharded optimizer state) into checkpoint `folder`."""

    def state_dict(self) -> dict[str, Any]:
        """What the trainer state file keeps for the policy (in-process: optimizer, schedule, critic)."""

    def load(self, folder: Path, state: dict[str, Any]) -> None: ...

    def shutdown(self) -> None: ...


def start_weights(cfg: Config, run_dir: Path) -> Path:
    """The weights RL starts from (and LoRA adapters sit on): the warm-up's output, or the configured model."""
    return run_dir / WARMUP_MODEL if cfg.warmup.steps else Path(cfg.model.path)


def place_policy(
    cfg: Config,
    processor: Any,
    run_dir: Path,
    resuming: bool,
    warmup: Callable[[Any], list[float]],
    console: Console,
) -> Policy:
    """The run's policy, after the format warm-up when the run has one and is not resuming a checkpoint
    (`warmup(model)` trains `model` in place and returns its losses)."""
    start = start_weights(cfg, run_dir)
    # A Ray run's controller leaves the GPUs to its workers.
    device = "cpu" if cfg.trainer.uses_workers else cfg.trainer.torch_device()
    if cfg.warmup.steps and resuming and not (start / "config.json").exists():
        raise FileNotFoundError(f"{start} is missing: the checkpoints of this run were trained from it")
    if cfg.warmup.steps and not resuming:
        _warm_up(cfg, processor, start, device, warmup, console)
    if not cfg.trainer.uses_workers:
        return LocalPolicy(cfg, start, processor, device)
    from mmrl.workers.group import PolicyGroup  # Ray is imported only by runs that use it

    cfg = cfg.model_copy(deep=True)
    cfg.model.path = str(start)
    group = PolicyGroup(cfg)
    roles = " and ".join(
        name for name, held in (("actor", True), ("critic", group.critic), ("PRM", group.prm)) if held
    )
    console.print(f"{group.world} {roles} workers (FSDP2) on {len(set(group.nodes))} node(s)")
    return group


def _warm_up(
    cfg: Config,
    processor: Any,
    start: Path,
    device: str,
    warmup: Callable[[Any], list[float]],
    console: Console,
) -> None:
    """The format warm-up's weights into `start`: trained here, or reused from `warmup.cache_dir`."""
    cache, key = cfg.warmup.cache_dir, warmup_key(cfg) if cfg.warmup.cache_dir else ""
    losses = restore(cache, key, start) if cache else None
    if losses is not None:
        console.print(
            f"format warm-up: reused {Path(cache) / key} (loss {losses[0]:.3f} -> {losses[-1]:.3f})"
        )
        return
    model = load_trainable(cfg.model.path, cfg, device)
    losses = warmup(model)
    save_model(model, processor, start)
    console.print(f"format warm-up: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if cache:
        store(cache, key, start, losses)
