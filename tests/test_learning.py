"""GRPO makes tiny random-init Qwen2.5-VL and Qwen3-VL models learn visual tasks (images, and videos):
accuracy rises from chance.

Each run is its recipe at test size (`learning_runs.RUNS`); the thresholds keep a margin below the worst
gain measured over seeds and x86 numerics (`bench/learning_spread.py`, figures in docs/benchmarks.md).
"""

from __future__ import annotations

import pytest
from learning_runs import RUNS, train, validations


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_quickstart_recipe_learns(tmp_path, tiny_model_dir) -> None:
    """The README's quickstart at test size. On two FSDP2 workers the same update is exact to one
    process's (tests/test_distributed.py), so the learning run itself takes one process and one core."""
    _learns("grpo", tmp_path, tiny_model_dir)


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
@pytest.mark.timeout(1500)
def test_quickstart_recipe_learns_with_rollouts_one_update_behind(
    local_ray, tmp_path, tiny_model_dir
) -> None:
    """`rollout.max_staleness=1`: every batch after the first is sampled by the policy before the last
    update, and the run learns as the synchronous GRPO run does (the same threshold)."""
    _learns("async", tmp_path, tiny_model_dir)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_video_quickstart_learns_the_colour_a_dot_ends_as(tmp_path, tiny_model_dir) -> None:
    """From chance (1/4): the dot shows two colours, and only the frames' order says which is the last."""
    val = _learns("video", tmp_path, tiny_model_dir)
    assert val[0][1] == pytest.approx(0.25, abs=0.1), f"should start at chance: {val}"
    gallery_page = tmp_path / "run" / "gallery" / f"step_{RUNS['video'].steps:08d}.html"
    assert "<img" in gallery_page.read_text(), "the gallery should show the clips"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_quickstart_recipe_learns_colour_with_a_tiny_qwen3_vl(tmp_path, tiny_family_dir) -> None:
    """The quickstart's recipe with Qwen3-VL's architecture (DeepStack features, 32-pixel grid,
    interleaved mRoPE) learns from chance, writing its reward curve and a validation gallery. The
    recipe's Qwen2.5-VL runs learn in test_quickstart_recipe_learns and
    tests/test_learning_recipes.py."""
    _learns("qwen3_vl", tmp_path, tiny_family_dir("qwen3_vl"))
    steps = RUNS["qwen3_vl"].steps
    run = tmp_path / "run"
    assert (run / "reward_curve.png").stat().st_size > 0
    gallery = run / "gallery"
    assert {p.name for p in gallery.glob("step_*.html")} == {f"step_{s:08d}.html" for s in (0, steps)}
    assert f"step_{steps:08d}.html" in (gallery / "index.html").read_text()


def _learns(name: str, tmp_path, model_dir) -> list[tuple[int, float]]:
    """Train run `name`; validation accuracy must start near chance (1/6 for the colour task, 1/4 for the
    video's) and rise by the run's `min_gain`."""
    run = RUNS[name]
    val = validations(train(name, tmp_path, model_dir))
    (first_step, first), (last_step, last) = val[0], val[-1]
    assert (first_step, last_step) == (0, run.steps)
    assert first < 0.35, f"the warm-up alone should leave accuracy near chance, got {first}"
    assert last - first >= run.min_gain, f"{name}: validation accuracy went {first:.3f} -> {last:.3f}"
    return val
