"""Whole training steps through the public CLI: mixed batches, no validation set, user estimators."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import FAST
from PIL import Image

from mmrl.cli import main
from mmrl.run.logger import read_metrics


def _mixed_dataset(folder: Path) -> Path:
    """Image rows of two sizes and text-only rows, so every batch mixes them."""
    folder.mkdir()
    rows = []
    for i in range(8):
        if i % 2:
            rows.append({"problem": "How many circles are there?", "answer": "two"})
        else:
            name = f"im{i}.png"
            Image.new("RGB", (112 if i % 4 else 56, 56), (200, 10 * i, 30)).save(folder / name)
            rows.append({"problem": "<image>What colour is the shape?", "answer": "red", "images": [name]})
    path = folder / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _train(tiny_model_dir: Path, data: Path, out: Path, *extra: str) -> int:
    return main(
        [
            "train",
            "configs/quickstart.yaml",
            f"model.path={tiny_model_dir}",
            f"data.train_files={data}",
            "data.val_files=[]",
            "data.min_pixels=3136",
            f"trainer.output_dir={out}",
            *FAST,
            *extra,
        ]
    )


def test_batches_mixing_text_only_and_image_rows_train_without_validation(tmp_path, tiny_model_dir) -> None:
    data = _mixed_dataset(tmp_path / "data")
    reward = tmp_path / "length_reward.py"  # varies between responses, so advantages are non-zero
    reward.write_text("def by_length(sample):\n    return (len(sample.response) % 5) / 4\n")
    functions = f"reward.functions=[{{name: {reward}:by_length}}]"
    # The HF engine samples with the trainer's own weights: the rollout correction, on here, sees ratio 1.
    assert _train(tiny_model_dir, data, tmp_path / "run", functions, "actor.rollout_correction=tis") == 0
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(len(r["data/rows"]) == 4 for r in records)
    assert not any(k.startswith("val/") for r in records for k in r)
    assert all(r["actor/grad_norm"] > 0 for r in records)
    assert all(
        abs(r["actor/rollout_is_mean"] - 1) < 1e-4 and r["actor/rollout_is_capped_frac"] == 0 for r in records
    )
    assert all(r["actor/rollout_logprob_diff"] < 1e-4 for r in records)


def test_bad_rows_are_skipped_and_counted_while_the_run_goes_on(tmp_path, tiny_model_dir) -> None:
    data = _mixed_dataset(tmp_path / "data")
    (data.parent / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20)
    bad = [
        {"problem": "<image>What colour?", "answer": "red", "images": ["corrupt.png"]},
        {"problem": "<image>What colour?", "answer": "red", "images": ["missing.png"]},
        {"problem": "<image>What colour?", "images": ["im0.png"]},
        {"problem": "How many? " * 200, "answer": "one"},
    ]
    with data.open("a") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in bad)
    # 12 rows, 4 bad: three steps of 4 prompts cover every row at least once.
    assert _train(tiny_model_dir, data, tmp_path / "run", "trainer.total_steps=3") == 0
    last = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert last["data/skipped/bad_image"] == 2
    assert last["data/skipped/missing_answer"] == 1
    assert last["data/skipped/prompt_too_long"] == 1
    used = {row for r in read_metrics(tmp_path / "run" / "metrics.jsonl") for row in r["data/rows"]}
    assert used.isdisjoint({8, 9, 10, 11})  # the bad rows never reach a rollout


def test_fresh_run_refuses_a_folder_holding_an_earlier_run(tmp_path, tiny_model_dir, capsys) -> None:
    data = _mixed_dataset(tmp_path / "data")
    assert _train(tiny_model_dir, data, tmp_path / "run") == 0
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert _train(tiny_model_dir, data, tmp_path / "run") == 2
    assert "--resume" in capsys.readouterr().err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before


def test_user_advantage_estimator_from_a_file_is_used(tmp_path, tiny_model_dir) -> None:
    marker = tmp_path / "called.txt"
    estimator = tmp_path / "my_estimator.py"
    estimator.write_text(
        "import torch\n"
        "def constant_advantage(token_rewards, response_mask, group_index, **kwargs):\n"
        f"    open({str(marker)!r}, 'a').write('x')\n"
        "    adv = response_mask.float() * 0.5\n"
        "    return adv, adv\n"
    )
    data = _mixed_dataset(tmp_path / "data")
    code = _train(
        tiny_model_dir, data, tmp_path / "run", f"algorithm.adv_estimator={estimator}:constant_advantage"
    )
    assert code == 0
    assert marker.read_text() == "xx"  # called once per training step


def test_user_policy_loss_from_a_file_is_used(tmp_path, tiny_model_dir) -> None:
    marker = tmp_path / "loss_called.txt"
    loss = tmp_path / "my_loss.py"
    loss.write_text(
        "from mmrl.algorithms import ppo_clip\n"
        "def logged_ppo(logp, old_logp, advantages, response_mask, **kwargs):\n"
        f"    open({str(marker)!r}, 'a').write('x')\n"
        "    return ppo_clip(logp, old_logp, advantages, response_mask, **kwargs)\n"
    )
    data = _mixed_dataset(tmp_path / "data")
    assert _train(tiny_model_dir, data, tmp_path / "run", f"actor.policy_loss={loss}:logged_ppo") == 0
    assert marker.read_text() == "xx"  # one micro-batch per step, two steps


def test_piped_output_has_a_plain_line_per_step_and_per_validation(tmp_path, tiny_model_dir, capsys) -> None:
    """Under pytest stdout is not a terminal, as in a job log, where rich's bar would draw nothing."""
    data = _mixed_dataset(tmp_path / "data")
    val = ["data.val_files=[" + str(data) + "]", "trainer.val_every=2", "trainer.val_before_train=true"]
    assert _train(tiny_model_dir, data, tmp_path / "run", "trainer.progress=true", *val) == 0
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/2", "2/2"], lines
    assert all("reward " in line and " s/step" in line and "ETA " in line for line in steps)
    validations = [line for line in lines if line.startswith("validation at step ")]
    assert [line.split()[3] for line in validations] == ["0:", "2:"], lines
    assert all("accuracy " in line for line in validations)


def test_a_run_ends_at_the_first_validation_that_meets_its_target(tmp_path, tiny_model_dir, capsys) -> None:
    """`trainer.stop_at`: the run ends at the first periodic validation that meets every target, with its
    final checkpoint there; a target out of reach trains every step; a target the validation does not
    report stops the run before its first step, naming what it does report."""
    data = _mixed_dataset(tmp_path / "data")
    shape = [f"data.val_files={data}", "trainer.total_steps=3", "trainer.val_every=2"]

    assert (
        _train(tiny_model_dir, data, tmp_path / "met", *shape, "trainer.stop_at={val/format_answer: 0}") == 0
    )
    assert [r["step"] for r in read_metrics(tmp_path / "met" / "metrics.jsonl")] == [0, 1, 2]
    assert [p.name for p in (tmp_path / "met" / "checkpoints").iterdir()] == ["step_00000002"]
    assert "val/format_answer 0 >= 0 (trainer.stop_at): the run ends here" in capsys.readouterr().out

    assert _train(tiny_model_dir, data, tmp_path / "far", *shape, "trainer.stop_at={val/accuracy: 1.01}") == 0
    assert [r["step"] for r in read_metrics(tmp_path / "far" / "metrics.jsonl")] == [0, 1, 2, 3]

    # a gain counts from the validation before training: a share in [0, 1] is always above its first
    # value less 1, and never 1.01 above it
    rise = "trainer.stop_at_gain={val/format_answer: -1}"
    assert _train(tiny_model_dir, data, tmp_path / "gain", *shape, rise) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "gain" / "metrics.jsonl")] == [0, 1, 2]
    far = "trainer.stop_at_gain={val/format_answer: 1.01}"
    assert _train(tiny_model_dir, data, tmp_path / "gain_far", *shape, far) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "gain_far" / "metrics.jsonl")] == [0, 1, 2, 3]

    assert _train(tiny_model_dir, data, tmp_path / "typo", *shape, "trainer.stop_at={val/acuracy: 0.5}") == 2
    assert "trainer.stop_at names ['val/acuracy']" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(tmp_path / "typo" / "metrics.jsonl")] == [0]


def test_stop_at_names_validation_metrics_and_needs_periodic_validation() -> None:
    from mmrl.config.trainer import TrainerConfig

    with pytest.raises(ValueError, match="a target is a validation metric"):
        TrainerConfig(stop_at={"reward/mean": 0.5})
    with pytest.raises(ValueError, match=r"set trainer.val_every > 0"):
        TrainerConfig(stop_at={"val/accuracy": 0.5}, val_every=0)
    with pytest.raises(ValueError, match=r"set trainer.val_before_train=true"):
        TrainerConfig(stop_at_gain={"val/accuracy": 0.3}, val_before_train=False)
