"""Attention over packed rows segment by segment: the padding-free forward without an (N, N) mask.

Packed rows (`mmrl.training.packing`) are one sequence of N tokens. transformers keeps them apart with a
block-diagonal mask: on a CPU a dense (N, N) tensor per forward, and every query scored against all N
keys, most of them masked (16 rows of 600 tokens: 92 M mask entries, 16x the attention work). Here each
segment attends only to its own keys, causally, and wholly to the keys of the segments it continues: a
response continues its group's prompt, which is packed once for all of the group's responses. One
`scaled_dot_product_attention` call per segment computes exactly what the padded forward computes.

The attention is a transformers attention implementation (`IMPLEMENTATION`), switched on for the language
model for the length of one forward (`segment_attention`); the plan reaches every layer as a keyword
argument of the model's forward (`PLAN`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from mmrl.models import attention_implementation, sdpa

IMPLEMENTATION = "mmrl_segments"
PLAN = "mmrl_segments"  # the forward keyword that carries the `SegmentPlan` down to each layer


@dataclass(frozen=True)
class Segment:
    """Columns [start, end) of a packed sequence: they attend to themselves causally and to every column
    in `context` (a shared prompt they continue), which must come before `start`."""

    start: int
    end: int
    context: tuple[range, ...] = ()


class SegmentPlan:
    """Segments covering a packed sequence in order, run by run: consecutive segments of one length that
    continue the same context (a group's responses of equal length, frames of equal size) attend as one
    batch. Key columns and masks are built once per forward, for all of its layers."""

    def __init__(self, segments: Sequence[Segment], device: torch.device | str) -> None:
        if [s.start for s in segments] != [0, *(s.end for s in segments[:-1])]:
            raise ValueError("segments must cover the packed sequence in order")
        self.length = segments[-1].end if segments else 0
        self.runs: list[_Run] = []
        for s in segments:
            last = self.runs[-1] if self.runs else None
            if last is not None and last.width == s.end - s.start and last.context == s.context:
                last.count += 1
            else:
                self.runs.append(_Run(s.start, 1, s.end - s.start, s.context, device))

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float | None,
        dropout: float,
    ) -> torch.Tensor:
        """Attention output (1, N, heads, dim) from query (1, heads, N, dim) and key/value (1, kv heads, N,
        dim), each segment on its own keys."""
        gqa = key.shape[1] != query.shape[1]
        outputs = []
        for run in self.runs:
            q, k, v = run.rows(query), run.keys(key), run.keys(value)
            out = sdpa(
                q,
                k,
                v,
                attn_mask=run.mask,
                dropout_p=dropout,
                is_causal=run.mask is None and run.width > 1,
                scale=scaling,
                enable_gqa=gqa,
            )
            outputs.append(
                out.transpose(0, 1).reshape(out.shape[1], -1, out.shape[-1])
            )  # heads, columns, dim
        return torch.cat(outputs, dim=1)[None].transpose(1, 2).contiguous()


class _Run:
    """`count` consecutive segments of `width` columns from `start`, all continuing `context`."""

    def __init__(self, start: int, count: int, width: int, context: tuple[range, ...], device: Any) -> None:
        self.start, self.count, self.width, self.context = start, count, width, context
        before = [c for r in context for c in r]
        self.before = torch.tensor(before, device=device) if before else None
        # Each column sees the whole context and its own segment up to itself: causal aligned to the last
        # key (lower right). As a `CausalBias` rather than a boolean mask, CUDA's flash and memory-efficient
        # kernels take it (grouped-query attention included); a dense mask would leave only the math
        # kernel and its fp32 (width x keys) probabilities. Elsewhere PyTorch builds the same mask itself.
        self.mask = causal_lower_right(width, len(before) + width) if before else None

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The run's columns of x (1, heads, N, dim) as a batch (count, heads, width, dim)."""
        own = x[0, :, self.start : self.start + self.count * self.width]
        return own.unflatten(1, (self.count, self.width)).transpose(0, 1)

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """Keys (or values) each segment attends to: the context's columns, then its own."""
        own = self.rows(x)
        if self.before is None:
            return own
        context = x[0].index_select(1, self.before)[None].expand(self.count, -1, -1, -1)
        return torch.cat([context, own], dim=2)


def _segment_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention implementation transformers calls in each layer while `segment_attention` is on."""
    plan = kwargs.get(PLAN)
    if plan is None or query.shape[0] != 1 or query.shape[2] != plan.length:
        raise RuntimeError("mmrl's segment attention runs only on one packed sequence with its plan")
    return plan.attend(query, key, value, scaling, dropout if module.training else 0.0), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The plan keeps the segments apart, so transformers builds no mask."""
    return None


AttentionInterface.register(IMPLEMENTATION, _segment_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, _no_mask)


def segment_attention(language_model: torch.nn.Module) -> AbstractContextManager:
    """`language_model` attends by segment plan inside the block, and as before after it. (The vision
    tower keeps its own attention: media are encoded before the packed forward.)"""
    return attention_implementation(language_model.config, IMPLEMENTATION)
