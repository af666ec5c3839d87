"""Video decode throughput: decord vs PyAV through `processors.read_video`.

Writes a synthetic H.264 clip (default 10 s, 224x224, 30 fps) and reads it with each backend,
once decoding every frame and once sampling at the training rate (2 fps). The pixel budget keeps
frames at their source size, so the timings are decoding and RGB conversion, not resizing.

    .venv/bin/python bench/video.py --out bench/results/video.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import load_average, median, provenance, write_result

from mmrl.processors import VideoBudget, read_video

BACKENDS = ("decord", "pyav")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0, help="clip length")
    p.add_argument("--fps", type=int, default=30, help="clip frame rate")
    p.add_argument("--size", type=int, default=224, help="clip side in pixels (multiple of 28)")
    p.add_argument("--sample-fps", type=float, default=2.0, help="rate of the sampled decode")
    p.add_argument("--repeats", type=int, default=5, help="timed reads per case; the median is reported")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    return p.parse_args(argv)


def write_clip(path: Path, seconds: float, fps: int, size: int) -> Path:
    """A moving gradient with texture, encoded with libx264 at its defaults (as most datasets are)."""
    import av

    yy, xx = np.mgrid[0:size, 0:size]
    texture = np.random.default_rng(0).integers(0, 40, (size, size), dtype=np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(round(seconds * fps)):
            frame = np.stack([(xx + 3 * i) % 256, (yy + 2 * i) % 256, (xx + yy + i) % 256], axis=-1)
            frame = (frame.astype(np.uint8) // 2 + np.roll(texture, i, axis=1)[..., None]).astype(np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def time_case(path: Path, backend: str, budget: VideoBudget, repeats: int) -> dict[str, Any]:
    """Median wall time of `read_video` over `repeats` runs, after one untimed warm-up read."""
    frames = len(read_video(path, budget, backend=backend).frames)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        read_video(path, budget, backend=backend)
        times.append(time.perf_counter() - start)
    seconds = median(times)
    return {"frames": frames, "median_s": seconds, "frames_per_s": frames / seconds, "times_s": times}


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Time every backend on the full and the sampled decode of one generated clip."""
    path = write_clip(root / "clip.mp4", args.seconds, args.fps, args.size)
    total = round(args.seconds * args.fps)
    pixels = args.size * args.size
    full = total + total % 2
    room = {
        "max_frames": full,
        "min_pixels": 28 * 28,
        "max_pixels": pixels,
        "max_total_pixels": full * pixels,
    }
    budgets = {"full": VideoBudget(fps=args.fps, **room), "sampled": VideoBudget(fps=args.sample_fps, **room)}
    load_before = load_average()
    cases = {
        f"{backend}/{mode}": time_case(path, backend, budget, args.repeats)
        for mode, budget in budgets.items()
        for backend in BACKENDS
    }
    for case in cases.values():
        case["clip_seconds_per_s"] = args.seconds / case["median_s"]
    return {
        "system": "mmrl video decode",
        "config": {
            "seconds": args.seconds,
            "fps": args.fps,
            "size": args.size,
            "sample_fps": args.sample_fps,
            "repeats": args.repeats,
            "clip_bytes": path.stat().st_size,
        },
        "cases": cases,
        **provenance(load_before),
    }


def print_table(result: dict[str, Any]) -> None:
    """A short plain-text summary."""
    c = result["config"]
    print(
        f"video decode: {c['seconds']:g} s {c['size']}x{c['size']} clip at {c['fps']} fps "
        f"({c['clip_bytes'] / 1024:.0f} KiB), median of {c['repeats']} reads"
    )
    print(f"  {'case':<16} {'frames':>6} {'time':>9} {'frames/s':>9} {'x realtime':>10}")
    for name, case in result["cases"].items():
        print(
            f"  {name:<16} {case['frames']:>6} {case['median_s'] * 1000:>7.1f}ms "
            f"{case['frames_per_s']:>9.0f} {case['clip_seconds_per_s']:>10.1f}"
        )
    print(f"  load avg before/after: {result['load_avg_before'][0]:.2f} / {result['load_avg_after'][0]:.2f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mmrl-video-bench-") as tmp:
        result = run(args, Path(tmp))
    print_table(result)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
