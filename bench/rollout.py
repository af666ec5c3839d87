"""Rollout throughput of the vLLM engine against the HF engine, side by side in one run.

Both engines generate for the same prompts (the colour task, tiny Qwen2.5-VL, fp32 on CPU), with the same
sampling, alternating round by round; the first round of each is warm-up. Tokens/s counts generated
tokens (and, separately, prompt + generated tokens, as EasyR1 counts throughput).

    .venv/bin/python bench/rollout.py --batch 32 --n 8 --max-new-tokens 32 --rounds 5 \
        --out bench/results/rollout.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from common import load_average, make_workspace, median, provenance, run_in_workspace, write_result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32, help="prompts per round")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per engine (after one warm-up)")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import torch

    from mmrl.config import load_config
    from mmrl.data.dataset import PromptDataset
    from mmrl.models import load_policy, load_processor
    from mmrl.rollout import SamplingParams, engine_from_config
    from mmrl.sources.prompts import build_datasets

    model_dir, data_dir = make_workspace(root, args.batch, args.image_size)
    pixels = args.image_size**2
    overrides = [
        f"model.path={model_dir}",
        f"data.train_files={data_dir / 'train.jsonl'}",
        "data.val_files=[]",
        f"data.min_pixels={pixels}",
        f"data.max_pixels={pixels}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.vllm.max_model_len=1024",
        "rollout.vllm.enforce_eager=true",
        "rollout.vllm.verify_sync_every=0",
    ]
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml", overrides)
    model = load_policy(model_dir).eval()
    processor = load_processor(model_dir)
    train: PromptDataset = build_datasets(cfg, processor, model.config)[0]
    prompts = train.prepare_all(limit=args.batch)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)
    engines, startup = {}, {}
    for kind in ("hf", "vllm"):
        start = time.perf_counter()
        engines[kind] = engine_from_config(
            cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine": kind})}),
            model,
            processor,
            torch.float32,
            model_dir,
        )
        engines[kind].generate(prompts, params)  # warm-up
        startup[kind] = time.perf_counter() - start
    times: dict[str, list[float]] = {k: [] for k in engines}
    tokens: dict[str, list[int]] = {k: [] for k in engines}
    prompt_tokens = sum(len(p.prompt_ids) for p in prompts) * args.n
    load_before = load_average()
    for _ in range(args.rounds):
        for kind, engine in engines.items():
            start = time.perf_counter()
            batch = engine.generate(prompts, params)
            times[kind].append(time.perf_counter() - start)
            tokens[kind].append(int(batch["response_mask"].sum()))
    result: dict[str, Any] = {"config": vars(args) | {"workdir": str(args.workdir), "out": str(args.out)}}
    for kind in engines:
        t = median(times[kind])
        result[kind] = {
            "startup_plus_warmup_s": startup[kind],
            "median_round_s": t,
            "generated_tokens_per_s": median(tokens[kind]) / t,
            "total_tokens_per_s": (median(tokens[kind]) + prompt_tokens) / t,
            "round_s": times[kind],
        }
    result["vllm_over_hf"] = result["vllm"]["generated_tokens_per_s"] / result["hf"]["generated_tokens_per_s"]
    result.update(provenance(load_before))
    return result


def print_table(result: dict[str, Any]) -> None:
    c = result["config"]
    print(
        f"rollout benchmark: {c['batch']} prompts x n={c['n']}, up to {c['max_new_tokens']} new tokens, "
        f"{c['image_size']}px, median of {c['rounds']} rounds"
    )
    print(f"  {'engine':<6} {'round s':>8} {'gen tok/s':>10} {'all tok/s':>10} {'start s':>8}")
    for kind in ("hf", "vllm"):
        r = result[kind]
        print(
            f"  {kind:<6} {r['median_round_s']:>8.2f} {r['generated_tokens_per_s']:>10.0f} "
            f"{r['total_tokens_per_s']:>10.0f} {r['startup_plus_warmup_s']:>8.1f}"
        )
    print(f"  vLLM / HF generated tokens/s: {result['vllm_over_hf']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    result = run_in_workspace(args.workdir, "mmrl-rollout-", lambda folder: run(args, folder))
    print_table(result)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
