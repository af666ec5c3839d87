"""Throughput of the built-in graders (samples/s, one process) on realistic response mixes.

Geometry: 250 prompts x 8 responses of ~1.5k characters of reasoning ending in an answer in one of the
forms Geometry3K-style models write (integers, surds, fractions, pi, degrees, rounded decimals, multiple
choice, garbage); timed with cold caches, and with every answer distinct (no cache hits at all).
Grounding: Qwen2.5-VL JSON answers on a 1920x1080 image mapped to model-input pixels, one box and five.

    .venv/bin/python bench/graders.py --out bench/results/graders.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import load_average, median, provenance, write_result

from mmrl.processors import PixelBudget, smart_size
from mmrl.rewards import GRADERS, ImageSize, RewardInput
from mmrl.rewards.geometry import _parse

REASONING = "Consider the figure: triangle ABC is right-angled at B and AB = 5. " * 22


def geometry_samples(rng: random.Random, distinct: bool) -> list[RewardInput]:
    """(response, ground truth) pairs: each prompt's 8 answers are drawn from right and wrong forms."""
    samples = []
    for i in range(250):
        k = rng.randint(2, 40)
        truth, answers, choices = [
            (str(k), [str(k), f"{k}.0", f"{k} cm", f"x = {k}", str(k + 1)], None),
            (
                rf"{k}\sqrt{{3}}",
                [rf"{k}\sqrt{{3}}", rf"\sqrt{{{3 * k * k}}}", f"{k * 3**0.5:.2f}", rf"{k}\sqrt{{2}}"],
                None,
            ),
            (
                rf"\frac{{{k}}}{{{k + 1}}}",
                [f"{k}/{k + 1}", f"{k / (k + 1):.3f}", rf"\frac{{{k + 1}}}{{{k}}}"],
                None,
            ),
            (rf"{k}\pi", [rf"{k}\pi", f"{k * 3.14159265:.2f}", rf"{2 * k}\pi"], None),
            (str(3 * k), [rf"{3 * k}^\circ", f"{3 * k}°", f"{3 * k + 1} degrees"], None),
            ("C", ["C", "(C)", rf"{k}\sqrt{{2}}", "B"], [str(k), str(k + 2), rf"{k}\sqrt{{2}}", str(2 * k)]),
            (str(k), ["", "I am not sure.", f"{k} or {k + 1}", "9^{9^{9^9}}"], None),
        ][i % 7]
        for j in range(8):
            answer = rng.choice(answers)
            if distinct:  # a different number in every response: nothing is served from a cache
                answer = f"{1000 + 8 * i + j}" + (r"\sqrt{3}" if j % 2 else "")
            samples.append(
                RewardInput(
                    response=REASONING + f"So the answer is $\\boxed{{{answer}}}$.",
                    ground_truth=truth,
                    extra={"choices": choices} if choices else {},
                )
            )
    return samples


def grounding_samples(rng: random.Random, boxes: int) -> list[RewardInput]:
    """JSON box answers in model-input pixels, ground truth in original pixels of a 1920x1080 image."""
    original = (1920, 1080)
    height, width = smart_size(1080, 1920, PixelBudget(28 * 28, 1280 * 28 * 28))
    sx, sy = width / 1920, height / 1080
    samples = []
    for _ in range(2000):
        truth = []
        for _ in range(boxes):
            x, y = rng.uniform(0, 1500), rng.uniform(0, 800)
            truth.append([x, y, x + rng.uniform(50, 400), y + rng.uniform(50, 250)])
        predicted = [
            [round(v * s + rng.gauss(0, 6)) for v, s in zip(b, (sx, sy, sx, sy), strict=True)] for b in truth
        ]
        body = json.dumps([{"bbox_2d": b, "label": "object"} for b in predicted])
        samples.append(
            RewardInput(
                response=f"<think>Looking at the image.</think>\n```json\n{body}\n```",
                ground_truth=truth if boxes > 1 else truth[0],
                image_sizes=[ImageSize(original=original, model_input=(width, height))],
            )
        )
    return samples


def rate(
    grader: Callable[[RewardInput], Any], samples: list[RewardInput], repeats: int, before: Callable[[], None]
) -> float:
    """Median samples/s over `repeats` passes; `before` runs untimed before each (cache clearing)."""
    rates = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        for sample in samples:
            grader(sample)
        rates.append(len(samples) / (time.perf_counter() - start))
    return median(rates)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rng = random.Random(0)
    load_before = load_average()
    geometry, iou, multi = GRADERS["geometry"], GRADERS["grounding_iou"], GRADERS["grounding_multi"]
    rows = {
        "geometry (mixed, cold cache)": rate(
            geometry, geometry_samples(rng, False), args.repeats, _parse.cache_clear
        ),
        "geometry (all answers distinct)": rate(
            geometry, geometry_samples(rng, True), args.repeats, _parse.cache_clear
        ),
        "grounding_iou (1 box)": rate(iou, grounding_samples(rng, 1), args.repeats, lambda: None),
        "grounding_multi (5 boxes)": rate(multi, grounding_samples(rng, 5), args.repeats, lambda: None),
    }
    print("grader throughput, one process (samples/s)")
    for name, value in rows.items():
        print(f"  {name:<34} {value:>9.0f}")
    write_result(
        args.out,
        {
            "samples_per_s": rows,
            **provenance(load_before),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
