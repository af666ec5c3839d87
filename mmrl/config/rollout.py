"""The rollout sections: the engine that generates responses and how it samples them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mmrl.config.base import Section


class SamplingConfig(Section):
    n: int = Field(1, gt=0, description="Responses per prompt")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, description="Nucleus sampling: the smallest token set with this mass"
    )
    top_k: int = Field(-1, description="-1 disables top-k")


class ValSamplingConfig(SamplingConfig):
    """Validation sampling: greedy, one answer per prompt, unless set otherwise."""

    n: int = Field(1, gt=0, description="Answers per validation prompt (pass@k needs k)")
    temperature: float = Field(0.0, ge=0.0, description="0 means greedy")


class VLLMConfig(Section):
    """The vLLM engine (rollout.engine=vllm): colocated with training in the same process."""

    gpu_memory_utilization: float = Field(0.6, gt=0, le=1, description="Share of GPU memory vLLM may take")
    max_num_batched_tokens: int = Field(8192, gt=0, description="vLLM's token budget per scheduler step")
    max_model_len: int = Field(4096, gt=0, description="Prompt + response tokens per sequence")
    enforce_eager: bool = Field(False, description="Skip CUDA graphs: slower decoding, faster start")
    tensor_parallel_size: int = Field(
        1,
        gt=0,
        description="Ranks one engine spans: each group of this many consecutive Ray workers runs one engine "
        "with the weights split between them (vLLM's external launcher) and generates the same prompts",
    )
    kv_cache_gb: float = Field(1.0, gt=0, description="KV cache size on CPU (GPUs use the memory share)")
    sleep_between_rollouts: bool = Field(
        True, description="Give the engine's GPU memory back while training (CUDA only; no-op on CPU)"
    )
    sleep_level: Literal[1, 2] = Field(
        2,
        description="1: free the KV cache and move the weights to host memory; 2: free both (the weights "
        "come back from the policy at the next sync, so no host copy of them is kept)",
    )
    verify_sync_every: int = Field(
        10, ge=0, description="Check vLLM's log-probs against the trainer's every N weight syncs; 0 never"
    )


class RolloutConfig(Section):
    engine: Literal["auto", "hf", "vllm"] = Field(
        "auto", description="auto: vLLM where it is installed, else the HF transformers engine"
    )
    vllm: VLLMConfig = VLLMConfig()
    n: int = Field(5, gt=0, description="Responses per prompt (the GRPO group size)")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 means greedy")
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, description="Nucleus sampling: the smallest token set with this mass"
    )
    top_k: int = Field(-1, description="-1 disables top-k")
    max_new_tokens: int = Field(512, gt=0, description="Response length budget in tokens")
    hf_max_seqs: int | None = Field(
        None,
        gt=0,
        description="HF engine: at most this many sequences decoded at once (whole groups; their KV cache "
        "is the rollout's memory); default: every sequence of a step together",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="0: a sample trains with the weights that drew it (on-policy). K > 0: rollout workers "
        "generate up to K batches ahead while the trainer updates, each row sampled by a policy at most K "
        "updates old (older groups: rollout.stale); needs actor.rollout_correction",
    )
    workers: int = Field(
        1,
        gt=0,
        description="Rollout workers (Ray actors, each with its own engine) when rollout runs apart from "
        "the trainer (this > 1 or max_staleness > 0); prompt groups go to the one with the fewest tokens "
        "in flight",
    )
    worker_cpus: int = Field(
        1,
        gt=0,
        description="CPU cores of each rollout worker (workers > 1 or max_staleness > 0); the trainer keeps "
        "the rest",
    )
    stale: Literal["regenerate", "drop"] = Field(
        "regenerate",
        description="A finished group older than max_staleness updates when its turn comes: sample it "
        "again with the newest weights, or drop it (rollout/stale_groups counts either)",
    )
    group_seeds: bool = Field(
        False,
        description="Synchronous runs: sample each prompt group alone with a seed of its own, as rollout "
        "workers always do, so the samples equal a run with any number of workers (slower: no batching "
        "across groups)",
    )
    val: ValSamplingConfig = ValSamplingConfig()

    @property
    def remote(self) -> bool:
        """Rollout on workers of its own (`mmrl.workers.remote`) instead of the trainer's engine."""
        return self.workers > 1 or self.max_staleness > 0
