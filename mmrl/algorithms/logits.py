"""Token log-probabilities and entropies from logits, without materialising softmax copies."""

from __future__ import annotations

import torch
from torch import Tensor

# The logit of a blocked token: its probability underflows to exactly 0, yet 0·logit stays finite, so
# entropies and gradients never see inf − inf.
BLOCKED_LOGIT = -1e9


def block_tokens(logits: Tensor, token_ids: list[int]) -> Tensor:
    """`logits` with the given vocabulary entries set to BLOCKED_LOGIT (out of place, grad-safe): the
    distribution the engines actually sample from, which never emits those tokens."""
    if not token_ids:
        return logits
    return logits.index_fill(-1, torch.tensor(token_ids, device=logits.device), BLOCKED_LOGIT)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = −Σ_v p_v log p_v = logsumexp(z) − Σ_v p_v z_v, over the last axis.

    The logsumexp form never takes log of an underflowed probability, so large or
    peaked logits give a finite entropy. Computed in the logits' dtype.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log π(label) = z_label − logsumexp(z), shape [B, T] from logits [B, T, V] and labels [B, T].

    Full precision takes the gather − logsumexp route: no [B, T, V] log-softmax is built,
    and backward only keeps the logits, which are alive anyway. Half precision would lose
    the log-prob to rounding, so those logits go through float32 one sequence at a time
    (a [T, V] float32 copy at a time when no gradient is needed, e.g. old/ref log-probs);
    the result is then float32.
    """
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    rows = [
        torch.log_softmax(row.float(), dim=-1).gather(-1, row_labels.unsqueeze(-1)).squeeze(-1)
        for row, row_labels in zip(logits, labels, strict=True)
    ]
    return torch.stack(rows)
