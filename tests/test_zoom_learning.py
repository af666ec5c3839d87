"""RL teaches the tiny policy to use `image_zoom` (`configs/quickstart_agent.yaml` at the size
`learning_runs.RUNS["zoom"]` gives): from a warm-up that calls the tool on boxes and names colours drawn
independently of the image, greedy play on held-out scenes comes to zoom onto the mark and its accuracy
leaves chance, which a policy that never zooms cannot (`bench/zoom_locate.py`: 0.33 at every validation).

Measured under the suite's AVX2 pin on the 2-core AMD EPYC VM (2026-12-06, docs/benchmarks.md "The zoom
run with each turn weighed alike"): seed 1 reads 0.33, 0.33, 0.33, 0.67 at steps 0, 5, 10, 15, where
the run stops, with greedy useful zooms 1.00 from step 5; run on, it reads 1.00 from step 25."""

from __future__ import annotations

import pytest
from learning_runs import RUNS, train_until_learned, validations


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.xdist_group("zoom")  # test_agent_resume.py follows on this worker and reuses its warm-up
def test_grpo_teaches_the_agent_quickstart_to_zoom_and_read(tmp_path, tiny_model_dir) -> None:
    run = RUNS["zoom"]
    trained = train_until_learned("zoom", tmp_path, tiny_model_dir)  # the first seed that reads the crop
    records, first, last, seed = trained.records, trained.first, trained.last, trained.seed
    assert run.chance is not None
    assert first <= run.chance + 0.01, (
        f"the warm-up alone should not read the mark: held-out accuracy {first}"
    )
    assert run.gain(first, last) >= run.min_gain, (
        f"held-out accuracy went {first:.2f} -> {last:.2f} (seed {seed})"
    )
    zooms = validations(records, "val/zoom_hit")  # greedy zooms tight around the mark, held-out scenes
    assert zooms[-1][1] >= 0.9, (
        f"held-out accuracy rose, yet greedy play misses the mark (useful zooms): {zooms}"
    )
