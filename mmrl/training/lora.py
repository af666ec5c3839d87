"""LoRA through peft: which layers get adapters, and the base model with the adapter switched off.

peft injects the adapter layers into the model object in place, so the trainer, the engines and the
log-prob code keep using the plain transformers object; the PeftModel wrapper is kept only for what
needs it: switching the adapter off for the reference, and saving it in peft's format.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmrl.config import LoraConfig
from mmrl.models import ACTION_TOKENIZER_FILE, SHARDED_MARKER, family_of


def target_modules(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Full names of the linear layers that get adapters: those of the language model (and the vision
    tower when `include_vision`), filtered to `cfg.target_modules` leaf names when given; never the LM
    head, whose adaptation would also move the tied embeddings."""
    prefixes = family_of(model).lora_prefixes(cfg.include_vision)
    leaves = set(cfg.target_modules or ())
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and name.startswith(prefixes)
        and (not leaves or name.rpartition(".")[2] in leaves)
    ]
    if not names:
        raise ValueError("LoRA found no linear layers to adapt; check model.lora.target_modules")
    return names


def apply_lora(model: nn.Module, cfg: LoraConfig) -> Any:
    """Inject adapters into `model` (in place) and freeze everything else; returns the PeftModel."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=target_modules(model, cfg),
        bias="none",
    )
    return get_peft_model(model, peft_cfg)


def merged_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`model`'s state dict with every adapter folded into its base weight, one tensor at a time and
    without touching the model: W + (α/r)·B·A is computed per layer as it is streamed, so the base
    weights (and with them the KL reference) never pick up merge/unmerge rounding. Adapter matrices
    are left out and `base_layer.` disappears from the names, giving the plain model's names."""
    from peft.tuners.lora import LoraLayer

    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            continue
        tensor = _whole(tensor)
        owner, _, leaf = name.rpartition(".base_layer.")
        if leaf == "weight" and owner in layers:
            layer = layers[owner]
            with torch.no_grad():
                tensor = tensor + sum(_delta(layer, a) for a in layer.active_adapters)
        yield name.replace(".base_layer.", "."), tensor.detach()


def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """`merged_state` collected on the CPU: what a rollout worker of its own loads."""
    return {name: tensor.cpu() for name, tensor in merged_state(model)}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor in full: an FSDP2 shard (DTensor) is gathered from every rank, which must all ask in step."""
    full = getattr(tensor, "full_tensor", None)
    return full() if full else tensor


def _delta(layer: Any, adapter: str) -> torch.Tensor:
    """(α/r)·B·A of one linear adapter, from whole matrices when the layer is sharded."""
    a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    if not hasattr(a, "full_tensor"):
        return layer.get_delta_weight(adapter)
    return (_whole(b) @ _whole(a)) * layer.scaling[adapter]


def is_adapter(folder: Path) -> bool:
    return (folder / "adapter_config.json").exists()


def load_with_adapter(folder: Path, device: str = "cpu") -> nn.Module:
    """A policy saved as a LoRA adapter, loaded the plain-transformers way: the base model named in the
    adapter's config, with `load_adapter` (transformers' peft integration) on top."""
    from mmrl.models import load_policy

    base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").exists():
        raise FileNotFoundError(
            f"the LoRA adapter in {folder} names its base model as {base!r}, which is not a model folder here; "
            "copy the base model there or edit base_model_name_or_path in adapter_config.json"
        )
    model = load_policy(base, device=device)
    model.load_adapter(str(folder))
    return model


def gather_shards(folder: Path) -> nn.Module:
    """The model of a Ray workers' checkpoint (FSDP shards in `dcp/`), whole, in this one process.

    Full fine-tuning saved every weight, so the architecture comes from the saved config; LoRA saved
    only the adapters, which go onto the base model named in the marker file and are merged."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig

    from mmrl.models import load_policy

    marker = json.loads((folder / SHARDED_MARKER).read_text())
    lora = LoraConfig(**marker["lora"])
    if lora.rank:
        model = load_policy(marker["base"])
        peft = apply_lora(model, lora)
        wanted = {n for n, p in model.named_parameters() if p.requires_grad}
    else:
        config = AutoConfig.from_pretrained(folder)
        model = family_of(config).new_model(config)
        wanted = set(model.state_dict())
    state = {k: v for k, v in model.state_dict().items() if k in wanted}
    dcp.load({"model": state}, checkpoint_id=folder / "dcp")  # in place, into the model's own tensors
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return peft.merge_and_unload() if lora.rank else model


def export_plain(folder: Path, out: Path) -> Path:
    """A checkpoint as a plain transformers model folder: a LoRA adapter is merged into its base, so
    the result loads with `from_pretrained` (and in vLLM) with no peft involved. An action-token
    policy's bins go with it."""
    from mmrl.models import load_policy, load_processor, save_model

    if out.is_file():
        raise FileExistsError(f"{out} is a file; give a new or empty folder to export into")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; choose a new folder for the export")
    processor_from = folder
    if (folder / SHARDED_MARKER).exists():
        model = gather_shards(folder)
    elif is_adapter(folder):
        from peft import PeftModel

        base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
        model = PeftModel.from_pretrained(load_policy(base), str(folder)).merge_and_unload()
        processor_from = base  # an adapter folder may hold the adapter alone
    else:
        model = load_policy(folder)
    save_model(model, load_processor(processor_from), out)
    if (folder / ACTION_TOKENIZER_FILE).is_file():  # without it, a run from the export bins afresh
        shutil.copy2(folder / ACTION_TOKENIZER_FILE, out / ACTION_TOKENIZER_FILE)
    return out
