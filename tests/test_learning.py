"""GRPO makes a tiny random-init Qwen2.5-VL learn visual tasks (images, and videos): accuracy rises from chance."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmrl.cli import main
from mmrl.logger import read_metrics
from mmrl.synthetic import generate
from mmrl.synthetic_video import generate_motion


@pytest.mark.slow
@pytest.mark.timeout(1500)  # ~2 min on an idle 2-core machine; generous for loaded ones
def test_quickstart_recipe_learns_colour_from_pixels(tmp_path, tiny_model_dir) -> None:
    _learns(tmp_path, tiny_model_dir)


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
@pytest.mark.timeout(1500)  # ~3 min on an idle 2-core machine
def test_quickstart_recipe_learns_with_two_fsdp_workers(local_ray, tmp_path, tiny_model_dir) -> None:
    _learns(tmp_path, tiny_model_dir, "trainer.n_gpus_per_node=2")


def _learns(tmp_path: Path, tiny_model_dir: Path, *extra: str) -> None:
    data = tmp_path / "data"
    generate(data, task="color", n_train=2048, n_val=64, seed=0, image_size=112)
    # The recipe's own 200 steps; the breakthrough comes between 75 and 125.
    val = _train("configs/quickstart.yaml", data, tmp_path / "run", tiny_model_dir, *extra)
    (first_step, first), (last_step, last) = val[0], val[-1]
    assert (first_step, last_step) == (0, 200)
    assert first < 0.35, f"the warm-up alone should leave accuracy near chance (1/6), got {first}"
    assert last - first >= 0.3, f"validation accuracy went {first:.3f} -> {last:.3f}"
    run = tmp_path / "run"
    assert (run / "reward_curve.png").stat().st_size > 0
    gallery = run / "gallery"
    assert {p.name for p in gallery.glob("step_*.html")} == {f"step_{s:08d}.html" for s in (0, 100, 200)}
    assert "step_00000200.html" in (gallery / "index.html").read_text()


@pytest.mark.slow
@pytest.mark.timeout(1500)  # ~3.5 min on an idle 2-core machine
def test_video_quickstart_learns_which_way_the_dot_moves(tmp_path, tiny_model_dir) -> None:
    """From chance (1/4) to at least 0.8: the answer is only in the motion across frames."""
    data = tmp_path / "data"
    generate_motion(data, n_train=2048, n_val=64, seed=0)
    val = _train("configs/quickstart_video.yaml", data, tmp_path / "run", tiny_model_dir)
    assert val[0] == (0, pytest.approx(0.25, abs=0.1)), f"should start at chance: {val}"
    assert val[-1][0] == 200 and val[-1][1] >= 0.8, f"validation accuracy {val}"
    gallery_page = tmp_path / "run" / "gallery" / "step_00000200.html"
    assert "<img" in gallery_page.read_text(), "the gallery should show the clips"


def _train(config: str, data: Path, run: Path, model: Path, *extra: str) -> list[tuple[int, float]]:
    """`mmrl train` on the recipe with validation every 100 steps; the (step, accuracy) record."""
    code = main(
        [
            "train",
            config,
            f"model.path={model}",
            f"data.train_files={data / 'train.jsonl'}",
            f"data.val_files={data / 'val.jsonl'}",
            f"trainer.output_dir={run}",
            "trainer.val_every=100",
            "trainer.save_every=0",
            "trainer.progress=false",
            "trainer.loggers=[jsonl]",
            *extra,
        ]
    )
    assert code == 0
    return [
        (r["step"], r["val/accuracy"]) for r in read_metrics(run / "metrics.jsonl") if "val/accuracy" in r
    ]
