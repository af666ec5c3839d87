"""Supervised format warm-up: teach the answer format, not the task.

Each step pairs randomly chosen prompts with answers drawn independently of them, so the
model learns to reply `<answer>word</answer>` with words from the answer set, while the
image-to-answer mapping stays at chance and must be learned by RL.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmrl.config import WarmupConfig
from mmrl.data.sample import PromptSample
from mmrl.training.supervised import supervised_step


def format_warmup(
    model: Any, tokenizer: Any, samples: list[PromptSample], cfg: WarmupConfig, seed: int
) -> list[float]:
    """Run `cfg.steps` steps of cross-entropy on answer-shuffled targets; returns the losses."""
    if not samples:
        raise ValueError("format warm-up needs at least one usable training row")
    rng = np.random.default_rng([seed, 1])
    answers = [str(s.ground_truth) for s in samples]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    losses = []
    for _ in range(cfg.steps):
        rows = rng.choice(len(samples), size=cfg.batch_size)
        targets = rng.choice(answers, size=cfg.batch_size)  # independent of the rows: no task signal
        ids = [
            [
                *tokenizer(cfg.target_template.format(answer=a), add_special_tokens=False)["input_ids"],
                tokenizer.eos_token_id,
            ]
            for a in targets
        ]
        losses.append(supervised_step(model, optimizer, samples, rows.tolist(), ids, tokenizer.pad_token_id))
    return losses
