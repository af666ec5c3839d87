"""The policy in this process, with the worker group's methods.

`PolicyGroup` (Ray workers, FSDP2 shards) and `LocalPolicy` answer the same calls: log-probs,
reference log-probs, update, save, load, and an engine to generate with. The trainer holds one of
them and never asks which (`mmrl.workers.placement.place_policy` decides).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from mmrl.config import Config
from mmrl.data.batch import Batch
from mmrl.errors import ConfigError
from mmrl.models import load_policy, resolve_dtype, tokenizer_of
from mmrl.rollout import RolloutEngine, engine_from_config
from mmrl.run import checkpoint as ckpt
from mmrl.training.actor import build_actor, needs_reference
from mmrl.training.critic import Critic, build_critic, needs_critic, value_model
from mmrl.training.lora import merged_weights
from mmrl.training.optim import MiniBatch, UpdateStats, apply_settings
from mmrl.training.prm import ImplicitPRM, build_prm, needs_prm, prm_model
from mmrl.training.setup import add_adapters, load_trainable, reference_logprobs
from mmrl.workers.remote import RemoteRollout


class LocalPolicy:
    """The whole policy on this process's device, starting from the weights at `start`: the model (a
    frozen base with adapters under LoRA), its optimizer, the frozen KL reference, the critic under GAE,
    the implicit PRM under PRIME, and the engine that generates from the same weights (or, overlapped, a rollout worker of its own)."""

    def __init__(self, cfg: Config, start: Path, processor: Any, device: str) -> None:
        if cfg.rollout.remote and device == "cuda":
            raise ConfigError(
                "rollout workers (rollout.max_staleness, rollout.workers) on a GPU: the trainer in this process "
                "would share its GPU with them. Run the trainer in a Ray worker too, so each has a GPU of its own: add "
                "trainer.ray_address=local (or auto on a cluster started with `ray start`)"
            )
        self.cfg, self.processor = cfg, processor
        self.compute_dtype = resolve_dtype(cfg.model.dtype, device)  # trained weights stay fp32
        pad_id = tokenizer_of(processor).pad_token_id
        self.model = load_trainable(start, cfg, device)
        self.peft = add_adapters(self.model, cfg, start, self.compute_dtype)
        self.actor = build_actor(cfg, self.model, pad_id, self.compute_dtype)
        self.has_reference = needs_reference(cfg)
        self.ref: Any = None  # under LoRA the policy itself, read with its adapter switched off
        with torch.random.fork_rng(devices=ckpt.rng_devices()):  # building these must not shift the RNG
            if self.has_reference and self.peft is None:
                self.ref = load_policy(start, self.compute_dtype, device).eval().requires_grad_(False)
            self.critic: Critic | None = None
            if needs_critic(cfg):
                critic = value_model(cfg, cfg.critic.model_path or start, device)
                self.critic = build_critic(cfg, critic, pad_id, self.compute_dtype)
            self.prm: ImplicitPRM | None = None
            if needs_prm(cfg):
                self.prm = build_prm(cfg, prm_model(cfg, start, device), pad_id, self.compute_dtype)
        self.engine: RolloutEngine = (
            RemoteRollout(cfg, partial(merged_weights, self.model))  # generates ahead while this trains
            if cfg.rollout.remote
            else engine_from_config(cfg, self.model, processor, self.compute_dtype, cfg.model.path)
        )

    def logprobs(self, batch: Batch) -> torch.Tensor:
        return self.actor.logprobs(batch)

    def ref_logprobs(self, batch: Batch) -> torch.Tensor:
        return reference_logprobs(self.actor, batch, self.peft, self.ref)

    def update(self, batch: Batch, plan: list[MiniBatch]) -> UpdateStats:
        return self.actor.update(batch, plan)

    def save(self, folder: Path) -> None:
        """The checkpoint's `model/` folder as transformers writes it (under LoRA the adapter alone)."""
        ckpt.hf_writer(self.peft or self.model, self.processor)(folder)

    def state_dict(self) -> dict[str, Any]:
        """What the trainer state keeps of the policy besides the weights: optimizer, schedule, critic, PRM."""
        state = {
            "optimizer": self.actor.optimizer.state_dict(),
            "scheduler": self.actor.scheduler.state_dict(),
        }
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        if self.prm is not None:
            state["prm"] = self.prm.state_dict()
        return state

    def load(self, folder: Path, state: dict[str, Any]) -> None:
        """Resume from checkpoint `folder` and its trainer `state`; the config's lr wins over the saved one."""
        if self.peft is not None:
            from peft import set_peft_model_state_dict

            adapter = folder / "model" / "adapter_model.safetensors"
            if not adapter.exists():
                raise FileNotFoundError(
                    f"{folder} holds no LoRA adapter ({adapter.name}); was it saved with model.lora?"
                )
            set_peft_model_state_dict(self.peft, load_file(adapter))
        else:
            ckpt.load_model_weights(self.model, folder)
        self.actor.optimizer.load_state_dict(state["optimizer"])
        self.actor.scheduler.load_state_dict(state["scheduler"])
        apply_settings(self.actor.optimizer, self.actor.scheduler, self.cfg.actor)
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
        if self.prm is not None:
            self.prm.load_state_dict(state["prm"])

    def shutdown(self) -> None:
        """Stop an overlapped run's rollout worker; an in-process engine has nothing to stop."""
        if (stop := getattr(self.engine, "shutdown", None)) is not None:
            stop()
