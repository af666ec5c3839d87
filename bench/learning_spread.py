"""The spread of the learning tests' results: each test-sized run over seeds and thread counts.

Every run is the one its test makes (`tests/learning_runs.py`), in its own subprocess, at `--threads`
torch threads (the suite uses one). `--isa avx2` makes ATen and MKL use the AVX2 kernels that an AVX2-only
machine would run, so one AVX-512 machine samples both kinds of numerics: an RL run turns a last-bit
difference into another trajectory, so the spread must cover them. `--jobs` runs go at once: on a 2-core
machine, two 1-thread runs, as `pytest -n auto` places them. Prints a table of validation
accuracy before and after and the gain, per run, and the worst gain per recipe: the figure the test's
threshold keeps its margin from.

    python bench/learning_spread.py --runs grpo dapo --seeds 1 2 3 --threads 1 2 --isa native avx2 --out /tmp/spread.json

The algorithms without a learning test of their own (`VARIANTS`: CISPO, SAPO, GMPO, GPG, OPO, KL-Cov,
Clip-Cov, PF-PPO, SPPO, PRIME) run as the `grpo` run with their keys on top, VAPO as the `ppo` run with
its keys, for the spread table of each:

    python bench/learning_spread.py --runs grpo cispo sapo gmpo --seeds 1 2 3 --isa native
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, machine, write_result

sys.path.insert(0, str(REPO / "tests"))
from learning_runs import RUNS

# name: (the learning run it starts from, the overrides that select it). The quickstart takes one optimizer
# step a batch, where every ratio is 1 and the losses that differ in how they treat ratios train alike:
# those take four (mini-batches of 8 prompts), so that three of them see π_θ ≠ π_old.
OFF_POLICY = ("actor.mini_batch_size=8",)
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "cispo": ("grpo", ("actor.policy_loss=cispo", *OFF_POLICY)),
    # SAPO's per-sequence mean and GMPO's 0.4 clip come with them (their entries' paper defaults)
    "sapo": ("grpo", ("actor.policy_loss=sapo", *OFF_POLICY)),
    "gmpo": ("grpo", ("actor.policy_loss=gmpo", *OFF_POLICY)),
    "gpg": ("grpo", ("algorithm.adv_estimator=gpg", "actor.policy_loss=gpg")),
    "opo": ("grpo", ("algorithm.adv_estimator=opo",)),
    "kl_cov": ("grpo", ("actor.policy_loss=kl_cov", "actor.kl_cov_ratio=0.002", *OFF_POLICY)),
    "clip_cov": ("grpo", ("actor.policy_loss=clip_cov", *OFF_POLICY)),
    "pf_ppo": ("grpo", ("algorithm.policy_filtration=best_worst",)),
    "sppo": ("grpo", ("algorithm.adv_estimator=sppo", "actor.policy_loss=sppo", *OFF_POLICY)),
    # configs/quickstart_vapo.yaml's keys on the `ppo` run (its critic, pretraining and clip-higher)
    "vapo": (
        "ppo",
        (
            "algorithm.critic_lam=1.0",
            "algorithm.length_adaptive_alpha=0.5",
            "actor.positive_lm_coef=0.1",
            "reward.functions=[{name: answer_match, weight: 1.0}]",
        ),
    ),
    # configs/quickstart_prime.yaml's keys on the `grpo` run (its implicit PRM and its outcome labels)
    "prime": (
        "grpo",
        (
            "algorithm.adv_estimator=prime",
            "algorithm.prime_process_coef=0.2",
            "algorithm.dynamic_sampling=true",
            "actor.kl_loss_coef=0.1",
            "prm.lr=1e-3",
            "prm.beta=0.05",
            "prm.warmup_steps=5",
            "prm.lr_schedule=cosine",
            "prm.min_lr_ratio=0.1",
            "reward.functions=[{name: answer_match, weight: 1.0}]",
        ),
    ),
}

# fp32 only: on AVX-512 CPUs, ATen's bfloat16 kernels fail under this cap (the learning runs are fp32).
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}

CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
import torch
torch.set_num_threads({threads})
from mmrl.models import build_tiny
from learning_runs import RUNS, train, validations
root = Path({root!r})
model = build_tiny(root / "tiny-model", family=RUNS[{name!r}].family, seed=0)
records = train({name!r}, root, model, seed={seed}, extra={extra!r})
print("RESULT " + json.dumps(validations(records, RUNS[{name!r}].metric)))
"""


def run_one(
    name: str, seed: int, threads: int, isa: str, workdir: Path, extra: tuple[str, ...]
) -> dict[str, Any]:
    """One test-sized run in a fresh subprocess; its validations and wall time."""
    base, selected = VARIANTS.get(name, (name, ()))
    extra = (*selected, *extra)
    root = workdir / f"{name}-s{seed}-t{threads}-{isa}"
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    env |= AVX2 if isa == "avx2" else {}
    code = CHILD.format(
        tests=str(REPO / "tests"), threads=threads, root=str(root), name=base, seed=seed, extra=extra
    )
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    result = {"run": name, "seed": seed, "threads": threads, "isa": isa}
    result["seconds"] = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        (root / "stderr.txt").write_text(proc.stderr)
        return result | {"error": proc.stderr[-2000:]}
    val = json.loads(lines[-1][len("RESULT ") :])
    (_, first), (_, last) = val[0], val[-1]
    # where the suite's run, which ends at its first validation min_gain above the start (or above
    # chance), stops
    run = RUNS[base]
    stop = next((step for step, v in val[1:] if run.gain(first, v) >= run.min_gain), None)
    return result | {"validations": val, "first": first, "last": last, "gain": last - first, "stop": stop}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=[*RUNS, *VARIANTS])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4])
    parser.add_argument("--threads", nargs="+", type=int, default=[1])
    parser.add_argument("--isa", nargs="+", choices=["native", "avx2"], default=["native", "avx2"])
    parser.add_argument("overrides", nargs="*", help="key=value on top of each run (trying a change)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once")
    parser.add_argument("--workdir", type=Path, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()

    combos = [(n, s, t, i) for n in args.runs for t in args.threads for i in args.isa for s in args.seeds]
    with tempfile.TemporaryDirectory(prefix="mmrl-spread-") as tmp:
        workdir = args.workdir or Path(tmp)
        with ThreadPoolExecutor(args.jobs) as pool:
            # every run trains all its steps, so the gain measured is the full run's
            extra = ("trainer.stop_at_gain={}", "trainer.stop_at={}", *args.overrides)
            results = list(pool.map(lambda c: run_one(*c, workdir, extra), combos))

    print(
        f"{'run':<15}{'seed':>5}{'threads':>8}{'isa':>7}{'before':>8}{'after':>8}{'gain':>8}{'stop':>6}{'seconds':>9}"
    )
    for r in results:
        head = f"{r['run']:<15}{r['seed']:>5}{r['threads']:>8}{r['isa']:>7}"
        if "error" in r:
            print(f"{head}   failed: {r['error'].splitlines()[-1:]}")
            continue
        print(
            f"{head}{r['first']:>8.3f}{r['last']:>8.3f}{r['gain']:>8.3f}{r['stop'] or '-':>6}{r['seconds']:>9.0f}"
        )
    print()
    for name in args.runs:
        gains = [r["gain"] for r in results if r["run"] == name and "gain" in r]
        if gains:
            print(
                f"{name:<15} gain min {min(gains):.3f}  max {max(gains):.3f}  "
                f"(threshold {RUNS[VARIANTS.get(name, (name,))[0]].min_gain:.2f}, {len(gains)} runs)"
            )
    write_result(args.out, {"machine": machine(), "results": results})


if __name__ == "__main__":
    main()
