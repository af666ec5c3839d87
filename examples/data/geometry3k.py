"""Convert the public Geometry3K release into EasyR1-style parquet files that mmrl trains on.

Input: the release's geometry3k folder (from the Inter-GPS project), one folder per split (train, val,
test), each holding `<id>/data.json` and `<id>/img_diagram.png`; data.json has `problem_text`,
`choices` (the options, A first), `answer` (a letter) and `id`.

Output: `OUT/<split>.parquet`, one row per problem, with the columns of EasyR1's geometry3k:
  problem        "<image>" + problem_text; with --choices-in-prompt the lettered options follow
  answer         the TEXT of the correct option (e.g. "2\\sqrt{221}"), not its letter
  images         [{"bytes": <png>, "path": null}], embedded as HF `datasets` stores images
plus choices (the options), answer_letter and id. The answer is the option's text so that the
`geometry` grader accepts a model that writes the value; since `choices` reaches the grader in
`extra`, a model that answers with the right letter is accepted too.

Then train with `data.train_files=OUT@train data.val_files=OUT@val`. Runs offline, on local files.
"""

from __future__ import annotations

import argparse
import json
import string
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = pa.schema(
    [
        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
        ("problem", pa.string()),
        ("answer", pa.string()),
        ("choices", pa.list_(pa.string())),
        ("answer_letter", pa.string()),
        ("id", pa.string()),
    ]
)


class BadProblem(ValueError):
    """A problem folder that cannot become a row; the message is the reason counted in the summary."""


def problem_row(folder: Path, choices_in_prompt: bool = False) -> dict[str, Any]:
    """The parquet row of one problem folder, or BadProblem saying what is wrong with it."""
    data_file, image_file = folder / "data.json", folder / "img_diagram.png"
    if not data_file.is_file() or not image_file.is_file():
        raise BadProblem("missing data.json or img_diagram.png")
    try:
        data = json.loads(data_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        raise BadProblem("data.json is not valid JSON") from None
    if not isinstance(data, dict):
        raise BadProblem("data.json is not an object")
    text, choices, letter = data.get("problem_text"), data.get("choices"), data.get("answer")
    if not isinstance(text, str) or not text.strip():
        raise BadProblem("no problem_text")
    if not isinstance(choices, list) or not choices:
        raise BadProblem("no choices")
    letters = string.ascii_uppercase[: len(choices)]
    if not isinstance(letter, str) or len(letter) != 1 or letter not in letters:
        raise BadProblem("answer is not one of the choice letters")
    choices = [str(choice) for choice in choices]
    problem = "<image>" + text.strip()
    if choices_in_prompt:
        problem += "\nChoices: " + " ".join(f"({k}) {c}" for k, c in zip(letters, choices, strict=True))
    return {
        "images": [{"bytes": image_file.read_bytes(), "path": None}],
        "problem": problem,
        "answer": choices[letters.index(letter)],
        "choices": choices,
        "answer_letter": letter,
        "id": str(data.get("id", folder.name)),
    }


def _problem_folders(split_dir: Path) -> list[Path]:
    """Problem folders in id order: shorter names first, so numeric ids sort as numbers (2 before 10)."""
    return sorted((p for p in split_dir.iterdir() if p.is_dir()), key=lambda p: (len(p.name), p.name))


def convert(root: Path, out: Path, choices_in_prompt: bool = False) -> dict[str, dict[str, int]]:
    """Write `out/<split>.parquet` for each split folder of `root`; returns rows and skips per split."""
    splits = sorted(p for p in root.iterdir() if p.is_dir() and any(p.glob("*/data.json")))
    if not splits:
        raise FileNotFoundError(
            f"no split folders with <id>/data.json under {root}; point at the release's geometry3k folder, "
            "the one holding train/, val/ and test/"
        )
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, dict[str, int]] = {}
    for split_dir in splits:
        rows, skipped = [], Counter()
        for folder in _problem_folders(split_dir):
            try:
                rows.append(problem_row(folder, choices_in_prompt))
            except BadProblem as err:
                skipped[str(err)] += 1
        pq.write_table(pa.Table.from_pylist(rows, SCHEMA), out / f"{split_dir.name}.parquet")
        summary[split_dir.name] = {"rows": len(rows), **skipped}
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Convert the Geometry3K release (train/<id>/data.json + img_diagram.png) into "
        "EasyR1-style parquet: OUT/<split>.parquet with problem, answer (the correct choice's text), "
        "images (embedded PNG), choices.",
    )
    parser.add_argument("root", type=Path, help="the release's geometry3k folder, holding train/ val/ test/")
    parser.add_argument("out", type=Path, help="output folder; train with data.train_files=OUT@train")
    parser.add_argument(
        "--choices-in-prompt", action="store_true", help="append the lettered choices to each problem"
    )
    args = parser.parse_args(argv)
    try:
        summary = convert(args.root, args.out, args.choices_in_prompt)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for split, counts in summary.items():
        print(f"{args.out / split}.parquet: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
