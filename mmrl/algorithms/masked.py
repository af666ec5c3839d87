"""Reductions over the valid (unpadded) tokens only.

`torch.where` rather than multiplying by the mask, so non-finite junk in padding
(e.g. -inf log-probs) cannot leak in as NaN = inf * 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

# A float32 square overflows past ~1.8e19: values this large get their spread computed in float64, or σ
# would be inf and every advantage 0. Ordinary values stay float32, so runs keep their exact numbers.
WIDE_BEYOND = 1e18


def wide_enough(values: Tensor) -> Tensor:
    """`values` in float64 when squaring them in float32 could overflow, else as they are."""
    finite = values[values.isfinite()]
    return values.double() if finite.numel() and float(finite.abs().max()) > WIDE_BEYOND else values


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ values over positions where mask is set (all positions if `dim` is None)."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over valid positions; an empty selection gives 0 rather than NaN."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """(x − μ) / (σ + eps) with μ and the unbiased σ over all valid positions; 0 on padding.

    A constant input (σ = 0, e.g. a single valid token) gives 0, even with eps = 0.
    """
    mask, dtype, values = mask.bool(), values.dtype, wide_enough(values)
    mean = masked_mean(values, mask)
    centred = torch.where(mask, values - mean, torch.zeros_like(values))
    variance = centred.square().sum() / (mask.sum() - 1).clamp(min=1)
    std = variance.sqrt()
    return torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred)).to(dtype)
