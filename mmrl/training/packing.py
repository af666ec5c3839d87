"""Padding-free packing: a micro-batch's rows as one sequence without pad tokens (`actor.padding_free`).

A padded micro-batch spends attention and MLP compute on every pad column: its width is its longest
prompt plus its longest response, and response lengths vary a lot within an RL batch. Packed, the
rows' real tokens are concatenated into one (1, N) sequence and nothing is computed on padding.

Sequences are kept apart by their positions alone, as transformers reads packed inputs: with no
attention mask, a text position that does not follow its predecessor (`find_packed_sequence_indices`)
starts a new sequence, so the causal mask becomes block-diagonal on CPU (sdpa, eager) and flash
attention runs varlen on GPU. The Qwen-VL models take the text positions as a fourth row before the
three mRoPE rows; the mRoPE rows are the padded layout's, column for column, so every token sits at
the position it has in the padded path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packed:
    """One micro-batch packed: ids (1, N), positions, and where each response position's state lies."""

    input_ids: torch.Tensor  # (1, N)
    positions: torch.Tensor  # (1, N) for text models; (4, 1, N): text positions, then the mRoPE rows
    index: torch.Tensor  # (B, T): column in N of the state that predicts response token t of row b
    valid: torch.Tensor  # (B, T): the response token exists (the batch's attention: `Batch.attention`)


def pack(
    input_ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, prompt_width: int
) -> Packed:
    """The attended columns of a padded (B, L) micro-batch, row after row, as one sequence.

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
    text = (keep.long().cumsum(dim=1) - 1)[keep][None]  # 0, 1, ... restarting at every row
    mrope = positions.dim() == 3
    positions = torch.cat([text, positions[:, keep]])[:, None] if mrope else text
    flat = keep.flatten().long().cumsum(dim=0).view(keep.shape) - 1  # each column's place in N
    start = prompt_width - 1  # the prompt's last token predicts the first response token
    return Packed(
        input_ids=input_ids[keep][None],
        positions=positions,
        index=flat[:, start : start + response.shape[1]],
        valid=response,
    )


def unpack(hidden: torch.Tensor, packed: Packed) -> torch.Tensor:
    """The packed (1, N, H) states at the response positions as the padded path lays them out,
    (B, T, H), with zeros where a row's response has ended."""
    index = packed.index.to(hidden.device)
    valid = packed.valid.to(hidden.device)[..., None]
    return torch.where(valid, hidden[0, index], hidden.new_zeros(()))
