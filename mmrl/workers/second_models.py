"""The second trained models that the policy's worker processes hold beside the actor, as FSDP2 shards:
the GAE critic and PRIME's implicit PRM.

Colocated rather than a worker group of their own: a group places one GPU bundle per rank, so a
second group would ask the cluster for twice the GPUs (or CPUs) and sit idle while the actor runs.
On the policy's ranks they reuse their process group, and the controller splits their batches
exactly as the actor's (`PolicyGroup.rowwise`, `PolicyGroup.split_update`). Each is saved into a
folder of its own in the checkpoint (`critic/`, `prm/`): its shards, AdamW state and schedule.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from mmrl.config import Config
from mmrl.run.checkpoint import load_state_file
from mmrl.training.critic import Critic, build_critic, value_model
from mmrl.training.optim import TrainedModel, apply_settings
from mmrl.training.prm import ImplicitPRM, build_prm, prm_model
from mmrl.workers.fsdp import load_sharded, save_sharded, shard_model, shard_policy

OPTIONS = StateDictOptions()  # every parameter, frozen ones too, as the policy saves without LoRA


def sharded_critic(cfg: Config, device: torch.device, pad_id: int, compute_dtype: torch.dtype) -> Critic:
    """This rank's shard of the critic, its trunk from `critic.model_path` or the policy's start."""
    model = value_model(cfg, cfg.critic.model_path or cfg.model.path, "cpu")
    shard_model(model, compute_dtype, cfg.actor.offload)
    if not cfg.actor.offload:
        model.to(device)
    return build_critic(cfg, model, pad_id, compute_dtype)


def sharded_prm(cfg: Config, device: torch.device, pad_id: int, compute_dtype: torch.dtype) -> ImplicitPRM:
    """This rank's shard of PRIME's PRM, from `prm.model_path` or the policy's start."""
    model = shard_policy(prm_model(cfg, cfg.model.path), compute_dtype, cfg.actor.offload)
    if not cfg.actor.offload:
        model.to(device)
    return build_prm(cfg, model, pad_id, compute_dtype)


def save_second(trained: TrainedModel, folder: Path, rank: int) -> None:
    """This rank's shards of a critic or PRM and its AdamW state into `folder`; rank 0 adds the
    learning-rate schedule (the same on every rank)."""
    save_sharded(trained.model, trained.optimizer, folder / "dcp", OPTIONS)
    if rank == 0:
        torch.save(trained.scheduler.state_dict(), folder / "scheduler.pt")


def load_second(trained: TrainedModel, folder: Path) -> None:
    """What `save_second` wrote; the config's learning rate wins over the saved one."""
    load_sharded(trained.model, trained.optimizer, folder / "dcp", OPTIONS)
    trained.scheduler.load_state_dict(load_state_file(folder / "scheduler.pt"))
    apply_settings(trained.optimizer, trained.scheduler, trained.cfg)  # a resume may change lr
