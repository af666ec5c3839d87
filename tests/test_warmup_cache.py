"""`warmup.cache_dir`: a run that reuses a cached warm-up trains exactly as one that makes its own, and
anything the warm-up reads (weights, rows, warm-up settings, seed) gives another key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mmrl.cli import main
from mmrl.config import load_config
from mmrl.data.synthetic import generate
from mmrl.run.logger import read_metrics
from mmrl.run.warmup_cache import LOSSES, restore, warmup_key


def _config_args(model: Path, data: Path, out: Path, *overrides: str) -> list[str]:
    return [
        "configs/quickstart.yaml",
        f"model.path={model}",
        f"data.train_files={data / 'train.jsonl'}",
        "data.val_files=[]",
        f"trainer.output_dir={out}",
        "data.train_batch_size=4",
        "actor.mini_batch_size=4",
        "rollout.n=2",
        "warmup.steps=3",
        "warmup.batch_size=8",
        "trainer.total_steps=2",
        "trainer.save_every=0",
        "trainer.progress=false",
        "trainer.loggers=[jsonl]",
        *overrides,
    ]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("warmup_cache") / "data"
    generate(root, task="color", n_train=16, n_val=0, seed=0, image_size=56)
    return root


def _learning(out: Path) -> list[dict]:
    """A run's records without the ones that measure the machine (time, memory)."""
    return [
        {k: v for k, v in r.items() if not k.startswith(("timing/", "throughput/", "memory/"))}
        for r in read_metrics(out / "metrics.jsonl")
    ]


def test_a_reused_warm_up_trains_as_one_made_in_the_run(tmp_path, tiny_model_dir, data, capsys) -> None:
    cache = f"warmup.cache_dir={tmp_path / 'cache'}"
    runs = {name: tmp_path / name for name in ("own", "stores", "reuses", "other_lr")}
    assert main(["train", *_config_args(tiny_model_dir, data, runs["own"])]) == 0
    assert main(["train", *_config_args(tiny_model_dir, data, runs["stores"], cache)]) == 0
    assert "reused" not in capsys.readouterr().out
    # Another learning rate for RL reads the same warm-up: a hit.
    assert main(["train", *_config_args(tiny_model_dir, data, runs["reuses"], cache)]) == 0
    assert main(["train", *_config_args(tiny_model_dir, data, runs["other_lr"], cache, "actor.lr=5e-4")]) == 0
    assert capsys.readouterr().out.count("format warm-up: reused") == 2
    assert _learning(runs["reuses"]) == _learning(runs["own"])
    assert _learning(runs["other_lr"]) != _learning(runs["own"])
    (entry,) = (tmp_path / "cache").iterdir()
    assert json.loads((entry / LOSSES).read_text())[-1] < json.loads((entry / LOSSES).read_text())[0]
    # The run's folder holds its starting weights itself, so it resumes without the cache.
    shutil.rmtree(tmp_path / "cache")
    assert (runs["reuses"] / "warmup_model" / "config.json").exists()


def test_the_key_changes_with_everything_the_warm_up_reads(tmp_path, tiny_model_dir, data) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)

    def key(*overrides: str) -> str:
        config, *args = _config_args(model, data, tmp_path / "run", *overrides)
        return warmup_key(load_config(config, args))

    base = key()
    assert key("actor.lr=5e-4", "algorithm.adv_estimator=rloo", "trainer.total_steps=9") == base
    assert key("data.train_batch_size=8", "data.max_val_samples=4") == base  # RL's batch, validation's rows
    assert key("trainer.output_dir=/elsewhere") == base  # paths do not count, contents do
    for changed in ("warmup.lr=1e-2", "warmup.steps=4", "trainer.seed=2", "data.max_prompt_length=100"):
        assert key(changed) != base, changed
    (model / "config.json").write_text((model / "config.json").read_text() + "\n")
    assert key() != base, "a changed model file must miss"
    rows = data / "train.jsonl"
    copy = tmp_path / "rows.jsonl"
    copy.write_text(rows.read_text().replace('"red"', '"blue"', 1))
    assert key(f"data.train_files={copy}") != key(f"data.train_files={rows}")


def test_an_unfinished_entry_is_a_miss(tmp_path) -> None:
    (tmp_path / "abc").mkdir()
    (tmp_path / "abc" / "config.json").write_text("{}")  # a store that died before its losses file
    assert restore(tmp_path, "abc", tmp_path / "target") is None
    assert not (tmp_path / "target").exists()
