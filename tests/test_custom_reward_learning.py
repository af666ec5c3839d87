"""The custom pixel reward of examples/custom_reward teaches the tiny model the colour task on its own: the
dataset's answer column is replaced by random colours (`learning_runs.hidden_colour_task`), so the only
signal about the image is the reward computed from its pixels."""

from __future__ import annotations

import pytest
from learning_runs import RUNS, train_until_learned


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_pixel_reward_alone_teaches_the_colour_task(tmp_path, tiny_model_dir) -> None:
    run = RUNS["custom_reward"]
    trained = train_until_learned("custom_reward", tmp_path, tiny_model_dir)
    records, first, last = trained.records, trained.first, trained.last
    val = [r for r in records if "val/accuracy" in r]
    assert all(r["val/accuracy"] == r["val/dominant_colour"] for r in val), "accuracy is the pixel reward"
    assert first < 0.35, f"the warm-up alone should leave accuracy near chance (1/6), got {first}"
    assert last - first >= run.min_gain, f"validation accuracy went {first:.3f} -> {last:.3f}"
    assert val[-1]["val/dominant_colour/answer_given"] > 0.9
