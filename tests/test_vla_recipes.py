"""The VLA recipes at full size, run as a user runs them: `mmrl model init-tiny`, `mmrl sft`, `mmrl train`
on the shipped config, then the run's success on its unseen seeds before and after RL.

Each takes about 25 minutes of a 2-core CPU (reach 26, Meta-World 24 on an AMD EPYC VM), together twice
CI's whole suite; cut to 8 minutes of one core, the Meta-World lift falls within one validation's noise
(docs/benchmarks.md, "At a size CI has room for"). So they are `recipe` tests: skipped unless
`MMRL_RECIPES=1` (`MMRL_RECIPES=1 pytest tests/test_vla_recipes.py`). They run in subprocesses with two
threads and the CPU's own kernels, as the figures in docs/benchmarks.md were measured; the suite's
one-thread AVX2 pin (tests/conftest.py) would make them another run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from learning_runs import REPO, validations

from mmrl.run.logger import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.recipe]

_PINS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR")


def run_recipe(config: str, root: Path) -> list[tuple[int, float]]:
    """Clone, then RL, with `config` as shipped (outputs under `root`); (step, success) of every
    validation of the RL run, the first being the clone's."""
    env = {k: v for k, v in os.environ.items() if k not in _PINS}
    env.update(OMP_NUM_THREADS="2", MKL_NUM_THREADS="2")
    paths = [f"model.path={root / 'sft-model'}", f"sft.base_model={root / 'tiny-model'}"]
    for args in (
        ["model", "init-tiny", str(root / "tiny-model")],
        ["sft", config, *paths],
        ["train", config, *paths, f"trainer.output_dir={root / 'run'}", "trainer.progress=false"],
    ):
        with (root / f"{args[0]}.log").open("w") as log:
            done = subprocess.run(
                [sys.executable, "-m", "mmrl.cli", *args],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        assert done.returncode == 0, f"mmrl {args[0]} failed; see {root / (args[0] + '.log')}"
    return validations(read_metrics(root / "run" / "metrics.jsonl"), "val/success")


def test_reach_wrist_recipe_reaches_the_target_and_rl_adds_to_the_clone(tmp_path) -> None:
    """The issue's target: greedy success >= 0.8 on 100 unseen seeds after SFT + RL, RL adding >= 10
    points. Measured on a 2-core Intel Xeon (2026-11-27): 0.60 -> 0.84 with the config's seed 1; seed 2
    gave 0.60 -> 0.79, so the recipe lands at about 0.8 and another CPU's run may fall just short. This
    test on a 2-core AMD EPYC (2026-11-29): 0.54 -> 0.81, in 26 minutes."""
    runs = run_recipe("configs/vla_reach_wrist.yaml", tmp_path)
    (_, cloned), (step, trained) = runs[0], runs[-1]
    print(f"reach (wrist): greedy success {cloned:.2f} after SFT -> {trained:.2f} after {step} RL steps")
    assert step == 30
    assert trained >= 0.8, f"greedy success {cloned} -> {trained}: under the target 0.8"
    assert trained - cloned >= 0.10, f"RL added {trained - cloned:+.2f} to the clone's {cloned}"


def test_metaworld_handle_press_recipe_lifts_the_clone(tmp_path) -> None:
    """RL on a Meta-World task lifts the clone's sampled success on 100 unseen seeds. Measured on a
    2-core AMD EPYC (2026-11-28), two runs from one clone: 0.60 -> 0.73 (trainer seed 1, shipped) and
    0.45 -> 0.78 (seed 2). One validation samples, so its 100 episodes move by about 7 points between
    sampling seeds: the clone scored 0.60, 0.45 and 0.57 under three, each run's final 0.73-0.78. The
    thresholds keep 8 points below the worst final and the worst gain."""
    runs = run_recipe("configs/vla_metaworld_handle_press.yaml", tmp_path)
    (_, cloned), (step, trained) = runs[0], runs[-1]
    print(f"handle-press: sampled success {cloned:.2f} after SFT -> {trained:.2f} after {step} RL steps")
    assert step == 16
    assert trained >= 0.65, f"sampled success {cloned} -> {trained}: under 0.65"
    assert trained - cloned >= 0.05, f"RL added {trained - cloned:+.2f} to the clone's {cloned}"


@pytest.mark.parametrize(
    ("kind", "steps", "measured"), [("gaussian", 40, "0.06 -> 0.19"), ("flow", 20, "0.07 -> 0.24")]
)
def test_reach_recipe_with_a_continuous_head_lifts_the_clone(tmp_path, kind, steps, measured) -> None:
    """RL lifts a continuous head's clone by at least 10 points of sampled success on 100 unseen seeds
    (configs/vla_reach_gaussian.yaml, configs/vla_reach_flow.yaml). Measured once each, one thread, on a
    2-core AMD EPYC (2026-12-04) with the configs' seed 1: the Gaussian head 0.06 -> 0.19 in 40 steps, the
    flow expert 0.07 -> 0.24 in 20. With seed 2 both gained only 3 points in 20 steps (docs/benchmarks.md),
    so a run on another CPU may fall short: this is the issue's target, not yet a settled result."""
    runs = run_recipe(f"configs/vla_reach_{kind}.yaml", tmp_path)
    (_, cloned), (step, trained) = runs[0], runs[-1]
    print(
        f"reach, {kind} head: sampled success {cloned:.2f} after SFT -> {trained:.2f} after {step} RL steps"
    )
    assert step == steps
    assert trained - cloned >= 0.10, (
        f"RL added {trained - cloned:+.2f} to the clone's {cloned} (measured {measured})"
    )
