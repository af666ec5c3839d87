"""GRPO makes tiny random-init Qwen2.5-VL and Qwen3-VL models learn visual tasks (images, and videos):
accuracy rises from chance.

Each run is its recipe at test size (`learning_runs.RUNS`); the thresholds keep a margin below the worst
gain measured over seeds and x86 numerics (`bench/learning_spread.py`, figures in docs/benchmarks.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from learning_runs import RUNS, train_until_learned

from mmrl.run.logger import read_metrics


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
    update, and the run still learns: at least the first colour beyond the warm-up's."""
    _learns("async", tmp_path, tiny_model_dir)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_video_quickstart_learns_the_colour_a_dot_ends_as(tmp_path, tiny_model_dir) -> None:
    """From chance (1/4): the dot shows two colours, and only the frames' order says which is the last."""
    run, last_step, first = _learns("video", tmp_path, tiny_model_dir)
    assert first == pytest.approx(0.25, abs=0.1), f"should start at chance: {first}"
    gallery_page = run / "gallery" / f"step_{last_step:08d}.html"
    assert "<img" in gallery_page.read_text(), "the gallery should show the clips"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_quickstart_recipe_learns_colour_with_a_tiny_qwen3_vl(tmp_path, tiny_family_dir) -> None:
    """The quickstart's recipe with Qwen3-VL's architecture (DeepStack features, 32-pixel grid,
    interleaved mRoPE) learns from chance, writing its reward curve and a validation gallery. The
    recipe's Qwen2.5-VL runs learn in test_quickstart_recipe_learns and
    tests/test_learning_recipes.py."""
    run, last_step, _ = _learns("qwen3_vl", tmp_path, tiny_family_dir("qwen3_vl"))
    assert (run / "reward_curve.png").stat().st_size > 0
    gallery = run / "gallery"
    validated = {r["step"] for r in read_metrics(run / "metrics.jsonl") if "val/accuracy" in r}
    assert {p.name for p in gallery.glob("step_*.html")} == {f"step_{s:08d}.html" for s in validated}
    assert f"step_{last_step:08d}.html" in (gallery / "index.html").read_text()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_quickstart_recipe_takes_a_tiny_llava_onevision_from_chance_to_0_8(tmp_path, tiny_family_dir) -> None:
    """The quickstart's recipe on a family outside the Qwen line (SigLIP crops at any resolution, image
    newlines, 1-D positions) learns the colour task from chance to 0.8 held-out accuracy."""
    run, last_step, first = _learns("llava_onevision", tmp_path, tiny_family_dir("llava_onevision"))
    final = [r["val/accuracy"] for r in read_metrics(run / "metrics.jsonl") if r["step"] == last_step]
    assert first == pytest.approx(1 / 6, abs=0.05) and final[-1] >= 0.8, (first, final)


def _learns(name: str, tmp_path: Path, model_dir: Path) -> tuple[Path, int, float]:
    """Train run `name`; validation accuracy must start near chance (1/6 for the colour task, 1/4 for the
    video's) and rise by the run's `min_gain`, at the first of its seeds that does. The run's folder, the
    step it ended at, and where it started."""
    run = RUNS[name]
    trained = train_until_learned(name, tmp_path, model_dir)
    first, last = trained.first, trained.last
    assert first < 0.35, f"the warm-up alone should leave accuracy near chance, got {first}"
    assert run.gain(first, last) >= run.min_gain, (
        f"{name}: validation accuracy went {first:.3f} -> {last:.3f} (seed {trained.seed}, the last tried)"
    )
    return trained.root / "run", trained.last_step, first
