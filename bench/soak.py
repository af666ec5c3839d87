"""Soak: long runs of the quickstart, the zoom agent and a VLA run with env workers, watching host memory.

Each scenario is `mmrl` as a user runs it, in its own subprocess; every second the bench sums the resident
memory of that process and all its children (env workers, reward workers, Ray) and notes the step the
run's metrics.jsonl has reached. A leak shows as a slope: the table gives, per scenario, the memory once
warm (at 10% of the steps), the least-squares slope per 100 steps after that, and the peak.

    python bench/soak.py                                   # 1000 quickstart, 200 agent, 100 VLA steps
    python bench/soak.py --scenarios colour --steps 300 --out /tmp/soak.json
    python bench/soak.py --scenarios zoom data.train_batch_size=4   # a smaller batch, the same machinery
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, machine, write_result

QUIET = ("trainer.val_every=0", "trainer.save_every=0", "trainer.progress=false", "trainer.loggers=[jsonl]")
DEFAULT_STEPS = {"colour": 1000, "zoom": 200, "vla": 100}


def _mmrl(*args: str) -> list[str]:
    return [
        sys.executable,
        "-c",
        "import sys; from mmrl.cli import main; sys.exit(main(sys.argv[1:]))",
        *args,
    ]


def commands(
    name: str, root: Path, steps: int, overrides: tuple[str, ...] = ()
) -> tuple[list[list[str]], Path]:
    """The commands of scenario `name` (set-up first, the watched run last, with `overrides`) and its run
    folder."""
    run = root / "run"
    if name in ("colour", "zoom"):
        quick = ["quickstart", "--task", name, "--out", str(root), f"trainer.total_steps={steps}"]
        return [_mmrl(*quick, *QUIET, *overrides)], run
    model, cloned = root / "tiny-model", root / "sft-model"
    config = str(REPO / "configs" / "vla_mujoco_reach.yaml")
    # A short behaviour-cloning pass: the soak watches RL's episodes, not the quality of the clone.
    setup = [
        _mmrl("model", "init-tiny", str(model)),
        _mmrl("sft", config, f"sft.base_model={model}", f"model.path={cloned}", "sft.steps=20"),
    ]
    train = _mmrl(
        "train",
        config,
        f"model.path={cloned}",
        f"trainer.output_dir={run}",
        f"trainer.total_steps={steps}",
        "env.num_workers=2",
        *QUIET,
        *overrides,
    )
    return [*setup, train], run


def tree_rss_gb(proc: psutil.Process) -> float:
    """Resident memory of `proc` and every process below it."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # ended between the listing and the read
            total += p.memory_info().rss
    return total / 2**30


def steps_done(metrics: Path) -> int:
    """The newest step metrics.jsonl holds (0 before the first)."""
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    try:
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except ValueError:  # a line being written
        return int(json.loads(lines[-2])["step"]) if len(lines) > 1 else 0


def watch(cmd: list[str], metrics: Path, log: Path) -> list[tuple[float, int, float]]:
    """Run `cmd`, sampling (seconds, step, tree RSS in GiB) every second until it ends."""
    samples = []
    start = time.perf_counter()
    with log.open("w") as out:
        child = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        proc = psutil.Process(child.pid)
        while child.poll() is None:
            samples.append((time.perf_counter() - start, steps_done(metrics), tree_rss_gb(proc)))
            time.sleep(1.0)
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[3:6])}... exited with {child.returncode}; see {log}")
    return samples


def slope_per_100(samples: list[tuple[float, int, float]], steps: int) -> tuple[float, float]:
    """(memory once warm, least-squares GiB per 100 steps after it), from the samples past 10% of the steps."""
    warm = [(s, rss) for _, s, rss in samples if s >= max(1, steps // 10)]
    if len(warm) < 2:
        return float("nan"), float("nan")
    xs, ys = [s for s, _ in warm], [r for _, r in warm]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else float("nan")
    return ys[0], 100 * slope


def soak(name: str, steps: int, workdir: Path, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    root = workdir / name
    root.mkdir(parents=True, exist_ok=True)
    (*setup, train), run = commands(name, root, steps, overrides)
    for i, cmd in enumerate(setup):
        with (root / f"setup{i}.log").open("w") as out:
            subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=True)
    samples = watch(train, run / "metrics.jsonl", root / "train.log")
    warm, slope = slope_per_100(samples, steps)
    return {
        "scenario": name,
        "steps": steps_done(run / "metrics.jsonl"),
        "seconds": samples[-1][0] if samples else 0.0,
        "warm_gb": warm,
        "slope_gb_per_100_steps": slope,
        "peak_gb": max((rss for *_, rss in samples), default=float("nan")),
        "samples": samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", nargs="+", choices=list(DEFAULT_STEPS), default=list(DEFAULT_STEPS))
    parser.add_argument("--steps", type=int, help="steps for every scenario (default: 1000, 200, 100)")
    parser.add_argument("--workdir", type=Path, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--out", type=Path, help="write the results, samples included, as JSON here")
    parser.add_argument("overrides", nargs="*", help="key=value on every scenario's watched run")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="mmrl-soak-") as tmp:
        workdir = args.workdir or Path(tmp)
        overrides = tuple(args.overrides)
        results = [soak(n, args.steps or DEFAULT_STEPS[n], workdir, overrides) for n in args.scenarios]

    print(f"{'scenario':<10}{'steps':>7}{'seconds':>9}{'warm GiB':>10}{'GiB/100 steps':>15}{'peak GiB':>10}")
    for r in results:
        print(
            f"{r['scenario']:<10}{r['steps']:>7}{r['seconds']:>9.0f}{r['warm_gb']:>10.3f}"
            f"{r['slope_gb_per_100_steps']:>15.4f}{r['peak_gb']:>10.3f}"
        )
    write_result(args.out, {"machine": machine(), "overrides": args.overrides, "results": results})


if __name__ == "__main__":
    main()
