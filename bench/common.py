"""Shared set-up for the benchmark scripts: a tiny model, the colour task and mmrl overrides."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "configs" / "quickstart.yaml"
QUESTION = "What colour is the shape?"


def make_workspace(root: Path, n_train: int, image_size: int, n_val: int = 16) -> tuple[Path, Path]:
    """Build the tiny Qwen2.5-VL and render the colour task under `root` (reused when present)."""
    from mmrl.data.synthetic import generate
    from mmrl.models import build_tiny

    model_dir, data_dir = root / "tiny-model", root / "data"
    if not (model_dir / "config.json").exists():
        build_tiny(model_dir, seed=0)
    if not (data_dir / "train.jsonl").exists():
        generate(data_dir, task="color", n_train=n_train, n_val=n_val, seed=0, image_size=image_size)
    return model_dir, data_dir


def data_overrides(model_dir: Path, data_dir: Path, run_dir: Path, image_size: int) -> list[str]:
    """Paths and the pixel budget that keep every image at `image_size` squared."""
    pixels = image_size * image_size
    visual_tokens = pixels // (28 * 28)
    return [
        f"model.path={model_dir}",
        f"data.train_files={data_dir / 'train.jsonl'}",
        "data.val_files=[]",
        f"data.min_pixels={pixels}",
        f"data.max_pixels={pixels}",
        f"data.max_prompt_length={max(128, visual_tokens + 64)}",
        f"trainer.output_dir={run_dir}",
        "trainer.val_every=0",
        "trainer.val_before_train=false",
        "trainer.save_every=0",
        "trainer.loggers=[jsonl]",
        "trainer.progress=false",
    ]


def median(values: list[float]) -> float:
    """Median, NaN for an empty list."""
    return statistics.median(values) if values else float("nan")


def load_average() -> tuple[float, float, float]:
    """The 1/5/15-minute load averages, to flag runs disturbed by other work on the machine."""
    return os.getloadavg()


def provenance(load_before: tuple[float, float, float]) -> dict[str, Any]:
    """What every result records about how it was measured: the load around it and the machine."""
    return {"load_avg_before": load_before, "load_avg_after": load_average(), "machine": machine()}


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    cpu = "unknown"
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "git": _git_head(),
    }


def _git_head() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_in_workspace(
    workdir: Path | None, prefix: str, run: Callable[[Path], dict[str, Any]]
) -> dict[str, Any]:
    """`run(folder)` in `workdir` if given (kept for inspection), else in a temporary folder."""
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        return run(workdir)
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        return run(Path(tmp))


def write_result(out: Path | None, result: dict[str, Any]) -> None:
    """Save the result as JSON where `--out` says, if it says anywhere."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
