"""A seeded visual task that needs the `image_zoom` tool: name the colours of a small striped mark.

The mark is a square of stripes two pixels wide in one of three colour pairs (red/cyan, green/magenta,
blue/yellow), at one of a few places in a large image (`PLACES`: the four quadrants' centres, two, or one).
Every pair averages to the same grey, so at the policy's pixel budget (the image shrunk 4x) the mark is
a grey square whose colours are gone: without zooming, the answer is at chance (1/3). Zooming onto the
mark (its place's box in `boxes()`, shown enlarged) makes the stripes wide and the answer legible.
Rows are in the EasyR1 jsonl layout, with the mark's box in the model's coordinates (`target_box`, read
by the `zoom_hit` grader).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmrl.data.synthetic import write_meta, write_rows

ANSWERS = ("red", "green", "blue")  # each named by its first stripe colour
PAIRS: dict[str, tuple[tuple[int, int, int], tuple[int, int, int]]] = {
    "red": ((255, 0, 0), (0, 255, 255)),
    "green": ((0, 255, 0), (255, 0, 255)),
    "blue": ((0, 0, 255), (255, 255, 0)),
}
IMAGE_SIZE = 448  # the original; the recipe's budget sees it at 112 x 112
MODEL_SIZE = 112
MARK = 48  # the mark's side in original pixels
STRIPE = 2
QUESTION = "Zoom in and name the colour of the striped mark."
# The places a mark can be, each jittered by a few pixels. Four: one per quadrant's centre. Two: left and
# right, each centred on one 14-px patch of the policy's view (a mark on a patch corner is split four
# ways, so each patch the vision tower sees shifts by a few grey levels only, and where the mark is goes
# unseen). Each place's box in the model's coordinates is 16 px there, 64 px of the original, which the
# zoom shows at 112 px, so each stripe is 3.5 px wide. A quadrant's box (shown at half size) leaves 1-px
# stripes, which the tiny model does not learn to tell apart (docs/benchmarks.md, "Agents").
PLACES = {
    4: [
        (x, y) for y in (IMAGE_SIZE // 4, 3 * IMAGE_SIZE // 4) for x in (IMAGE_SIZE // 4, 3 * IMAGE_SIZE // 4)
    ],
    2: [(84, 196), (364, 196)],  # patch centres (21, 49) and (91, 49) in the model's view
    1: [(IMAGE_SIZE // 4, IMAGE_SIZE // 4)],  # the top-left quadrant's: where to zoom is fixed
}
FOCUS = 16


def boxes(places: int = 4) -> list[list[int]]:
    """Each place's tight box in the model's coordinates: what the warm-up's calls draw from."""
    return [
        [
            c * MODEL_SIZE // IMAGE_SIZE + FOCUS // 2 * d
            for c, d in zip((x, y, x, y), (-1, -1, 1, 1), strict=True)
        ]
        for x, y in PLACES[places]
    ]


# Original pixels either way, in steps of 4 (one stripe pair): the mark stays inside its place's box, and
# a crop from any box (its edges land on multiples of 4) shows the stripes in one phase, so a colour pair
# always reaches the vision tower's patches as the same pattern. With steps of 2 the phase flipped from
# scene to scene, and the tiny model did not learn to read the crop even from 4,800 labelled trajectories
# (docs/benchmarks.md, "Agents", fifth pass).
JITTER = 8


def draw(
    rng: np.random.Generator,
    answer: str,
    place: int,
    places: int = 4,
    background: tuple[int, int] = (178, 199),
) -> tuple[Image.Image, dict[str, Any]]:
    """One scene: grey noise in the `background` range, and the `answer` mark at `place` (of `places`)."""
    pixels = rng.integers(*background, size=(IMAGE_SIZE, IMAGE_SIZE, 3)).astype(np.uint8)
    cx, cy = PLACES[places][place]
    x, y = (c - MARK // 2 + 4 * int(rng.integers(-JITTER // 4, JITTER // 4 + 1)) for c in (cx, cy))
    first, second = PAIRS[answer]
    index = np.arange(MARK) // STRIPE % 2
    stripes = np.where(index[None, :, None] == 0, first, second)  # vertical stripes
    pixels[y : y + MARK, x : x + MARK] = np.broadcast_to(stripes, (MARK, MARK, 3))
    scale = MODEL_SIZE / IMAGE_SIZE
    target = [round(v * scale, 1) for v in (x, y, x + MARK, y + MARK)]
    params = {"x": x, "y": y, "place": place, "target_box": target}
    return Image.fromarray(pixels), params


def generate_zoom(
    out_dir: str | Path,
    n_train: int = 512,
    n_val: int = 96,
    seed: int = 0,
    places: int = 4,
    background: tuple[int, int] = (178, 199),
) -> dict[str, Any]:
    """Write `train.jsonl` and `val.jsonl` (balanced answers and places) with their images."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    histogram = {}
    for split, n in (("train", n_train), ("val", n_val)):
        rng = np.random.default_rng([seed, ("train", "val").index(split), 7])
        cells = [(a, q) for q in range(places) for a in ANSWERS]
        order = [cells[i % len(cells)] for i in rng.permutation(n)]
        rows = []
        for index, (answer, place) in enumerate(order):
            image, params = draw(rng, answer, place, places, background)
            rel = f"images/{split}_{index:06d}.png"
            image.save(out / rel, compress_level=1)
            row = {
                "problem": f"<image>{QUESTION}",
                "answer": answer,
                "images": [rel],
                "target_box": params.pop("target_box"),  # the mark, in the model's coordinates (`zoom_hit`)
                "params": params,
            }
            rows.append(row)
        write_rows(out / f"{split}.jsonl", rows)
        histogram[split] = dict(Counter(a for a, _ in order))
    meta = {"task": "zoom", "seed": seed, "places": places, "n_train": n_train, "n_val": n_val}
    meta |= {"answers": list(ANSWERS), "answer_histogram": histogram}
    write_meta(out, meta)
    return meta
