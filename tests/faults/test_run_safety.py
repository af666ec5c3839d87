"""A run folder is held by one run at a time, a resume refuses config changes that would break it and
applies the others, and SIGTERM or Ctrl-C end a run with a checkpoint and the command that resumes it."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from faultkit import CONFIG, REPO, child_env, finish, overrides, raw_records, start, train_argv, wait_until

from mmrl.cli import main
from mmrl.run import checkpoint as ckpt

# Holds a run folder the way a training run does, until killed.
HOLD = """
import sys, time
from pathlib import Path
from mmrl.run.lock import RunLock

RunLock(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


def _args(model: Path, task: dict[str, Path], out: Path, steps: int, *extra: str) -> list[str]:
    return [*overrides(model, task["train"], out, task["reward"], steps), *extra]


def _train(model: Path, task: dict[str, Path], out: Path, steps: int, *extra: str) -> int:
    return main(["train", CONFIG, *_args(model, task, out, steps, *extra)])


def test_a_run_folder_held_by_a_live_run_is_refused_and_a_dead_runs_lock_is_taken_over(
    tmp_path, tiny_model_dir, colour_task, capsys, caplog
) -> None:
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run)], cwd=REPO, env=child_env(), stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline() == b"held\n"
        for resume in ([], ["--resume"]):
            assert _train(tiny_model_dir, colour_task, run, 1, *resume) == 2
            err = capsys.readouterr().err
            assert f"pid {holder.pid} on host {socket.gethostname()}" in err, err
            assert "Traceback" not in err
        assert not (run / "metrics.jsonl").exists() and not (run / "config.yaml").exists()
    finally:
        holder.kill()
        holder.wait()
    # Killed, the holder left its lock behind; the next run takes it over with a note and frees it at the end.
    with caplog.at_level(logging.WARNING, logger="mmrl.run.lock"):
        assert _train(tiny_model_dir, colour_task, run, 1) == 0
    assert f"pid {holder.pid}" in caplog.text and "no longer alive" in caplog.text
    assert [r["step"] for r in raw_records(run)] == [1]
    assert not (run / "run.lock").exists()


def test_a_folder_where_the_lock_goes_is_one_line_and_left_alone(
    tmp_path, tiny_model_dir, colour_task, capsys
) -> None:
    run = tmp_path / "run"
    (run / "run.lock").mkdir(parents=True)
    (run / "run.lock" / "notes.txt").write_text("mine")
    assert _train(tiny_model_dir, colour_task, run, 1) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "run.lock is a folder where the run's lock file goes" in err and "Traceback" not in err
    assert (run / "run.lock" / "notes.txt").read_text() == "mine"
    assert not (run / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, tiny_model_dir: Path, colour_task) -> Path:
    """A run of 2 steps with a checkpoint at step 2, to resume with changed configs."""
    run = tmp_path_factory.mktemp("resume_config") / "run"
    assert _train(tiny_model_dir, colour_task, run, 2, "actor.lr=1e-5") == 0
    return run


@pytest.mark.parametrize(
    "changed",
    [["data.train_batch_size=2"], ["rollout.n=2", "trainer.seed=7"], ["model.lora.rank=4"]],
    ids=["batch", "n_and_seed", "model"],
)
def test_resume_refuses_changes_that_break_exactness_naming_each(
    stopped_run, tiny_model_dir, colour_task, capsys, changed
) -> None:
    before = (stopped_run / "config.yaml").read_text()
    assert _train(tiny_model_dir, colour_task, stopped_run, 4, *changed, "--resume") == 2
    err = capsys.readouterr().err
    for change in changed:
        assert change.split("=")[0] in err, err
    assert "trainer.output_dir" in err and "Traceback" not in err
    assert (stopped_run / "config.yaml").read_text() == before
    assert [r["step"] for r in raw_records(stopped_run)] == [1, 2]


def test_resume_below_the_reached_step_explains_instead_of_finishing(
    stopped_run, tiny_model_dir, colour_task, capsys
) -> None:
    assert _train(tiny_model_dir, colour_task, stopped_run, 1, "--resume") == 2
    err = capsys.readouterr().err
    assert "trainer.total_steps=1 is below step 2" in err and "Traceback" not in err


def test_resume_applies_a_new_learning_rate_and_keeps_every_config(
    stopped_run, tiny_model_dir, colour_task, capsys
) -> None:
    assert _train(tiny_model_dir, colour_task, stopped_run, 3, "actor.lr=3e-4", "--resume") == 0
    assert "actor.lr 1e-05 -> 0.0003" in capsys.readouterr().out
    records = raw_records(stopped_run)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["actor/lr"] == pytest.approx(1e-5) and records[2]["actor/lr"] == pytest.approx(3e-4)
    state = ckpt.load_trainer_state(stopped_run / "checkpoints" / "step_00000003")
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(3e-4)
    history = stopped_run / "config_history"
    used = {p.name: yaml.safe_load(p.read_text())["actor"]["lr"] for p in sorted(history.iterdir())}
    assert used == {"from_step_00000000.yaml": 1e-5, "from_step_00000002.yaml": 3e-4}
    assert yaml.safe_load((stopped_run / "config.yaml").read_text())["actor"]["lr"] == 3e-4


def _records_reach(run: Path, step: int) -> bool:
    try:
        return any(r["step"] >= step for r in raw_records(run))
    except ValueError:  # a line being written
        return False


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_says_how_to_resume_and_the_resume_finishes(
    tmp_path, tiny_model_dir, colour_task
) -> None:
    run, log = tmp_path / "run", tmp_path / "child.log"
    args = _args(tiny_model_dir, colour_task, run, 6, "trainer.save_every=0")
    child = start(train_argv(args), log)
    wait_until(lambda: _records_reach(run, 1), child, log)
    child.send_signal(signal.SIGTERM)
    assert finish(child, log) == 143, log.read_text()
    said = log.read_text()
    assert "Traceback" not in said
    assert f"mmrl train {CONFIG}" in said and "--resume" in said
    newest = ckpt.latest_checkpoint(run / "checkpoints")
    stopped_at = ckpt.load_trainer_state(newest)["step"]
    assert 1 <= stopped_at < 6 and [r["step"] for r in raw_records(run)] == list(range(1, stopped_at + 1))
    assert not (run / "run.lock").exists()
    assert main(["train", CONFIG, *args, "--resume"]) == 0
    assert [r["step"] for r in raw_records(run)] == list(range(1, 7))


def test_a_first_ctrl_c_finishes_the_step_and_saves(
    tmp_path, tiny_model_dir, colour_task, capsys, monkeypatch
) -> None:
    """Ctrl-C arrives in the middle of step 1 (sent by the reward function, wherever it runs): step 1
    ends, is saved, and the command exits 130 naming the command that resumes it."""
    reward = tmp_path / "interrupting.py"
    reward.write_text(
        "import os, signal\n"
        "def scramble(sample, **kwargs):\n"
        "    try:  # created once, atomically: two reward workers must not both send Ctrl-C\n"
        "        os.close(os.open(os.environ['SENT_FILE'], os.O_CREAT | os.O_EXCL))\n"
        "    except FileExistsError:\n"
        "        return len(sample.response) % 3 / 2\n"
        "    os.kill(int(os.environ['TRAINER_PID']), signal.SIGINT)\n"
        "    return len(sample.response) % 3 / 2\n"
    )
    monkeypatch.setenv("TRAINER_PID", str(os.getpid()))
    monkeypatch.setenv("SENT_FILE", str(tmp_path / "sent"))
    run = tmp_path / "run"
    assert _train(tiny_model_dir, {**colour_task, "reward": reward}, run, 3) == 130
    err = capsys.readouterr().err
    assert f"mmrl train {CONFIG}" in err and "--resume" in err and "Traceback" not in err
    assert ckpt.load_trainer_state(ckpt.latest_checkpoint(run / "checkpoints"))["step"] == 1
    assert [r["step"] for r in raw_records(run)] == [1]
