"""Rollout engines: one interface, an HF transformers engine everywhere, vLLM where installed."""

from mmrl.rollout.base import RolloutEngine, SamplingParams
from mmrl.rollout.hf import HFEngine

__all__ = ["HFEngine", "RolloutEngine", "SamplingParams", "make_engine"]


def make_engine(kind: str, model, processor, compute_dtype) -> RolloutEngine:
    """The configured engine; only `hf` exists until the vLLM engine lands."""
    if kind == "hf":
        return HFEngine(model, processor, compute_dtype)
    raise ValueError(
        f"rollout.engine={kind!r} is not available in this build; use rollout.engine=hf "
        "(the vLLM engine needs `pip install mmrl[vllm]`)"
    )
