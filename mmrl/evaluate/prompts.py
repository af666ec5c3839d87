"""`mmrl eval`: a checkpoint's accuracy on held-out prompts, greedy or pass@k, as JSON and a table.

Generation and scoring go through the same functions as the trainer's validation, in the same chunks,
so evaluating the checkpoint a run saved at its last validation reproduces that validation's numbers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from mmrl.config import Config
from mmrl.errors import ConfigError
from mmrl.models import load_policy, load_processor, resolve_dtype
from mmrl.rewards import RewardManager
from mmrl.rollout import SamplingParams, engine_from_config, weights_device
from mmrl.run import checkpoint as ckpt
from mmrl.sources.prompts import build_datasets
from mmrl.sources.scoring import generate_and_score, reward_label, reward_metrics
from mmrl.training.lora import is_adapter, load_with_adapter


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k from n samples of which `correct` are right (Chen et al. 2021):
    1 − C(n − c, k) / C(n, k), the chance that k of the n drawn without replacement include a right one."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def resolve_checkpoint(path: str | Path) -> Path:
    """The model folder inside what the user pointed at: a run folder, its `checkpoints/` folder (the
    newest complete checkpoint), one `step_N` checkpoint, or a plain HF model folder."""
    path = Path(path)
    for candidate in (path / "checkpoints", path):
        if candidate.is_dir() and any(candidate.glob("step_*")):
            latest = ckpt.latest_checkpoint(candidate)
            if latest is None:
                raise FileNotFoundError(f"{candidate} holds no complete checkpoint (all are torn or partial)")
            return latest / "model"
    for candidate in (path / "model", path):
        if (candidate / "config.json").exists() or is_adapter(candidate):
            return candidate
    if (path / "config.yaml").exists() or (path / "checkpoints").is_dir():
        raise FileNotFoundError(
            f"{path} is a run with no checkpoint yet: one is written every trainer.save_every steps and at the "
            "end; wait for it, or give a checkpoints/step_N folder or a model folder"
        )
    raise FileNotFoundError(
        f"{path}: no model there; give a run folder, a checkpoints/step_N folder or a model folder"
    )


def load_for_eval(cfg: Config, checkpoint: str | Path) -> tuple[Path, Any, Any, Any]:
    """The checkpoint's model folder, the model in eval mode, its processor, and a rollout engine on it."""
    model_dir = resolve_checkpoint(checkpoint)
    device = cfg.trainer.torch_device()
    held = weights_device(cfg.rollout.engine, device)
    if is_adapter(model_dir):
        model = load_with_adapter(model_dir, held).eval()
    else:
        model = load_policy(model_dir, torch.float32, held).eval()
    processor = load_processor(model_dir)
    compute_dtype = resolve_dtype(cfg.model.dtype, device)
    if cfg.rollout.vllm.tensor_parallel_size > 1:  # training split each engine over workers; here it is whole
        cfg = cfg.model_copy(deep=True)
        cfg.rollout.vllm.tensor_parallel_size = 1
    engine = engine_from_config(cfg, model, processor, compute_dtype, model.config._name_or_path)
    engine.sync_weights()  # vLLM loads the architecture from the folder; the weights are the model's
    return model_dir, model, processor, engine


@dataclass
class EvalResult:
    """What `mmrl eval` reports; `metrics` is what lands in the JSON file."""

    metrics: dict[str, Any]
    out_file: Path


def evaluate(
    cfg: Config,
    checkpoint: str | Path,
    n: int = 1,
    temperature: float | None = None,
    k: list[int] | None = None,
    correct_threshold: float = 0.5,
    out: str | Path | None = None,
) -> EvalResult:
    """Score the checkpoint on `data.val_files`. n=1 decodes as validation does (`rollout.val`); n>1
    samples at `temperature` (default `rollout.temperature`) and reports pass@k for each k."""
    if not cfg.data.val_files:
        raise ConfigError(
            "mmrl eval scores data.val_files, and the config has none; pass data.val_files=FILE"
        )
    model_dir, model, processor, engine = load_for_eval(cfg, checkpoint)
    _, samples = build_datasets(cfg, processor, model.config)  # refuses a set with no usable row
    v = cfg.rollout.val
    if n == 1:
        params = SamplingParams(
            n=1,
            temperature=v.temperature,
            top_p=v.top_p,
            top_k=v.top_k,
            max_new_tokens=cfg.rollout.max_new_tokens,
        )
    else:
        t = cfg.rollout.temperature if temperature is None else temperature
        if t == 0:
            raise ConfigError(f"--n {n} with temperature 0 repeats one greedy answer; pass --temperature > 0")
        params = SamplingParams(
            n=n,
            temperature=t,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            max_new_tokens=cfg.rollout.max_new_tokens,
        )
    functions = [f.model_dump() for f in cfg.reward.functions]
    agents = None
    if cfg.agent is not None:  # every answer is a multi-turn trajectory with tool calls
        from mmrl.sources.agents import AgentLoops

        agents = AgentLoops(cfg, processor, model.config)
        engine = agents(engine)
    with RewardManager(
        functions,
        timeout_s=cfg.reward.timeout_s,
        isolation=cfg.reward.isolation,
        num_workers=cfg.reward.num_workers,
    ) as rewards:
        try:
            _, result = generate_and_score(engine, rewards, samples, params, cfg.data.val_batch_size)
        finally:
            if agents is not None:
                agents.close()
    metrics = reward_metrics(result, prefix="eval")
    accuracy_scores = result.components[reward_label(cfg.reward.functions[0].name)]
    metrics["eval/accuracy"] = float(np.mean(accuracy_scores))
    metrics.update({"eval/prompts": len(samples), "eval/samples_per_prompt": n, "checkpoint": str(model_dir)})
    if n > 1:
        correct = (np.asarray(accuracy_scores).reshape(len(samples), n) >= correct_threshold).sum(axis=1)
        for kk in sorted(set(k or [1, n])):
            if not 1 <= kk <= n:
                raise ConfigError(f"--k {kk} must be between 1 and --n {n}")
            metrics[f"eval/pass@{kk}"] = float(np.mean([pass_at_k(n, int(c), kk) for c in correct]))
    out_file = Path(out) if out else model_dir.parent / f"eval_{'greedy' if n == 1 else f'n{n}'}.json"
    out_file.write_text(json.dumps(metrics, indent=1))
    return EvalResult(metrics, out_file)


def print_table(result: EvalResult, console: Console) -> None:
    table = Table(title=f"mmrl eval · {result.metrics['checkpoint']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.metrics.items():
        if key != "checkpoint":
            table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    console.print(table)
    console.print(f"written to {result.out_file}")
