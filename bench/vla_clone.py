"""What limits a behaviour-cloned VLA policy: SFT variants of an env recipe, each evaluated greedy and
sampled on the same unseen seeds.

Each variant is a list of config overrides on top of the recipe (`mmrl sft`, then `mmrl eval` twice);
variants run as 1-thread subprocesses, `--jobs` at once. Prints a table of greedy and sampled success,
the final cloning loss and the time, and writes it as JSON with the machine.

    python bench/vla_clone.py --config configs/vla_mujoco_reach.yaml --jobs 2 \\
        --variant base= --variant dart=sft.labels=expert,sft.noise=1.0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, machine, write_result

MMRL = [sys.executable, "-m", "mmrl.cli"]


def run_variant(
    name: str, overrides: list[str], config: Path, base_model: Path, episodes: int, root: Path
) -> dict[str, Any]:
    """SFT with `overrides`, then greedy and sampled evaluation of the clone on `episodes` seeds."""
    folder = root / name
    model = folder / "sft"
    common = [f"model.path={model}", f"sft.base_model={base_model}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    _call([*MMRL, "sft", str(config), *common, "--force"], env, folder / "sft.log")
    cloned = time.perf_counter()
    success = {}
    for mode, extra in (
        ("greedy", ["rollout.val.temperature=0"]),
        ("sampled", ["rollout.val.temperature=1"]),
    ):
        out = folder / f"{mode}.json"
        args = [*MMRL, "eval", str(config), *common, *extra, "--checkpoint", str(model)]
        _call([*args, "--episodes", str(episodes), "--out", str(out)], env, folder / f"{mode}.log")
        success[mode] = json.loads(out.read_text())["eval/success"]
    report = json.loads((model / "sft_report.json").read_text())
    return {
        "variant": name,
        "overrides": overrides,
        **success,
        "demo_success": report["demo_success"],
        "loss": report["loss"][-1],
        "sft_s": round(cloned - start),
        "eval_s": round(time.perf_counter() - cloned),
    }


def _call(args: list[str], env: dict[str, str], log: Path) -> None:
    with log.open("w") as handle:
        done = subprocess.run(args, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args[2:4])} failed; see {log}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "vla_mujoco_reach.yaml")
    parser.add_argument(
        "--variant",
        action="append",
        required=True,
        help="NAME=override,override,... (NAME= alone: the recipe as it is)",
    )
    parser.add_argument("--base-model", type=Path, help="default: a fresh `mmrl model init-tiny`")
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="vla_clone_"))
    base = args.base_model
    if base is None:
        from mmrl.models import build_tiny

        base = build_tiny(root / "tiny-model", seed=0)
    variants = [v.split("=", 1) for v in args.variant]
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [
            pool.submit(
                run_variant, name, [o for o in rest.split(",") if o], args.config, base, args.episodes, root
            )
            for name, rest in variants
        ]
        rows = [f.result() for f in futures]
    print(f"\n{args.config.name}, {args.episodes} unseen seeds")
    print(f"{'variant':<16} {'greedy':>7} {'sampled':>8} {'demos ok':>9} {'loss':>6} {'sft s':>6}  overrides")
    for r in rows:
        print(
            f"{r['variant']:<16} {r['greedy']:>7.2f} {r['sampled']:>8.2f} {r['demo_success']:>9.2f} "
            f"{r['loss']:>6.2f} {r['sft_s']:>6}  {' '.join(r['overrides'])}"
        )
    write_result(args.out, {"machine": machine(), "config": str(args.config), "rows": rows})


if __name__ == "__main__":
    main()
