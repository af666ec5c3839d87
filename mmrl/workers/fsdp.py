"""FSDP2 for the policy: the process group, which modules become shards, and whole-model state.

Every decoder layer and every vision block is its own FSDP unit (`Family.fsdp_units`), so only
one layer is ever gathered at a time; the root unit holds the rest (embeddings, tied LM head,
norms, patch embedding and merger). Gradients are summed, not averaged, across ranks: each rank's loss is
already divided by the whole mini-batch's totals (`optim.MiniBatch`), so the sum is exactly the
one-process gradient.
"""

from __future__ import annotations

from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from mmrl.models import family_of
from mmrl.training.forward import SHARDED_LOGPROBS, response_logprobs
from mmrl.workers.device import worker_device


def process_group_backend(device: torch.device) -> str:
    """gloo on a CPU. On a GPU, NCCL for CUDA tensors and gloo for CPU ones: with `actor.offload` the
    shards and gradients live in CPU memory, and the gradient norm's reduction and the whole tensors
    gathered for a vLLM sync are collectives over them, which an NCCL-only group cannot run."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_process_group(rank: int, world_size: int, address: str, port: int, timeout_s: float) -> torch.device:
    """Join the group (`process_group_backend`) and return this rank's device (`worker_device`)."""
    device = worker_device()
    dist.init_process_group(
        process_group_backend(device),
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return device


def shard_model(model: Any, compute_dtype: torch.dtype, offload: bool) -> Any:
    """Shard `model` (the policy or the critic: anything whose family names its units) in place.

    Mixed precision casts the gathered parameters to `compute_dtype` (bf16 on GPUs) and reduces
    gradients in fp32; the sharded master weights and AdamW state stay fp32. `offload` keeps
    parameters, gradients and optimizer state in CPU memory between uses."""
    kwargs: dict[str, Any] = {}
    if compute_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for unit in family_of(model).fsdp_units(model):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum
    return model


def shard_policy(model: Any, compute_dtype: torch.dtype, offload: bool) -> Any:
    """`shard_model`, and `forward.response_logprobs` and `generate` made FSDP-aware: both reach the
    root's weights (LM head, embeddings) outside `forward`."""
    shard_model(model, compute_dtype, offload)
    setattr(model, SHARDED_LOGPROBS, partial(response_logprobs, model, through_shards=False))
    register_fsdp_forward_method(model, SHARDED_LOGPROBS)
    register_fsdp_forward_method(model, "generate")
    return model


def full_state_dict(model: Any, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The whole, unsharded state on CPU, on every rank (a collective: every rank must call it)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options)


def save_sharded(model: Any, optimizer: Any, path: Path, options: StateDictOptions) -> None:
    """This rank's shards of the weights and AdamW state into `path` (a collective: DCP)."""
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=path)


def load_sharded(model: Any, optimizer: Any, path: Path, options: StateDictOptions) -> None:
    """`save_sharded`'s inverse (a collective)."""
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=options,
    )
