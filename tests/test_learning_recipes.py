"""The DAPO and Dr.GRPO recipes learn the quickstart's visual task as the GRPO recipe does."""

from __future__ import annotations

import pytest

from mmrl.cli import main
from mmrl.logger import read_metrics
from mmrl.synthetic import generate


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_dapo_and_drgrpo_recipes_learn_colour_from_pixels(tmp_path, tiny_model_dir) -> None:
    data = tmp_path / "data"
    generate(data, task="color", n_train=2048, n_val=64, seed=0, image_size=112)
    gains = {}
    for recipe in ("quickstart_dapo", "quickstart_drgrpo"):
        run = tmp_path / recipe
        code = main(
            [
                "train",
                f"configs/{recipe}.yaml",
                f"model.path={tiny_model_dir}",
                f"data.train_files={data / 'train.jsonl'}",
                f"data.val_files={data / 'val.jsonl'}",
                f"trainer.output_dir={run}",
                "trainer.val_every=100",  # the recipes' own 200 steps
                "trainer.save_every=0",
                "trainer.progress=false",
                "trainer.loggers=[jsonl]",
            ]
        )
        assert code == 0, recipe
        records = read_metrics(run / "metrics.jsonl")
        val = [(r["step"], r["val/accuracy"]) for r in records if "val/accuracy" in r]
        assert [step for step, _ in val] == [0, 100, 200], recipe
        gains[recipe] = (val[0][1], val[-1][1])
    for recipe, (first, last) in gains.items():
        assert last - first >= 0.3, f"{recipe}: validation accuracy went {first:.3f} -> {last:.3f}"
    assert any(
        r.get("dynamic_sampling/filtered_groups", 0) > 0
        for r in read_metrics(tmp_path / "quickstart_dapo" / "metrics.jsonl")
    )
