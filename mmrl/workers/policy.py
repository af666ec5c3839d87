"""One rank of the actor/rollout worker group: it trains and generates in turns (colocated).

Each rank holds an FSDP2 shard of the policy (all weights, or a frozen base with LoRA
adapters), its shard of the AdamW state, and, when a KL term needs one, the frozen reference:
a sharded copy under full fine-tuning, the same weights with the adapter switched off under
LoRA. Under GAE it also holds its shard of the critic, under PRIME its shard of the implicit PRM
(`mmrl.workers.second_models`). Generation uses the HF engine on the sharded weights, so there is
nothing to sync.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions

from mmrl.config import Config
from mmrl.data.batch import Batch
from mmrl.data.dataset import image_budget
from mmrl.data.sample import PromptSample
from mmrl.models import SHARDED_MARKER, load_policy, load_processor, resolve_dtype, tokenizer_of
from mmrl.rollout import SamplingParams, engine_from_config, resolve_engine
from mmrl.rollout.hf import HFEngine
from mmrl.run.checkpoint import load_state_file
from mmrl.training.actor import build_actor, needs_reference
from mmrl.training.critic import needs_critic
from mmrl.training.lora import merged_state
from mmrl.training.media import keep_blank_image
from mmrl.training.micro_batches import Layout
from mmrl.training.optim import MiniBatch, TrainedModel, UpdateStats, apply_settings
from mmrl.training.prm import needs_prm
from mmrl.training.setup import add_adapters, load_trainable, reference_logprobs
from mmrl.workers.fsdp import full_state_dict, init_process_group, load_sharded, save_sharded, shard_policy
from mmrl.workers.second_models import load_second, save_second, sharded_critic, sharded_prm


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class PolicyWorker:
    """Created empty by Ray; `setup` joins the process group and builds this rank's shard."""

    def where(self) -> dict[str, Any]:
        """Where this worker runs, for rendezvous, placement checks and error messages."""
        import ray

        ctx = ray.get_runtime_context()
        return {"ip": ray.util.get_node_ip_address(), "node": ctx.get_node_id(), "pid": os.getpid()}

    def free_port(self) -> int:
        return free_port()

    def setup(self, cfg: Config, rank: int, world_size: int, address: str, port: int) -> None:
        torch.set_num_threads(cfg.trainer.cpus_per_worker)
        self.cfg, self.rank = cfg, rank
        device = init_process_group(rank, world_size, address, port, cfg.trainer.dist_timeout_s)
        torch.manual_seed(cfg.trainer.seed)  # LoRA's random A matrices must be equal on every rank
        self.compute_dtype = resolve_dtype(cfg.model.dtype, device.type)
        model = load_trainable(cfg.model.path, cfg)
        processor = load_processor(cfg.model.path)
        self.peft = add_adapters(model, cfg, cfg.model.path, self.compute_dtype)
        self.model = shard_policy(model, self.compute_dtype, cfg.actor.offload)
        if not cfg.actor.offload:
            self.model.to(device)
        self.ref = None
        if needs_reference(cfg) and self.peft is None:
            # Frozen, so held in the compute dtype: the values FSDP's mixed precision would gather anyway.
            ref = load_policy(cfg.model.path, self.compute_dtype).requires_grad_(False).eval()
            self.ref = shard_policy(ref, self.compute_dtype, cfg.actor.offload)
            if not cfg.actor.offload:
                self.ref.to(device)
        self.pad_id = tokenizer_of(processor).pad_token_id
        self.processor = processor
        self.actor = build_actor(cfg, self.model, self.pad_id, self.compute_dtype)
        self.critic = (
            sharded_critic(cfg, device, self.pad_id, self.compute_dtype) if needs_critic(cfg) else None
        )
        self.prm = sharded_prm(cfg, device, self.pad_id, self.compute_dtype) if needs_prm(cfg) else None
        budget = image_budget(cfg.data, model.config)
        for sharded in (self.model, self.ref, self.critic and self.critic.model, self.prm and self.prm.model):
            if sharded is not None:  # ranks with other media make as many tower passes (`training.media`)
                keep_blank_image(sharded, processor, budget)
        # A vLLM engine (or its tensor-parallel rank) per worker, unless a rollout worker of its own generates.
        if resolve_engine(cfg.rollout.engine) == "vllm" and not cfg.rollout.remote:
            self.engine = engine_from_config(cfg, self.model, processor, self.compute_dtype, cfg.model.path)
        else:  # generates with the shards themselves; ranks step together
            # Every rank takes an equal share of the prompts, so all decode the same number of passes.
            self.engine = HFEngine(
                self.model,
                processor,
                self.compute_dtype,
                synced_gpus=world_size > 1,
                max_seqs=cfg.rollout.hf_max_seqs,
            )

    # ------------------------------------------------------------ coarse methods
    def generate(self, prompts: list[PromptSample], params: SamplingParams, seed: int) -> Batch:
        torch.manual_seed(seed)  # from the controller's RNG, one per engine, so a resumed run repeats it
        return self.engine.generate(prompts, params)

    def sync_weights(self) -> None:
        self.engine.sync_weights()

    def merged_weights(self) -> Any:
        """The whole policy, LoRA folded in, under the plain model's names, for a rollout worker of its own
        (`rollout.max_staleness`). A collective: every rank gathers each tensor from the shards in turn,
        and only rank 0 keeps them, in Ray's object store (its reference goes back, not a copy)."""
        import ray

        state = {}
        for name, tensor in merged_state(self.model):
            if self.rank == 0:
                state[name] = tensor.cpu()
        return ray.put(state) if self.rank == 0 else None

    def sleep(self) -> None:
        self.engine.sleep()

    def logprobs(self, batch: Batch, layout: Layout | None = None) -> torch.Tensor:
        return self.actor.logprobs(batch, layout=layout)

    def ref_logprobs(self, batch: Batch, layout: Layout | None = None) -> torch.Tensor:
        return reference_logprobs(self.actor, batch, self.peft, self.ref, layout)

    def update(self, batch: Batch, plan: list[MiniBatch]) -> UpdateStats:
        return self.actor.update(batch, plan)

    def values(self, batch: Batch, layout: Layout | None = None) -> torch.Tensor:
        assert self.critic is not None
        return self.critic.values(batch, layout)

    def critic_update(self, batch: Batch, plan: list[MiniBatch]) -> UpdateStats:
        assert self.critic is not None
        return self.critic.update(batch, plan)

    def critic_state(self) -> dict[str, torch.Tensor]:
        """The critic's whole state, unsharded (a collective; for parity checks and tests)."""
        assert self.critic is not None
        return full_state_dict(self.critic.model)

    def prm_rewards(self, batch: Batch, layout: Layout | None = None) -> torch.Tensor:
        assert self.prm is not None
        return self.prm.rewards(batch, layout)

    def prm_update(self, batch: Batch, plan: list[MiniBatch]) -> UpdateStats:
        assert self.prm is not None
        return self.prm.update(batch, plan)

    def prm_state(self) -> dict[str, torch.Tensor]:
        """The PRM's whole state, unsharded (a collective; for parity checks and tests)."""
        assert self.prm is not None
        return full_state_dict(self.prm.model)

    def state(self) -> dict[str, torch.Tensor]:
        """The whole trainable state, unsharded (a collective; for parity checks and tests)."""
        state = full_state_dict(self.model, trainable_only=self.peft is not None)
        if self.peft is None:
            return state
        trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
        return {
            k: v for k, v in state.items() if k in trainable
        }  # not the frozen LM head tied to the embedding

    def save(self, folder: Path) -> None:
        """Write this rank's shards of the weights and AdamW state into `folder/model/dcp`; rank 0 adds
        the config, the processor and the learning-rate schedule (the same on every rank).

        Under LoRA only the adapters are saved; the base is `model.path`, recorded in the marker file.
        The critic, if any, goes into `folder/critic` and the PRM into `folder/prm`
        (`mmrl.workers.second_models.save_second`)."""
        save_sharded(self.model, self.actor.optimizer, folder / "model" / "dcp", self._options)
        for trained in self._second_models():
            save_second(trained, folder / trained.prefix, self.rank)
        adapter = self.state() if self.peft is not None else None  # a collective: every rank gathers
        if self.rank == 0:
            if adapter is not None:  # also in peft's format, so plain transformers (and `mmrl eval`) load it
                prefixed = {f"base_model.model.{name}": tensor for name, tensor in adapter.items()}
                self.peft.save_pretrained(folder / "model", state_dict=prefixed)
            self.processor.save_pretrained(folder / "model")
            self.model.config.save_pretrained(folder / "model")
            self.model.generation_config.save_pretrained(folder / "model")
            marker = {
                "base": str(Path(self.cfg.model.path).resolve()),
                "lora": self.cfg.model.lora.model_dump(),
            }
            (folder / "model" / SHARDED_MARKER).write_text(json.dumps(marker, indent=2))
            torch.save(self.actor.scheduler.state_dict(), folder / "model" / "scheduler.pt")
        dist.barrier()

    def load(self, folder: Path) -> None:
        load_sharded(self.model, self.actor.optimizer, folder / "model" / "dcp", self._options)
        self.actor.scheduler.load_state_dict(load_state_file(folder / "model" / "scheduler.pt"))
        apply_settings(self.actor.optimizer, self.actor.scheduler, self.cfg.actor)  # a resume may change lr
        for trained in self._second_models():
            load_second(trained, folder / trained.prefix)

    def _second_models(self) -> list[TrainedModel]:
        """The critic and the PRM, those this rank holds; each is saved under its `prefix`."""
        return [m for m in (self.critic, self.prm) if m is not None]

    @property
    def _options(self) -> StateDictOptions:
        return StateDictOptions(ignore_frozen_params=self.peft is not None)
