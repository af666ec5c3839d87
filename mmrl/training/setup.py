"""The policy as training takes it, built the same way in this process and on every Ray worker.

`mmrl.workers.local.LocalPolicy` and `mmrl.workers.policy.PolicyWorker` both start here, so a
freeze, a LoRA prefix or the reference's rule is written once for both placements.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mmrl.config import Config
from mmrl.data.batch import Batch
from mmrl.models import family_of, load_policy
from mmrl.training.actor import Actor
from mmrl.training.lora import apply_lora
from mmrl.training.micro_batches import Layout


def load_trainable(path: str | Path, cfg: Config, device: str = "cpu") -> Any:
    """The policy at `path` in fp32 (`model.dtype` is the autocast precision), with the vision tower
    frozen and gradient checkpointing on where the config asks."""
    model = load_policy(path, torch.float32, device)
    if cfg.model.freeze_vision_tower:
        family_of(model).freeze_vision(model)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def add_adapters(
    model: Any, cfg: Config, base: str | Path, compute_dtype: torch.dtype = torch.float32
) -> Any:
    """LoRA adapters on `model` (in place) when `model.lora.rank` is set; the PeftModel, else None. Then
    every frozen parameter (the base under LoRA, a frozen vision tower) is held in `compute_dtype`.

    peft records `base` as the adapter's base model, so `mmrl eval` and plain transformers find it. Frozen
    weights are only ever read in the compute dtype, so an fp32 copy is 4 bytes a parameter that buy
    nothing, and under autocast the bf16 copies made for backward come on top: about 6 bytes a parameter
    where bf16 weights take 2 (EasyR1 holds a LoRA base in bf16 too). Trained parameters stay fp32."""
    peft = None
    if cfg.model.lora.rank:
        model.name_or_path = model.config._name_or_path = str(Path(base).resolve())
        peft = apply_lora(model, cfg.model.lora)
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point():
            param.data = param.data.to(compute_dtype)
    return peft


def reference_logprobs(
    actor: Actor, batch: Batch, peft: Any, ref: Any, layout: Layout | None = None
) -> torch.Tensor:
    """The frozen reference's log-probs: under LoRA the policy with its adapter switched off (no second
    copy of the weights), else the separate reference model `ref`."""
    if peft is not None:
        with peft.disable_adapter():
            return actor.logprobs(batch, layout=layout)
    return actor.logprobs(batch, ref, layout)
