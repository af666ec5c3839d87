"""What can the tiny policy read from the zoom task's first view alone, without the tool?

Single-turn GRPO with the colour quickstart's recipe over the zoom task's scenes (`mmrl.data.synthetic_zoom`):
- `--ask side`: "is the mark on the left or the right?" over two-place scenes (chance 0.5). The zoom
  quickstart asks the policy to pick the box that holds the mark from this view.
- `--ask colour --places 1`: the zoom task's own question with the tool taken away, the no-tool
  baseline (chance 1/3): the best a policy that never zooms learns.
Each variant is a quickstart run with its own overrides (`bench/quickstart_sweep.py`); greedy held-out
accuracy at every validation.

    python bench/zoom_locate.py --variant 112= --variant 56=data.min_pixels=3136,data.max_pixels=3136
    python bench/zoom_locate.py --ask colour --places 1 --variant no_tool=
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, write_result
from quickstart_sweep import run_variant

from mmrl.data.synthetic_zoom import generate_zoom

QUESTIONS = {
    "side": "<image>Is the grey mark on the left or the right?",
    "colour": "<image>Name the colour of the striped mark.",
}


def write_rows(
    data_dir: Path, ask: str, places: int, background: tuple[int, int], n_train: int = 1024, n_val: int = 96
) -> None:
    """The zoom task's scenes, each row asking `QUESTIONS[ask]` (the side's answer is left or right)."""
    generate_zoom(data_dir, n_train, n_val, places=places, background=background)
    for split in ("train", "val"):
        path = data_dir / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        for row in rows:
            row["problem"] = QUESTIONS[ask]
            if ask == "side":
                row["answer"] = ("left", "right")[row["params"]["place"]]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", action="append", required=True, help="NAME=override,override,...")
    parser.add_argument("--ask", choices=sorted(QUESTIONS), default="side")
    parser.add_argument("--places", type=int, choices=(1, 2, 4), default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--background", default="178,199", help="the noise's grey range, as LO,HI")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="zoom_locate_"))
    low, high = (int(v) for v in args.background.split(","))
    if args.ask == "side" and args.places != 2:
        parser.error("--ask side needs --places 2 (left or right)")
    schedule = [f"trainer.total_steps={args.steps}", "trainer.val_every=25", "trainer.save_every=100000"]
    variants = [v.split("=", 1) for v in args.variant]
    for name, _ in variants:
        write_rows(root / name / "data", args.ask, args.places, (low, high))
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [
            pool.submit(
                run_variant, "colour", name, [*schedule, *(o for o in rest.split(",") if o)], root, 7200
            )
            for name, rest in variants
        ]
        rows = [f.result() for f in futures]
    chance = 0.5 if args.ask == "side" else 1 / 3
    print(f"\n{args.ask}, greedy held-out accuracy (chance {chance:.2f}), background {low}-{high}")
    for r in rows:
        print(f"{r['variant']:<10} {r['wall_s']:>5} s  " + " ".join(f"{s}:{v:.2f}" for s, v in r["val"]))
    write_result(
        args.out,
        {
            "machine": machine(),
            "ask": args.ask,
            "places": args.places,
            "background": [low, high],
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
