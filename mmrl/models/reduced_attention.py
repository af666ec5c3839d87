"""Scaled dot-product attention that runs on every CPU, in fp32 where PyTorch's reduced precision cannot.

PyTorch's CPU flash attention packs bf16 keys and values for AMX whenever oneDNN may use AMX (fp16 too where
the CPU has AMX-FP16), once a call has 64 or more queries and keys. The packing routine exists only in
ATen's AVX-512 kernels, though: with ATen pinned lower (`ATEN_CPU_CAPABILITY=avx2`, as mmrl's test suite
pins it, or `default`) on a Sapphire Rapids or later Xeon, such a call raises `pack_vnni2 is only supported
when avx512 is supported`. A CPU without AMX (every AMD EPYC so far) never packs, and ATen's AVX-512
kernels pack correctly.

On the failing combination (`attention_fails_in`, decided once per process from the CPU's features and
ATen's kernel level), the attention mmrl calls itself (`sdpa`: the stacked vision attention, the packed
segments) and transformers' own `sdpa` attention in every family's layers (`sdpa_where_it_runs`, registered
over it only there) attend on fp32 copies with autocast off, and return in the dtype they would have. A
vLLM engine, whose attention mmrl does not call, is refused at start with `attention_refusal`. Everywhere else
nothing changes.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.nn import functional as F
from torch.nn.attention.bias import CausalBias
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def _fails_here(dtype: torch.dtype) -> bool:
    if torch.backends.cpu.get_cpu_capability() == "AVX512" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float16:
        return torch.cpu._is_amx_fp16_supported()
    return dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported()


FAILING_DTYPES = frozenset(d for d in (torch.bfloat16, torch.float16) if _fails_here(d))


def attention_fails_in(dtype: torch.dtype) -> bool:
    """Whether PyTorch's CPU attention raises in `dtype` here: a CPU with AMX, ATen below AVX-512."""
    return dtype in FAILING_DTYPES


def _attends_in(query: torch.Tensor) -> torch.dtype:
    """The dtype SDPA computes in for `query`: autocast's where autocast is on (it casts SDPA's inputs)."""
    if query.is_floating_point() and torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    return query.dtype


def _must_widen(query: torch.Tensor) -> bool:
    return bool(FAILING_DTYPES) and query.device.type == "cpu" and _attends_in(query) in FAILING_DTYPES


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, on fp32 copies where this CPU cannot attend in the dtype it would
    use; the output in that dtype either way."""
    if not _must_widen(query):
        return F.scaled_dot_product_attention(query, key, value, **kwargs)
    dtype, mask = _attends_in(query), kwargs.get("attn_mask")
    if mask is not None and not isinstance(mask, CausalBias) and mask.is_floating_point():
        kwargs["attn_mask"] = mask.float()  # a `CausalBias` (a shape, no values) goes as it is
    with torch.autocast("cpu", enabled=False):
        return F.scaled_dot_product_attention(query.float(), key.float(), value.float(), **kwargs).to(dtype)


def sdpa_in_fp32(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention on fp32 copies of its inputs; the output in the query's dtype. Where the
    inputs are not on a CPU (parameters offloaded to the CPU, compute on a GPU), SDPA as it is."""
    if query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast(query.device.type, enabled=False):
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return out.to(query.dtype), weights


def sdpa_where_it_runs(
    module: torch.nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa` attention (`sdpa_in_fp32`'s arguments), in fp32 where this CPU cannot attend
    in the dtype it would use."""
    if not _must_widen(query):
        return sdpa_attention_forward(module, query, *args, **kwargs)
    out, weights = sdpa_in_fp32(module, query, *args, **kwargs)
    return out.to(_attends_in(query)), weights


def attention_refusal(what: str, dtype: torch.dtype) -> str:
    """The one line that stops a run at start whose `what` would attend in `dtype` where it cannot."""
    pin = os.environ.get("ATEN_CPU_CAPABILITY", "default")
    return (
        f"{what} cannot attend in {str(dtype).removeprefix('torch.')} on this CPU: it has AMX and ATen runs "
        f"below its AVX-512 kernels (ATEN_CPU_CAPABILITY={pin}), where PyTorch's CPU attention fails "
        "('pack_vnni2 is only supported when avx512 is supported'); unset ATEN_CPU_CAPABILITY, or set "
        "model.dtype=float32"
    )


if FAILING_DTYPES:
    AttentionInterface.register("sdpa", sdpa_where_it_runs)
