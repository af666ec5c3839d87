"""How much GPU memory a run needs, per GPU and per phase, before it starts (`mmrl plan`).

A run holds its trained state (fp32 weights, gradients, AdamW's two moments), frozen copies (a KL
reference, a LoRA base, a frozen tower) in the compute dtype, and then either the rollout engine's share
(vLLM's `gpu_memory_utilization`, or the HF engine's KV cache) or one micro-batch's activations and
logits. FSDP2 divides the state by the ranks but gathers one unit (a layer) at a time, plus the root's
embeddings and output layer for the whole forward. `mmrl train` refuses a run whose larger phase does not
fit its GPU and names the keys that would make it fit.

The activation and logit constants are bytes saved for backward per token, measured with PyTorch's
`MemTracker` on mmrl's own update (`bench/memory_plan.py`, and `tests/test_memory_plan.py` keeps the
prediction within 15 % of the measured peak); the formulas are in `docs/memory_planner.md`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmrl.config import Config
from mmrl.models import family_of
from mmrl.models.loading import resolve_dtype
from mmrl.models.published import published_config

GIB = 2**30
# Usable memory of each GPU kind `mmrl plan --gpu` knows (what `torch.cuda.mem_get_info` reports free on
# an idle card is a little under the marketed size).
GPUS: dict[str, float] = {
    "a100-40g": 39.4,
    "a100-80g": 79.1,
    "h100-80g": 79.1,
    "h200-141g": 139.8,
    "l40s-48g": 44.4,
    "rtx4090-24g": 23.5,
}
# Per GPU process besides tensors: the CUDA context and kernels, NCCL's buffers, cuBLAS workspaces and the
# caching allocator's fragmentation (a CUDA context alone is 0.5-1 GiB).
GPU_OVERHEAD = 3.0 * GIB
# vLLM's own need inside its share besides weights and KV: its profiled activations and CUDA graphs.
VLLM_RUNTIME = 2.0 * GIB
# What a sleeping vLLM engine keeps on the GPU during the update: its CUDA graphs' memory pool.
VLLM_ASLEEP = 1.0 * GIB


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a model: its parameter counts and its language model's sizes."""

    params: int
    vision_params: int  # the vision tower's (with its projector), frozen by model.freeze_vision_tower
    lora_params: int  # what `model.lora` trains (0 without LoRA)
    root_params: int  # outside every FSDP unit (embeddings, output layer): gathered for a whole forward
    unit_params: int  # the largest FSDP unit (a decoder layer or vision block)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    vision_layers: int = 0
    vision_hidden: int = 0
    vision_intermediate: int = 0
    patch_size: int = 14


def shape_of(config: Any, cfg: Config) -> ModelShape:
    """A model's shape from its transformers config: the model is built on the meta device (no memory,
    no weights), so every count is the real architecture's, LoRA adapters included."""
    family = family_of(config)
    with torch.device("meta"):
        model = family.new_model(config)
    params = sum(p.numel() for p in model.parameters())
    if getattr(config, "vision_config", None) is not None:
        family.freeze_vision(model)
    vision = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    units = family.fsdp_units(model)
    in_units = {id(p) for unit in units for p in unit.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
    largest = max(sum(p.numel() for p in unit.parameters()) for unit in units)
    lora = 0
    if cfg.model.lora.rank:
        from mmrl.training.lora import apply_lora

        model.requires_grad_(True)
        peft = apply_lora(model, cfg.model.lora)
        lora = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    text = config.get_text_config()
    heads = text.num_attention_heads
    tower = getattr(config, "vision_config", None)
    patch = getattr(tower, "patch_size", 14)
    return ModelShape(
        params=params,
        vision_params=vision,
        lora_params=lora,
        root_params=root,
        unit_params=largest,
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab=text.vocab_size,
        vision_layers=getattr(tower, "depth", None) or getattr(tower, "num_hidden_layers", 0),
        vision_hidden=getattr(tower, "hidden_size", 0),
        vision_intermediate=getattr(tower, "intermediate_size", 0),
        patch_size=patch[0] if isinstance(patch, (tuple, list)) else patch,
    )


# Bytes saved for backward per token of one decoder layer: coefficients of the hidden size, the MLP's
# width and the attention width (q + k + v) in the compute dtype, and of the hidden size in fp32 (the
# residual stream and the norms stay fp32 under autocast). Fitted to mmrl's update in fp32 and bf16
# (`bench/memory_plan.py`, docs/memory_planner.md).
ACT_HIDDEN, ACT_INTERMEDIATE, ACT_ATTENTION, ACT_HIDDEN_FP32 = 1.5, 3.0, 1.5, 7.0
# fp32 (N, V) copies alive at the update's peak per scored response token besides the output layer's own
# (N, V) in the compute dtype: the fp32 cast, the temperature's division, the blocked ids, the
# log-softmax, the entropy's terms and the gradient that flows back (measured: 6). Beyond one chunk of
# tokens the output layer runs chunk by chunk (`mmrl.training.forward.head_logprobs`).
LOGIT_COPIES = 6.0


@dataclass(frozen=True)
class Phase:
    """Per-GPU bytes of one phase, by what holds them."""

    name: str
    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass(frozen=True)
class Plan:
    """A run's per-GPU memory at rollout and at update, against the GPU's memory."""

    gpu: str
    gpu_bytes: float
    ranks: int
    phases: tuple[Phase, ...]
    kv_sequences: float | None  # how many max_model_len sequences vLLM's KV cache holds (None: HF engine)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.gpu_bytes and (self.kv_sequences is None or self.kv_sequences >= 1)

    def table(self) -> str:
        """The plan as a plain-text table, GiB per GPU."""
        names = list(dict.fromkeys(k for p in self.phases for k in p.parts))
        rows = [f"{'per GPU (GiB)':<32}" + "".join(f"{p.name:>10}" for p in self.phases)]
        for name in names:
            rows.append(
                f"{name:<32}" + "".join(f"{p.parts.get(name, 0.0) / GIB:>10.2f}" for p in self.phases)
            )
        rows.append(f"{'total':<32}" + "".join(f"{p.total / GIB:>10.2f}" for p in self.phases))
        rows.append(f"{self.gpu + ' holds':<32}{self.gpu_bytes / GIB:>10.2f}")
        if self.kv_sequences is not None:
            rows.append(
                f"vLLM's KV cache holds {self.kv_sequences:.1f} sequences of rollout.vllm.max_model_len"
            )
        verdict = "fits" if self.fits else "does NOT fit"
        rows.append(f"{verdict} on {self.ranks} x {self.gpu} (peak: {self.peak.name})")
        return "\n".join(rows)


def activation_bytes(shape: ModelShape, tokens: int, compute: int, checkpointing: bool) -> float:
    """What the language model saves for backward over one micro-batch of `tokens` tokens: every layer's
    tensors, or under gradient checkpointing each layer's input plus one layer recomputed at a time."""
    per_layer = layer_bytes(shape, compute)
    if checkpointing:
        return tokens * (shape.layers * 4 * shape.hidden + per_layer)
    return tokens * shape.layers * per_layer


def layer_bytes(shape: ModelShape, compute: int) -> float:
    """Bytes one decoder layer saves for backward per token."""
    attention = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    return _block_bytes(shape.hidden, shape.intermediate, attention, compute)


def _block_bytes(hidden: int, intermediate: int, attention: int, compute: int) -> float:
    in_compute = ACT_HIDDEN * hidden + ACT_INTERMEDIATE * intermediate + ACT_ATTENTION * attention
    return compute * in_compute + 4 * ACT_HIDDEN_FP32 * hidden


def tower_bytes(shape: ModelShape, patches: int, compute: int, checkpointing: bool) -> float:
    """What a trained vision tower saves for backward over `patches` patches: its blocks counted as
    decoder layers of the tower's width (full attention: q, k and v each as wide as the block)."""
    block = _block_bytes(shape.vision_hidden, shape.vision_intermediate, 3 * shape.vision_hidden, compute)
    if checkpointing:
        return patches * (shape.vision_layers * 4 * shape.vision_hidden + block)
    return patches * shape.vision_layers * block


def logit_bytes(shape: ModelShape, scored_tokens: int, compute: int) -> float:
    """The output layer's (N, V) logits at the scored response positions and their fp32 copies, for at most
    one chunk of `mmrl.training.forward.logit_chunk` tokens at a time."""
    from mmrl.training.forward import logit_chunk

    return min(scored_tokens, logit_chunk(shape.vocab)) * shape.vocab * (compute + 4 * LOGIT_COPIES)


def micro_batch_rows(cfg: Config, ranks: int) -> int:
    """Rows of the largest micro-batch: `actor.micro_batch_size`, or a rank's whole mini-batch if smaller."""
    return max(1, min(cfg.actor.micro_batch_size, cfg.actor.mini_batch_size * cfg.rollout.n // ranks))


def micro_batch_tokens(cfg: Config, ranks: int) -> tuple[int, int]:
    """(tokens, scored response tokens) of the largest micro-batch the config allows: every row at the
    longest prompt and response (a shared prompt, computed once per group, is not counted on)."""
    prompt, response = cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
    rows = micro_batch_rows(cfg, ranks)
    if cfg.actor.max_tokens_per_micro_batch:
        budget = cfg.actor.max_tokens_per_micro_batch
        return budget, min(budget, rows * response)
    return rows * (prompt + response), rows * response


def plan_memory(cfg: Config, shape: ModelShape, gpu: str, gpu_bytes: float | None = None) -> Plan:
    """Per-GPU bytes at rollout and update for `cfg` on GPUs of kind `gpu` (`gpu_bytes`: a measured size)."""
    from mmrl.rollout import resolve_engine
    from mmrl.training.actor import needs_reference
    from mmrl.training.critic import needs_critic
    from mmrl.training.prm import needs_prm

    total = gpu_bytes if gpu_bytes is not None else GPUS[gpu] * GIB
    ranks = cfg.trainer.world_size if cfg.trainer.uses_workers else 1
    compute = resolve_dtype(cfg.model.dtype, "cuda").itemsize
    lora = bool(cfg.model.lora.rank)
    trained = (
        shape.lora_params if lora else shape.params - shape.vision_params * cfg.model.freeze_vision_tower
    )
    frozen = shape.params - (0 if lora else trained)
    offload = cfg.actor.offload
    state: dict[str, float] = {
        "weights": 0.0 if offload else (4 * trained + compute * frozen) / ranks,
        "optimizer (AdamW)": 0.0 if offload else 8 * trained / ranks,
    }
    if needs_reference(cfg) and not lora:
        state["KL reference"] = 0.0 if offload else compute * shape.params / ranks
    for name, needed in (("critic", needs_critic(cfg)), ("implicit PRM", needs_prm(cfg))):
        if needed:  # a second full model, trained like the actor (the critic's value head is negligible)
            state[name] = 0.0 if offload else 16 * shape.params / ranks
    state["CUDA, NCCL, allocator"] = GPU_OVERHEAD
    tokens, scored = micro_batch_tokens(cfg, ranks)
    update = dict(state)
    sharded = ranks > 1 or offload
    if sharded:  # FSDP: one unit gathered and the next prefetched, the root for the whole forward
        update["gathered units"] = compute * (shape.root_params + 2 * shape.unit_params)
    elif compute < 4:  # autocast keeps a compute-dtype copy of every trained weight through the forward
        update["autocast weight copies"] = compute * trained
    # Backward frees activations as it fills gradients: at its start every activation and the logits'
    # copies are alive, at its end every gradient and the last layer differentiated.
    grads = 0.0 if offload else 4 * trained / ranks
    early = {
        "activations": activation_bytes(shape, tokens, compute, cfg.model.gradient_checkpointing),
        "logits": logit_bytes(shape, scored, compute),
    }
    if shape.vision_layers and not (
        cfg.model.freeze_vision_tower or (lora and not cfg.model.lora.include_vision)
    ):
        # The tower encodes each distinct prompt's images once: a micro-batch of a group's rows spans at
        # most two groups' prompts (a frozen tower saves nothing).
        rows = micro_batch_rows(cfg, ranks)
        images = min(rows, -(-rows // cfg.rollout.n) + 1)
        patches = images * cfg.data.max_pixels // shape.patch_size**2
        early["vision tower activations"] = tower_bytes(
            shape, patches, compute, cfg.model.gradient_checkpointing
        )
    late = grads + tokens * layer_bytes(shape, compute)
    update.update(early if sum(early.values()) >= late else {"gradients + one layer": late})
    rollout = dict(state)
    kv_sequences = None
    kv_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * compute
    if resolve_engine(cfg.rollout.engine) == "vllm":
        share = cfg.rollout.vllm.gpu_memory_utilization * total
        rollout["vLLM (gpu_memory_utilization)"] = share
        update["vLLM asleep (CUDA graphs)"] = VLLM_ASLEEP
        tp = cfg.rollout.vllm.tensor_parallel_size
        cache = share - compute * shape.params / tp - VLLM_RUNTIME
        kv_sequences = max(0.0, cache) / (kv_token / tp * cfg.rollout.vllm.max_model_len)
    else:  # the HF engine decodes the rank's share (or `rollout.hf_max_seqs` of it) at once
        rows = cfg.data.train_batch_size * cfg.rollout.n / ranks
        rows = min(rows, cfg.rollout.hf_max_seqs or rows)
        rollout["KV cache (HF engine)"] = (
            rows * (cfg.data.max_prompt_length + cfg.rollout.max_new_tokens) * kv_token
        )
    return Plan(gpu, total, ranks, (Phase("rollout", rollout), Phase("update", update)), kv_sequences)


# What `mmrl train` suggests, in this order, when a run does not fit: the anchors' proven settings first.
REMEDIES: tuple[tuple[str, Any], ...] = (
    ("model.gradient_checkpointing", True),
    ("rollout.hf_max_seqs", 64),
    ("actor.micro_batch_size", 2),
    ("actor.micro_batch_size", 1),
    ("rollout.vllm.gpu_memory_utilization", 0.5),
    ("actor.offload", True),
)


def what_fits(cfg: Config, shape: ModelShape, gpu: str, gpu_bytes: float | None = None) -> list[str]:
    """The `REMEDIES` that make the run fit, as `key=value` overrides, each kept only where it lowers the
    peak (a later value of the same key replaces the earlier); [] if even all of them do not fit."""
    chosen: dict[str, Any] = {}
    trial = cfg
    peak = plan_memory(trial, shape, gpu, gpu_bytes).peak.total
    for key, value in REMEDIES:
        section, _, name = key.rpartition(".")
        candidate = trial.model_copy(deep=True)
        owner = candidate
        for part in section.split("."):
            owner = getattr(owner, part)
        setattr(owner, name, value)
        plan = plan_memory(candidate, shape, gpu, gpu_bytes)
        if plan.peak.total < peak:
            trial, peak, chosen[key] = candidate, plan.peak.total, value
            if plan.fits:
                return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in chosen.items()]
    return []


def gpu_kind(name: str) -> str:
    """`name` checked against the kinds the planner knows."""
    if name not in GPUS:
        from mmrl.errors import ConfigError

        raise ConfigError(f"--gpu {name!r}: the planner knows {', '.join(GPUS)}")
    return name


def shape_for(cfg: Config) -> ModelShape:
    """The shape of `cfg.model.path`: from its config.json (a folder, or a hub id already in the Hugging
    Face cache), else from the published sizes of a recipe's model (`mmrl.models.published`)."""
    from huggingface_hub import try_to_load_from_cache
    from transformers import AutoConfig

    path = cfg.model.path
    local = Path(path) / "config.json"
    cached = None if local.exists() or path.count("/") != 1 else try_to_load_from_cache(path, "config.json")
    if local.exists() or isinstance(cached, str):
        config = AutoConfig.from_pretrained(local.parent if local.exists() else Path(cached).parent)
    else:
        config = published_config(path)
    if config is None:
        raise FileNotFoundError(
            f"model.path {path!r}: no config.json there or in the Hugging Face cache, and it is not one of the "
            f"recipes' models the planner knows; fetch its config with `huggingface-cli download {path} config.json`"
        )
    return shape_of(config, cfg)


def refuse_what_cannot_fit(cfg: Config) -> None:
    """At start on GPUs: stop a run whose larger phase exceeds this GPU's memory, naming what would fit."""
    if not torch.cuda.is_available() or cfg.trainer.torch_device() != "cuda":
        return
    from mmrl.errors import ConfigError

    gpu_bytes = float(torch.cuda.get_device_properties(0).total_memory)
    shape = shape_for(cfg)
    plan = plan_memory(cfg, shape, "this GPU", gpu_bytes)
    if plan.fits:
        return
    fixes = what_fits(cfg, shape, "this GPU", gpu_bytes)
    advice = (
        f"set {' '.join(fixes)}"
        if fixes
        else "use more GPUs (trainer.n_gpus_per_node) or LoRA (model.lora.rank)"
    )
    raise ConfigError(
        f"this run needs {plan.peak.total / GIB:.1f} GiB per GPU at its {plan.peak.name} and the GPU holds "
        f"{gpu_bytes / GIB:.1f} GiB (`mmrl plan` with this config shows where it goes): {advice}"
    )
