"""`mmrl eval` reproduces a run's last validation on its checkpoint, and pass@k follows the formula."""

from __future__ import annotations

import json

import pytest

from mmrl.cli import main
from mmrl.data.synthetic import generate
from mmrl.evaluate.prompts import pass_at_k, resolve_checkpoint
from mmrl.run.logger import read_metrics

SCRAMBLE = "def scramble(sample):\n    return (sum(map(ord, sample.response)) * 7919 % 101) / 100\n"


@pytest.mark.parametrize(
    ("n", "correct", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # pass@1 is the fraction right
        (5, 2, 2, 1 - 3 / 10),  # 1 − C(3,2)/C(5,2)
        (4, 0, 2, 0.0),
        (3, 2, 2, 1.0),  # fewer wrong samples than k: any k include a right one
        (10, 3, 5, 1 - 21 / 252),  # 1 − C(7,5)/C(10,5)
    ],
)
def test_pass_at_k_by_hand(n: int, correct: int, k: int, expected: float) -> None:
    assert pass_at_k(n, correct, k) == pytest.approx(expected)


@pytest.mark.slow
def test_eval_reproduces_the_last_validation_and_reports_pass_at_k(tmp_path, tiny_model_dir, capsys) -> None:
    data = tmp_path / "data"
    generate(data, task="color", n_train=32, n_val=24, seed=0, image_size=56)
    reward = tmp_path / "scramble.py"  # differs between responses, so equal numbers are not a coincidence
    reward.write_text(SCRAMBLE)
    common = [
        f"model.path={tiny_model_dir}",
        f"data.train_files={data / 'train.jsonl'}",
        f"data.val_files={data / 'val.jsonl'}",
        "data.val_batch_size=16",  # chunks of 16 and 8: padding differs between chunks, as in training
        f"reward.functions=[{{name: '{reward}:scramble'}}, {{name: answer_match}}]",
    ]
    run = tmp_path / "run"
    train = [
        "train",
        "configs/quickstart.yaml",
        *common,
        f"trainer.output_dir={run}",
        "trainer.total_steps=2",
        "trainer.val_every=2",
        "trainer.progress=false",
        "trainer.loggers=[jsonl]",
        "warmup.steps=2",
        "data.train_batch_size=4",
        "actor.mini_batch_size=4",
        "rollout.n=2",
    ]
    assert main(train) == 0
    last = [r for r in read_metrics(run / "metrics.jsonl") if "val/accuracy" in r][-1]
    assert last["step"] == 2
    assert resolve_checkpoint(run) == run / "checkpoints" / "step_00000002" / "model"

    out = tmp_path / "eval.json"
    assert (
        main(["eval", "configs/quickstart.yaml", *common, "--checkpoint", str(run), "--out", str(out)]) == 0
    )
    result = json.loads(out.read_text())
    assert result["eval/prompts"] == 24
    assert result["eval/accuracy"] == pytest.approx(last["val/accuracy"], abs=1e-9)
    assert result["eval/mean"] == pytest.approx(last["val/mean"], abs=1e-9)
    assert 0 < result["eval/accuracy"] < 1
    # An --out that exists is refused before any work, and kept; --force replaces it.
    again = ["eval", "configs/quickstart.yaml", *common, "--checkpoint", str(run), "--out", str(out)]
    capsys.readouterr()
    assert main(again) == 2 and json.loads(out.read_text()) == result
    assert f"{out} exists" in " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    out.write_text("{}")
    assert main([*again, "--force"]) == 0 and json.loads(out.read_text()) == result

    sampled = tmp_path / "pass.json"
    args = ["--checkpoint", str(run / "checkpoints"), "--n", "4", "--k", "1", "2", "4", "--out", str(sampled)]
    assert main(["eval", "configs/quickstart.yaml", *common, *args]) == 0
    passes = json.loads(sampled.read_text())
    assert passes["eval/pass@1"] <= passes["eval/pass@2"] <= passes["eval/pass@4"]
    assert passes["eval/pass@4"] > passes["eval/pass@1"]  # several tries find more high scores


def test_eval_explains_a_missing_checkpoint(tmp_path, capsys) -> None:
    code = main(["eval", "configs/quickstart.yaml", "--checkpoint", str(tmp_path / "nope")])
    assert code == 2
    assert "no model there" in " ".join(capsys.readouterr().err.split())  # rich wraps long lines
