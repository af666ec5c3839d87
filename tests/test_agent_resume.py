"""An agent run (multi-turn trajectories with tool calls) stopped at step 1 and resumed with `--resume`
ends exactly where an uninterrupted run does: the agent source's data cursor, the RNG its turns are
sampled with and the optimizer all come back. The runs warm up on scripted zoom trajectories first, so
the policy really calls the tool and the resumed steps run tools too. They run after the zoom learning
test on its worker (one xdist group), on its data and with its warm-up, which the shared warm-up cache
then holds: no warm-up of their own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from learning_runs import task_data, warmup_cache, zoom_task

from mmrl.cli import main
from mmrl.models import load_policy
from mmrl.run.logger import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("zoom")]  # after test_zoom_learning.py

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "quickstart_agent.yaml")
STEPS = 2  # the second run stops after step 1 and resumes for step 2
REWARD = '''
def scramble(sample, **kwargs):
    """A score that differs between trajectories' answers and tool use, so advantages are never all 0."""
    return (sum(map(ord, sample.response)) * 7919 % 101) / 100 + sample.extra["agent_tool_calls"]
'''


def _overrides(root: Path, data: Path, model: Path, out: Path, steps: int) -> list[str]:
    return [
        f"model.path={model}",
        f"data.train_files={data / 'train.jsonl'}",
        f"data.val_files={data / 'val.jsonl'}",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={steps}",
        "trainer.save_every=1",
        "actor.lr_schedule=constant",
        "trainer.val_every=0",
        "trainer.val_before_train=false",
        "data.train_batch_size=4",
        "actor.mini_batch_size=2",  # two optimizer steps per batch: old log-probs are recomputed
        "actor.ppo_epochs=1",
        "rollout.n=4",
        f'reward.functions=[{{name: "{root / "reward.py"}:scramble"}}]',
        "trainer.loggers=[jsonl]",
        "trainer.progress=false",
        *warmup_cache(),  # the runs share one warm-up
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("agent_resume")
    data = task_data(zoom_task, root / "data")  # the zoom test's, where it ran first
    (root / "reward.py").write_text(REWARD)
    a, b = root / "a", root / "b"
    assert main(["train", CONFIG, *_overrides(root, data, tiny_model_dir, a, STEPS)]) == 0
    assert main(["train", CONFIG, *_overrides(root, data, tiny_model_dir, b, 1)]) == 0
    assert main(["train", CONFIG, *_overrides(root, data, tiny_model_dir, b, STEPS), "--resume"]) == 0
    return {"a": a, "b": b}


def test_a_resumed_agent_run_ends_with_the_same_weights_rows_and_tool_calls(runs: dict[str, Path]) -> None:
    a, b = (read_metrics(runs[k] / "metrics.jsonl") for k in ("a", "b"))
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert sum(r["agent/tool_calls"] for r in a) > 0, "the policy never called the tool: nothing was tested"
    for ra, rb in zip(a, b, strict=True):
        assert rb["data/rows"] == ra["data/rows"]
        assert rb["agent/tool_calls"] == ra["agent/tool_calls"]
        assert rb["reward/mean"] == pytest.approx(ra["reward/mean"], abs=1e-6)
    wa, wb = (load_policy(runs[k] / "checkpoints" / f"step_{STEPS:08d}" / "model").state_dict() for k in "ab")
    off = {
        name: float((wa[name] - wb[name]).abs().max())
        for name in wa
        if not torch.allclose(wa[name], wb[name], atol=1e-6)
    }
    assert not off, f"tensors that differ after resume: {off}"
