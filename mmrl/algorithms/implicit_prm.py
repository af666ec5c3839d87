"""PRIME's implicit process reward model (Cui et al. 2025, "Process Reinforcement through Implicit
Rewards", arXiv 2502.01456): a language model π_φ whose log-ratio to the frozen reference is a reward
for every token, trained on outcome labels alone."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from mmrl.algorithms.masked import masked_sum


def implicit_process_rewards(
    prm_logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor, *, beta: float
) -> Tensor:
    """PRIME's implicit process reward (Cui et al. 2025, arXiv 2502.01456, §3.1, Eq. 3), per token:

        r_φ(y_t) = β · log(π_φ(y_t | y_<t) / π_ref(y_t | y_<t)),

    with π_φ the PRM (a language model started from the reference) and π_ref the frozen reference. Its
    sum over a response is the outcome reward model that the PRM's loss trains (`implicit_prm_loss`),
    so each token's share of it says how much that token moved the PRM's belief in a correct answer.
    All tensors [B, T]; float32, exactly 0 on padding.
    """
    mask = response_mask.bool()
    ratio = prm_logprobs.float() - ref_logprobs.float()
    return torch.where(mask, beta * ratio, torch.zeros_like(ratio))


def batch_normalized_process_rewards(process_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """The process rewards scaled so that the largest |return-to-go| in the batch is 1:

        r̃(y^i_t) = r_φ(y^i_t) / max_{j,s} | Σ_{u≥s} r_φ(y^j_u) |,

    the normalisation of the PRIME authors' implementation (verl's `prime_norm: batch_norm`; the paper
    does not state it). Unscaled, a response's process return grows with its length and with how far
    the policy has drifted from what the PRM was trained on, and can outweigh the outcome's ±1: the
    policy then learns the PRM's blind spots instead of the task. [B, T]; 0 on padding."""
    rewards = process_rewards.float() * response_mask
    to_go = rewards.flip(dims=[1]).cumsum(dim=1).flip(dims=[1])
    return rewards / (to_go.abs().max() + 1e-6)


def implicit_prm_loss(
    prm_logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    labels: Tensor,
    *,
    beta: float,
    num_seqs: float | None = None,
    **kwargs: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PRIME's PRM loss (Cui et al. 2025, arXiv 2502.01456, Algorithm 1 line 8, L_CE, unnumbered), a cross-entropy on
    outcome labels:

        r_φ(y) = Σ_t r_φ(y_t) = β · Σ_t log(π_φ(y_t|y_<t) / π_ref(y_t|y_<t)),  p = σ(r_φ(y)),
        L_CE = −1/N · Σ_i [ y_i · log p_i + (1 − y_i) · log(1 − p_i) ],

    y_i the outcome verifier's reward of response i, 0 or 1 (a label between them is a soft label: the
    same formula). `prm_logprobs` [B, T] carries the gradient; `ref_logprobs` [B, T], `labels` [B].
    A row without response tokens (a worker's padding row) carries no loss. Under gradient accumulation
    pass the mini-batch's row count as `num_seqs` (default: this call's rows with tokens); other totals
    are ignored. Metric ``accuracy``: the share of rows whose p falls on their label's side of ½ (p = ½,
    as at the start, predicts 0).
    """
    real = response_mask.bool().any(dim=-1)
    scores = beta * masked_sum(prm_logprobs - ref_logprobs, response_mask, dim=-1)
    targets = labels.to(scores)
    per_row = F.binary_cross_entropy_with_logits(scores, targets, reduction="none")
    count = num_seqs if num_seqs is not None else real.sum().clamp(min=1)
    loss = torch.where(real, per_row, torch.zeros_like(per_row)).sum() / count
    right = ((scores.detach() > 0) == (targets > 0.5)) & real
    accuracy = right.sum() / real.sum().clamp(min=1)
    return loss, {"accuracy": accuracy.float()}
