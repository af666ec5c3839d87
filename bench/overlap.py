"""Overlapped rollouts against the synchronous loop, side by side, one core each.

The synchronous run generates and then updates on one core (`--threads 1`), so its step takes about
rollout + update. The overlapped run (`rollout.max_staleness=1`) gives the rollout worker one core and
the trainer the other, so its step should take about max(rollout, update). Both use the same shape, the
order sync, overlapped, sync, overlapped, and report median step times with the synchronous phase split.

    .venv/bin/python bench/overlap.py --batch 16 --n 4 --max-new-tokens 24 --steps 10 actor.use_kl_loss=false
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from common import run_in_workspace, write_result
from step import parse_args as step_args
from step import run as step_run

OVERLAP = ["rollout.max_staleness=1", "actor.rollout_correction=tis"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2, help="sync/overlapped pairs")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("overrides", nargs="*", help="extra mmrl config overrides for both runs, key.sub=value")
    return p.parse_args(argv)


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    shape = [
        f"--batch={args.batch}",
        f"--n={args.n}",
        f"--max-new-tokens={args.max_new_tokens}",
        f"--image-size={args.image_size}",
        f"--steps={args.steps}",
        "--skip=2",  # the overlapped run's first step waits for its first batch, as a synchronous one does
    ]
    runs: dict[str, list[dict[str, Any]]] = {"sync": [], "overlapped": []}
    for _ in range(args.repeats):
        runs["sync"].append(
            step_run(
                step_args([*shape, "--threads=1", *args.overrides, "actor.rollout_correction=tis"]), root
            )
        )
        runs["overlapped"].append(step_run(step_args([*shape, *args.overrides, *OVERLAP]), root))
    return {"config": vars(args) | {"out": str(args.out)}, "runs": runs}


def print_table(result: dict[str, Any]) -> None:
    c = result["config"]
    print(
        f"overlap benchmark: {c['batch']} prompts x n={c['n']}, {c['max_new_tokens']} new tokens, "
        f"{c['image_size']}px, {c['steps']} steps, one core for the trainer and (overlapped) one for rollout"
    )
    print("  (rollout: generating, or waiting for the worker; training: every phase but rollout)")
    print(f"  {'run':<11} {'step s':>7} {'rollout s':>10} {'training s':>11} {'samples/s':>10}")
    for name, runs in result["runs"].items():
        for r in runs:
            phases = r["phases_s"]
            training = sum(v for k, v in phases.items() if k != "rollout")
            print(
                f"  {name:<11} {r['median_step_s']:>7.3f} {phases.get('rollout', 0):>10.3f} "
                f"{training:>11.3f} {r['samples_per_s']:>10.1f}"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run_in_workspace(None, "mmrl-overlap-", lambda folder: run(args, folder))
    print_table(result)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
