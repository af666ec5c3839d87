"""The policy model's section: what is loaded, in which precision, and which weights train."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mmrl.config.base import Section


class LoraConfig(Section):
    """LoRA adapters (peft) instead of full fine-tuning; the KL reference is then the base model with
    the adapter switched off, so no second copy of the weights is held."""

    rank: int = Field(0, ge=0, description="0 trains all weights (full fine-tuning)")
    alpha: float = Field(16.0, gt=0, description="LoRA scale numerator: updates are scaled by alpha/rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA branch's input")
    target_modules: list[str] | None = Field(
        None,
        description="Linear layer names (q_proj, ...); default: every linear layer of the language model",
    )
    include_vision: bool = Field(False, description="Also adapt the vision tower's linear layers")


class ModelConfig(Section):
    path: str = Field(
        description="A model folder or hub id of a supported family (docs/models.md), or `mmrl model init-tiny` output"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Compute dtype. auto: bf16 on GPUs and on CPUs with bf16 instructions (AVX-512 BF16, "
        "AMX), fp32 elsewhere",
    )
    freeze_vision_tower: bool = Field(
        False, description="Train the language model only; the vision tower's weights stay"
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute layer activations in the backward pass: less memory, about 30% more time",
    )
    lora: LoraConfig = LoraConfig()
