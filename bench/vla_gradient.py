"""Is an episode-GRPO step's gradient signal or noise? The policy gradient of independent batches of
episodes from one policy, compared by cosine: near 1, each step moves the policy the same way; near 0,
each step is a random direction, which Adam turns into a full-size step all the same.

Each batch is `--groups` initial states x `rollout.n` episodes, sampled at the acting temperature and
scored with the config's advantage estimator, as `mmrl train` would; the loss is the token mean over the
batch's action tokens. Prints each batch's success and mixed groups, then the pairwise cosines (whole
model, vision tower, language model), and writes them as JSON with the machine.

    python bench/vla_gradient.py --config configs/vla_reach_wrist.yaml --checkpoint runs/vla_reach_wrist/sft-model \\
        --groups 16 --groups 48
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `envs` the package, not bench/envs.py

from common import machine, write_result

from mmrl.algorithms import get_advantage_estimator
from mmrl.config import load_config
from mmrl.data.dataset import image_budget
from mmrl.evaluate.prompts import load_for_eval
from mmrl.rollout import SamplingParams
from mmrl.sources.episodes import episode_advantages, make_envs
from mmrl.training.forward import forward_logprobs
from mmrl.vla.episodes import run_episodes
from mmrl.vla.observations import ObservationPrompts
from mmrl.vla.sft import load_action_tokenizer

PARTS = {"all": "", "vision": "visual.", "language": "language_model."}


def batch_gradient(
    cfg: Any, model: Any, engine: Any, prompts: Any, tokenizer: Any, envs: Any, seeds: list[int]
) -> tuple[dict[str, torch.Tensor], float, int]:
    """The flattened policy gradient of one batch of episodes on `seeds`, its success and mixed groups."""
    n = cfg.rollout.n
    params = SamplingParams(
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k
    )
    episodes = run_episodes(
        engine, envs, prompts, tokenizer, [s for s in seeds for _ in range(n)], params, group_size=n
    )
    batch = episodes.batch
    a = cfg.algorithm
    advantages, _ = episode_advantages(
        get_advantage_estimator(a.adv_estimator),
        batch,
        norm_adv_by_std=a.norm_adv_by_std,
        gamma=a.gamma,
        lam=a.lam,
    )
    mask = batch["response_mask"].float()
    pad = prompts.processor.tokenizer.pad_token_id
    model.zero_grad()
    for start in range(0, len(batch), cfg.actor.micro_batch_size):
        rows = list(range(start, min(start + cfg.actor.micro_batch_size, len(batch))))
        logp, _ = forward_logprobs(model, batch.select(rows), pad)
        (-(advantages[rows] * logp * mask[rows]).sum() / mask.sum()).backward()
    grads = {name: p.grad.flatten().clone() for name, p in model.named_parameters() if p.grad is not None}
    wins = episodes.success.view(-1, n).sum(1)
    return grads, episodes.success.float().mean().item(), int(((wins > 0) & (wins < n)).sum())


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str) -> float:
    names = [k for k in a if prefix in k]
    x, y = torch.cat([a[k] for k in names]), torch.cat([b[k] for k in names])
    return float(x @ y / (x.norm() * y.norm()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, required=True, help="the policy, e.g. `mmrl sft`'s output")
    parser.add_argument("--groups", type=int, action="append", help="initial states per batch (repeatable)")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cfg = load_config(args.config, [f"model.path={args.checkpoint}"])
    model_dir, model, processor, engine = load_for_eval(cfg, args.checkpoint)
    tokenizer = load_action_tokenizer(model_dir)
    prompts = ObservationPrompts(
        processor, image_budget(cfg.data, model.config), cfg.env.prompt, cfg.env.history
    )
    rows = []
    for groups in args.groups or [cfg.data.train_batch_size]:
        envs = make_envs(cfg, groups * cfg.rollout.n)
        start = time.perf_counter()
        try:
            batches = []
            for b in range(args.batches):
                torch.manual_seed(b)
                batches.append(
                    batch_gradient(
                        cfg, model, engine, prompts, tokenizer, envs, [b * 100_000 + g for g in range(groups)]
                    )
                )
        finally:
            envs.close()
        pairs = list(itertools.combinations(range(args.batches), 2))
        row = {
            "groups": groups,
            "episodes": groups * cfg.rollout.n,
            "success": [round(s, 3) for _, s, _ in batches],
            "mixed_groups": [m for _, _, m in batches],
            **{
                f"cosine_{part}": [round(cosine(batches[i][0], batches[j][0], prefix), 3) for i, j in pairs]
                for part, prefix in PARTS.items()
            },
            "seconds": round(time.perf_counter() - start),
        }
        rows.append(row)
        print(
            f"{groups:>4} groups x {cfg.rollout.n}: success {row['success']}, mixed groups {row['mixed_groups']}; "
            f"cosine all {row['cosine_all']}, vision {row['cosine_vision']}, language {row['cosine_language']}",
            flush=True,
        )
    write_result(
        args.out,
        {"config": str(args.config), "checkpoint": str(args.checkpoint), "rows": rows, "machine": machine()},
    )


if __name__ == "__main__":
    main()
