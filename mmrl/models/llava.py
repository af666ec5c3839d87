"""What the LLaVA-layout families (InternVL, Gemma 3, LLaVA-OneVision, Mistral 3) share, unlike the Qwen line.

A vision tower (`model.vision_tower`) takes a batch of images (equal tiles or crops; Pixtral's of their own
sizes), a projector
(`model.multi_modal_projector`) maps its features to the language model's width, and they replace the
runs of one image token in a plain 1-D-position language model. transformers 5.19 saves these families
under the names of their original LLaVA checkpoints, which vLLM's loader maps. Each family module keeps
what differs: sizing, its image text, the encoding, its tower's layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from mmrl.models.family import Family
from mmrl.models.text import TextPositions


class LlavaLayout(TextPositions, Family):
    """A LLaVA-layout family: one image token, 1-D positions, tower and projector beside the language model."""

    packed_vision = False  # the tower takes a batch of images, with no cu_seqlens
    qwen_turns = False  # env and tool turns would carry Qwen's image tokens: refused at start
    saved_prefixes: ClassVar[dict[str, str]] = {
        "model.language_model.": "language_model.model.",
        "lm_head.": "language_model.lm_head.",
        "model.vision_tower.": "vision_tower.",
        "model.multi_modal_projector.": "multi_modal_projector.",
    }

    def media_token_ids(self) -> dict[str, int]:
        return {"image": self.config.image_token_id}

    def media_token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """1 on image tokens (Gemma 3's `token_type_ids`, whose runs attend both ways), 0 elsewhere."""
        return (input_ids == self.config.image_token_id).int()

    def freeze_vision(self, model: Any) -> None:
        """The tower and the projector that maps its features to the language model's width."""
        model.model.vision_tower.requires_grad_(False)
        model.model.multi_modal_projector.requires_grad_(False)

    def vision_layers(self, model: Any) -> nn.ModuleList:
        """The tower's blocks, each an FSDP unit."""
        return model.model.vision_tower.encoder.layers

    def fsdp_units(self, model: Any) -> list[nn.Module]:
        return [*self.vision_layers(model), *self.language_model(model).layers]

    def lora_prefixes(self, include_vision: bool) -> tuple[str, ...]:
        vision = ("model.vision_tower.", "model.multi_modal_projector.") if include_vision else ()
        return ("model.language_model.", *vision)


RELEASED_SIGLIP = "vision_tower.vision_model."


class ReleasedSiglipNames:
    """A family whose SigLIP tower transformers saves as `vision_tower.`, where the released checkpoints (and
    so vLLM 0.32's loader) hold it under `vision_tower.vision_model.`: transformers loads both, so folders
    mmrl writes, and every weight sync, use the released names (LLaVA-OneVision, Gemma 3)."""

    relaid_out = True

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """SigLIP's tensors under the released `vision_tower.vision_model.`; every other one as saved."""
        tower = "vision_tower."
        if name.startswith(tower) and not name.startswith(RELEASED_SIGLIP):
            name = RELEASED_SIGLIP + name[len(tower) :]
        yield name, tensor
