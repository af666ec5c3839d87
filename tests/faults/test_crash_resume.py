"""`kill -9` a training run mid-checkpoint and at a random point, resume it twice, and get exactly the run
that was never interrupted: the same final weights, the same data rows at every step, and a metrics log
with each step once.

The first leg is stopped inside a checkpoint write: a child started with `python -c` wraps
`mmrl.run.checkpoint._fsync_tree` so that, for one save, it signals and sleeps once every file but the
manifest is written, and the test kills it there. That leaves the torn folder a real crash leaves.
The second leg is killed at a seeded random moment. A finished-looking checkpoint folder whose files
do not match its manifest (what a crash can leave on a file system that reorders writes) is planted
too; it must be passed over.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from faultkit import (
    CONFIG,
    finish,
    max_differences,
    overrides,
    raw_records,
    start,
    train_argv,
    wait_until,
    weights,
)

from mmrl.run import checkpoint as ckpt
from mmrl.run.resume import truncate_metrics

STEPS = 8
SAVE = ["trainer.save_every=2", "trainer.keep_checkpoints=3"]
HANG_AT_SAVE = 4  # the first leg dies while writing this step's checkpoint
SEED = 20240611  # picks the second leg's kill point

# Runs `mmrl train ARGS...` with a save that hangs, after writing everything but its manifest, once
# the checkpoint of step $HANG_AT is being written; $SIGNAL_FILE tells the test where.
HANGING_SAVE = """
import os, sys, time
from pathlib import Path
from mmrl.run import checkpoint
from mmrl.cli import main

real_fsync_tree = checkpoint._fsync_tree
hang_prefix = f"{checkpoint.TMP_PREFIX}{int(os.environ['HANG_AT']):08d}_"

def fsync_then_hang(folder):
    real_fsync_tree(folder)
    if folder.name.startswith(hang_prefix):
        Path(os.environ["SIGNAL_FILE"]).write_text(str(folder))
        time.sleep(600)

checkpoint._fsync_tree = fsync_then_hang
sys.exit(main(["train", *sys.argv[1:]]))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, colour_task) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("crash")
    log = root / "children.log"

    def args(out: Path) -> list[str]:
        return [*overrides(tiny_model_dir, colour_task["train"], out, colour_task["reward"], STEPS), *SAVE]

    reference, crashed = root / "reference", root / "crashed"
    assert finish(start(train_argv(args(reference)), log), log) == 0, log.read_text()

    # Leg 1: killed while the step-4 checkpoint is half written.
    signal_file = root / "saving"
    child = start(
        ["-c", HANGING_SAVE, CONFIG, *args(crashed)],
        log,
        {"HANG_AT": str(HANG_AT_SAVE), "SIGNAL_FILE": str(signal_file)},
    )
    wait_until(signal_file.exists, child, log)
    torn_tmp = Path(signal_file.read_text())
    child.send_signal(signal.SIGKILL)
    assert finish(child, log) == -signal.SIGKILL
    after_first = {
        "tmp_exists": torn_tmp.is_dir(),
        "tmp_has_manifest": (torn_tmp / ckpt.MANIFEST).exists(),
        "tmp_files": sorted(p.name for p in torn_tmp.iterdir()),
        "latest": ckpt.latest_checkpoint(crashed / "checkpoints"),
        "steps_logged": [r["step"] for r in raw_records(crashed)],
    }
    latest = after_first["latest"]
    after_first["latest_state_step"] = ckpt.load_trainer_state(latest)["step"]
    after_first["latest_weights"] = weights(latest)
    planted = _plant_torn_checkpoint(latest, crashed / "checkpoints" / "step_00000003")

    # Leg 2: resumed, then killed at a seeded random moment: up to 0.2 s after it logged step 5 or 6
    # (mid-step, mid-save or mid-log), early enough that steps 7 and 8 are still to come. Steps the
    # first leg logged (up to 4) cannot trigger it before the resumed run has dropped them.
    rng = random.Random(SEED)
    kill_after, delay = rng.randint(5, 6), rng.uniform(0.0, 0.2)
    child = start(train_argv([*args(crashed), "--resume"]), log)
    wait_until(lambda: any(r["step"] >= kill_after for r in _readable(crashed)), child, log)
    time.sleep(delay)
    child.send_signal(signal.SIGKILL)
    assert finish(child, log) == -signal.SIGKILL, "the second leg ended before it could be killed"
    steps_after_second = [r["step"] for r in raw_records(crashed)]

    # Leg 3: resumed to the end.
    final = start(train_argv([*args(crashed), "--resume"]), log)
    assert finish(final, log) == 0, log.read_text()
    return {
        "reference": reference,
        "crashed": crashed,
        "after_first": after_first,
        "planted": planted,
        "kill_after": kill_after,
        "steps_after_second": steps_after_second,
        "log": log.read_text(),
    }


def _readable(run: Path) -> list[dict[str, Any]]:
    """Records of a log another process is appending to; a half-written last line is skipped."""
    path = run / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except ValueError:
            break
    return records


def _plant_torn_checkpoint(good: Path, torn: Path) -> Path:
    """A `step_*` folder with a manifest whose weights file is cut short."""
    shutil.copytree(good, torn)
    weights_file = next((torn / "model").glob("*.safetensors"))
    data = weights_file.read_bytes()
    weights_file.write_bytes(data[: len(data) // 2])
    return torn


def _kill_during_a_checkpoint_write_leaves_a_torn_folder_that_is_ignored(runs: dict[str, Any]) -> None:
    first = runs["after_first"]
    assert first["tmp_exists"], "the kill should have left the half-written folder behind"
    assert not first["tmp_has_manifest"]
    assert "trainer_state.pt" in first["tmp_files"]
    assert first["latest"].name == "step_00000002", "the newest complete checkpoint precedes the torn one"
    assert first["latest_state_step"] == 2
    assert first["latest_weights"], "the newest complete checkpoint loads"
    assert first["steps_logged"] == [1, 2, 3, 4]  # logged before the save that died


def _resume_ignores_torn_checkpoints_and_cleans_up_dead_writes(runs: dict[str, Any]) -> None:
    checkpoints = runs["crashed"] / "checkpoints"
    assert "ignoring torn checkpoint" in runs["log"] and "step_00000003" in runs["log"]
    assert "resumed from" in runs["log"]
    assert not list(checkpoints.glob(f"{ckpt.TMP_PREFIX}*")), "dead writers' folders are removed on resume"
    assert runs["planted"].is_dir() and not ckpt.is_complete(runs["planted"])
    assert ckpt.latest_checkpoint(checkpoints).name == f"step_{STEPS:08d}"


def _twice_killed_run_ends_with_the_uninterrupted_weights(runs: dict[str, Any]) -> None:
    final = f"step_{STEPS:08d}"
    reference = weights(runs["reference"] / "checkpoints" / final)
    resumed = weights(runs["crashed"] / "checkpoints" / final)
    off = {name: diff for name, diff in max_differences(reference, resumed).items() if diff > 1e-6}
    assert not off, f"tensors that differ after two kills and resumes: {off}"
    start_weights = runs["after_first"]["latest_weights"]
    assert len(max_differences(start_weights, reference)) > len(reference) // 2, "training moved the weights"


def _metrics_log_has_every_step_once_and_the_same_rows(runs: dict[str, Any]) -> None:
    assert max(runs["steps_after_second"]) >= runs["kill_after"], "the second leg was killed mid-run"
    reference = raw_records(runs["reference"])
    crashed = raw_records(runs["crashed"])
    assert [r["step"] for r in crashed] == list(range(1, STEPS + 1)), "no duplicate or lost steps"
    assert [r["data/rows"] for r in crashed] == [r["data/rows"] for r in reference]
    for a, b in zip(reference, crashed, strict=True):
        assert b["reward/mean"] == pytest.approx(a["reward/mean"], abs=1e-6), a["step"]
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], abs=1e-5), a["step"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_killed_twice_resumes_to_the_uninterrupted_run(runs) -> None:
    """One test over the three legs, so one worker runs them (`--dist loadgroup` does not keep a group on
    one worker under pytest 9.2 and xdist 3.8, and each worker would run the legs again)."""
    _kill_during_a_checkpoint_write_leaves_a_torn_folder_that_is_ignored(runs)
    _resume_ignores_torn_checkpoints_and_cleans_up_dead_writes(runs)
    _twice_killed_run_ends_with_the_uninterrupted_weights(runs)
    _metrics_log_has_every_step_once_and_the_same_rows(runs)


def test_truncating_the_log_keeps_checkpointed_steps_and_drops_a_torn_line(tmp_path) -> None:
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(6)) + '{"step": 6, "x"')
    assert truncate_metrics(log, 3) == 3  # steps 4 and 5, and the torn line
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1, 2, 3]
    assert truncate_metrics(log, 3) == 0
    assert truncate_metrics(log, None) == 4  # resuming without a checkpoint starts the log afresh
    assert log.read_text() == ""
