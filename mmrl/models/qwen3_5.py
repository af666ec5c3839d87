"""Qwen3.5 (`qwen3_5`) and Qwen3.5-MoE (`qwen3_5_moe`): natively multimodal, hybrid linear-attention layers.

What Qwen3.5 shares with Qwen3-VL (`Qwen3_VL`): timestamped video text, `get_rope_index`'s layout (every
video temporal patch its own t=1 grid; transformers 5.19's Qwen3.5 `get_rope_index` is Qwen3-VL's), the
interleaved mRoPE, and the checkpoint's processor (`Qwen3VLProcessor` over `Qwen2VLImageProcessor` and
`Qwen3VLVideoProcessor`, which is what transformers' auto classes load for `qwen3_5`).

What is its own:

- The language model mixes Gated DeltaNet layers (`linear_attention`, a recurrent state) with gated
  full-attention layers (`layer_types`, 3 to 1 in the real checkpoints). On CPU transformers runs the
  DeltaNet's reference PyTorch kernels (`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`). A
  recurrent layer must not carry padding into its state: the model zeroes the hidden states of
  padded positions before each DeltaNet layer (`apply_mask_to_padding_states`), so a left-padded
  row's state stays exactly zero until its first real token (its convolution sees zeros, as at the
  start of an unpadded row). tests/test_family_qwen3_5.py checks a left-padded row equals the row alone.
- No DeepStack: the vision tower returns its merged features only (`select_media` carries none).
- Saved names are the in-memory names (`model.language_model.*`, `model.visual.*`), so no renaming.
  Qwen3.5-MoE keeps its experts fused in memory (`mlp.experts.gate_up_proj`, (E, 2I, H)) and
  `save_pretrained` writes them per expert (`mlp.experts.{e}.gate_proj.weight`, ...).
- vLLM 0.32's CPU build runs the DeltaNet layers in bfloat16 only (`CPU GDN attention requires BF16.`)
  and its CPU kernel takes 128-dim linear-attention heads only (`Unexpected head dim size, 32`), which
  is why the tiny build uses them. vLLM builds the LM head from the text config's
  `tie_word_embeddings`, so a tied checkpoint must say so there too.
- transformers 5.19 declares Qwen3.5's generation classes text-only (`input_modalities`), so its
  `generate` does not encode media before expanding a batch for `num_return_sequences`: with n > 1 it
  repeat-interleaves `pixel_values` patch by patch and every copy of a multi-image or video row sees
  scrambled pixels. The HF engine's n > 1 is wrong for such rows until it passes the media encoded
  (`mm_encoder_outputs`) or repeats the prompts itself (tests/test_family_qwen3_5.py pins this down).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from transformers import Qwen3_5Config, Qwen3_5MoeConfig

from mmrl.models.family import per_expert, register
from mmrl.models.qwen2_5_vl import media_ids, tiny_text
from mmrl.models.qwen3_vl import Qwen3_VL, tiny_vision

# Three DeltaNet layers then one full-attention layer: the real checkpoints' pattern (interval 4).
TINY_LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def tiny_qwen3_5_text(tokenizer: Any) -> dict[str, Any]:
    """The tiny hybrid language model: hidden 128, 4 layers (3 DeltaNet, 1 gated attention).

    Full attention: 4 heads of 32 with a quarter of each head rotated (`partial_rotary_factor` 0.25,
    as in the real models), so the interleaved mRoPE sections cover 32 / 4 / 2 = 4 frequencies.
    DeltaNet: one 128-dim key head shared by two 128-dim value heads (vLLM's CPU kernel takes only
    128-dim heads; the real models have 16 key and 32 value heads of 128)."""
    text = tiny_text(tokenizer)
    text.update(
        num_hidden_layers=len(TINY_LAYER_TYPES),
        layer_types=list(TINY_LAYER_TYPES),
        head_dim=32,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
            "partial_rotary_factor": 0.25,
        },
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        # vLLM builds the LM head from the text config's flag: without it a tied head (which is not
        # saved) would load as uninitialised memory (NaN log-probs).
        tie_word_embeddings=True,
    )
    return text


def tiny_qwen3_5_vision() -> dict[str, Any]:
    """Qwen3-VL's tiny vision tower without DeepStack (Qwen3.5's tower returns merged features only)."""
    vision = tiny_vision()
    del vision["deepstack_visual_indexes"]
    return vision


@register
class Qwen3_5(Qwen3_VL):
    name = "qwen3_5"
    model_types = ("qwen3_5",)
    model_class = "Qwen3_5ForConditionalGeneration"
    saved_prefixes: ClassVar[dict[str, str]] = {}  # save_pretrained writes the in-memory names
    # transformers 5.19's PyTorch DeltaNet kernels (`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`)
    # ignore sequence boundaries: packed, a row's recurrent state and convolution would start from
    # the previous row's (tests/test_packing.py measures the gap).
    packs_sequences = False
    why_unpacked = "have recurrent (Gated DeltaNet) layers that would carry their state from one packed sequence into the next"
    prefix_cache = False  # the recurrent layers' state is not keys and values

    @classmethod
    def tiny_config(cls, tokenizer: Any) -> Qwen3_5Config:
        return Qwen3_5Config(
            text_config=tiny_qwen3_5_text(tokenizer),
            vision_config=tiny_qwen3_5_vision(),
            **media_ids(tokenizer),
            tie_word_embeddings=True,
        )


@register
class Qwen3_5_MoE(Qwen3_5):
    """Qwen3.5's MoE models: each decoder layer's MLP is a routed mixture of experts beside a gated
    shared expert; the experts sit inside their decoder layer, so the FSDP units are Qwen3.5's."""

    name = "qwen3_5_moe"
    model_types = ("qwen3_5_moe",)
    model_class = "Qwen3_5MoeForConditionalGeneration"
    mixture_of_experts = True

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The fused experts as the checkpoint (and so vLLM's loader) has them, per expert and projection."""
        yield from per_expert(name, tensor)

    @classmethod
    def tiny_config(cls, tokenizer: Any) -> Qwen3_5MoeConfig:
        text = tiny_qwen3_5_text(tokenizer)
        del text["intermediate_size"]
        text.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
        )
        return Qwen3_5MoeConfig(
            text_config=text,
            vision_config=tiny_qwen3_5_vision(),
            **media_ids(tokenizer),
            tie_word_embeddings=True,
        )
