"""Gemma 3 (`gemma3`): a SigLIP tower at one fixed square size on a Gemma 3 language model.

What differs from the Qwen line:

- Sizing: every image is resized to the tower's square input (896 px released), whatever its shape, as
  `Gemma3ImageProcessor` resizes it (pan-and-scan, off by default, is not used). The pixel budget
  cannot change that size: `square` ignores it.
- Tokens: the tower's patches are average-pooled to a fixed `mm_tokens_per_image` (256 released), and an
  image is `\\n\\n<start_of_image>` + that many `<image_soft_token>` + `<end_of_image>\\n\\n`, the text
  `Gemma3Processor` puts where the chat template writes `<start_of_image>`.
- Pixels: one (3, side, side) row per image, its grid `[1]` (`processors.pixel_inputs`).
- Attention: the tokens of one image attend to each other both ways inside the causal language model,
  which the model builds from `token_type_ids` (1 on image tokens); its layers alternate sliding-window
  and global attention. The shared-prompt forward keeps both: the prompt runs through the model's own
  masks, and the responses, text after it, attend to its cached keys and values causally within the
  window. The packed forward (one causal mask per segment, no window) would not: `actor.padding_free` is
  refused (0.37 nats off on the tiny model, whose window cuts its prompts).
- Positions: one id per attended token, as a plain language model takes them.
- Saved names: transformers 5.19 saves Gemma 3 under its original checkpoints' names
  (`language_model.model.`, `vision_tower.`, ...), as it does InternVL, but for SigLIP's, which released
  checkpoints and vLLM hold under `vision_tower.vision_model.` (`ReleasedSiglipNames`).
- Tokens of a tiny build: Gemma's runs of one to four newlines are single tokens, as in Gemma's vocabulary,
  which vLLM's Gemma 3 processor looks them up in.
- vLLM: refused (`vllm_unsupported`). vLLM 0.32 on CPU serves the tiny model, and its expanded prompts are
  mmrl's once each image's `\\n\\n<start_of_image>…<end_of_image>\\n\\n` is sent as `<start_of_image>` with
  two newlines taken from the newline tokens on each side; but rows with images come back up to 3e-3
  from the trainer's log-probs (text-only rows 1e-6), over the 1e-3 mmrl holds vLLM to. vLLM's CPU
  attention backend has no bidirectional attention among a multimodal item's tokens (`supports_mm_prefix`,
  which its GPU backends give with FlashAttention 4), so it attends causally within each image.

Video is refused: Gemma 3 takes no video.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from transformers import Gemma3Config, Gemma3ImageProcessor, Gemma3Processor
from transformers.modeling_outputs import BaseModelOutputWithPooling

from mmrl.models.family import Grid, register
from mmrl.models.llava import LlavaLayout, ReleasedSiglipNames
from mmrl.models.qwen2_5_vl import tiny_text
from mmrl.processors import PixelBudget, Video, VideoBudget
from mmrl.processors.chat import VIDEO_PAD

START, END, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
# Gemma's tokenizer names its image tokens so; `Gemma3Processor` reads them (and their ids) by these names.
NAMED_TOKENS = {"boi_token": START, "eoi_token": END, "image_token": SOFT}
# Gemma's vocabulary holds runs of up to four newlines as single tokens, and vLLM's Gemma 3 processor merges
# the blank lines around an image it expands into them.
NEWLINES = tuple("\n" * k for k in range(1, 5))
TINY_SIDE = 56  # the tiny SigLIP's input side: 8 x 8 patches of 7 px
TINY_IMAGE_TOKENS = 16  # the 8 x 8 patches pooled 2 x 2, as the released 64 x 64 are pooled 4 x 4 to 256
TINY_WINDOW = 24  # the tiny sliding window: shorter than a two-image prompt, longer than an image's run


def square(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """`Gemma3ImageProcessor`'s size for any image: the tower's square input (`factor`), the budget aside."""
    return factor, factor


@register
class Gemma3(ReleasedSiglipNames, LlavaLayout):
    name = "gemma3"
    model_types = ("gemma3",)
    model_class = "Gemma3ForConditionalGeneration"
    takes_video = False
    packs_sequences = False  # see the module docstring
    why_unpacked = (
        "attend both ways within each image and through sliding windows, which the packed forward's "
        "per-sequence causal attention would not"
    )
    tiny_grid_factor = TINY_SIDE
    image_size_rule = staticmethod(square)
    media_pads: ClassVar[tuple[str, str]] = (START, VIDEO_PAD)
    vllm_unsupported = (
        "vLLM 0.32's CPU attention backend attends causally within an image, where Gemma 3 attends both ways "
        "(it has no `supports_mm_prefix`): rows with images come back up to 3e-3 from the trainer's log-probs"
    )
    tiny_special_tokens: ClassVar[tuple[str, ...]] = tuple(NAMED_TOKENS.values())
    tiny_added_tokens: ClassVar[tuple[str, ...]] = NEWLINES
    tiny_chat_media: ClassVar[tuple[str, str]] = (START, VIDEO_PAD)

    # ------------------------------------------------------------------ media
    def grid(self) -> Grid:
        """Sides are the tower's input side (`factor`): patches per side stand where Qwen's merge does."""
        vision = self.config.vision_config
        return Grid(vision.patch_size, vision.image_size // vision.patch_size, 1)

    def never_generated_ids(self) -> list[int]:
        """The soft token and its delimiters: a sampled `<start_of_image>` is an image slot to the processor."""
        cfg = self.config
        return [cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id]

    def image_placeholder(self, height: int, width: int, budget: PixelBudget) -> int | str:
        """The text `Gemma3Processor` puts for one image: its soft tokens between the delimiters, in blank lines."""
        return f"\n\n{START}{SOFT * self.config.mm_tokens_per_image}{END}\n\n"

    def video_placeholder(self, video: Video, budget: VideoBudget) -> int | str:
        raise ValueError(f"{self.name} models take no video")

    # ------------------------------------------------------------------ forward
    def encode_media(self, model: Any, pixels: torch.Tensor, grids: torch.Tensor, video: bool) -> Any:
        """Every image through SigLIP, the pooling and the projector: one run of soft-token features each."""
        device = next(model.parameters()).device
        features = model.model.get_image_features(pixel_values=pixels.to(device)).pooler_output
        return BaseModelOutputWithPooling(pooler_output=tuple(features))

    def token_inputs(self, model: Any, input_ids: torch.Tensor, media: dict[str, Any]) -> dict[str, Any]:
        """The selected images' features as one tensor, and `token_type_ids`, from which the model builds
        each image's bidirectional block (text-only rows too, so every row's masks come one way)."""
        tokens = super().token_inputs(model, input_ids, media)
        if media:
            features = torch.stack(media["image"].pooler_output)
            tokens["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=features)}
        return {**tokens, "token_type_ids": self.media_token_types(input_ids)}

    def generate_inputs(self, input_ids: torch.Tensor, vision: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The images and `token_type_ids`: the model places features by soft token and blocks by type."""
        pixels = {"pixel_values": vision["pixel_values"]} if "pixel_values" in vision else {}
        return {**pixels, "token_type_ids": self.media_token_types(input_ids)}

    # ------------------------------------------------------------------ tiny models
    @classmethod
    def new_model(cls, config: Any, dtype: torch.dtype = torch.float32) -> nn.Module:
        """transformers starts the projector's matrix at zero (released weights replace it), which would
        give a random-init model zero image features, the same for every image, and no gradient into the
        tower: it starts random here, as the text model's matrices do."""
        model = super().new_model(config, dtype)
        with torch.no_grad():
            std = config.get_text_config().initializer_range
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, std)
        return model

    @classmethod
    def tiny_config(cls, tokenizer: Any) -> Gemma3Config:
        """A tiny SigLIP on a tiny Gemma 3 text model: one sliding-window layer then one global one (the
        released pattern is five to one), a window short enough to cut prompts, the head tied as released."""
        text = tiny_text(tokenizer)
        del text["rope_parameters"]  # Gemma 3's own per layer type
        text.update(
            model_type="gemma3_text",
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=TINY_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        )
        ids = tokenizer.convert_tokens_to_ids
        return Gemma3Config(
            text_config=text,
            vision_config={
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "image_size": TINY_SIDE,
                "patch_size": 7,
                "vision_use_head": False,  # as released: the soft tokens are the pooled patches
            },
            mm_tokens_per_image=TINY_IMAGE_TOKENS,
            boi_token_index=ids(START),
            eoi_token_index=ids(END),
            image_token_index=ids(SOFT),
            tie_word_embeddings=True,
        )

    @classmethod
    def tiny_processor(cls, tokenizer: Any, min_pixels: int, max_pixels: int, chat_template: str) -> Any:
        """The real `Gemma3Processor`: 56 px squares (the budget cannot change them), the tokenizer's image
        tokens named as Gemma's tokenizer names them."""
        tokenizer._set_model_specific_special_tokens(NAMED_TOKENS)  # transformers' own naming of them
        return Gemma3Processor(
            image_processor=Gemma3ImageProcessor(size={"height": TINY_SIDE, "width": TINY_SIDE}),
            tokenizer=tokenizer,
            image_seq_length=TINY_IMAGE_TOKENS,
            chat_template=chat_template,
        )
