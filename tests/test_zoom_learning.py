"""RL teaches the tiny policy to use `image_zoom` (`configs/quickstart_agent.yaml` at the size
`learning_runs.RUNS["zoom"]` gives): from a warm-up that calls the tool on boxes and names colours drawn
independently of the image, zooms onto the mark grow common and held-out accuracy leaves chance, which a
policy that never zooms cannot (`bench/zoom_locate.py`: 0.33 at every validation)."""

from __future__ import annotations

import pytest
from learning_runs import RUNS, rise, train


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_grpo_teaches_the_agent_quickstart_to_zoom_and_read(tmp_path, tiny_model_dir) -> None:
    run = RUNS["zoom"]
    records = train("zoom", tmp_path, tiny_model_dir)
    _, first, last = rise(run, records)
    chance = 1 / 3  # the no-tool policy's, at every validation (bench/zoom_locate.py)
    assert first <= chance + 0.01, f"the warm-up alone should not read the mark: held-out accuracy {first}"
    assert last - chance >= run.min_gain, f"held-out accuracy went {first:.2f} -> {last:.2f}"
    hits = [r["reward/zoom_hit"] for r in records if "reward/zoom_hit" in r]
    early, late = sum(hits[:5]) / 5, sum(hits[-5:]) / 5
    assert late - early >= 0.3, f"useful zooms (sampled) went {early:.2f} -> {late:.2f}"
