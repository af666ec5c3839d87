"""Reward functions that raise, hang, kill their worker, or return NaN, inf, None, a string or a dict without
"overall", in a real training run with process isolation: the run finishes, every failure is counted under
its function and kind, the failed samples score 0 for that function only, and no worker outlives the run.

The unit tests of the reward layer (tests/test_rewards.py) cover each fault in isolation; this runs them
together through `mmrl train`, where a hung or dead worker must be replaced between steps.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import textwrap
from pathlib import Path

import pytest
from faultkit import CONFIG, overrides
from PIL import Image

from mmrl.cli import main
from mmrl.run.logger import read_metrics

RESPONSES_PER_PROMPT = 2
FAST = [
    "trainer.total_steps=3",
    "trainer.val_every=0",
    "trainer.save_every=0",
    "trainer.progress=false",
    "trainer.loggers=[jsonl]",
    "warmup.steps=0",
    "data.train_batch_size=4",
    "actor.mini_batch_size=4",
    f"rollout.n={RESPONSES_PER_PROMPT}",
]

# Each row names the fault its responses trigger, so which samples fail is known from `data/rows`.
FAULTS = ["ok", "raise", "hang", "nan", "inf", "none", "string", "no_overall", "exit", "ok", "raise", "nan"]
# reward function -> (the faults that break it, the failure kind they must be counted as)
BROKEN = {
    "raises": ({"raise"}, "exception"),
    "sleeps": ({"hang"}, "timeout"),
    "bad_value": ({"nan", "inf", "none", "string", "no_overall"}, "invalid"),
    "exits": ({"exit"}, "exception"),  # the worker process dies mid-call
}

REWARDS = """
    import math
    import os
    import time

    BAD_VALUES = {"nan": math.nan, "inf": -math.inf, "none": None, "string": "0.7", "no_overall": {"acc": 1.0}}

    def raises(sample):
        if sample.extra["fault"] == "raise":
            raise RuntimeError("the judge rejected this sample")
        return 1.0

    def sleeps(sample):
        if sample.extra["fault"] == "hang":
            time.sleep(60)
        return 1.0

    def bad_value(sample):
        return BAD_VALUES.get(sample.extra["fault"], 1.0)

    def exits(sample):
        if sample.extra["fault"] == "exit":
            os._exit(3)
        return 1.0

    def good(sample):
        return 1.0
"""


def _dataset(folder: Path) -> Path:
    folder.mkdir()
    Image.new("RGB", (56, 56), (210, 0, 0)).save(folder / "red.png")
    rows = [
        {"problem": "<image>What colour is the shape?", "answer": "red", "images": ["red.png"], "fault": f}
        for f in FAULTS
    ]
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.slow
@pytest.mark.timeout(300)  # ~25 s on an idle 2-core machine
def test_broken_rewards_are_counted_per_kind_and_score_zero(tmp_path, tiny_model_dir) -> None:
    data = _dataset(tmp_path / "data")
    rewards = tmp_path / "rewards.py"
    rewards.write_text(textwrap.dedent(REWARDS))
    functions = ", ".join(f"{{name: {rewards}:{name}}}" for name in [*BROKEN, "good"])
    run = tmp_path / "run"
    code = main(
        [
            "train",
            CONFIG,
            f"model.path={tiny_model_dir}",
            f"data.train_files={data}",
            "data.val_files=[]",
            "data.min_pixels=3136",
            f"trainer.output_dir={run}",
            f"reward.functions=[{functions}]",
            "reward.isolation=process",
            "reward.timeout_s=2",
            *FAST,
        ]
    )
    assert code == 0
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert sorted(row for r in records for row in r["data/rows"]) == list(range(len(FAULTS)))

    for r in records:
        faults = [FAULTS[row] for row in r["data/rows"]]
        samples = RESPONSES_PER_PROMPT * len(faults)
        means = []
        for name, (breaking, kind) in BROKEN.items():
            failed = RESPONSES_PER_PROMPT * sum(f in breaking for f in faults)
            assert r.get(f"reward/failures/{name}/{kind}", 0) == failed, (name, r["step"])
            means.append(1.0 - failed / samples)  # 1.0 where the call worked, 0 where it failed
            assert r[f"reward/{name}"] == pytest.approx(means[-1]), (name, r["step"])
        assert r["reward/good"] == 1.0, "a failed call must not cost the sample its other scores"
        assert r["reward/mean"] == pytest.approx(1.0 + sum(means))
    failures = {k for r in records for k in r if k.startswith("reward/failures/")}
    assert failures == {f"reward/failures/{name}/{kind}" for name, (_, kind) in BROKEN.items()}
    assert not [p for p in multiprocessing.active_children() if p.name == "mmrl-reward-worker"]


WHERE_AND_BROKEN = """
    import os

    TRAINER_PID = {pid}

    def where(sample):
        return {{"overall": 1.0, "in_a_worker": float(os.getpid() != TRAINER_PID)}}

    def broken(sample):
        raise KeyError("bbox")
"""


def _reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "where.py"
    path.write_text(textwrap.dedent(WHERE_AND_BROKEN.format(pid=os.getpid())))
    return path


@pytest.mark.timeout(300)
def test_user_reward_code_runs_in_a_worker_process_by_default(tmp_path, tiny_model_dir, colour_task) -> None:
    """With no isolation key, a hang, `os._exit` or segfault in a user reward costs a score, not the run."""
    run = tmp_path / "run"
    args = overrides(tiny_model_dir, colour_task["train"], run, colour_task["reward"], steps=1)
    reward = f"reward.functions=[{{name: '{_reward_file(tmp_path)}:where'}}, {{name: format_answer}}]"
    assert main(["train", CONFIG, *args, reward]) == 0
    (record,) = read_metrics(run / "metrics.jsonl")
    assert record["reward/where/in_a_worker"] == 1.0
    assert not [p for p in multiprocessing.active_children() if p.name == "mmrl-reward-worker"]


@pytest.mark.timeout(300)
def test_a_reward_failing_on_every_sample_stops_the_run_naming_it_and_its_error(
    tmp_path, tiny_model_dir, colour_task, capsys
) -> None:
    run = tmp_path / "run"
    args = overrides(tiny_model_dir, colour_task["train"], run, colour_task["reward"], steps=6)
    broken = f"{{name: '{_reward_file(tmp_path)}:broken'}}"
    code = main(
        [
            "train",
            CONFIG,
            *args,
            f"reward.functions=[{{name: '{colour_task['reward']}:scramble'}}, {broken}]",
            "reward.isolation=inline",  # trusted test code; spares starting workers
            "reward.max_all_failed_steps=2",
        ]
    )
    err = " ".join(capsys.readouterr().err.split())
    assert code == 1, err
    assert "'broken' failed on every sample for 2 steps in a row (steps 1-2)" in err
    assert "KeyError: 'bbox'" in err and "reward.max_all_failed_steps" in err and "--resume" in err
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1], "step 2 is not trained on"


@pytest.mark.timeout(120)
def test_a_reward_stop_without_a_checkpoint_does_not_claim_one(
    tmp_path, tiny_model_dir, colour_task, capsys
) -> None:
    """With `trainer.save_every: 0` nothing is saved before the end: the stop says so, not that checkpoints
    are intact."""
    run = tmp_path / "run"
    args = overrides(tiny_model_dir, colour_task["train"], run, colour_task["reward"], steps=3)
    broken = f"{{name: '{_reward_file(tmp_path)}:broken'}}"
    reward = f"reward.functions=[{{name: '{colour_task['reward']}:scramble'}}, {broken}]"
    settings = ["reward.isolation=inline", "reward.max_all_failed_steps=1", "trainer.save_every=0"]
    assert main(["train", CONFIG, *args, reward, *settings]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "'broken' failed on every sample" in err and "intact" not in err, err
    assert "No checkpoint was written (trainer.save_every is 0), so this run starts over" in err
