"""Write seeded arithmetic word problems with numeric answers, for text-only recipes (configs/qwen3_math.yaml).

Output: `OUT/train.jsonl` and `OUT/val.jsonl` in EasyR1's layout, one row per problem:
  problem   a one- or two-step word problem ("Mia has 12 apples and buys 7 more. ...")
  answer    the number, as text ("19")
plus `template` (which kind of problem). The `geometry` grader checks answers by value, so `19`,
`19.0` and `\\boxed{19}` all count. Train with `data.train_files=OUT@train data.val_files=OUT@val`.
Runs offline; the same seed writes the same files.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "coins")


def _add(r: random.Random) -> tuple[str, int]:
    name, item, a, b = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 60), r.randint(2, 40)
    return f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", a + b


def _subtract(r: random.Random) -> tuple[str, int]:
    name, item, b = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 30)
    a = b + r.randint(1, 50)
    return f"{name} had {a} {item} and gave {b} away. How many {item} are left?", a - b


def _multiply(r: random.Random) -> tuple[str, int]:
    item, boxes, each = r.choice(ITEMS), r.randint(2, 12), r.randint(2, 12)
    return (
        f"There are {boxes} boxes with {each} {item} in each box. How many {item} are there in total?",
        boxes * each,
    )


def _divide(r: random.Random) -> tuple[str, int]:
    name, item, kids, each = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 9), r.randint(2, 12)
    return (
        f"{name} shares {kids * each} {item} equally among {kids} friends. How many {item} does each friend get?",
        each,
    )


def _two_step(r: random.Random) -> tuple[str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    packs, each, lost = r.randint(2, 8), r.randint(3, 10), r.randint(1, 5)
    return (
        f"{name} buys {packs} packs of {each} {item} and then loses {lost} of them. "
        f"How many {item} does {name} have?",
        packs * each - lost,
    )


def _perimeter(r: random.Random) -> tuple[str, int]:
    a, b = r.randint(2, 30), r.randint(2, 30)
    return f"A rectangle is {a} cm long and {b} cm wide. What is its perimeter in cm?", 2 * (a + b)


TEMPLATES: dict[str, Callable[[random.Random], tuple[str, int]]] = {
    "add": _add,
    "subtract": _subtract,
    "multiply": _multiply,
    "divide": _divide,
    "two_step": _two_step,
    "perimeter": _perimeter,
}


def problems(n: int, seed: int) -> list[dict[str, str]]:
    """`n` problems, the templates taken in turn, numbers drawn from `seed`."""
    r = random.Random(seed)
    names = list(TEMPLATES)
    rows = []
    for i in range(n):
        template = names[i % len(names)]
        text, answer = TEMPLATES[template](r)
        rows.append({"problem": text, "answer": str(answer), "template": template})
    return rows


def write(out: str | Path, n_train: int = 2048, n_val: int = 128, seed: int = 0) -> Path:
    """Write `out/train.jsonl` and `out/val.jsonl` (disjoint seeds) and return `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for split, n, split_seed in (("train", n_train, seed), ("val", n_val, seed + 1_000_003)):
        lines = "".join(json.dumps(row) + "\n" for row in problems(n, split_seed))
        (out / f"{split}.jsonl").write_text(lines, encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", help="output folder (train.jsonl, val.jsonl)")
    parser.add_argument("--n-train", type=int, default=2048)
    parser.add_argument("--n-val", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = write(args.out, args.n_train, args.n_val, args.seed)
    print(f"wrote {args.n_train} train and {args.n_val} val problems to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
