"""DAPO's dynamic sampling, overlong shaping and truncation masking, and the KL reward, in
whole training steps through the public CLI on a tiny model and text-only prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmrl.cli import main
from mmrl.run.logger import read_metrics

FAST = [
    "trainer.val_every=0",
    "trainer.save_every=0",
    "trainer.progress=false",
    "trainer.loggers=[jsonl]",
    "warmup.steps=0",
    "data.val_files=[]",
    "data.shuffle=false",
    "rollout.n=2",
    "reward.isolation=inline",  # `split` counts its calls: one process must make them all, in order
]
# Prompts answered "same" get one score for every response: their groups are uniform. Prompts
# answered "vary" alternate 0, 1, 0, ... across calls, so each group of n >= 2 differs.
REWARD = """
calls = [0]

def split(sample):
    if sample.ground_truth == "same":
        return 1.0
    calls[0] += 1
    return float(calls[0] % 2)
"""


def _dataset(folder: Path, answers: list[str]) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / "train.jsonl"
    rows = [{"problem": f"Question {i}?", "answer": a} for i, a in enumerate(answers)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _train(tmp_path: Path, model: Path, answers: list[str], *extra: str) -> int:
    tmp_path.mkdir(exist_ok=True)
    reward = tmp_path / "split_reward.py"
    reward.write_text(REWARD)
    return main(
        [
            "train",
            "configs/quickstart.yaml",
            f"model.path={model}",
            f"data.train_files={_dataset(tmp_path / 'data', answers)}",
            f"trainer.output_dir={tmp_path / 'run'}",
            f"reward.functions=[{{name: {reward}:split}}]",
            *FAST,
            *extra,
        ]
    )


def _records(tmp_path: Path) -> list[dict]:
    return read_metrics(tmp_path / "run" / "metrics.jsonl")


def test_dynamic_sampling_trains_full_batches_of_informative_groups(tmp_path, tiny_model_dir) -> None:
    answers = ["same", "vary", "same", "same", "vary", "same", "vary", "vary"]
    code = _train(
        tmp_path,
        tiny_model_dir,
        answers,
        "trainer.total_steps=2",
        "data.train_batch_size=2",
        "actor.mini_batch_size=2",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_num_gen_batches=4",
        "algorithm.on_unfilled=fail",
    )
    assert code == 0
    vary = {i for i, a in enumerate(answers) if a == "vary"}
    # Unshuffled, step 1 draws rows 0-1 (1 informative), then 2-3 (none), then 4-5 (one more);
    # step 2 draws 6-7, both informative.
    first, second = _records(tmp_path)
    assert first["data/rows"] == [0, 1, 2, 3, 4, 5]
    assert first["dynamic_sampling/kept_rows"] == [1, 4]
    assert first["dynamic_sampling/gen_rounds"] == 3
    assert first["dynamic_sampling/filtered_groups"] == 4
    assert second["dynamic_sampling/kept_rows"] == [6, 7]
    assert second["dynamic_sampling/gen_rounds"] == 1
    assert second["dynamic_sampling/filtered_groups"] == 0
    for record in (first, second):
        assert set(record["dynamic_sampling/kept_rows"]) <= vary
        assert record["dynamic_sampling/kept_groups"] == 2
        assert record["actor/grad_norm"] > 0


def test_unfilled_batch_fails_naming_the_step_and_the_fix(tmp_path, tiny_model_dir, capsys) -> None:
    code = _train(
        tmp_path,
        tiny_model_dir,
        ["same"] * 4,
        "trainer.total_steps=1",
        "data.train_batch_size=2",
        "actor.mini_batch_size=2",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_num_gen_batches=2",
        "algorithm.on_unfilled=fail",
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "step 1" in err and "0 of data.train_batch_size=2" in err
    assert "algorithm.max_num_gen_batches" in err and "algorithm.on_unfilled=continue" in err


def test_unfilled_batch_continues_with_a_partial_batch(tmp_path, tiny_model_dir) -> None:
    # One round of 4 prompts, 3 informative: 6 rows in mini-batches of 2 prompts (4 rows) -> 4 + 2.
    code = _train(
        tmp_path,
        tiny_model_dir,
        ["vary", "same", "vary", "vary", "same", "same", "same", "same"],
        "trainer.total_steps=2",
        "data.train_batch_size=4",
        "actor.mini_batch_size=2",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_num_gen_batches=1",
        "algorithm.on_unfilled=continue",
    )
    assert code == 0
    first, second = _records(tmp_path)
    assert first["dynamic_sampling/kept_rows"] == [0, 2, 3]
    assert first["dynamic_sampling/filtered_groups"] == 1
    assert first["actor/grad_norm"] > 0 and abs(first["actor/pg_loss"]) < 1e3
    # Step 2 draws only uniform groups: nothing to train on, and the run goes on.
    assert second["dynamic_sampling/kept_groups"] == 0
    assert "actor/grad_norm" not in second


def test_overlong_shaping_and_masking_truncated_responses(tmp_path, tiny_model_dir) -> None:
    # A 2-token budget that the random-init model always fills: every response is truncated.
    shaped = [
        "trainer.total_steps=1",
        "data.train_batch_size=2",
        "actor.mini_batch_size=2",
        "rollout.max_new_tokens=2",
        "algorithm.overlong_buffer_len=2",
        "algorithm.overlong_penalty_factor=0.5",
    ]
    assert _train(tmp_path / "a", tiny_model_dir, ["same"] * 4, *shaped) == 0
    (plain,) = _records(tmp_path / "a")
    assert plain["response_length/clip_frac"] == 1.0
    assert plain["reward/overlong_penalty"] == -0.5  # length 2 = L_max: the full −factor
    assert plain["actor/grad_norm"] > 0  # the entropy bonus and KL still push on every token
    assert _train(tmp_path / "b", tiny_model_dir, ["same"] * 4, *shaped, "algorithm.mask_truncated=true") == 0
    (masked,) = _records(tmp_path / "b")
    assert masked["response_length/clip_frac"] == 1.0
    assert masked["actor/grad_norm"] == 0.0  # every row left the loss


def test_kl_reward_coefficient_adapts_and_survives_resume(tmp_path, tiny_model_dir) -> None:
    kl = [
        "data.train_batch_size=2",
        "actor.mini_batch_size=2",
        "actor.use_kl_loss=false",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.1",
        "algorithm.kl_ctrl.target_kl=0.01",
        "algorithm.kl_ctrl.horizon=10",
        "trainer.save_every=2",
        "actor.lr_schedule=constant",
    ]
    answers = ["vary"] * 8
    assert _train(tmp_path, tiny_model_dir, answers, *kl, "trainer.total_steps=2") == 0
    assert _train(tmp_path, tiny_model_dir, answers, *kl, "trainer.total_steps=3", "--resume") == 0
    steps = _records(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all("timing/ref" in r for r in steps)  # the reference is loaded for the reward alone
    # Step 1: the policy is the reference, KL = 0 (to float32 rounding: the two forwards batch differently),
    # so β shrinks by the clipped 20%, over 4 of 10 samples.
    assert steps[0]["kl_reward/kl"] == pytest.approx(0.0, abs=1e-6)
    assert steps[0]["kl_reward/coef"] == 0.1
    assert steps[1]["kl_reward/coef"] == pytest.approx(0.1 * (1 - 0.2 * 4 / 10))
    error = min(max(steps[1]["kl_reward/kl"] / 0.01 - 1, -0.2), 0.2)
    # Step 3 ran in a new process: β came back from the step-2 checkpoint, not from the config.
    assert steps[2]["kl_reward/coef"] == pytest.approx(steps[1]["kl_reward/coef"] * (1 + error * 4 / 10))


def test_reference_is_not_loaded_without_any_kl(tmp_path, tiny_model_dir) -> None:
    off = [
        "trainer.total_steps=1",
        "data.train_batch_size=2",
        "actor.mini_batch_size=2",
        "actor.use_kl_loss=false",
    ]
    assert _train(tmp_path, tiny_model_dir, ["vary"] * 4, *off) == 0
    (record,) = _records(tmp_path)
    assert "timing/ref" not in record and "kl_reward/coef" not in record
