"""Shared pieces of the fault-injection suite: one small run config, training in a child process that
can be killed, and reading back what a run left on disk.

Runs that must be killed (SIGKILL) or measured from the inside go through `python -m mmrl.cli` in a
child process, forked from one that has imported the training stack; the others call `mmrl.cli.main`
in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from forked import Child, run_python
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "quickstart.yaml")

# A score that differs between response texts: a random-init model never names a colour, so the
# quickstart's answer_match would score every response 0 and every update would be zero. With this,
# each update depends on what was sampled, so a resume that lost any state would end elsewhere.
SCRAMBLE = '''
def scramble(sample, **kwargs):
    """Varies with the response text, so advantages are never all zero."""
    return (sum(map(ord, sample.response)) * 7919 % 101) / 100
'''


def overrides(model: Path, train: Path, out: Path, reward: Path, steps: int) -> list[str]:
    """A few-second run of the tiny model: 4 prompts x 4 responses a step, constant learning rate.

    The schedule is constant because the crash tests stop runs early; `mini_batch_size=2` makes two
    optimizer steps a batch, so old log-probs are recomputed and resumed state has more to get wrong."""
    return [
        f"model.path={model}",
        f"data.train_files={train}",
        "data.val_files=[]",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={steps}",
        "trainer.val_every=0",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
        "trainer.progress=false",
        "warmup.steps=0",
        "actor.lr_schedule=constant",
        "actor.warmup_steps=0",
        "data.train_batch_size=4",
        "actor.mini_batch_size=2",
        "rollout.n=4",
        f'reward.functions=[{{name: "{reward}:scramble"}}]',
    ]


def child_env() -> dict[str, str]:
    """The test's environment for a training child, with the repository importable."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def start(
    argv: list[str], log: Path, extra_env: dict[str, str] | None = None, fresh: bool = False
) -> Child | subprocess.Popen[bytes]:
    """`python argv...` in the repository with output to `log`, as a child forked from a process that
    has imported the training stack (`forked.py`): it runs, and dies, as a fresh one would. `fresh`: a
    new interpreter instead."""
    return run_python(argv, log, {**child_env(), **(extra_env or {})}, fresh)


def train_argv(args: list[str]) -> list[str]:
    return ["-m", "mmrl.cli", "train", CONFIG, *args]


def finish(proc: Child | subprocess.Popen[bytes], log: Path, timeout: float = 240) -> int:
    """Wait for a child and return its exit code; on a timeout kill it and fail with its log."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"child did not finish in {timeout:g}s; its log:\n{log.read_text()}") from None


def wait_until(
    condition: Callable[[], bool], proc: Child | subprocess.Popen[bytes], log: Path, timeout: float = 240
) -> None:
    """Poll `condition` while the child runs; fail with the child's log if it exits first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"child exited ({proc.returncode}) too early; its log:\n{log.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"condition not met in {timeout:g}s; child log:\n{log.read_text()}")
        time.sleep(0.02)


def raw_records(run: Path) -> list[dict[str, Any]]:
    """Every line of metrics.jsonl as written, repeats included (`read_metrics` would merge them)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model tensors a checkpoint folder holds, as saved."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted((checkpoint / "model").glob("*.safetensors")):
        tensors.update(load_file(file))
    assert tensors, f"no weights in {checkpoint / 'model'}"
    return tensors


def max_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Largest absolute difference per tensor, for the tensors that differ at all."""
    assert a.keys() == b.keys()
    worst = {name: float((a[name] - b[name]).abs().max()) for name in a}
    return {name: diff for name, diff in worst.items() if diff > 0}
