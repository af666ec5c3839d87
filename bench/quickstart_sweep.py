"""Variants of a quickstart recipe, run side by side: what makes a task learn.

Each variant is `mmrl quickstart --task TASK` with its own overrides, in its own folder (its own tiny
model, data and run), as a subprocess; `--jobs` run at once. A variant that outlives `--limit-s` is
stopped and reported from the metrics it wrote so far. Prints, per variant, the held-out metric at
every validation (greedy on the agent tasks) and the sampled training metric over the first and last
five steps, and writes them as JSON with the machine.

    python bench/quickstart_sweep.py --task game --jobs 4 --limit-s 600 \\
        --variant base=trainer.total_steps=100 \\
        --variant expert=warmup.expert_noise=1.0,warmup.steps=300,trainer.total_steps=100
"""

from __future__ import annotations

import argparse
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

from mmrl.run.logger import read_metrics

# task -> (held-out metric, sampled training metric)
METRICS = {
    "colour": ("val/accuracy", "reward/mean"),
    "zoom": ("val/accuracy", "reward/mean"),
    "game": ("val/env_success", "game/success"),
}


def run_variant(task: str, name: str, overrides: list[str], root: Path, limit_s: float) -> dict[str, Any]:
    """One quickstart run; stopped at `limit_s` seconds, its metrics read either way."""
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "mmrl.cli", "quickstart", "--task", task, "--out", str(out), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    with (out / "log.txt").open("w") as log:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code: int | str = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = "stopped"
    held_out, sampled = METRICS[task]
    records = read_metrics(out / "run" / "metrics.jsonl")
    train = [r[sampled] for r in records if sampled in r and r.get("step", 0) > 0]
    return {
        "variant": name,
        "overrides": overrides,
        "exit": code,
        "steps": max((r.get("step", 0) for r in records), default=0),
        "val": [(r["step"], round(r[held_out], 3)) for r in records if held_out in r],
        "first5": round(sum(train[:5]) / max(len(train[:5]), 1), 3),
        "last5": round(sum(train[-5:]) / max(len(train[-5:]), 1), 3),
        "wall_s": round(time.perf_counter() - start),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", choices=tuple(METRICS), default="game")
    parser.add_argument(
        "--variant",
        action="append",
        required=True,
        help="NAME=override,override,... (NAME= alone: as shipped)",
    )
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--limit-s", type=float, default=3600.0, help="stop a variant after this long")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="quickstart_sweep_"))
    variants = [v.split("=", 1) for v in args.variant]
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [
            pool.submit(run_variant, args.task, name, [o for o in rest.split(",") if o], root, args.limit_s)
            for name, rest in variants
        ]
        rows = [f.result() for f in futures]
    held_out, sampled = METRICS[args.task]
    print(f"\n{args.task}: {held_out} at each validation; {sampled} over the first and last 5 steps")
    for r in rows:
        val = " ".join(f"{step}:{value:.2f}" for step, value in r["val"])
        print(
            f"{r['variant']:<14} steps {r['steps']:>4} {r['wall_s']:>5} s  exit {r['exit']!s:<8} "
            f"sampled {r['first5']:.2f} -> {r['last5']:.2f}  val {val}"
        )
    write_result(args.out, {"machine": machine(), "task": args.task, "rows": rows})


if __name__ == "__main__":
    main()
