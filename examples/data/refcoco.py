"""Convert RefCOCO-style referring expressions into grounding rows mmrl trains on.

Inputs, from the public refer release (refcoco, refcoco+, refcocog) and COCO:
  INSTANCES  instances.json: COCO `images` ({id, file_name, width, height}) and `annotations`
             ({id, image_id, bbox: [x, y, width, height]})
  REFS       refs(unc).p, a pickle of refs; or a JSON list of the same refs:
             {ref_id, ann_id, image_id, split, sentences: [{sent}, ...]}
  IMAGES     the folder of COCO images the instances' file_name values are in (train2014/)

Output: `OUT/<split>.parquet` (train, val, testA, testB, ...), one row per referring sentence:
  problem    <image>Locate "{sentence}" and output its bbox_2d in JSON.
  answer     [x1, y1, x2, y2]: COCO's [x, y, width, height] turned into corners, in pixels of the
             ORIGINAL image
  images     [path of the image relative to OUT], so OUT@train loads wherever it is run from
plus ref_id, ann_id, image_id, sent_id, width and height. Refs whose image file is missing are left out
and counted.

Box frame: the grounding graders (rewards/grounding.py) default to gt_frame="original" and map the
model's box, given in pixels of the resized image it saw (response_frame="model_input"), into the
original image with each sample's image sizes; so the boxes here stay in original pixels, unscaled.

The pickle is read by an unpickler that refuses every class: refs files are plain lists and dicts, so
one that needs a class is not a refs file, and refusing it keeps a doctored file from running code.
Runs offline, on local files.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

PROMPT = '<image>Locate "{sentence}" and output its bbox_2d in JSON.'
SCHEMA = pa.schema(
    [
        ("problem", pa.string()),
        ("answer", pa.list_(pa.float64())),
        ("images", pa.list_(pa.string())),
        ("ref_id", pa.int64()),
        ("ann_id", pa.int64()),
        ("image_id", pa.int64()),
        ("sent_id", pa.int64()),
        ("width", pa.int64()),
        ("height", pa.int64()),
    ]
)


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"the refs file asks for {module}.{name}; a refs file holds only lists, dicts, strings and numbers"
        )


def load_refs(path: Path) -> list[dict[str, Any]]:
    """Refs from a refer-release pickle (read without running any code) or a JSON list."""
    if path.suffix == ".json":
        return json.loads(path.read_text(encoding="utf-8"))
    with path.open("rb") as fh:
        return _PlainUnpickler(fh, encoding="utf-8", errors="replace").load()


def corners(bbox: list[float]) -> list[float]:
    """COCO [x, y, width, height] as [x1, y1, x2, y2], same pixels (COCO's two decimals, no float noise)."""
    x, y, w, h = (float(v) for v in bbox)
    return [x, y, round(x + w, 2), round(y + h, 2)]


def ref_rows(
    ref: dict[str, Any], image: dict[str, Any], bbox: list[float], image_path: str
) -> list[dict[str, Any]]:
    """One row per sentence of a ref."""
    return [
        {
            "problem": PROMPT.format(sentence=sentence["sent"]),
            "answer": corners(bbox),
            "images": [image_path],
            "ref_id": ref["ref_id"],
            "ann_id": ref["ann_id"],
            "image_id": ref["image_id"],
            "sent_id": sentence.get("sent_id"),
            "width": image["width"],
            "height": image["height"],
        }
        for sentence in ref["sentences"]
    ]


def convert(instances: Path, refs: Path, images: Path, out: Path) -> dict[str, dict[str, int]]:
    """Write `out/<split>.parquet` per split of the refs; returns rows and left-out refs per split."""
    coco = json.loads(instances.read_text(encoding="utf-8"))
    image_by_id = {image["id"]: image for image in coco["images"]}
    bbox_by_ann = {ann["id"]: ann["bbox"] for ann in coco["annotations"]}
    rows: dict[str, list[dict[str, Any]]] = {}
    left_out: defaultdict[str, Counter[str]] = defaultdict(Counter)
    for ref in load_refs(refs):
        split_rows = rows.setdefault(ref["split"], [])
        image = image_by_id.get(ref["image_id"])
        if image is None or ref["ann_id"] not in bbox_by_ann:
            left_out[ref["split"]]["not in instances"] += 1
            continue
        path = images / image["file_name"]
        if not path.is_file():
            left_out[ref["split"]]["image missing"] += 1
            continue
        split_rows += ref_rows(ref, image, bbox_by_ann[ref["ann_id"]], os.path.relpath(path, out))
    out.mkdir(parents=True, exist_ok=True)
    for split, written in rows.items():
        pq.write_table(pa.Table.from_pylist(written, SCHEMA), out / f"{split}.parquet")
    return {split: {"rows": len(r), **left_out[split]} for split, r in rows.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Convert RefCOCO-style refs + COCO instances into grounding parquet: OUT/<split>.parquet "
        "with problem, answer ([x1, y1, x2, y2] in original-image pixels) and images (relative paths).",
    )
    parser.add_argument(
        "--instances", type=Path, required=True, help="COCO instances.json of the refer release"
    )
    parser.add_argument("--refs", type=Path, required=True, help="refs(unc).p pickle, or a JSON list of refs")
    parser.add_argument("--images", type=Path, required=True, help="folder of the COCO images (train2014/)")
    parser.add_argument(
        "--out", type=Path, required=True, help="output folder; train with data.train_files=OUT@train"
    )
    args = parser.parse_args(argv)
    for name in ("instances", "refs", "images"):
        if not getattr(args, name).exists():
            print(f"error: --{name} {getattr(args, name)} does not exist", file=sys.stderr)
            return 2
    for split, counts in convert(args.instances, args.refs, args.images, args.out).items():
        print(f"{args.out / split}.parquet: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
