"""`mmrl eval` on an env config: success rate over the fixed evaluation seeds, as JSON, a table and a GIF.

It runs the same greedy episodes on the same seeds as the trainer's validation, so evaluating the
checkpoint of a validation step reproduces that step's `val/success`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mmrl.config import Config
from mmrl.data.dataset import image_budget
from mmrl.errors import ConfigError
from mmrl.evaluate.prompts import EvalResult, load_for_eval
from mmrl.rollout import SamplingParams
from mmrl.sources.episodes import make_envs
from mmrl.vla.episodes import run_episodes
from mmrl.vla.media import episodes_gif
from mmrl.vla.observations import ObservationPrompts
from mmrl.vla.sft import acting_on, policy_actions


def evaluate_episodes(
    cfg: Config, checkpoint: str | Path, episodes: int | None = None, out: str | Path | None = None
) -> EvalResult:
    """Greedy (`rollout.val`) episodes on seeds `env.val_seed ...`; `episodes` defaults to `env.val_episodes`."""
    env = cfg.env
    if env is None:
        raise ConfigError("evaluating episodes needs an env section in the config")
    count = episodes or env.val_episodes
    if count < 1:
        raise ConfigError("no evaluation episodes: set env.val_episodes or pass --episodes")
    model_dir, model, processor, engine = load_for_eval(cfg, checkpoint)
    tokenizer = policy_actions(model_dir) or policy_actions(cfg.model.path)
    if tokenizer is None:
        raise ConfigError(
            f"{model_dir} has no action_tokenizer.json or action head (nor has model.path {cfg.model.path}): "
            "evaluate a checkpoint of an env run, or a model written by `mmrl sft`"
        )
    v = cfg.rollout.val
    envs = make_envs(cfg, count)
    torch.manual_seed(cfg.trainer.seed)  # as the trainer's validation does
    try:
        tokenizer = acting_on(tokenizer, model_dir, env.task, envs.action_dim)
        result = run_episodes(
            engine,
            envs,
            ObservationPrompts(processor, image_budget(cfg.data, model.config), env.prompt, env.history),
            tokenizer,
            list(range(env.val_seed, env.val_seed + count)),
            SamplingParams(temperature=v.temperature, top_p=v.top_p, top_k=v.top_k),
            invalid_penalty=env.invalid_penalty,
            record=env.media_episodes,
        )
    finally:
        envs.close()
    metrics = {
        **result.metrics("eval"),
        "eval/episodes": count,
        "eval/first_seed": env.val_seed,
        "checkpoint": str(model_dir),
    }
    out_file = Path(out) if out else model_dir.parent / "eval_episodes.json"
    if result.frames:
        gif = episodes_gif(
            result.frames, result.success[: len(result.frames)].tolist(), out_file.with_suffix(".gif")
        )
        metrics["media"] = str(gif)
    out_file.write_text(json.dumps(metrics, indent=1))
    return EvalResult(metrics, out_file)
