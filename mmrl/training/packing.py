"""Padding-free packing: a micro-batch's rows as one sequence without pad tokens (`actor.padding_free`).

A padded micro-batch spends attention and MLP compute on every pad column: its width is its longest
prompt plus its longest response, and response lengths vary a lot within an RL batch. Packed, the
rows' real tokens are concatenated into one (1, N) sequence and nothing is computed on padding.

Rows that share a prompt (a GRPO group's n responses, `mmrl.training.shared_prompt.Sharing`) can share
it here too: the prompt is packed once, then each of its responses, and every response segment attends
to the prompt's columns as if they stood right before it (`mmrl.training.segments`). Every token sees
what it sees in the padded path, at the position it has there; the Qwen-VL models take the text
positions as a fourth row before the three mRoPE rows, which are the padded layout's, column for column.

How the segments are kept apart: by `mmrl.training.segments`' per-segment attention, or, where a
forward is re-run in the backward pass (gradient checkpointing, which would run it outside the
segment attention), by the positions alone, as transformers reads packed inputs (a dense
block-diagonal mask on CPU, varlen flash attention on GPU); rows are then packed each whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from mmrl.models import family_of
from mmrl.training.segments import Segment

if TYPE_CHECKING:
    from mmrl.training.shared_prompt import Sharing


# `actor.padding_free: auto` packs a model whose language model is at least this wide. One forward and
# backward of a micro-batch, packed (each prompt once) against padded with the shared prompt, as speed
# (bench/packed_forward.py, one CPU thread, 2026-12-06): 0.93x on the quickstart's 128-wide model, where
# each attention call's overhead outweighs the padding saved; with the realistic shape's 12 layers, at
# responses of up to 8 tokens 1.02x at 256 wide and 1.03x at 512 and 768; at up to 64 tokens 1.35x at 256
# wide and 1.56x at 512 (1.29-1.96x at 768 with 448 px images).
PACKS_FROM_WIDTH = 256


def runs_packed(setting: bool | Literal["auto"], model: Any) -> bool:
    """Whether forwards over `model` run packed (`actor.padding_free`): as set, or, for `auto`, where it
    pays: a family whose rows can be packed, at least `PACKS_FROM_WIDTH` wide, without gradient
    checkpointing (whose re-run forward keeps packed rows apart with a dense mask over the whole pack)."""
    if setting != "auto":
        return bool(setting)
    family = family_of(model)
    return (
        family.packs_sequences
        and not getattr(model, "is_gradient_checkpointing", False)
        and family.text_config.hidden_size >= PACKS_FROM_WIDTH
    )


@dataclass(frozen=True)
class Packed:
    """One micro-batch packed: ids (1, N), positions, its segments, and where each response position's
    state lies."""

    input_ids: torch.Tensor  # (1, N)
    positions: torch.Tensor  # (1, N) for text models; (4, 1, N): text positions, then the mRoPE rows
    segments: list[Segment]  # in column order, covering N
    index: torch.Tensor  # (B, T): column in N of the state that predicts response token t of row b
    valid: torch.Tensor  # (B, T): the response token exists (the batch's attention: `Batch.attention`)


def pack(
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    positions: torch.Tensor,
    prompt_width: int,
    sharing: Sharing | None = None,
) -> Packed:
    """The attended columns of a padded (B, L) micro-batch as one sequence: row after row, or with
    `sharing`, the prompts' common text once, then each group's prompt once and its rows' responses.

    `input_ids` and `attention` are the padded path's left-padded prompts then right-padded responses
    (prompt columns first, `prompt_width` of them); `positions` are its position ids, (B, L) or
    (3, B, L). The response mask must be a prefix of each response: a masked token inside a response
    would be dropped here but attended to in the padded path's queries after it."""
    keep = attention.bool()
    response = keep[:, prompt_width:]
    if not torch.equal(response, response.cumprod(dim=1).bool()):
        raise ValueError(
            "padding_free: a response attention mask with holes cannot be packed (1s must come first)"
        )
    prompt_len = keep[:, :prompt_width].sum(dim=1).tolist()
    response_len = response.sum(dim=1).tolist()
    width = response.shape[1]
    layout = _Layout()
    index = torch.zeros(response.shape, dtype=torch.long)
    steps = torch.arange(width)
    if sharing is None:
        for b, (p, n) in enumerate(zip(prompt_len, response_len, strict=True)):
            span = layout.add(b, range(prompt_width - p, prompt_width + n))
            index[b] = span.start + p - 1 + steps
    else:
        first = sharing.first[0]
        common = range(prompt_width - prompt_len[first], prompt_width - prompt_len[first] + sharing.common)
        root = (layout.add(first, common),) if sharing.common else ()
        for g, first in enumerate(sharing.first):
            prompt = layout.add(
                first, range(prompt_width - prompt_len[first] + sharing.common, prompt_width), root
            )
            for b in (b for b, group in enumerate(sharing.group) if group == g):
                span = layout.add(b, range(prompt_width, prompt_width + response_len[b]), (*root, prompt))
                index[b] = torch.cat([torch.tensor([prompt.stop - 1]), span.start + steps[:-1]])
    rows, columns = torch.tensor(layout.rows), torch.tensor(layout.columns)
    text = (keep.long().cumsum(dim=1) - 1)[rows, columns][None]  # each token's place in its own row
    mrope = positions.dim() == 3
    return Packed(
        input_ids=input_ids[rows, columns][None],
        positions=torch.cat([text, positions[:, rows, columns]])[:, None] if mrope else text,
        segments=layout.segments,
        index=index.clamp(max=len(layout.columns) - 1),
        valid=response,
    )


class _Layout:
    """The packed sequence being laid out: the padded (row, column) each packed column comes from."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.columns: list[int] = []
        self.segments: list[Segment] = []

    def add(self, row: int, columns: range, context: tuple[range, ...] = ()) -> range:
        """Row `row`'s `columns` as the next segment, continuing `context`; where they landed. An empty
        span (a response of no tokens) adds no segment."""
        start = len(self.columns)
        if columns:
            self.rows += [row] * len(columns)
            self.columns += columns
            self.segments.append(Segment(start, len(self.columns), context))
        return range(start, len(self.columns))


def unpack(hidden: torch.Tensor, packed: Packed) -> torch.Tensor:
    """The packed (1, N, H) states at the response positions as the padded path lays them out,
    (B, T, H), with zeros where a row's response has ended."""
    index = packed.index.to(hidden.device)
    valid = packed.valid.to(hidden.device)[..., None]
    return torch.where(valid, hidden[0, index], hidden.new_zeros(()))
