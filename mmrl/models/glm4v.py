"""GLM-4.1V (`glm4v`) and GLM-4.5V (`glm4v_moe`): Qwen-VL-like models with GLM's own tokens, and their tiny builds.

What they share with the Qwen line: a vision tower whose merged features replace placeholder tokens,
3-axis mRoPE, and videos told as one grid per temporal patch with its time in text (as Qwen3-VL).
What is their own:

- Tokens: an image is `<|begin_of_image|>` + `<|image|>` per merged patch + `<|end_of_image|>`; a video
  is `<|begin_of_video|>`, then per temporal patch an image-like frame followed by the whole second its
  first frame is shown at (`0`, `1`, ...), then `<|end_of_video|>`. A video's frames are written with the
  image token `<|image|>` too; only the video delimiters around them tell them apart
  (`media_token_types`, as `Glm4vProcessor.create_mm_token_type_ids` does), and the chat template's
  `<|video|>` never reaches the model.
- Sizing: GLM's image processor sizes an image as one temporal patch of two frames, so its pixel bounds
  hold for twice the image's area (`image_size`); its video processor bounds a whole clip's frames x
  pixels, as Qwen3-VL's does (`whole_clip`).
- Positions: transformers' `get_rope_index` splits each video into one t=1 grid per temporal patch and
  resumes text at max(h, w) / merge after a grid's start; vLLM 0.32 (`Glm4vForConditionalGeneration.
  get_mrope_input_positions`) resumes at 1 + the largest id so far, the same for t=1 grids, so both
  engines' layouts are one (`processors.mrope_position_ids` gives both rules the same ids).
- Forward: transformers 5.19's GLM forward finds both kinds' slots as `<|image|>` tokens, so a forward
  with images and videos together (one prompt with both, or a batch mixing image and video rows) fails
  its count check ("Image features and image tokens do not match"). `token_inputs` places the encoded
  features itself, each kind at its own tokens, and hands the model the embeddings. Only transformers'
  `generate` (the HF engine on FSDP workers) runs the model's own forward: a run there whose rows mix
  images and videos is refused at start (`generate_mixes_media`).
- Saved names: transformers 5.19 saves GLM under its in-memory names, which vLLM's loader maps
  (`hf_to_vllm_mapper`), so no renaming. GLM-4.5V holds its routed experts fused and saves them per
  expert (transformers' Qwen2-MoE conversion), as vLLM's loader reads them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch
from transformers import (
    Glm4vConfig,
    Glm4vImageProcessor,
    Glm4vMoeConfig,
    Glm4vProcessor,
    Glm4vVideoProcessor,
)
from transformers.models.glm4v import image_processing_glm4v, video_processing_glm4v

from mmrl.models.family import Family, per_expert, register
from mmrl.models.qwen2_5_vl import tiny_text
from mmrl.models.qwen3_vl import frame_grids
from mmrl.processors import TRANSFORMERS_RULE, PositionRule, Video, VideoBudget, num_video_tokens

IMAGE, VIDEO = "<|image|>", "<|video|>"
BEGIN_IMAGE, END_IMAGE = "<|begin_of_image|>", "<|end_of_image|>"
BEGIN_VIDEO, END_VIDEO = "<|begin_of_video|>", "<|end_of_video|>"
# GLM's media tokens, by the config field that holds each one's id.
GLM_MEDIA_IDS = {
    "image_token_id": IMAGE,
    "video_token_id": VIDEO,
    "image_start_token_id": BEGIN_IMAGE,
    "image_end_token_id": END_IMAGE,
    "video_start_token_id": BEGIN_VIDEO,
    "video_end_token_id": END_VIDEO,
}
TEMPORAL_PATCH = 2  # frames per temporal patch (GLM-V's); GLM's image processor counts an image as two


def image_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """GLM's image processor: an image sized as a clip of one temporal patch, its two frames' pixels bounded."""
    return image_processing_glm4v.smart_resize(
        TEMPORAL_PATCH, height, width, TEMPORAL_PATCH, factor, min_pixels, max_pixels
    )


def whole_clip(
    num_frames: int, height: int, width: int, budget: VideoBudget, max_pixels: int
) -> tuple[int, int]:
    """GLM's video processor bounds a clip's frames x pixels: the per-frame bounds scaled by the frame count."""
    low, high = budget.min_pixels * num_frames, max_pixels * num_frames
    return video_processing_glm4v.smart_resize(
        num_frames, height, width, budget.temporal_patch_size, budget.factor, low, high
    )


def timestamped_frames(video: Video, budget: VideoBudget) -> str:
    """A video's text inside `<|begin_of_video|>` and `<|end_of_video|>`, as `Glm4vProcessor` writes it: per
    temporal patch `<|begin_of_image|>pads<|end_of_image|>` and the whole second its first frame is shown
    at. The frames are indices 0.. of a clip shown at `video.fps`, how the vLLM engine hands them over
    (`mmrl.rollout.vllm.video_item`), so both engines write the same seconds."""
    tps = budget.temporal_patch_size
    pads = IMAGE * num_video_tokens(tps, *video.size, budget)
    return "".join(
        f"{BEGIN_IMAGE}{pads}{END_IMAGE}{int(start / video.fps)}"
        for start in range(0, len(video.frames), tps)
    )


def tiny_vision() -> dict[str, Any]:
    """The tiny GLM vision tower: depth 2, hidden 64, patch 14, a learned 16 x 16 position grid."""
    return {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 256,  # the merger's inner width (the language model's MLP width, as released)
        "num_heads": 4,
        "patch_size": 14,
        "image_size": 224,  # 16 x 16 learned positions, interpolated to each image
        "spatial_merge_size": 2,
        "temporal_patch_size": TEMPORAL_PATCH,
        "out_hidden_size": 128,  # the language model's hidden size
    }


def tiny_glm_text(tokenizer: Any) -> dict[str, Any]:
    """The shared tiny language model with GLM's half-rotary mRoPE: 4 heads of 32, 16 dims rotated, in
    sections [2, 3, 3] of the 8 frequencies (the released [8, 12, 12] of 32, scaled down)."""
    text = tiny_text(tokenizer)
    # transformers always gives q, k and v a bias; vLLM 0.32's GLM-4 layer only where the config says so
    # (as the released one does), and otherwise drops them on load and on every weight sync.
    text["attention_bias"] = True
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "partial_rotary_factor": 0.5,
    }
    return text


def glm_media_ids(tokenizer: Any) -> dict[str, int]:
    """The config's media token ids in the tiny tokenizer."""
    return {field: tokenizer.convert_tokens_to_ids(token) for field, token in GLM_MEDIA_IDS.items()}


@register
class Glm4v(Family):
    name = "glm4v"
    model_types = ("glm4v",)
    model_class = "Glm4vForConditionalGeneration"
    tiny_grid_factor = 28
    video_time_in_seconds = False  # time is in the text after each frame; every frame's time id is 0
    image_size_rule = staticmethod(image_size)
    video_size_rule = staticmethod(whole_clip)
    media_pads: ClassVar[tuple[str, str]] = (IMAGE, VIDEO)
    qwen_turns = False  # GLM's turns and image tokens differ: env and agent runs are refused at start
    generate_mixes_media = False  # transformers' forward takes a video frame's `<|image|>`s for image slots
    saved_prefixes: ClassVar[dict[str, str]] = {}
    tiny_special_tokens: ClassVar[tuple[str, ...]] = tuple(GLM_MEDIA_IDS.values())
    tiny_chat_media: ClassVar[tuple[str, str]] = (
        f"{BEGIN_IMAGE}{IMAGE}{END_IMAGE}",
        f"{BEGIN_VIDEO}{VIDEO}{END_VIDEO}",
    )

    # ------------------------------------------------------------------ media
    def media_token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """1 on image tokens, 2 on the image tokens of a video's frames (between its delimiters)."""
        cfg = self.config
        opened = (input_ids == cfg.video_start_token_id).cumsum(-1)
        closed = (input_ids == cfg.video_end_token_id).cumsum(-1)
        return (input_ids == cfg.image_token_id).int() * (1 + (opened > closed).int())

    def never_generated_ids(self) -> list[int]:
        """GLM's image and video tokens and their begin and end delimiters."""
        return [getattr(self.config, name) for name in GLM_MEDIA_IDS]

    def video_placeholder(self, video: Video, budget: VideoBudget) -> int | str:
        return timestamped_frames(video, budget)

    def video_grids(self, grids: torch.Tensor) -> torch.Tensor:
        return frame_grids(grids)

    # ------------------------------------------------------------------ positions
    def position_ids(
        self,
        prompts: Sequence[Any],
        input_ids: torch.Tensor,
        attention: torch.Tensor,
        rules: PositionRule | Sequence[PositionRule] = TRANSFORMERS_RULE,
    ) -> torch.Tensor:
        """The shared mRoPE layout, once each video frame's `<|image|>` tokens are told apart as video."""
        marked = torch.where(self.media_token_types(input_ids) == 2, self.config.video_token_id, input_ids)
        return super().position_ids(prompts, marked, attention, rules)

    # ------------------------------------------------------------------ forward
    def token_inputs(self, model: Any, input_ids: torch.Tensor, media: dict[str, Any]) -> dict[str, Any]:
        """The token embeddings with each encoded image and video frame in its own slots: the model's
        forward would take every `<|image|>` for both kinds and refuse images and videos together."""
        embeds = model.model.get_input_embeddings()(input_ids)
        types = self.media_token_types(input_ids)
        for code, kind in enumerate(("image", "video"), start=1):
            if kind not in media:
                continue
            features = torch.cat(media[kind].pooler_output).to(embeds.device, embeds.dtype)
            slots = types == code
            if int(slots.sum()) != len(features):
                raise ValueError(f"{int(slots.sum())} {kind} tokens for {len(features)} {kind} features")
            embeds = embeds.masked_scatter(slots[..., None], features)
        return {"inputs_embeds": embeds}

    def vllm_prompt_ids(self, prompt_ids: Sequence[int], tokenizer: Any) -> list[int]:
        """Prompt ids as vLLM takes them: one `<|image|>` per image, and each video's frames and seconds
        as one `<|video|>` between its delimiters, which vLLM's GLM-4V processor expands itself."""
        cfg = self.config
        out: list[int] = []
        in_video = False
        for token in prompt_ids:
            if token == cfg.video_end_token_id:
                in_video = False
            elif in_video or (token == cfg.image_token_id and out and out[-1] == token):
                continue
            out.append(token)
            if token == cfg.video_start_token_id:
                in_video = True
                out.append(cfg.video_token_id)
        return out

    # ------------------------------------------------------------------ tiny models
    @classmethod
    def tiny_config(cls, tokenizer: Any) -> Any:
        return Glm4vConfig(
            text_config=tiny_glm_text(tokenizer),
            vision_config=tiny_vision(),
            **glm_media_ids(tokenizer),
            tie_word_embeddings=False,  # as released
        )

    @classmethod
    def tiny_processor(cls, tokenizer: Any, min_pixels: int, max_pixels: int, chat_template: str) -> Any:
        """The real `Glm4vProcessor`: images sized within [min_pixels, max_pixels] for their two frames
        (GLM's convention), clips within up to 32 frames at `max_pixels` (`processors.fit_image` and
        `video_frame_size` apply both rules; the processors never resize)."""
        return Glm4vProcessor(
            image_processor=Glm4vImageProcessor(
                size={"shortest_edge": min_pixels, "longest_edge": max_pixels}
            ),
            video_processor=Glm4vVideoProcessor(
                size={"shortest_edge": min_pixels, "longest_edge": 32 * max_pixels}
            ),
            tokenizer=tokenizer,
            chat_template=chat_template,
        )


@register
class Glm4vMoe(Glm4v):
    """GLM-4.5V: GLM-4.1V's layout with mixture-of-experts decoder layers after the first dense ones
    (`first_k_dense_replace`); each MoE layer's routed experts, shared expert and router sit inside it,
    so the FSDP units are GLM-4.1V's."""

    name = "glm4v_moe"
    model_types = ("glm4v_moe",)
    model_class = "Glm4vMoeForConditionalGeneration"
    mixture_of_experts = True

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        yield from per_expert(name, tensor)

    @classmethod
    def tiny_config(cls, tokenizer: Any) -> Any:
        text = tiny_glm_text(tokenizer)
        text.update(
            # Keys transformers 5.19 does without (it derives head_dim as 128 / 4 and has no q/k norm) but
            # vLLM 0.32's GLM-4-MoE layer reads (AttributeError without them); the released config has both.
            head_dim=32,
            use_qk_norm=False,
            first_k_dense_replace=1,  # layer 0 dense, layer 1 routed, as the released model starts
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            n_group=1,
            topk_group=1,
        )
        return Glm4vMoeConfig(
            text_config=text,
            vision_config=tiny_vision(),
            **glm_media_ids(tokenizer),
            # As released: vLLM 0.32's GLM-4-MoE has no tied head, and would leave a tied one's unloaded.
            tie_word_embeddings=False,
        )
