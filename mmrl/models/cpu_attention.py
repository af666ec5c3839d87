"""Attention in fp32 while a CPU decodes under bf16 autocast (the HF engine, `model.dtype` bf16).

PyTorch's CPU flash attention is several times slower in bf16 than in fp32 for one query per row, which
is every decode step: 16 rows over 300-550 cached keys, 12 heads of 64 (2 for keys and values), one thread,
took 6.3-11.5 ms in bf16 and 1.2-1.7 ms in fp32 (2026-12-06, AMD EPYC with AVX-512 BF16). At training
lengths the two are within 5-10%. So while the HF engine samples on a CPU, each attention call casts its
query, keys and values up, attends in fp32, and casts the result back; every matmul around it stays in the
autocast dtype. The trainer's forwards keep transformers' own attention.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

FP32_SDPA = "mmrl_sdpa_fp32"


def sdpa_in_fp32(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention on fp32 copies of its inputs; the output in the query's dtype."""
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast(query.device.type, enabled=False):
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return out.to(query.dtype), weights


AttentionInterface.register(FP32_SDPA, sdpa_in_fp32)
ALL_MASK_ATTENTION_FUNCTIONS.register(FP32_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # SDPA's masks


@contextmanager
def fp32_attention_on_cpu(language_model: torch.nn.Module, compute_dtype: torch.dtype) -> Iterator[None]:
    """Inside the block, `language_model` attends in fp32 where it runs SDPA on a CPU in a lower
    precision; elsewhere (a GPU, fp32, another attention) nothing changes."""
    config = language_model.config
    before = config._attn_implementation
    device = next(language_model.parameters()).device
    if device.type != "cpu" or compute_dtype == torch.float32 or before != "sdpa":
        yield
        return
    config._attn_implementation = FP32_SDPA
    try:
        yield
    finally:
        config._attn_implementation = before
