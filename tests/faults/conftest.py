"""Fixtures of the fault-injection suite: the synthetic colour task and the scrambled reward, built once."""

from __future__ import annotations

from pathlib import Path

import pytest
from faultkit import SCRAMBLE

from mmrl.data.synthetic import generate


@pytest.fixture(scope="session")
def colour_task(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """64 training rows of the colour task and a reward that varies per response."""
    root = tmp_path_factory.mktemp("colour_task")
    generate(root / "data", task="color", n_train=64, n_val=16, seed=0)
    reward = root / "scramble.py"
    reward.write_text(SCRAMBLE)
    return {"train": root / "data" / "train.jsonl", "val": root / "data" / "val.jsonl", "reward": reward}
