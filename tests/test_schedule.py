"""The learning-rate schedule: linear warm-up, then constant or cosine to the floor."""

from __future__ import annotations

import itertools
import math

import pytest

from mmrl.config import ActorConfig
from mmrl.training.optim import lr_factor


def test_warmup_is_linear_then_constant() -> None:
    cfg = ActorConfig(warmup_steps=4)
    assert [lr_factor(u, cfg, total=10) for u in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decays_from_one_to_the_floor() -> None:
    cfg = ActorConfig(warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(2, cfg, total=12) == pytest.approx(1.0)
    # halfway through the 10 decay steps: 0.1 + 0.9 * 0.5 * (1 + cos(pi / 2)) = 0.55
    assert lr_factor(7, cfg, total=12) == pytest.approx(0.55)
    assert lr_factor(12, cfg, total=12) == pytest.approx(0.1)
    assert lr_factor(50, cfg, total=12) == pytest.approx(0.1)  # past the end it stays at the floor
    values = [lr_factor(u, cfg, total=12) for u in range(2, 13)]
    assert all(a >= b for a, b in itertools.pairwise(values))
    assert not math.isclose(values[1], values[0])
