"""Vision-tower attention over many short sequences in one call per length, not one call per sequence.

The Qwen-VL towers (and GLM-4V's) attend within each image, and Qwen2.5-VL within each window of
an image too, given as `cu_seqlens` boundaries over one packed sequence of patches. transformers sends
those boundaries only to an attention implementation whose name contains "flash"; for any other
(SDPA on a CPU, or on a GPU without flash-attn) it splits the sequence and calls attention once per
image or window, so a batch of 32 images pays 160 calls, and their autograd nodes, per forward. Here
the sequences of one length are stacked into a batch and attended in one SDPA call: the same values,
since every sequence still attends only to itself. The name carries "flash" for that routing only.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from transformers import AttentionInterface

from mmrl.models.reduced_attention import sdpa

VARLEN_SDPA = "mmrl_sdpa_varlen_like_flash"


def sdpa_varlen(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of (1, heads, S, d) `query`, `key`, `value` within each [cu[i], cu[i+1]) span; (1, S,
    heads, d) out, as transformers' attention functions return it."""
    if cu_seq_lens_q is None or attention_mask is not None or kwargs.get("is_causal"):
        raise ValueError(f"{VARLEN_SDPA} is for a vision tower's cu_seqlens attention only")
    q, k, v = query[0], key[0], value[0]  # (heads, S, d)
    bounds = cu_seq_lens_q.tolist()
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    if len(set(lengths)) == 1:  # every span one length (images of one size, whole windows): a reshape
        n, size = len(lengths), lengths[0]
        out = _attend(*(t.unflatten(1, (n, size)).transpose(0, 1) for t in (q, k, v)), scaling, dropout)
        return out.transpose(1, 2).flatten(0, 1)[None], None
    parts, order = [], []
    for size in sorted(set(lengths)):
        starts = torch.tensor([a for a, n in zip(bounds, lengths, strict=False) if n == size])
        index = (starts[:, None] + torch.arange(size)).to(q.device)  # (spans, size)
        stacked = (t[:, index].transpose(0, 1) for t in (q, k, v))  # (spans, heads, size, d)
        out = _attend(*stacked, scaling, dropout)
        parts.append(out.transpose(1, 2).flatten(0, 1))  # (spans * size, heads, d)
        order.append(index.flatten())
    out = torch.cat(parts)[torch.argsort(torch.cat(order))]
    return out[None], None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None, dropout: float):
    return sdpa(q, k, v, dropout_p=dropout, scale=scaling)


AttentionInterface.register(VARLEN_SDPA, sdpa_varlen)


def use_varlen_vision_attention(model: Any) -> None:
    """Route a vision tower running SDPA through `sdpa_varlen`; a tower on flash-attn or eager keeps it."""
    vision = getattr(model.config, "vision_config", None)
    if vision is not None and vision._attn_implementation == "sdpa":
        vision._attn_implementation = VARLEN_SDPA
