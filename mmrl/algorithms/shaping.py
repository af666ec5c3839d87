"""Reward shaping by response length: DAPO's soft overlong punishment (Yu et al. 2025).

A truncated response is cut mid-thought, and scoring it like a finished one teaches the
model nothing about length; a hard −1 is too abrupt a cliff. DAPO ramps the penalty in
linearly over the last `buffer_len` tokens of the budget.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def overlong_penalty(lengths: Tensor, max_len: int, buffer_len: int, factor: float) -> Tensor:
    """R_length(|y|) · factor, float32 [B], with L_max = `max_len`, L_cache = `buffer_len`:

    0 if |y| ≤ L_max − L_cache; ((L_max − L_cache) − |y|) / L_cache inside the buffer;
    −1 beyond L_max. The result is added to each response's score.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"buffer_len must be in (0, max_len={max_len}], got {buffer_len}")
    expected = max_len - buffer_len
    ramp = (expected - lengths.float()) / buffer_len
    return ramp.clamp(-1.0, 0.0) * factor
