"""The custom pixel reward of examples/custom_reward teaches the tiny model the colour task on its own: the
dataset's answer column is replaced by random colours, so the only signal about the image is the reward
computed from its pixels."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mmrl.cli import main
from mmrl.logger import read_metrics
from mmrl.synthetic import COLOURS, generate


def _hide_labels(path: Path, rng: np.random.Generator) -> None:
    """Replace each row's answer with a colour drawn independently of its image, and drop the scene params
    (which name the colour). The format warm-up still sees the answer vocabulary; nothing sees the label."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        row["answer"] = str(rng.choice(list(COLOURS)))
        del row["params"]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.slow
@pytest.mark.timeout(1500)  # ~2-4 min on a 2-core machine; generous for loaded ones
def test_pixel_reward_alone_teaches_the_colour_task(tmp_path, tiny_model_dir) -> None:
    data = tmp_path / "data"
    generate(data, task="color", n_train=2048, n_val=64, seed=0, image_size=112)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        _hide_labels(data / f"{split}.jsonl", rng)
    run = tmp_path / "run"
    code = main(
        [
            "train",
            "examples/custom_reward/config.yaml",
            f"model.path={tiny_model_dir}",
            f"data.train_files={data / 'train.jsonl'}",
            f"data.val_files={data / 'val.jsonl'}",
            f"trainer.output_dir={run}",
            "trainer.val_every=100",
            "trainer.save_every=0",
            "trainer.progress=false",
            "trainer.loggers=[jsonl]",
        ]
    )
    assert code == 0
    val = [r for r in read_metrics(run / "metrics.jsonl") if "val/accuracy" in r]
    assert [r["step"] for r in val] == [0, 100, 200]
    assert all(r["val/accuracy"] == r["val/dominant_colour"] for r in val), "accuracy is the pixel reward"
    first, last = val[0]["val/accuracy"], val[-1]["val/accuracy"]
    assert first < 0.35, f"the warm-up alone should leave accuracy near chance (1/6), got {first}"
    assert last - first >= 0.3, f"validation accuracy went {first:.3f} -> {last:.3f}"
    assert val[-1]["val/dominant_colour/answer_given"] > 0.9
