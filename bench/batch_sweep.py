"""Training throughput against batch size: `bench/step.py` at several prompt batch sizes, one plot.

.venv/bin/python bench/batch_sweep.py --batches 4 8 16 32 64 --steps 8 --plot docs/throughput_vs_batch.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import step
from common import run_in_workspace, write_result


def sweep(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    rows = []
    for batch in args.batches:
        step_args = step.parse_args(
            ["--batch", str(batch), "--n", str(args.n), "--steps", str(args.steps), "--max-new-tokens", "8"]
        )
        result = step.run(step_args, root)
        rows.append(
            {
                "batch": batch,
                **{k: result[k] for k in ("samples_per_s", "tokens_per_s", "median_step_s", "peak_rss_gb")},
            }
        )
        print(
            f"  batch {batch:>3} x n={args.n}: {result['samples_per_s']:7.1f} samples/s, step {result['median_step_s']:.3f} s"
        )
    return {"n": args.n, "rows": rows, "machine": result["machine"]}


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch"] * result["n"] for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.plot(batches, [r["samples_per_s"] for r in result["rows"]], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("responses per step (prompts x n)")
    ax.set_ylabel("samples / s")
    ax.set_ylim(bottom=0)
    ax.set_title("mmrl training throughput, tiny Qwen2.5-VL on CPU")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    result = run_in_workspace(None, "mmrl-sweep-", lambda root: sweep(args, root))
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
