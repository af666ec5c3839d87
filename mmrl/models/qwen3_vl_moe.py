"""Qwen3-VL-MoE: Qwen3-VL with mixture-of-experts decoder layers, and its tiny build.

Everything Qwen3-VL does (timestamped videos, DeepStack, interleaved mRoPE, saved names) holds. The
experts live inside each decoder layer (`mlp.experts`, one 3-D weight per projection, and the router
`mlp.gate`), so the default FSDP units, one per decoder layer, shard the experts with their layer.
The router's load-balancing loss is off unless `actor.router_aux_loss_coef` > 0 (`Family.router_loss`).

Expert weight layout: transformers 5.19 holds the fused experts as (experts, out, in) and
`save_pretrained` writes them so, while Qwen's released checkpoints, and so vLLM 0.32's loader
(`is_fused_checkpoint_transposed=True`), have them as (experts, in, out); transformers transposes
them on load by shape. vLLM rejects a checkpoint as transformers writes it, so the same transpose is
due on every weight sync, and every folder mmrl writes (tiny builds, warm-up, checkpoints, exports) is
rewritten in the released layout (`save_model`): `checkpoint_tensors` gives a tensor as that layout has it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from transformers import Qwen3VLMoeConfig

from mmrl.models.family import register
from mmrl.models.qwen2_5_vl import media_ids
from mmrl.models.qwen3_vl import Qwen3_VL, tiny_qwen3_text, tiny_vision


@register
class Qwen3_VL_MoE(Qwen3_VL):
    name = "qwen3_vl_moe"
    model_types = ("qwen3_vl_moe",)
    model_class = "Qwen3VLMoeForConditionalGeneration"
    mixture_of_experts = True
    relaid_out = True

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """The fused experts `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` as Qwen's released
        checkpoints (and vLLM's loader) lay them out, (experts, in, out)."""
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            tensor = tensor.transpose(1, 2)
        yield name, tensor

    @classmethod
    def tiny_config(cls, tokenizer: Any) -> Any:
        text = {
            **tiny_qwen3_text(tokenizer),
            "num_experts": 4,
            "num_experts_per_tok": 2,
            # gate_up_proj (experts, 2 x 32, 128) is not square, so a transposed expert weight cannot
            # load silently (transformers decides whether to transpose a fused expert by its shape).
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,  # every layer is a mixture of experts
            "mlp_only_layers": [],
            "router_aux_loss_coef": 0.001,  # the pre-training value; mmrl's is actor.router_aux_loss_coef
            # transformers 5.19 always renormalises the top-k weights and dropped this key; vLLM 0.32's
            # Qwen3-MoE layer still reads it (AttributeError without it). True is what transformers does.
            "norm_topk_prob": True,
        }
        return Qwen3VLMoeConfig(
            text_config=text,
            vision_config=tiny_vision(),
            **media_ids(tokenizer),
            tie_word_embeddings=True,
        )
