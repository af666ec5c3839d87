"""Episode collection end to end: a tiny Qwen2.5-VL acting in MuJoCo through `mmrl.vla.run_episodes`.

What a VLA training step waits for before it can update: frames rendered, turned into prompts,
one batched `generate` per step for every live env, action tokens decoded, envs stepped. Measured
with the envs in the trainer's process (`env.num_workers=0`) and on 1 and 2 Ray env workers.

    .venv/bin/python bench/episodes.py --episodes 64 --repeats 3 --out bench/results/episodes.json

With action chunks (`--chunk 4`), steps inside a chunk go unrendered; `--render-every-step` adds rows
that render them anyway, the loop as it was before, for a side-by-side comparison:

    .venv/bin/python bench/episodes.py --task metaworld/reach-v3 --image-size 112 --max-steps 120 \
        --chunk 4 --episodes 16 --workers 0 --render-every-step
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `envs` the package, not bench/envs.py

from common import load_average, machine, write_result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="reach")
    p.add_argument("--episodes", type=int, default=64, help="episodes collected together (envs)")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--image-size", type=int, default=56)
    p.add_argument("--workers", nargs="+", type=int, default=[0, 1, 2], help="0: envs in this process")
    p.add_argument("--chunk", type=int, default=1, help="actions per decision, executed open-loop")
    p.add_argument("--render-every-step", action="store_true", help="also measure rendering every step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


class CountedEnvs:
    """The envs, counting the steps taken; with `render_all`, rendering every step whatever is asked."""

    def __init__(self, envs: Any, render_all: bool) -> None:
        self.envs, self.render_all, self.steps = envs, render_all, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.envs, name)

    def step(self, actions: list[Any], render: list[bool] | None = None) -> list[Any]:
        self.steps += sum(a is not None for a in actions)
        return self.envs.step(actions, None if self.render_all else render)


def measure(
    args: argparse.Namespace, workers: int, model: Any, processor: Any, render_all: bool = False
) -> dict[str, Any]:
    import torch

    from mmrl.envs.actions import ActionTokenizer
    from mmrl.envs.vector import LocalEnvs
    from mmrl.processors import PixelBudget
    from mmrl.rollout import SamplingParams
    from mmrl.rollout.hf import HFEngine
    from mmrl.vla.episodes import run_episodes
    from mmrl.vla.observations import ObservationPrompts

    options = {"image_size": args.image_size, "max_steps": args.max_steps}
    start = time.perf_counter()
    if workers:
        from mmrl.envs.workers import EnvPool

        envs: Any = EnvPool(args.task, args.episodes, workers, options)
    else:
        envs = LocalEnvs(args.task, args.episodes, options)
    envs = CountedEnvs(envs, render_all)
    startup = time.perf_counter() - start
    pixels = args.image_size**2
    prompts = ObservationPrompts(processor, PixelBudget(min_pixels=pixels, max_pixels=pixels))
    # Every id an action bin: the untrained model's random tokens are all valid actions, so episodes
    # run their full length unless the arm touches a ball.
    tokenizer = ActionTokenizer(
        action_dim=envs.action_dim, start_id=0, n_bins=model.config.text_config.vocab_size, chunk=args.chunk
    )
    engine = HFEngine(model, processor)
    times, decisions = [], 0
    for repeat in range(args.repeats):
        torch.manual_seed(repeat)
        seeds = list(range(repeat * args.episodes, (repeat + 1) * args.episodes))
        start = time.perf_counter()
        episodes = run_episodes(engine, envs, prompts, tokenizer, seeds, SamplingParams(temperature=1.0))
        times.append(time.perf_counter() - start)
        decisions += len(episodes.batch)
    envs.close()
    elapsed = statistics.median(times)
    return {
        "workers": workers,
        "render_every_step": render_all,
        "startup_s": startup,
        "median_s": elapsed,
        "episodes_per_s": args.episodes / elapsed,
        "decisions_per_s": decisions / args.repeats / elapsed,
        "env_steps_per_s": envs.steps / args.repeats / elapsed,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray
    import torch

    from mmrl.models import build_tiny, load_policy, load_processor

    load_before = load_average()
    folder = build_tiny(Path(tempfile.mkdtemp()) / "tiny")
    model, processor = load_policy(folder, torch.float32, "cpu").eval(), load_processor(folder)
    ray.init(num_cpus=max(2, *args.workers), include_dashboard=False, logging_level="ERROR")
    modes = [False, True] if args.render_every_step else [False]
    results = [measure(args, w, model, processor, every) for w in args.workers for every in modes]
    ray.shutdown()
    result = {
        "machine": machine(),
        "config": vars(args) | {"out": str(args.out)},
        "results": results,
        "load_avg_before": load_before,
        "load_avg_after": load_average(),
    }
    print(
        f"episode collection: {args.episodes} {args.task} episodes of up to {args.max_steps} steps, "
        f"{args.image_size}px frames, chunks of {args.chunk}, tiny Qwen2.5-VL (HF engine), "
        f"median of {args.repeats}"
    )
    print(
        f"  {'env workers':<12}  {'frames':<14}  {'episodes/s':>10}  {'decisions/s':>11}  {'env steps/s':>11}  {'startup':>8}"
    )
    for r in results:
        where = "in-process" if not r["workers"] else f"{r['workers']} on Ray"
        frames = "every step" if r["render_every_step"] else "decisions'"
        print(
            f"  {where:<12}  {frames:<14}  {r['episodes_per_s']:>10.2f}  {r['decisions_per_s']:>11.0f}  "
            f"{r['env_steps_per_s']:>11.0f}  {r['startup_s']:>7.2f}s"
        )
    if args.out:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
