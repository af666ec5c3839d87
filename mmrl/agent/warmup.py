"""The agent runs' format warm-up: whole scripted trajectories, with the tools run for real.

A tiny or untuned model does not know the call syntax, nor that an answer follows the tool's reply.
Each warm-up trajectory follows `warmup.turns`: assistant turns whose {answer} is an answer of another
row and whose other {key}s are drawn from `warmup.fill`, all independent of the prompt's images. Its
tool calls run through the same agent loop as in RL, so the model is taught on the observations it will
really see, but learns only the format: which box to zoom into and which answer is right stay for RL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from mmrl.agent.game import GameResponder, expert_scripts
from mmrl.agent.loop import AgentEngine
from mmrl.agent.scripts import SCRIPT, Script, ScriptedEngine
from mmrl.config import WarmupConfig
from mmrl.data.sample import PromptSample
from mmrl.rollout.base import SamplingParams
from mmrl.training.supervised import supervised_batch_step


def scripts(cfg: WarmupConfig, answers: list[str], count: int, rng: np.random.Generator) -> list[Script]:
    """`count` scripts: `cfg.turns` with {answer} (one per script) and every `cfg.fill` key drawn independently."""
    assert cfg.turns is not None
    out = []
    for _ in range(count):
        answer = str(rng.choice(answers))
        turns = []
        for turn in cfg.turns:  # fills are drawn afresh each turn: a game's scripted moves differ
            values = {key: str(rng.choice(options)) for key, options in cfg.fill.items()}
            turns.append(_fill(turn, {**values, "answer": answer}))
        out.append(Script(turns))
    return out


def _fill(template: str, values: dict[str, str]) -> str:
    """`template` with each {key} of `values` replaced; other braces (a call's JSON) stay as written."""
    for key, value in values.items():
        template = template.replace("{" + key + "}", value)
    return template


def agent_warmup(
    model: Any,
    agent_loop: Callable[[Any], AgentEngine],
    samples: list[PromptSample],
    cfg: WarmupConfig,
    seed: int,
    tokenizer: Any,
) -> list[float]:
    """`cfg.steps` cross-entropy steps on scripted trajectories (see the module); returns the losses.
    `agent_loop` makes the run's agent loop over a given engine (here, the script)."""
    if not samples:
        raise ValueError("format warm-up needs at least one usable training row")
    rng = np.random.default_rng([seed, 1])
    answers = [str(s.ground_truth) for s in samples]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    agent = agent_loop(ScriptedEngine(tokenizer))
    losses = []
    for _ in range(cfg.steps):
        rows = rng.choice(len(samples), size=cfg.batch_size)
        if cfg.expert_noise is None:
            drawn = scripts(cfg, answers, len(rows), rng)
        else:  # a game's expert, played from each row's seed
            assert isinstance(agent.responder, GameResponder) and cfg.turns is not None
            seeds = [int(samples[r].extra["seed"]) for r in rows]
            drawn = expert_scripts(agent.responder, cfg.turns, seeds, rng, cfg.expert_noise)
        prompts = [
            replace(samples[r], extra={**samples[r].extra, SCRIPT: script})
            for r, script in zip(rows, drawn, strict=True)
        ]
        batch = agent.generate(prompts, SamplingParams(n=1, max_new_tokens=1 << 16))
        losses.append(supervised_batch_step(model, optimizer, batch, tokenizer.pad_token_id))
    return losses
