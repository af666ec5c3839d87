"""Loading a policy and its processor from a folder or a hub id, and the dtype rules around them."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoProcessor, AutoTokenizer, PreTrainedModel

from mmrl.models.action_head import load_action_head, save_action_head, without_action_head
from mmrl.models.family import family_of
from mmrl.models.vision_attention import use_varlen_vision_attention

SHARDED_MARKER = "mmrl_sharded.json"  # in a checkpoint's model/ folder: the weights are FSDP shards in dcp/


def model_folder(path: str | Path) -> Path:
    """The local folder of a model: `path` itself when it is a folder, else a hub id resolved through
    the Hugging Face cache (downloaded when online; with `HF_HUB_OFFLINE=1`, the cache only)."""
    local = Path(path)
    if local.exists() or str(path).startswith((".", "/", "~")) or str(path).count("/") != 1:
        return local
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(path)))
    except LocalEntryNotFoundError:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
        why = "HF_HUB_OFFLINE is set, so only the cache was searched" if offline else "the hub is unreachable"
        raise FileNotFoundError(
            f"model.path {path!r} is neither a local folder nor in the Hugging Face cache, and {why}. "
            f"Download it with `huggingface-cli download {path}` (where the hub is reachable; copy the cache "
            f"over if needed), build a tiny model there with `mmrl model init-tiny {path}`, or point "
            "model.path at a model folder."
        ) from None
    except Exception as err:  # a misspelt id, a private repo, a network error
        raise FileNotFoundError(
            f"model.path {path!r} is not a local folder, and fetching it as a hub id failed ({err}). "
            f"Check the spelling, download it with `huggingface-cli download {path}`, or build a tiny "
            f"model there with `mmrl model init-tiny {path}`."
        ) from None


def checked_folder(path: str | Path) -> Path:
    """`model_folder(path)`, which must hold a transformers model."""
    path = model_folder(path)
    if (path / SHARDED_MARKER).exists():
        raise FileNotFoundError(
            f"{path} holds FSDP shards written by Ray workers, not a transformers model. Convert it once with "
            f"`mmrl export {path.parent} <out_dir>` and use <out_dir>."
        )
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model.path: no model checkpoint at {path} (config.json missing). Build a tiny one with "
            f"`mmrl model init-tiny {path}`, or point model.path at a model folder or a hub id "
            "(the README lists the supported families)."
        )
    return path


def load_config(path: str | Path) -> Any:
    """The checkpoint's config, with its family checked (an unsupported one stops here)."""
    config = AutoConfig.from_pretrained(checked_folder(path))
    family_of(config)
    return config


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> PreTrainedModel:
    """Load a checkpoint (a folder or a hub id, tiny or real) of any supported family."""
    folder = checked_folder(path)
    family = family_of(AutoConfig.from_pretrained(folder))
    model = family.load_class().from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    if family.packed_vision:
        use_varlen_vision_attention(model)
    model = model.to(device)
    load_action_head(model, folder)  # a continuous-action VLA policy's head, saved beside the backbone
    return model


# A tokenizer's vocabulary lives in one of these (the fast tokenizer's file, a sentencepiece model, or a
# BPE vocabulary with its merges); without any, transformers builds an empty tokenizer without a word.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# An action-token policy's bins (`mmrl sft`, env runs' checkpoints): what it needs beside its weights to
# act again. A continuous head's files are the model's own (`save_model` writes them).
ACTION_TOKENIZER_FILE = "action_tokenizer.json"


def load_processor(path: str | Path) -> Any:
    """The processor saved next to the weights (tokenizer, chat template, image and video processors);
    a text-only model's is its tokenizer. A folder without a tokenizer's vocabulary is refused here,
    not at the first step, where the empty tokenizer it would load fails inside the engine."""
    folder = model_folder(path)
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{folder} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the tokenizer files "
            "of the model it came from into it, with its chat template, or point model.path at a full model folder"
        )
    if family_of(AutoConfig.from_pretrained(folder)).takes_images:
        return AutoProcessor.from_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def tokenizer_of(processor: Any) -> Any:
    """The tokenizer inside a processor, or the processor itself for a text-only model."""
    return getattr(processor, "tokenizer", processor)


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """`auto` is the dtype people train in: bf16 on GPUs that support it and on CPUs that run it natively
    (`cpu_runs_bf16`), fp32 elsewhere, where bf16 is emulated, slower than fp32 and noisier."""
    if name == "auto":
        dev = torch.device(device)
        native = (
            torch.cuda.is_bf16_supported() if dev.type == "cuda" else dev.type == "cpu" and cpu_runs_bf16()
        )
        return torch.bfloat16 if native else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def cpu_runs_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX-512 BF16 or AMX; plain AVX-512 only emulates bf16)
    and ATen may use its AVX-512 kernels (`ATEN_CPU_CAPABILITY` not pinned lower). A 2,048-square matmul on
    a 2-core AMD EPYC with AVX-512 BF16: 42 ms in bf16, 99 ms in fp32."""
    instructions = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return instructions and torch.backends.cpu.get_cpu_capability() == "AVX512"


# Set on a VLA policy's config by `mmrl sft` (and saved with it): [first, end) of its action-token ids.
ACTION_TOKENS = "mmrl_action_tokens"


def never_generated_ids(config: Any) -> list[int]:
    """Tokens the policy must never emit: the family's vision placeholders and, for a VLA policy
    (`ACTION_TOKENS` in its config), every id outside its action bins. Engines block them and the
    trainer's log-probs exclude them, so RL cannot drift into tokens that decode to no action."""
    blocked = family_of(config).never_generated_ids()
    actions = getattr(config, ACTION_TOKENS, None)
    if actions is None:
        return blocked
    return [*blocked, *_outside(*actions, config.get_text_config().vocab_size)]


@functools.cache
def _outside(first: int, end: int, vocab_size: int) -> tuple[int, ...]:
    return (*range(first), *range(end, vocab_size))


def autocast_for(model: Any, dtype: torch.dtype) -> AbstractContextManager:
    """Mixed precision for forward passes. Trained parameters stay fp32, so AdamW steps of 1e-6
    are not rounded away as they would be in bf16 weights; the matmuls run in `dtype`."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=dtype)


@contextmanager
def attention_implementation(config: Any, name: str) -> Iterator[None]:
    """The layers reading `config` attend with transformers' registered implementation `name` inside the
    block, and as before after it (mmrl's per-segment and fp32 attentions are switched on this way)."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def save_model(model: Any, processor: Any, out: str | Path) -> Path:
    """`model` and its processor (or tokenizer) as a folder that transformers and vLLM both load.

    transformers writes weights as it holds them. Where a family's released checkpoints lay a tensor out
    otherwise (Qwen3-VL-MoE's fused experts), vLLM's loader reads only the released layout and
    transformers reads both, so the weight files are rewritten in the released layout. A LoRA adapter
    (peft) is written as peft writes it. A continuous action head goes into files of its own beside it."""
    out = Path(out)
    with without_action_head(model) as head:
        model.save_pretrained(out)
    if head is not None:
        save_action_head(head, out)
    processor.save_pretrained(out)
    family = family_of(model)
    if family.relaid_out and not hasattr(model, "peft_config"):
        for path in sorted(out.glob("*.safetensors")):
            with safe_open(path, "pt") as f:
                metadata = f.metadata()
                tensors = {
                    name: tensor.contiguous()
                    for key in f.keys()  # noqa: SIM118
                    for name, tensor in family.checkpoint_tensors(key, f.get_tensor(key))
                }
            save_file(tensors, path, metadata=metadata)
    return out
