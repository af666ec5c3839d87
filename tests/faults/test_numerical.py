"""NaN and inf losses injected through a user policy loss (`actor.policy_loss=file.py:fn`): a bad update
is skipped with a warning and leaves weights, optimizer and schedule as they were; too many bad steps in a
row stop the run with a checkpoint of the last good state, from which `--resume` continues exactly.

The loss counts its calls; with one mini-batch and one micro-batch a step, call k is step k. The state
before and after each step is copied by wrapping `Trainer.train_step` in this process.
"""

from __future__ import annotations

import copy
import logging
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from faultkit import CONFIG, max_differences, overrides, raw_records, weights

from mmrl.cli import main
from mmrl.run import checkpoint as ckpt
from mmrl.trainer import Trainer

ONE_UPDATE_A_STEP = ["actor.mini_batch_size=4", "actor.micro_batch_size=16"]

POISONED_LOSS = """
    from mmrl.algorithms import ppo_clip

    BAD = {bad}  # call number -> what the loss is multiplied by
    BAD_FROM = {bad_from}  # every call from this one on is NaN (None: none)
    calls = 0

    def poisoned(logp, old_logp, advantages, response_mask, **kwargs):
        global calls
        calls += 1
        loss, metrics = ppo_clip(logp, old_logp, advantages, response_mask, **kwargs)
        if calls in BAD:
            loss = loss * BAD[calls]
        elif BAD_FROM is not None and calls >= BAD_FROM:
            loss = loss * float("nan")
        return loss, metrics
"""


def _loss_file(folder: Path, bad: dict[int, str], bad_from: int | None = None) -> str:
    path = folder / "poisoned_loss.py"
    table = "{" + ", ".join(f"{k}: float({v!r})" for k, v in bad.items()) + "}"
    path.write_text(textwrap.dedent(POISONED_LOSS.format(bad=table, bad_from=bad_from)))
    return f"actor.policy_loss={path}:poisoned"


def _train(tiny_model_dir: Path, task: dict[str, Path], out: Path, steps: int, *extra: str) -> int:
    args = overrides(tiny_model_dir, task["train"], out, task["reward"], steps)
    return main(["train", CONFIG, *args, *ONE_UPDATE_A_STEP, *extra])


def _training_state(trainer: Trainer) -> dict[str, Any]:
    """A copy of everything an update may change: weights, optimizer moments and groups, schedule."""
    return copy.deepcopy(
        {
            "weights": trainer.policy.model.state_dict(),
            "optimizer": trainer.policy.actor.optimizer.state_dict(),
            "scheduler": trainer.policy.actor.scheduler.state_dict(),
        }
    )


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    moments_a, moments_b = a["optimizer"]["state"], b["optimizer"]["state"]
    return (
        not max_differences(a["weights"], b["weights"])
        and moments_a.keys() == moments_b.keys()
        and all(torch.equal(moments_a[p][k], moments_b[p][k]) for p in moments_a for k in moments_a[p])
        and a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
        and a["scheduler"] == b["scheduler"]
    )


@pytest.mark.timeout(300)
def test_a_nan_or_inf_update_is_skipped_and_changes_nothing(
    tmp_path, tiny_model_dir, colour_task, caplog, monkeypatch
) -> None:
    states: list[tuple[dict[str, Any], dict[str, Any]]] = []
    train_step = Trainer.train_step

    def recorded(self: Trainer) -> dict[str, Any]:
        before = _training_state(self)
        metrics = train_step(self)
        states.append((before, _training_state(self)))
        return metrics

    monkeypatch.setattr(Trainer, "train_step", recorded)
    loss = _loss_file(tmp_path, {2: "nan", 4: "inf"})
    run = tmp_path / "run"
    every_step = ["trainer.save_every=1", "trainer.keep_checkpoints=10"]
    with caplog.at_level(logging.WARNING, logger="mmrl.training.actor"):
        assert _train(tiny_model_dir, colour_task, run, 5, loss, *every_step) == 0

    records = raw_records(run)
    assert [r["actor/skipped_updates"] for r in records] == [0, 1, 0, 1, 0]
    assert [r["actor/updates"] for r in records] == [1] * 5
    warnings = [r.getMessage() for r in caplog.records if "non-finite gradient" in r.getMessage()]
    assert [w.split(":")[0] for w in warnings] == ["step 2", "step 4"]
    changed = [not _same(before, after) for before, after in states]
    assert changed == [True, False, True, False, True], "a skipped step changes nothing, bit for bit"
    # No checkpoint is written inside a run of bad steps (a stop must leave the last good state newest).
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == [
        f"step_{step:08d}" for step in (1, 3, 5)
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("first_bad", [1, 2])
def test_consecutive_bad_steps_stop_the_run_with_the_last_good_state_saved(
    tmp_path, tiny_model_dir, colour_task, capsys, first_bad: int
) -> None:
    steps = 4
    settings = [
        "trainer.max_consecutive_bad_steps=2",
        "trainer.save_every=2",
        f"data.val_files={colour_task['val']}",
        "trainer.val_before_train=true",  # a step-0 record, which a resumed run must not log again
    ]
    clean = tmp_path / "clean"
    assert _train(tiny_model_dir, colour_task, clean, steps, *settings) == 0
    capsys.readouterr()

    run = tmp_path / "run"
    loss = _loss_file(tmp_path, {}, bad_from=first_bad)
    assert _train(tiny_model_dir, colour_task, run, steps, loss, *settings) == 1
    error = " ".join(capsys.readouterr().err.split())
    good, last_bad = first_bad - 1, first_bad + 1
    assert f"steps {first_bad}-{last_bad}: every actor update had a non-finite gradient" in error
    assert "trainer.max_consecutive_bad_steps" in error and "--resume" in error
    saved = f"step_{good:08d}"
    assert saved in error
    # No periodic save was due before the fault (step 2's fell inside it and was held back): this
    # checkpoint was written for the stop, from the state before the first bad step.
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == [saved]
    assert ckpt.load_trainer_state(run / "checkpoints" / saved)["step"] == good
    assert [r["step"] for r in raw_records(run)] == list(range(last_bad + 1))

    # With the fault gone, --resume replays the rest exactly as the run that never had it.
    assert _train(tiny_model_dir, colour_task, run, steps, *settings, "--resume") == 0
    assert [r["step"] for r in raw_records(run)] == list(range(steps + 1))
    assert [r.get("data/rows") for r in raw_records(run)] == [r.get("data/rows") for r in raw_records(clean)]
    final = f"step_{steps:08d}"
    differ = max_differences(weights(clean / "checkpoints" / final), weights(run / "checkpoints" / final))
    assert not {name: d for name, d in differ.items() if d > 1e-6}
