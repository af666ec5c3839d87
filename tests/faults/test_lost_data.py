"""Nothing a run wrote is lost or misread: checkpoints whose bytes changed in place are found by their
checksums and passed over loudly, a resume that cannot go on changes nothing on disk, a resume whose
config record is gone still refuses changes that break it, and the quickstart never deletes a run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from faultkit import CONFIG, overrides, raw_records
from rich.console import Console

from mmrl.cli import main
from mmrl.envs.actions import ActionTokenizer
from mmrl.errors import CheckpointError
from mmrl.quickstart import set_aside_earlier_run
from mmrl.run import checkpoint as ckpt
from mmrl.vla.sft import load_action_tokenizer, save_action_tokenizer


def _train(model: Path, task: dict[str, Path], out: Path, steps: int, *extra: str) -> int:
    args = [*overrides(model, task["train"], out, task["reward"], steps), "trainer.save_every=1", *extra]
    return main(["train", CONFIG, *args])


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, tiny_model_dir: Path, colour_task) -> Path:
    """A run of 2 steps with a checkpoint after each, copied by each test before it damages it."""
    run = tmp_path_factory.mktemp("two_steps") / "run"
    assert _train(tiny_model_dir, colour_task, run, 2) == 0
    return run


@pytest.fixture
def run(two_steps: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(two_steps, copy)
    return copy


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def _weights(folder: Path) -> Path:
    return next((folder / "model").glob("*.safetensors"))


def test_bytes_changed_in_place_are_found_and_the_resume_falls_back_to_the_newest_whole_one(
    run, tiny_model_dir, colour_task, capsys
) -> None:
    weights = _weights(_step(run, 2))
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(range(64))  # the same size: only the checksum can tell
    weights.write_bytes(bytes(data))
    assert ckpt.is_complete(_step(run, 2)), "sizes alone cannot see this damage"
    assert "SHA-256 differs" in ckpt.damage(_step(run, 2))
    assert _train(tiny_model_dir, colour_task, run, 3, "--resume") == 0
    out = "".join(capsys.readouterr().out.split())  # the console wraps long paths anywhere
    assert f"passingover{_step(run, 2)},whichisdamaged" in out
    assert f"resumedfrom{_step(run, 1)}atstep1" in out
    assert [r["step"] for r in raw_records(run)] == [1, 2, 3]  # step 2 trained again, once
    assert ckpt.damage(_step(run, 2)) is None  # saved anew


def test_a_resume_with_every_checkpoint_damaged_changes_nothing(
    run, tiny_model_dir, colour_task, capsys
) -> None:
    for step in (1, 2):
        (_step(run, step) / ckpt.MANIFEST).write_text('{"step": ')  # the weights and state are whole
    before = _snapshot(run)
    assert _train(tiny_model_dir, colour_task, run, 4, "--resume") == 1
    err = capsys.readouterr().err
    assert "none of the 2 checkpoints" in err and "nothing was changed" in err and "Traceback" not in err
    assert _snapshot(run) == before, "a run that cannot resume must not touch what is there"


def test_a_damaged_state_file_of_an_older_checkpoint_is_one_line(
    run, tiny_model_dir, colour_task, capsys
) -> None:
    """Checkpoints from before checksums: a zeroed trainer state keeps its size, and torch's own error
    (advising weights_only=False) would be the wrong advice."""
    for step in (1, 2):
        manifest = json.loads((_step(run, step) / ckpt.MANIFEST).read_text())
        del manifest["sha256"]
        (_step(run, step) / ckpt.MANIFEST).write_text(json.dumps(manifest))
    state = _step(run, 2) / "trainer_state.pt"
    state.write_bytes(bytes(state.stat().st_size))
    with pytest.raises(CheckpointError, match=r"trainer_state\.pt cannot be read"):
        ckpt.load_trainer_state(_step(run, 2))
    assert _train(tiny_model_dir, colour_task, run, 3, "--resume") == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "trainer_state.pt cannot be read" in err and "weights_only" not in err and "Traceback" not in err


def test_a_resume_whose_config_record_is_gone_compares_with_the_checkpoints_own(
    run, tiny_model_dir, colour_task, capsys
) -> None:
    (run / "config.yaml").unlink()
    assert _train(tiny_model_dir, colour_task, run, 3, "algorithm.adv_estimator=gae", "--resume") == 2
    err = capsys.readouterr().err
    assert "algorithm.adv_estimator 'grpo' -> 'gae'" in err and "Traceback" not in err
    assert not (run / "config.yaml").exists(), "a refused resume writes no record"


def test_a_resume_with_no_config_record_at_all_is_refused(run, tiny_model_dir, colour_task, capsys) -> None:
    (run / "config.yaml").unlink()
    shutil.rmtree(run / "config_history")
    for step in (1, 2):  # as checkpoints written before they held their config
        (_step(run, step) / "config.yaml").unlink()
        manifest = json.loads((_step(run, step) / ckpt.MANIFEST).read_text())
        del manifest["files"]["config.yaml"], manifest["sha256"]["config.yaml"]
        (_step(run, step) / ckpt.MANIFEST).write_text(json.dumps(manifest))
    before = _snapshot(run)
    assert _train(tiny_model_dir, colour_task, run, 3, "--resume") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "no readable record of the config" in err and "Traceback" not in err
    assert _snapshot(run) == before


def test_the_quickstart_keeps_its_earlier_run_and_never_touches_another(tmp_path: Path) -> None:
    console = Console(quiet=True)
    root = tmp_path / "qs"
    own = root / "run"
    (own / "checkpoints").mkdir(parents=True)
    (own / "metrics.jsonl").write_text('{"step": 1}\n')
    aside = set_aside_earlier_run(own, root, console)
    assert not own.exists() and (aside / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert aside.parent == root and aside.name.startswith("run.")
    valuable = tmp_path / "runs" / "valuable"  # `mmrl quickstart --out qs trainer.output_dir=runs/valuable`
    (valuable / "checkpoints").mkdir(parents=True)
    (valuable / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(FileExistsError, match="holds an earlier run"):
        set_aside_earlier_run(valuable, root, console)
    assert (valuable / "metrics.jsonl").exists() and (valuable / "checkpoints").is_dir()
    assert set_aside_earlier_run(tmp_path / "new", root, console) is None


def test_an_export_carries_the_action_tokenizer_a_token_policy_acts_with(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    # An env run's checkpoint holds its bins beside the weights (`RolloutSource.save_files`); an export
    # without them trained on from scratch would bin actions afresh, without the demos' statistics.
    model = tmp_path / "step_4" / "model"
    shutil.copytree(tiny_model_dir, model)
    bins = ActionTokenizer(action_dim=2, start_id=7, n_bins=16, chunk=2)
    save_action_tokenizer(bins, model)
    assert main(["export", str(model.parent), str(tmp_path / "out")]) == 0
    assert load_action_tokenizer(tmp_path / "out").to_dict() == bins.to_dict()
    plain = tmp_path / "plain"
    assert main(["export", str(tiny_model_dir), str(plain)]) == 0
    assert load_action_tokenizer(plain) is None, "a model never taught actions gets no bins"
