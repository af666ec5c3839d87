"""The GAE critic's FSDP2 shards, held by the policy's worker processes.

Colocated rather than a worker group of its own: a group places one GPU bundle per rank, so a
second group would ask the cluster for twice the GPUs (or CPUs) and sit idle while the actor runs.
On the policy's ranks the critic reuses their process group, and the controller splits its
batches exactly as the actor's (`PolicyGroup.rowwise`, `PolicyGroup.split_update`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from mmrl.config import Config
from mmrl.run.checkpoint import load_state_file
from mmrl.training.critic import Critic, build_critic, value_model
from mmrl.training.optim import apply_settings
from mmrl.workers.fsdp import load_sharded, save_sharded, shard_model

OPTIONS = StateDictOptions()  # every parameter, frozen ones too, as the policy saves without LoRA


def sharded_critic(cfg: Config, device: torch.device, pad_id: int, compute_dtype: torch.dtype) -> Critic:
    """This rank's shard of the critic, its trunk from `critic.model_path` or the policy's start."""
    model = value_model(cfg, cfg.critic.model_path or cfg.model.path, "cpu")
    shard_model(model, compute_dtype, cfg.actor.offload)
    if not cfg.actor.offload:
        model.to(device)
    return build_critic(cfg, model, pad_id, compute_dtype)


def save_critic(critic: Critic, folder: Path, rank: int) -> None:
    """This rank's shards of the critic and its AdamW state into `folder/critic`; rank 0 adds the
    learning-rate schedule (the same on every rank)."""
    save_sharded(critic.model, critic.optimizer, folder / "critic" / "dcp", OPTIONS)
    if rank == 0:
        torch.save(critic.scheduler.state_dict(), folder / "critic" / "scheduler.pt")


def load_critic(critic: Critic, folder: Path, cfg: Config) -> None:
    load_sharded(critic.model, critic.optimizer, folder / "critic" / "dcp", OPTIONS)
    critic.scheduler.load_state_dict(load_state_file(folder / "critic" / "scheduler.pt"))
    apply_settings(critic.optimizer, critic.scheduler, cfg.critic)  # a resume may change lr
