"""PRIME's implicit process reward model (Cui et al. 2025, arXiv 2502.01456): a second copy of the
policy's language model, π_φ, trained online on outcome labels, whose token log-ratio to the frozen
reference is each response token's process reward (`mmrl.algorithms.implicit_prm`).

Each step it first trains on the step's responses, then scores them (the paper's "double forward"), so
the advantages use a PRM that has seen this step's outcomes. Log-probs are taken at the rollout
temperature, as the reference's are, so π_φ = π_ref at the start gives every token the reward 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from mmrl.algorithms import (
    batch_normalized_process_rewards,
    get_advantage_estimator,
    implicit_prm_loss,
    implicit_process_rewards,
    needs_of,
)
from mmrl.config import Config, PRMConfig
from mmrl.data.batch import Batch
from mmrl.errors import ConfigError
from mmrl.training.actor import optimizer_steps, responses_per_prompt
from mmrl.training.forward import evaluate_rows, forward_logprobs
from mmrl.training.micro_batches import Layout, micro_layout
from mmrl.training.optim import MiniBatch, TrainedModel, per_minibatch, plan_minibatches
from mmrl.training.setup import load_trainable


def needs_prm(cfg: Config) -> bool:
    """Whether the advantage estimator rewards tokens with an implicit PRM (its registry entry says so)."""
    return needs_of(get_advantage_estimator(cfg.algorithm.adv_estimator)).prm


def prm_plan(cfg: Config, batch: Batch) -> list[MiniBatch]:
    """The PRM's mini-batches: the actor's size, one pass over the step's responses.

    Shuffled on a forked RNG: the policy samples from the global stream, and a second model's shuffle
    drawing from it would move every later rollout, so PRIME with `prime_process_coef: 0` would no longer
    be the RLOO run it reduces to."""
    rows_per_step = cfg.actor.mini_batch_size * responses_per_prompt(cfg)
    with torch.random.fork_rng(devices=[]):
        return plan_minibatches(batch, rows_per_step, 1, cfg.rollout.max_new_tokens)


class ImplicitPRM(TrainedModel):
    """Owns π_φ and its optimizer: `update` on outcome labels (the cross-entropy of σ(r_φ(y)) against
    each response's outcome reward, `scores`), then `rewards` for the advantages."""

    prefix = "prm"

    def __init__(
        self,
        model: Any,
        cfg: PRMConfig,
        pad_id: int,
        temperature: float,
        total_updates: int,
        micro_batch_size: int,
        compute_dtype: torch.dtype = torch.float32,
        max_tokens: int | None = None,
        padding_free: bool | Literal["auto"] = False,
    ) -> None:
        super().__init__(
            model, cfg, total_updates, micro_batch_size, max_tokens, pad_id, compute_dtype, padding_free
        )
        self.cfg: PRMConfig = cfg
        self.temperature = temperature

    def _logprobs(self, micro: Batch) -> torch.Tensor:
        return forward_logprobs(
            self.model,
            micro,
            self.pad_id,
            self.temperature,
            compute_dtype=self.compute_dtype,
            padding_free=self.padding_free,
        )[0]

    def rewards(self, batch: Batch, layout: Layout | None = None) -> torch.Tensor:
        """β·log π_φ/π_ref of every response token (0 on padding), against the batch's `ref_logprobs`."""
        logp = evaluate_rows(
            self.model,
            batch,
            self.micro_batch_size,
            self._logprobs,
            layout if layout is not None else micro_layout(batch, self.max_tokens),
        )
        return implicit_process_rewards(
            logp, batch["ref_logprobs"], batch["response_mask"], beta=self.cfg.beta
        )

    def _micro_step(self, micro: Batch, totals: dict[str, float]) -> dict[str, float]:
        logp = self._logprobs(micro)
        device = logp.device
        loss, metrics = implicit_prm_loss(
            logp,
            micro["ref_logprobs"].to(device),
            micro["response_mask"].to(device),
            micro["scores"].to(device),
            beta=self.cfg.beta,
            num_seqs=totals["num_seqs"],
        )
        loss.backward()
        stats = {"prm/loss": float(loss.detach()), "prm/accuracy": float(metrics["accuracy"])}
        return per_minibatch(stats, len(micro), totals)


def prm_model(cfg: Config, start: str | Path, device: str = "cpu") -> Any:
    """π_φ, from `prm.model_path` or the policy's start `start`, frozen where the policy's is."""
    return load_trainable(cfg.prm.model_path or start, cfg, device)


def build_prm(cfg: Config, model: Any, pad_id: int, compute_dtype: torch.dtype) -> ImplicitPRM:
    """The PRM over `model` (whole, or this rank's FSDP shard), set up as `cfg` says."""
    return ImplicitPRM(
        model,
        cfg.prm,
        pad_id,
        cfg.rollout.temperature or 1.0,
        total_updates=optimizer_steps(cfg, 1),
        micro_batch_size=cfg.actor.micro_batch_size,
        compute_dtype=compute_dtype,
        max_tokens=cfg.actor.max_tokens_per_micro_batch,
        padding_free=cfg.actor.padding_free,
    )


def train_and_score(prm: Any, cfg: Config, batch: Batch) -> dict[str, Any]:
    """One PRM step (in-process `ImplicitPRM` or the workers' `PRMRole`): its update on the outcome
    labels, then the batch's `process_rewards` from the updated PRM; its metrics."""
    scores = batch["scores"]
    if bool(((scores < 0) | (scores > 1)).any()):
        raise ConfigError(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} trains its PRM on outcome labels in [0, 1] "
            f"(a verifier's 0 or 1), and this step's rewards range over [{float(scores.min()):.3g}, "
            f"{float(scores.max()):.3g}]: use reward.functions whose weighted sum stays in [0, 1], such as "
            "answer_match alone"
        )
    stats = prm.update(batch, prm_plan(cfg, batch))
    rewards = prm.rewards(batch)
    mask = batch["response_mask"].bool()
    metrics = dict(stats.metrics)
    metrics["prm/skipped_updates"] = stats.skipped_steps
    values = rewards[mask].float()  # the PRM's own β·log π_φ/π_ref, before any normalisation
    metrics["prm/process_reward_mean"] = float(values.mean()) if values.numel() else 0.0
    # a batch mean near 0 can hide a wide per-token spread, which the returns sum along each response
    metrics["prm/process_reward_std"] = float(values.std()) if values.numel() > 1 else 0.0
    if cfg.prm.process_norm == "batch":
        rewards = batch_normalized_process_rewards(rewards, batch["response_mask"])
    batch.set(process_rewards=rewards)
    return metrics
