"""The three VLA policy kinds side by side on one env recipe: action tokens, a Gaussian head and a flow
expert, each cloned the same way and trained with the same episode GRPO for the same steps.

Each kind is `mmrl sft` then `mmrl train` as a user runs them, in 1-thread subprocesses (`--jobs` at
once, so kinds that run together share the machine alike). The table gives the clone's validation
success, RL's at the end, the lift, the cloning and RL time, wall seconds per RL step (validations
included) and training episodes per second of rollout; the JSON keeps every validation.

    python bench/vla_heads.py --jobs 3 --out bench/results/vla_heads.json
    python bench/vla_heads.py --kinds gaussian flow --steps 40 --seed 2
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, machine, write_result

from mmrl.config import load_config
from mmrl.models import build_tiny

MMRL = [sys.executable, "-m", "mmrl.cli"]
# One cloning recipe for every kind: the expert's own action at the states its noisy runs visit (DART),
# and for the continuous kinds a wide starting noise, so that groups of episodes differ and GRPO has signal.
SHARED = ("sft.demos=100", "sft.steps=400", "sft.labels=expert", "sft.action_std=0.5")


def run_kind(kind: str, args: argparse.Namespace, base_model: Path, root: Path) -> dict[str, Any]:
    folder = root / kind
    folder.mkdir(parents=True, exist_ok=True)
    common = [
        f"model.path={folder / 'sft'}",
        f"sft.base_model={base_model}",
        f"sft.policy={kind}",
        *SHARED,
        f"env.val_episodes={args.episodes}",
        f"trainer.total_steps={args.steps}",
        f"trainer.val_every={args.val_every}",
        f"trainer.seed={args.seed}",
        f"trainer.output_dir={folder / 'run'}",
        "trainer.save_every=0",
        "trainer.progress=false",
        "trainer.loggers=[jsonl]",
        *args.overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    _call([*MMRL, "sft", args.config, *common, "--force"], env, folder / "sft.log")
    cloned = time.perf_counter()
    _call([*MMRL, "train", args.config, *common], env, folder / "train.log")
    trained = time.perf_counter()
    records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    validations = [(r["step"], r["val/success"]) for r in records if "val/success" in r]
    # A step whose groups all scored alike trains nothing and logs no timing: rollouts are timed where logged.
    rollout_s = float(np.mean([r["timing/rollout"] for r in records if "timing/rollout" in r] or [np.nan]))
    cfg = load_config(args.config, common)
    episodes_per_step = cfg.data.train_batch_size * cfg.rollout.n
    return {
        "kind": kind,
        "cloned": validations[0][1],
        "after_rl": validations[-1][1],
        "lift": validations[-1][1] - validations[0][1],
        "validations": validations,
        "sft_s": cloned - start,
        "rl_s": trained - cloned,
        "s_per_step": (trained - cloned) / args.steps,  # wall time, validations and start-up included
        "episodes_per_s": episodes_per_step / rollout_s,
    }


def _call(command: list[str], env: dict[str, str], log: Path) -> None:
    with log.open("w") as out:
        done = subprocess.run(command, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{' '.join(command[2:4])} failed ({done.returncode}); see {log}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(REPO / "configs" / "vla_mujoco_reach.yaml"))
    parser.add_argument("--kinds", nargs="+", default=["tokens", "gaussian", "flow"])
    parser.add_argument("--steps", type=int, default=20, help="RL steps")
    parser.add_argument("--val-every", type=int, default=10)
    parser.add_argument("--episodes", type=int, default=100, help="validation episodes (unseen seeds)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--root", type=Path, help="keep every run's logs and metrics here (default: a temp dir)"
    )
    parser.add_argument("overrides", nargs="*", help="config overrides for every kind")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = args.root or Path(tmp)
        base = build_tiny(root / "tiny-model", seed=0)
        with ThreadPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(lambda kind: run_kind(kind, args, base, root), args.kinds))
    print(
        f"{'kind':10} {'cloned':>7} {'after RL':>9} {'lift':>6} {'SFT s':>6} {'RL s':>6} {'s/step':>7} {'ep/s':>6}"
    )
    for r in rows:
        print(
            f"{r['kind']:10} {r['cloned']:7.2f} {r['after_rl']:9.2f} {r['lift']:+6.2f} {r['sft_s']:6.0f} "
            f"{r['rl_s']:6.0f} {r['s_per_step']:7.1f} {r['episodes_per_s']:6.2f}"
        )
    if args.out:
        write_result(
            args.out,
            {
                "machine": machine(),
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "rows": rows,
            },
        )


if __name__ == "__main__":
    main()
