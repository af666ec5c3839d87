"""Env throughput: MuJoCo task steps per second, rendering every frame, in 1 and in N worker processes.

Two measurements: the raw env in plain worker processes (the ceiling), and the same envs behind
`mmrl.envs.workers.EnvPool` (Ray actors, batched calls, timeouts): what an episode rollout gets.

VLA rollouts step many envs per policy decision, so env speed sets the floor on episode time. Each
worker process builds its env, warms it up, waits for the others at a barrier, then times `--steps`
steps of random actions (resetting at episode ends, as a rollout does). Aggregate throughput is the
total steps over the slowest worker's time.

    .venv/bin/python bench/envs.py --workers 1 2 --steps 3000 --out bench/results/envs.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

# This file is bench/envs.py, so with bench/ first on sys.path `import envs` would import itself;
# the repository root goes first so the package wins (common.py is still found in bench/).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import load_average, machine, write_result

WARMUP_STEPS = 50


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=["reach", "push"])
    p.add_argument("--workers", nargs="+", type=int, default=[1, 2], help="worker-process counts to try")
    p.add_argument("--steps", type=int, default=3000, help="timed steps per worker")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument(
        "--pool-envs", type=int, default=8, help="envs stepped together through EnvPool (0: skip the pool)"
    )
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    return p.parse_args(argv)


def worker(task: str, image_size: int, steps: int, seed: int, barrier: Any, results: Any) -> None:
    """Build the env, warm up, wait for every worker, then time ``steps`` random-action steps."""
    import numpy as np

    from mmrl.envs import make_env

    start = time.perf_counter()
    env = make_env(task, image_size=image_size)
    rng = np.random.default_rng(seed)
    env.reset(seed=seed)
    for _ in range(WARMUP_STEPS):
        if any(env.step(rng.uniform(-1, 1, env.action_dim))[2:4]):
            env.reset()
    startup = time.perf_counter() - start
    barrier.wait()
    start = time.perf_counter()
    for _ in range(steps):
        if any(env.step(rng.uniform(-1, 1, env.action_dim))[2:4]):
            env.reset()
    results.put({"startup_s": startup, "elapsed_s": time.perf_counter() - start})
    env.close()


def measure(task: str, workers: int, steps: int, image_size: int) -> dict[str, Any]:
    """Run ``workers`` spawned processes side by side (spawn: an OpenGL context must not be forked)."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(workers), ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(task, image_size, steps, seed, barrier, results))
        for seed in range(workers)
    ]
    for proc in procs:
        proc.start()
    reports = [results.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    slowest = max(r["elapsed_s"] for r in reports)
    return {
        "task": task,
        "workers": workers,
        "steps_per_worker": steps,
        "steps_per_s": workers * steps / slowest,
        "per_worker_steps_per_s": [steps / r["elapsed_s"] for r in reports],
        "startup_s": max(r["startup_s"] for r in reports),
    }


def measure_pool(task: str, workers: int, num_envs: int, steps: int, image_size: int) -> dict[str, Any]:
    """Batched steps through `EnvPool`: every call steps all `num_envs` envs and returns their frames."""
    import numpy as np
    import ray

    from mmrl.envs.workers import EnvPool

    ray.init(num_cpus=max(workers, 2), include_dashboard=False, logging_level="ERROR")
    start = time.perf_counter()
    pool = EnvPool(task, num_envs, workers, {"image_size": image_size})
    startup = time.perf_counter() - start
    rng = np.random.default_rng(0)
    calls = max(1, steps // num_envs)
    action_dim = pool.action_dim
    pool.reset(list(range(num_envs)))
    start = time.perf_counter()
    for _ in range(calls):
        results = pool.step([rng.uniform(-1, 1, action_dim) for _ in range(num_envs)])
        if any(r[2] or r[3] for r in results):  # an episode ended: start a new batch of episodes
            pool.reset(list(rng.integers(0, 2**31, num_envs)))
    elapsed = time.perf_counter() - start
    pool.close()
    ray.shutdown()
    return {
        "task": task,
        "workers": workers,
        "num_envs": num_envs,
        "env_steps_per_s": calls * num_envs / elapsed,
        "batched_calls_per_s": calls / elapsed,
        "startup_s": startup,
    }


def print_table(result: dict[str, Any]) -> None:
    """A short plain-text summary."""
    c = result["config"]
    size = f"{c['image_size']}x{c['image_size']}"
    print(f"env benchmark: {size} frames, random actions, {c['steps']} steps/worker")
    print(f"  {'task':<18}  {'workers':>7}  {'steps/s':>8}  {'per worker':>10}  {'startup':>8}")
    for r in result["results"]:
        per = sum(r["per_worker_steps_per_s"]) / r["workers"]
        rate, startup = r["steps_per_s"], r["startup_s"]
        print(f"  {r['task']:<18}  {r['workers']:>7}  {rate:>8.0f}  {per:>10.0f}  {startup:>7.2f}s")
    if result["pool"]:
        print(f"  through EnvPool (Ray), {c['pool_envs']} envs per batched step:")
        print(f"  {'task':<18}  {'workers':>7}  {'steps/s':>8}  {'calls/s':>10}  {'startup':>8}")
        for r in result["pool"]:
            rate, calls, startup = r["env_steps_per_s"], r["batched_calls_per_s"], r["startup_s"]
            print(f"  {r['task']:<18}  {r['workers']:>7}  {rate:>8.0f}  {calls:>10.0f}  {startup:>7.2f}s")
    before, after = result["load_avg_before"][0], result["load_avg_after"][0]
    print(f"  load avg before/after: {before:.2f} / {after:.2f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = load_average()
    runs = [measure(t, n, args.steps, args.image_size) for t in args.tasks for n in args.workers]
    pool = [
        measure_pool(t, n, args.pool_envs, args.steps, args.image_size)
        for t in args.tasks
        for n in args.workers
        if args.pool_envs
    ]
    result = {
        "system": "mmrl-envs",
        "config": {
            "tasks": args.tasks,
            "workers": args.workers,
            "steps": args.steps,
            "image_size": args.image_size,
            "pool_envs": args.pool_envs,
        },
        "results": runs,
        "pool": pool,
        "load_avg_before": load_before,
        "load_avg_after": load_average(),
        "machine": machine(),
    }
    print_table(result)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
