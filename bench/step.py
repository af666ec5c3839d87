"""mmrl training-step throughput on the CPU quickstart recipe.

Builds the tiny Qwen2.5-VL and the colour task in a temporary folder, runs `--steps` GRPO steps
through `mmrl.trainer.Trainer` (configs/quickstart.yaml plus overrides), and reads the per-phase
timings the trainer writes to metrics.jsonl. The first `--skip` steps are left out of the medians.

    .venv/bin/python bench/step.py --batch 32 --n 8 --max-new-tokens 8 --image-size 112 --steps 10 \
        --out bench/results/step.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    QUICKSTART,
    data_overrides,
    load_average,
    make_workspace,
    median,
    provenance,
    run_in_workspace,
    write_result,
)

from mmrl.run.logger import peak_rss_gb

PHASES = ("data", "rollout", "reward", "old_logprobs", "ref", "advantage", "update", "sync")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--image-size", type=int, default=112, help="image side in pixels (multiple of 28)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--skip", type=int, default=1, help="first steps left out of the medians")
    p.add_argument("--workdir", type=Path, default=None, help="reuse a folder (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    p.add_argument("overrides", nargs="*", help="extra mmrl config overrides, key.sub=value")
    return p.parse_args(argv)


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Train for `args.steps` steps under `root` and summarise metrics.jsonl."""
    import torch

    from mmrl.config import load_config
    from mmrl.run.logger import read_metrics
    from mmrl.trainer import Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir, data_dir = make_workspace(root, max(512, args.batch * args.steps), args.image_size)
    run_dir = root / f"run-{time.strftime('%H%M%S')}"
    overrides = [
        *data_overrides(model_dir, data_dir, run_dir, args.image_size),
        f"data.train_batch_size={args.batch}",
        f"actor.mini_batch_size={args.batch}",
        f"actor.micro_batch_size={max(256, args.batch * args.n)}",
        f"rollout.n={args.n}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"trainer.total_steps={args.steps}",
        "warmup.steps=0",  # throughput only: the format warm-up is a one-off cost before step 1
        *args.overrides,
    ]
    cfg = load_config(QUICKSTART, overrides)
    load_before = load_average()
    start = time.perf_counter()
    Trainer(cfg).fit()
    wall = time.perf_counter() - start
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "timing/step" in r]
    kept = records[args.skip :] or records
    step_s = median([r["timing/step"] for r in kept])
    samples = args.batch * args.n
    return {
        "system": "mmrl",
        "config": {
            "batch": args.batch,
            "n": args.n,
            "max_new_tokens": args.max_new_tokens,
            "image_size": args.image_size,
            "steps": args.steps,
            "skip": args.skip,
            "threads": args.threads,
            "overrides": args.overrides,
        },
        "median_step_s": step_s,
        "samples_per_s": samples / step_s,
        "tokens_per_s": median([r["throughput/tokens_per_s"] for r in kept]),
        "phases_s": {
            p: median([r[f"timing/{p}"] for r in kept if f"timing/{p}" in r])
            for p in PHASES
            if any(f"timing/{p}" in r for r in kept)
        },
        "peak_rss_gb": max([r["memory/peak_rss_gb"] for r in records] + [peak_rss_gb()]),
        "reward_mean": [r.get("reward/mean") for r in records],
        "fit_wall_s": wall,
        **provenance(load_before),
    }


def print_table(result: dict[str, Any]) -> None:
    """A short plain-text summary."""
    c = result["config"]
    print(
        f"mmrl step benchmark: {c['batch']} prompts x n={c['n']}, {c['max_new_tokens']} new tokens, "
        f"{c['image_size']}px, {c['steps']} steps (median over steps {c['skip'] + 1}..{c['steps']})"
    )
    rows = [
        ("samples/s", f"{result['samples_per_s']:.1f}"),
        ("tokens/s", f"{result['tokens_per_s']:.0f}"),
        ("step time", f"{result['median_step_s']:.3f} s"),
        *((f"  {p}", f"{v:.3f} s") for p, v in result["phases_s"].items()),
        ("peak RSS", f"{result['peak_rss_gb']:.2f} GiB"),
        ("load avg before/after", f"{result['load_avg_before'][0]:.2f} / {result['load_avg_after'][0]:.2f}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run_in_workspace(args.workdir, "mmrl-bench-", lambda folder: run(args, folder))
    print_table(result)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
