"""Attention in fp32 while the HF engine samples on a CPU under bf16 (or fp16) autocast.

PyTorch's CPU flash attention is several times slower in bf16 than in fp32 for one query per row, which
is every decode step: 16 rows over 300-550 cached keys, 12 heads of 64 (2 for keys and values), one thread,
took 6.3-11.5 ms in bf16 and 1.2-1.7 ms in fp32 (2026-12-06, AMD EPYC with AVX-512 BF16). At training
lengths the two are within 5-10%. So while the HF engine samples on a CPU (prefill and decode), each
attention call of the language model runs with autocast off on fp32 copies of its query, keys and values,
and returns in the query's dtype; every matmul around it stays in the autocast dtype, and the vision tower
and the trainer's forwards keep transformers' own attention. The engine's log-probs then differ from the
trainer's bf16 forward by the attention's rounding (6e-4 to 1.6e-3 over two quickstart steps).

The switch is the language model's config, shared by every forward: no forward of the same model may run
concurrently with a sampling call (none does: the trainer and its in-process engine take turns).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from mmrl.models.loading import attention_implementation
from mmrl.models.reduced_attention import sdpa_in_fp32

FP32_SDPA = "mmrl_sdpa_fp32"


AttentionInterface.register(FP32_SDPA, sdpa_in_fp32)
ALL_MASK_ATTENTION_FUNCTIONS.register(FP32_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # SDPA's masks


def fp32_attention_on_cpu(model: Any, compute_dtype: torch.dtype) -> AbstractContextManager:
    """Inside the block, `model`'s language model attends in fp32 where it runs SDPA in a lower precision
    and its inputs are on a CPU (`sdpa_in_fp32` checks each call); with fp32 or another attention nothing
    changes. The switch is the text config, which the language model's layers and masks read."""
    config = model.config.get_text_config()
    if compute_dtype == torch.float32 or config._attn_implementation != "sdpa":
        return nullcontext()
    return attention_implementation(config, FP32_SDPA)
