"""Reducing a per-token loss [B, T] to the scalar that is back-propagated.

The choice decides how much each token weighs: per token (long answers count more),
per sequence (every answer counts the same), per sequence over a fixed horizon
(Dr.GRPO, no length bias), or per turn within each sequence (an agent's short final answer
weighs as much as the long tool call before it). For gradient accumulation pass the mini-batch's global
count (`num_tokens` / `num_seqs`): then Σ over micro-batches equals the mini-batch loss,
which dividing by each micro-batch's own count would not give.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmrl.algorithms.masked import masked_sum

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-turn-mean",
)


def agg_loss(
    values: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    horizon: int | None = None,
    **other_totals: float,
) -> Tensor:
    """Aggregate `values` [B, T] over the valid tokens of `mask`; L_i = length of sequence i.

    - ``token-mean`` (DAPO): Σ_i Σ_t v_it / N_tokens
    - ``seq-mean-token-mean`` (GRPO paper): Σ_i (Σ_t v_it / L_i) / N_seqs
    - ``seq-mean-token-sum``: Σ_i Σ_t v_it / N_seqs
    - ``seq-mean-token-sum-norm`` (Dr.GRPO): Σ_i (Σ_t v_it / horizon) / N_seqs, horizon a constant
      such as the maximum response length (required: the padded width of a micro-batch varies)
    - ``seq-mean-turn-mean``: Σ_i (Σ_k mean_{t in turn k} v_it / K_i) / N_seqs, a turn being a run of
      valid tokens (an agent's tool replies are masked out between its turns) and K_i their count.
      Under seq-mean-token-mean a 60-token tool call holds 60 of every 65 shares of its trajectory and
      the 5-token answer after it the rest; here each holds half. One turn: seq-mean-token-mean.

    N_tokens / N_seqs default to the local valid-token count and the number of sequences with at
    least one valid token; pass the global counts, counted the same way, when accumulating. A
    mini-batch's other totals (`mmrl.training.optim.MiniBatch`) are ignored, so they can be passed whole.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {LOSS_AGG_MODES}")
    mask = mask.bool()
    if mode == "token-mean":
        return masked_sum(values, mask) / (num_tokens if num_tokens is not None else mask.sum().clamp(min=1))
    lengths = mask.sum(-1)
    per_seq = masked_sum(values, mask, dim=-1)
    if mode == "seq-mean-turn-mean":
        per_seq = _turn_mean(values, mask)
    elif mode == "seq-mean-token-mean":
        per_seq = per_seq / lengths.clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        if horizon is None:
            raise ValueError("seq-mean-token-sum-norm needs horizon=<max response length>")
        per_seq = per_seq / horizon
    return per_seq.sum() / (num_seqs if num_seqs is not None else (lengths > 0).sum().clamp(min=1))


def _turn_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Per row of `values` [B, T]: the mean over its turns (runs of set `mask` positions) of each turn's
    mean value; 0 for a row without one."""
    starts = mask & ~torch.nn.functional.pad(mask[:, :-1], (1, 0), value=False)
    turns = starts.sum(-1)
    turn = (starts.cumsum(-1) - 1).clamp(min=0)  # each position's turn in its row (padding: any)
    shape = (values.shape[0], int(turns.max().clamp(min=1)))
    kept = torch.where(mask, values, torch.zeros_like(values))
    sums = values.new_zeros(shape).scatter_add(1, turn, kept)
    counts = values.new_zeros(shape).scatter_add(1, turn, mask.to(values.dtype))
    return (sums / counts.clamp(min=1)).sum(-1) / turns.clamp(min=1)
