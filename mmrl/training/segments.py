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

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

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
    """Segments covering a packed sequence in order, with the key columns and masks of those that continue
    a context built once per forward, for all of its layers."""

    def __init__(self, segments: Sequence[Segment], device: torch.device | str) -> None:
        if [s.start for s in segments] != [0, *(s.end for s in segments[:-1])]:
            raise ValueError("segments must cover the packed sequence in order")
        self.segments = list(segments)
        self.keys: list[torch.Tensor | None] = []
        self.masks: list[torch.Tensor | None] = []
        for s in segments:
            before = [c for r in s.context for c in r]
            if not before:
                self.keys.append(None)
                self.masks.append(None)
                continue
            own = s.end - s.start
            self.keys.append(torch.tensor([*before, *range(s.start, s.end)], device=device))
            causal = torch.ones(own, own, dtype=torch.bool, device=device).tril()
            seen = torch.ones(own, len(before), dtype=torch.bool, device=device)
            self.masks.append(torch.cat([seen, causal], dim=1))

    @property
    def length(self) -> int:
        return self.segments[-1].end if self.segments else 0

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
        for s, keys, mask in zip(self.segments, self.keys, self.masks, strict=True):
            q = query[:, :, s.start : s.end]
            k = key[:, :, s.start : s.end] if keys is None else key.index_select(2, keys)
            v = value[:, :, s.start : s.end] if keys is None else value.index_select(2, keys)
            outputs.append(
                F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=mask,
                    dropout_p=dropout,
                    is_causal=mask is None and s.end - s.start > 1,
                    scale=scaling,
                    enable_gqa=gqa,
                )
            )
        return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


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


@contextmanager
def segment_attention(language_model: torch.nn.Module) -> Iterator[None]:
    """`language_model` attends by segment plan inside the block, and as before after it. (The vision
    tower keeps its own attention: media are encoded before the packed forward.)"""
    config = language_model.config
    before = config._attn_implementation
    config._attn_implementation = IMPLEMENTATION
    try:
        yield
    finally:
        config._attn_implementation = before
