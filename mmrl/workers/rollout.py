"""A rollout worker: its own copy of the policy and an engine, generating while the trainer updates.

It runs in a Ray actor of its own (`rollout.worker_cpus` cores, or a GPU of its own), one of
`rollout.workers` (`mmrl.workers.remote`). Ray runs one actor's calls in the order they were sent, so
weights loaded after an update reach every group dispatched after them. A group is generated whole
between two weight loads, never interrupted, so the version each row records is the version of every
one of its tokens.
"""

from __future__ import annotations

import os

import torch

from mmrl.config import Config
from mmrl.data.batch import Batch
from mmrl.data.sample import PromptSample
from mmrl.models import load_policy, load_processor, resolve_dtype
from mmrl.rollout import SamplingParams, engine_from_config, weights_device
from mmrl.rollout.base import generate_seeded
from mmrl.workers.device import worker_device

# Batch tensor: the version (updates applied) of the weights that sampled each row.
POLICY_VERSION = "policy_version"


class RolloutWorker:
    """Created empty by Ray; `setup` loads the policy's architecture and builds the engine."""

    def pid(self) -> int:
        return os.getpid()

    def setup(self, cfg: Config) -> None:
        torch.set_num_threads(cfg.rollout.worker_cpus)
        device = worker_device()
        held = weights_device(cfg.rollout.engine, str(device))
        self.model = load_policy(cfg.model.path, torch.float32, held).eval()
        dtype = resolve_dtype(cfg.model.dtype, device)
        self.engine = engine_from_config(
            cfg, self.model, load_processor(cfg.model.path), dtype, cfg.model.path
        )
        self.version = -1  # no trainer weights yet: the first `load_weights` brings version 0

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """The trainer's whole weights (LoRA merged in) after its `version`-th update."""
        self.model.load_state_dict(state)
        self.engine.sync_weights()
        self.version = version

    def generate(self, prompts: list[PromptSample], params: SamplingParams, seed: int) -> Batch:
        batch = generate_seeded(self.engine, prompts, params, seed)  # the seed: from the trainer's RNG
        batch.set(**{POLICY_VERSION: torch.full((len(batch),), self.version)})
        return batch
