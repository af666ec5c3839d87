"""Agent rollout throughput: multi-turn trajectories with tool calls, on the HF engine and vLLM, side by side.

Both engines run the same agent loop (`mmrl.agent`, `configs/quickstart_agent.yaml`: a zoom call, the
cropped image back, an answer) over the same zoom-task prompts, alternating round by round after one
warm-up round each. The policy must already call the tool: pass a model that went through the recipe's
warm-up (`mmrl quickstart --task zoom` writes one to runs/quickstart_agent/run/warmup_model).

    .venv/bin/python bench/agent_rollout.py --model runs/quickstart_agent/run/warmup_model \
        --batch 16 --n 8 --rounds 3 --out bench/results/agent_rollout.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from common import load_average, median, provenance, run_in_workspace, write_result

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "quickstart_agent.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="a model that calls the tool (see above)")
    p.add_argument("--batch", type=int, default=16, help="prompts per round")
    p.add_argument("--n", type=int, default=8, help="trajectories per prompt")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per engine (after one warm-up)")
    p.add_argument("--engines", default="hf,vllm")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import torch

    from mmrl.config import load_config
    from mmrl.data.synthetic_zoom import generate_zoom
    from mmrl.models import load_policy, load_processor
    from mmrl.rollout import SamplingParams, engine_from_config
    from mmrl.sources.agents import AgentLoops
    from mmrl.sources.prompts import build_datasets

    generate_zoom(root / "data", n_train=args.batch, n_val=0, seed=0)
    overrides = [
        f"model.path={args.model}",
        f"data.train_files={root / 'data' / 'train.jsonl'}",
        "data.val_files=[]",
        "rollout.vllm.max_model_len=1024",
        "rollout.vllm.enforce_eager=true",
        "rollout.vllm.verify_sync_every=0",
    ]
    cfg = load_config(RECIPE, overrides)
    model = load_policy(args.model).eval()
    processor = load_processor(args.model)
    prompts = build_datasets(cfg, processor, model.config)[0].prepare_all(limit=args.batch)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=cfg.rollout.max_new_tokens)
    loops = AgentLoops(cfg, processor, model.config)
    agents, startup = {}, {}
    for kind in args.engines.split(","):
        start = time.perf_counter()
        rollout = cfg.rollout.model_copy(update={"engine": kind})
        engine = engine_from_config(
            cfg.model_copy(update={"rollout": rollout}), model, processor, torch.float32, args.model
        )
        agents[kind] = loops(engine)
        agents[kind].generate(prompts, params)  # warm-up
        startup[kind] = time.perf_counter() - start
    times: dict[str, list[float]] = {k: [] for k in agents}
    calls: dict[str, list[int]] = {k: [] for k in agents}
    turns: dict[str, list[float]] = {k: [] for k in agents}
    load_before = load_average()
    for _ in range(args.rounds):
        for kind, agent in agents.items():
            start = time.perf_counter()
            batch = agent.generate(prompts, params)
            times[kind].append(time.perf_counter() - start)
            calls[kind].append(int(batch["tool_calls"].sum()))
            turns[kind].append(float(batch["turns"].float().mean()))
    loops.close()
    trajectories = args.batch * args.n
    result: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}}
    for kind in agents:
        t = median(times[kind])
        result[kind] = {
            "startup_plus_warmup_s": startup[kind],
            "median_round_s": t,
            "trajectories_per_s": trajectories / t,
            "tool_calls_per_s": median(calls[kind]) / t,
            "turns_mean": median(turns[kind]),
            "round_s": times[kind],
        }
    result.update(provenance(load_before))
    return result


def print_table(result: dict[str, Any]) -> None:
    c = result["config"]
    print(f"agent rollout benchmark: {c['batch']} prompts x n={c['n']}, median of {c['rounds']} rounds")
    print(f"  {'engine':<6} {'round s':>8} {'traj/s':>8} {'calls/s':>8} {'turns':>6} {'start s':>8}")
    for kind in c["engines"].split(","):
        r = result[kind]
        print(
            f"  {kind:<6} {r['median_round_s']:>8.2f} {r['trajectories_per_s']:>8.1f} "
            f"{r['tool_calls_per_s']:>8.1f} {r['turns_mean']:>6.2f} {r['startup_plus_warmup_s']:>8.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    result = run_in_workspace(args.workdir, "mmrl-agent-rollout-", lambda folder: run(args, folder))
    print_table(result)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
