"""Text-only causal language models (Qwen3, Qwen2, Llama) through `AutoModelForCausalLM`.

No vision tower and no mRoPE: one position id per attended token (the attention mask's running
count minus one, 0 on padding), which is what `generate` gives a left-padded prompt and what vLLM
gives a prompt without padding, so the trainer's log-probs are of the positions either engine
sampled at. Datasets for these models hold text rows only (`mmrl.sources.prompts.build_datasets` refuses
images and videos up front).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3Config

from mmrl.errors import ConfigError
from mmrl.models.family import Family, Grid, register
from mmrl.models.qwen2_5_vl import tiny_text
from mmrl.processors import TRANSFORMERS_RULE, PositionRule, Video, VideoBudget


def text_positions(attention: torch.Tensor) -> torch.Tensor:
    """(B, L) positions counting attended tokens only, 0 on padding: a 1-D-position language model's
    layout as `generate` gives a left-padded prompt and vLLM a prompt without padding."""
    mask = attention.long()
    return (mask.cumsum(dim=1) - 1).clamp(min=0) * mask


class TextPositions:
    """A family whose language model takes 1-D positions: one id per attended token, left padding and the
    padding after a response 0. Both engines lay such text out this way, so `rules` changes nothing."""

    def position_ids(
        self,
        prompts: Sequence[Any],
        input_ids: torch.Tensor,
        attention: torch.Tensor,
        rules: PositionRule | Sequence[PositionRule] = TRANSFORMERS_RULE,
    ) -> torch.Tensor:
        return text_positions(attention)


@register
class TextLM(TextPositions, Family):
    name = "text"
    model_types = ("qwen3", "qwen2", "llama")
    model_class = "AutoModelForCausalLM"
    takes_images = False
    takes_video = False
    saved_prefixes: ClassVar[dict[str, str]] = {}

    @classmethod
    def load_class(cls) -> type[nn.Module]:
        return AutoModelForCausalLM

    @classmethod
    def new_model(cls, config: Any, dtype: torch.dtype = torch.float32) -> nn.Module:
        return AutoModelForCausalLM.from_config(config, dtype=dtype)

    @property
    def text_config(self) -> Any:
        return self.config

    # ------------------------------------------------------------------ media: none
    def grid(self) -> Grid:
        raise ValueError(
            f"{self.config.model_type} is a text-only model ({self.name} family): it has no vision tower, "
            "so no pixel grid; image and video rows cannot be used with it"
        )

    def media_token_ids(self) -> dict[str, int]:
        return {}

    def never_generated_ids(self) -> list[int]:
        return []

    def video_placeholder(self, video: Video, budget: VideoBudget) -> int | str:
        self.grid()  # raises: a text model takes no video
        raise AssertionError("unreachable")

    def encode_media(self, model: Any, pixels: torch.Tensor, grids: torch.Tensor, video: bool) -> Any:
        self.grid()
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ forward
    def hidden_states(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention: torch.Tensor | None,
        positions: torch.Tensor,
        media: dict[str, Any],
        router_losses: list[torch.Tensor] | None = None,
        cache: Any = None,
        attention_kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        if media:
            self.grid()
        if router_losses is not None:
            raise ValueError(f"{self.name} models have no experts: set actor.router_aux_loss_coef to 0")
        out = model.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=cache is not None,
            **(attention_kwargs or {}),
        )
        return out.last_hidden_state

    def generate_inputs(self, input_ids: torch.Tensor, vision: dict[str, torch.Tensor]) -> dict[str, Any]:
        if vision:
            self.grid()
        return {}

    # ------------------------------------------------------------------ structure
    def language_model(self, model: Any) -> nn.Module:
        return model.model

    def freeze_vision(self, model: Any) -> None:
        raise ConfigError(
            f"model.freeze_vision_tower: {self.config.model_type} is a text-only model ({self.name} family) "
            "with no vision tower; set it to false"
        )

    def fsdp_units(self, model: Any) -> list[nn.Module]:
        return list(model.model.layers)

    def lora_prefixes(self, include_vision: bool) -> tuple[str, ...]:
        """The decoder (`model.`); there is no vision tower, so `include_vision` changes nothing."""
        return ("model.",)

    def saved_name(self, name: str) -> str:
        return name

    # ------------------------------------------------------------------ tiny models
    @classmethod
    def tiny_config(cls, tokenizer: Any) -> Qwen3Config:
        text = tiny_text(tokenizer)
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        return Qwen3Config(**text, head_dim=32, tie_word_embeddings=True)

    @classmethod
    def tiny_processor(cls, tokenizer: Any, min_pixels: int, max_pixels: int, chat_template: str) -> Any:
        """A text model's processor is its tokenizer (with the chat template)."""
        tokenizer.chat_template = chat_template
        return tokenizer
