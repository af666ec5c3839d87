"""The synthetic clip tasks (`mmrl data synth --task recolor|motion`): the answer is in the frames the
model is given, and only across them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mmrl.cli import main
from mmrl.data.synthetic import COLOURS
from mmrl.processors.video import VideoBudget, read_video

BUDGET = VideoBudget(fps=2.0, max_frames=4, min_pixels=12544, max_pixels=12544, max_total_pixels=50176)


def _clips(root: Path, task: str) -> list[tuple[dict, np.ndarray]]:
    assert main(["data", "synth", str(root), "--task", task, "--n-train", "8", "--n-val", "4"]) == 0
    rows = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]
    return [(row, read_video(row["videos"][0], BUDGET, base_dir=root).frames) for row in rows]


def _dot_colour(frame: np.ndarray) -> str:
    """The palette colour nearest the frame's most saturated pixels (the dot; the background is grey)."""
    pixels = frame.reshape(-1, 3).astype(int)
    dot = pixels[np.ptp(pixels, axis=1) > 80].mean(axis=0)
    return min(COLOURS, key=lambda name: np.abs(np.array(COLOURS[name]) - dot).sum())


def test_a_recolor_clip_ends_in_its_answer_after_showing_another_colour(tmp_path: Path) -> None:
    clips = _clips(tmp_path, "recolor")
    assert sorted(row["answer"] for row, _ in clips) == sorted(["red", "blue", "green", "purple"] * 2)
    for row, frames in clips:
        assert frames.shape == (4, 112, 112, 3)
        first, last = _dot_colour(frames[0]), _dot_colour(frames[-1])
        assert last == row["answer"] == _dot_colour(frames[2]), row
        assert first == _dot_colour(frames[1]) != last, f"the dot should show another colour first: {row}"


def test_a_motion_clip_moves_the_dot_the_way_its_answer_says(tmp_path: Path) -> None:
    for row, frames in _clips(tmp_path, "motion"):
        centre = [np.argwhere(np.ptp(f.astype(int), axis=2) > 80).mean(axis=0) for f in frames]
        dy, dx = centre[-1] - centre[0]
        moved = {"right": dx, "left": -dx, "down": dy, "up": -dy}
        assert max(moved, key=moved.get) == row["answer"], (row, centre)
