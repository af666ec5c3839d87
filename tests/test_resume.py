"""A run stopped at step 3 and resumed with `--resume` ends exactly where an uninterrupted run does.

Both runs go through the public CLI on a tiny random-init model and the synthetic colour task.
A random-init model never answers a colour, so the quickstart's answer_match reward would be
0 for every response, every advantage 0 and the comparison nearly vacuous; the runs here use a
reward that scores each response text differently, so every update depends on what was sampled
and a resume that lost the RNG, the loader cursor or the optimizer state would end elsewhere.
"""

from __future__ import annotations

import json
import pickletools
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from mmrl.cli import main
from mmrl.data.synthetic import generate
from mmrl.models import load_policy
from mmrl.run import checkpoint as ckpt
from mmrl.run.logger import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("resume")]  # one worker shares the runs

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml")
STEPS = 6
REWARD = '''
def scramble(sample, **kwargs):
    """A score that differs between response texts, so advantages are never all zero."""
    return (sum(map(ord, sample.response)) * 7919 % 101) / 100
'''


def _overrides(env: dict[str, Path], out: Path, steps: int) -> list[str]:
    return [
        f"model.path={env['model']}",
        f"data.train_files={env['data'] / 'train.jsonl'}",
        f"data.val_files={env['data'] / 'val.jsonl'}",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={steps}",
        "trainer.save_every=3",
        # The run is stopped by lowering total_steps, which would reshape a cosine schedule (it spans
        # total_steps by design); a constant schedule keeps the two runs comparable.
        "actor.lr_schedule=constant",
        "trainer.val_every=0",
        "trainer.val_before_train=false",
        "warmup.steps=2",
        "warmup.batch_size=8",
        "data.train_batch_size=4",
        "actor.mini_batch_size=2",  # two optimizer steps per batch: old log-probs are recomputed
        "rollout.n=4",
        f'reward.functions=[{{name: "{env["reward"]}:scramble"}}]',
        "trainer.loggers=[jsonl]",
        "trainer.progress=false",
    ]


def _lines(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resume")
    generate(root / "data", task="color", n_train=64, n_val=16, seed=0)
    reward = root / "reward.py"
    reward.write_text(REWARD)
    return {"root": root, "model": tiny_model_dir, "data": root / "data", "reward": reward}


@pytest.fixture(scope="module")
def runs(env: dict[str, Path]) -> dict[str, Any]:
    root = env["root"]
    a, b = root / "a", root / "b"
    assert main(["train", CONFIG, *_overrides(env, a, STEPS)]) == 0

    assert main(["train", CONFIG, *_overrides(env, b, 3)]) == 0
    first_leg = {
        "checkpoints": [p.name for p in ckpt.list_checkpoints(b / "checkpoints")],
        "state_step": ckpt.load_trainer_state(b / "checkpoints" / "step_00000003")["step"],
        "lines": _lines(b),
    }
    assert main(["train", CONFIG, *_overrides(env, b, STEPS), "--resume"]) == 0
    return {"a": a, "b": b, "first_leg": first_leg}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_policy(run / "checkpoints" / f"step_{STEPS:08d}" / "model").state_dict()


def test_resumed_run_ends_with_the_same_weights(runs) -> None:
    a, b = _weights(runs["a"]), _weights(runs["b"])
    assert a.keys() == b.keys()
    worst = {name: float((a[name] - b[name]).abs().max()) for name in a}
    off = {name: diff for name, diff in worst.items() if diff > 1e-6}
    assert not off, f"tensors that differ after resume: {off}"


def test_training_moved_the_weights(runs) -> None:
    """Guards the comparison above against passing because nothing was learned."""
    start = load_policy(runs["a"] / "warmup_model").state_dict()
    end = _weights(runs["a"])
    moved = [name for name in start if not torch.allclose(start[name], end[name], atol=1e-5)]
    assert len(moved) > len(start) // 2
    records = read_metrics(runs["a"] / "metrics.jsonl")
    assert any(r["reward/std"] > 0 for r in records)
    assert any(abs(r["actor/pg_loss"]) > 0 for r in records)


def test_both_runs_see_the_same_rows_every_step(runs) -> None:
    a = read_metrics(runs["a"] / "metrics.jsonl")
    b = read_metrics(runs["b"] / "metrics.jsonl")
    assert [r["step"] for r in a] == list(range(1, STEPS + 1))
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    rows_a = [r["data/rows"] for r in a]
    assert rows_a == [r["data/rows"] for r in b]
    assert all(len(rows) == 4 for rows in rows_a)
    # 6 steps x 4 rows from a 64-row epoch: 24 distinct rows, none repeated.
    flat = [i for rows in rows_a for i in rows]
    assert len(set(flat)) == len(flat) == 24


def test_resumed_steps_reproduce_the_same_rewards(runs) -> None:
    a = read_metrics(runs["a"] / "metrics.jsonl")
    b = read_metrics(runs["b"] / "metrics.jsonl")
    for ra, rb in zip(a, b, strict=True):
        assert rb["reward/mean"] == pytest.approx(ra["reward/mean"], abs=1e-6), ra["step"]
        assert rb["actor/pg_loss"] == pytest.approx(ra["actor/pg_loss"], abs=1e-5), ra["step"]


def test_second_invocation_really_resumed(runs) -> None:
    first = runs["first_leg"]
    assert first["checkpoints"] == ["step_00000003"]
    assert first["state_step"] == 3
    assert [r["step"] for r in first["lines"]] == [1, 2, 3]
    lines = _lines(runs["b"])
    # Steps 1-3 were written by the first call and not redone: the file just continues.
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    assert lines[:3] == first["lines"]
    assert [p.name for p in ckpt.list_checkpoints(runs["b"] / "checkpoints")] == [
        "step_00000003",
        "step_00000006",
    ]
    assert ckpt.load_trainer_state(runs["b"] / "checkpoints" / "step_00000006")["step"] == STEPS


def test_resume_without_a_checkpoint_starts_fresh(env, runs) -> None:
    out = env["root"] / "fresh"
    overrides = [*_overrides(env, out, 1), "warmup.steps=0"]
    assert main(["train", CONFIG, *overrides, "--resume"]) == 0
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1]
    # It started at the beginning of the data stream, like the uninterrupted run.
    assert records[0]["data/rows"] == read_metrics(runs["a"] / "metrics.jsonl")[0]["data/rows"]
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step_00000001"]


def test_a_checkpoint_names_no_mmrl_module(runs) -> None:
    """trainer_state.pt pickles only the standard library, numpy and torch, so a checkpoint written
    before a module moved still resumes after it (the layer folders of 2026-12 moved every module)."""
    with zipfile.ZipFile(ckpt.latest_checkpoint(runs["b"] / "checkpoints") / "trainer_state.pt") as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    modules = {arg.split()[0] for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}
    assert modules and not any(m.startswith("mmrl") for m in modules), modules
