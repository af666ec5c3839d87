"""The model-family adapter: everything that differs between the model families mmrl trains.

The rest of mmrl never names a model class. It asks the family of a config (`family_of`) for the
class to load, the training forward, position ids, the pixel grid, video placeholders, FSDP units,
LoRA prefixes and the names weights are saved under. `Family` holds the Qwen-VL behaviour most
families share; each family module overrides only what its models do differently and registers
itself with `@register`. Adding a family is one module and one import in `mmrl/models/__init__.py`
(`docs/adding_a_model.md`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import transformers
from packaging.version import Version
from torch import nn
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from mmrl.processors import (
    TRANSFORMERS_RULE,
    FrameRule,
    PixelBudget,
    PositionRule,
    SizeRule,
    Video,
    VideoBudget,
    frame_by_frame,
    mrope_position_ids,
    num_image_tokens,
    video_pad_count,
)
from mmrl.processors.chat import IMAGE_PAD, IMAGE_PART, VIDEO_PAD, VIDEO_PART

FAMILIES: dict[str, type[Family]] = {}  # config.json `model_type` -> family


class UnsupportedModelError(ValueError):
    """A checkpoint whose `model_type` no family handles."""


def register(family: type[Family]) -> type[Family]:
    """Class decorator: the family serves every `model_type` it lists."""
    for model_type in family.model_types:
        FAMILIES[model_type] = family
    return family


def family_of(config: Any) -> Family:
    """The family adapter for a model config (or a model, or anything with `.config`)."""
    config = getattr(config, "config", config)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        supported = {}
        for cls in FAMILIES.values():
            supported[cls.name] = f"{cls.name} ({', '.join(cls.model_types)})"
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not a supported model family. Supported families (model "
            f"types): {'; '.join(sorted(supported.values()))}. To add one, see docs/adding_a_model.md."
        )
    return family(config)


@dataclass(frozen=True)
class Grid:
    """The vision tower's patch grid: the side of a patch, the spatial merge, and frames per temporal patch."""

    patch: int
    merge: int
    temporal: int

    @property
    def factor(self) -> int:
        """Image sides are multiples of this (28 for Qwen2.5-VL, 32 for Qwen3-VL)."""
        return self.patch * self.merge


class Family:
    """A Qwen-VL-style family: a vision tower whose features replace placeholder tokens, and mRoPE.

    An instance wraps one model config; class attributes describe the family."""

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    model_class: ClassVar[str]  # the transformers class that loads the checkpoint, by name
    takes_images: ClassVar[bool] = True
    takes_video: ClassVar[bool] = True
    # Whether transformers' own forward (what `generate` runs) takes images and videos in one batch.
    generate_mixes_media: ClassVar[bool] = True
    # The vision tower attends within each image's span of one packed sequence of patches (`cu_seqlens`),
    # which `mmrl.models.vision_attention` batches; a tower that takes a batch of tiles (InternViT) keeps SDPA.
    packed_vision: ClassVar[bool] = True
    mixture_of_experts: ClassVar[bool] = False
    # Packed rows (`actor.padding_free`) stay apart only where every layer reads sequence boundaries
    # from the text positions, as attention does; a recurrent layer's state would run on across them.
    packs_sequences: ClassVar[bool] = True
    why_unpacked: ClassVar[str] = ""  # where it does not: why, as `actor.padding_free`'s refusal says it
    # A group's prompt runs once and its responses continue from its keys and values
    # (`mmrl.training.shared_prompt`) only where every layer's state is its keys and values.
    prefix_cache: ClassVar[bool] = True
    # Qwen2.5-VL spaces a video's time ids by real seconds (`second_per_grid_ts`); the other families
    # number temporal patches (Qwen2-VL) or tell time in text (Qwen3's timestamps), and their forward
    # refuses the argument.
    video_time_in_seconds: ClassVar[bool] = True
    # The transformers functions the family's image and video processors resize with: images
    # (`processors.smart_size`) and video frames (`video_frame_size`) are sized by them, so every
    # size is the one the checkpoint's own processors give.
    image_size_rule: ClassVar[SizeRule] = staticmethod(smart_resize)
    video_size_rule: ClassVar[FrameRule] = staticmethod(frame_by_frame)
    # The image and video tokens as the family's chat template writes them, each expanded to its item's
    # tokens (or a video's text) in a prompt (`processors.encode_prompt`): what its processor calls them.
    media_pads: ClassVar[tuple[str, str]] = (IMAGE_PAD, VIDEO_PAD)
    tiny_grid_factor: ClassVar[int] = 28  # patch x merge of the tiny build, for its default pixel budget
    # The tiny build's tokenizer (Qwen's special tokens) adds these, and its chat template writes an image
    # and a video part so: the family's own spelling where it is not Qwen's.
    tiny_special_tokens: ClassVar[tuple[str, ...]] = ()
    # Plain tokens the family's own vocabulary holds whole and a tiny build's tokenizer must too (Gemma's
    # runs of newlines, which vLLM's Gemma 3 processor looks up by their text).
    tiny_added_tokens: ClassVar[tuple[str, ...]] = ()
    # Env observations and tool results are written as Qwen chat turns with Qwen's image tokens
    # (`processors.chat.user_turn_text`); a family that reads other turns and tokens refuses env and agent runs.
    qwen_turns: ClassVar[bool] = True
    # Why mmrl's vLLM engine cannot serve the family yet (empty: it can); `rollout.engine: auto` then
    # picks the HF engine and `vllm` is refused at start (`mmrl.sources.startup.settle_engine`).
    vllm_unsupported: ClassVar[str] = ""
    tiny_chat_media: ClassVar[tuple[str, str]] = (IMAGE_PART, VIDEO_PART)
    # transformers saves some families' weights under older names than it holds in memory; vLLM
    # loads the saved names. Prefixes in memory -> saved.
    saved_prefixes: ClassVar[dict[str, str]] = {}
    # `checkpoint_tensors` lays some tensor out otherwise than transformers saves it: model folders
    # mmrl writes are rewritten in the released layout (`save_model`), which vLLM needs.
    relaid_out: ClassVar[bool] = False

    def __init__(self, config: Any) -> None:
        self.config = config

    # ------------------------------------------------------------------ loading
    @classmethod
    def load_class(cls) -> type[nn.Module]:
        import transformers

        return getattr(transformers, cls.model_class)

    @classmethod
    def new_model(cls, config: Any, dtype: torch.dtype = torch.float32) -> nn.Module:
        """A randomly initialised model of `config` (tiny builds; the shell FSDP shards load into)."""
        return cls.load_class()._from_config(config, dtype=dtype)

    @property
    def text_config(self) -> Any:
        return self.config.get_text_config()

    # ------------------------------------------------------------------ media
    def grid(self) -> Grid:
        vision = self.config.vision_config
        return Grid(vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)

    def media_token_ids(self) -> dict[str, int]:
        """Placeholder token per media kind; the engines and the trainer never let the policy emit them."""
        cfg = self.config
        return {"image": cfg.image_token_id, "video": cfg.video_token_id}

    def media_token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """transformers' `mm_token_type_ids`: 1 on image placeholder tokens, 2 on video ones, 0 elsewhere."""
        ids = self.media_token_ids()
        return (input_ids == ids["image"]).int() + 2 * (input_ids == ids["video"]).int()

    def never_generated_ids(self) -> list[int]:
        """Vision placeholder and delimiter tokens: sampling one would break the positions and media
        slots of the next forward, so engines block them and the trainer's log-probs exclude them."""
        cfg = self.config
        names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        return [i for i in (getattr(cfg, n, None) for n in names) if i is not None]

    def image_placeholder(self, height: int, width: int, budget: PixelBudget) -> int | str:
        """What one fitted image's pad expands to in a prompt (`processors.encode_prompt`): a pad count (one
        per merged patch), or the family's text around its tokens (InternVL's tiles)."""
        return num_image_tokens(height, width, budget)

    def video_placeholder(self, video: Video, budget: VideoBudget) -> int | str:
        """What one video's `<|video_pad|>` expands to in a prompt (`processors.encode_prompt`): a pad
        count, or the family's text with frame timestamps."""
        return video_pad_count(video, budget)

    # ------------------------------------------------------------------ positions
    def position_ids(
        self,
        prompts: Sequence[Any],
        input_ids: torch.Tensor,
        attention: torch.Tensor,
        rules: PositionRule | Sequence[PositionRule] = TRANSFORMERS_RULE,
    ) -> torch.Tensor:
        """Position ids of prompt + response rows as the engine that sampled them laid them out."""
        images = [p.image_grid_thw for p in prompts if p.image_grid_thw is not None]
        videos = [p.video_grid_thw for p in prompts if p.video_grid_thw is not None]
        seconds = [p.second_per_grid_ts for p in prompts if p.second_per_grid_ts is not None]
        cfg = self.config
        timed = self.video_time_in_seconds
        return mrope_position_ids(
            input_ids,
            attention,
            torch.cat(images) if images else None,
            image_token_id=cfg.image_token_id,
            video_token_id=cfg.video_token_id,
            spatial_merge_size=cfg.vision_config.spatial_merge_size,
            video_grid_thw=self.video_grids(torch.cat(videos)) if videos else None,
            # untimed: one second per temporal patch at one id per second, ids 0..t-1
            second_per_grid_ts=torch.cat(seconds) if seconds and timed else None,
            tokens_per_second=getattr(cfg.vision_config, "tokens_per_second", 1.0) if timed else 1.0,
            rules=rules,
        )

    def video_grids(self, grids: torch.Tensor) -> torch.Tensor:
        """Videos' (t, h, w) grids as the position layout places them (Qwen3 splits each per frame)."""
        return grids

    # ------------------------------------------------------------------ forward
    def encode_media(self, model: Any, pixels: torch.Tensor, grids: torch.Tensor, video: bool) -> Any:
        """The vision tower's output for a set of images (or videos), one entry per item in every field."""
        device = next(model.parameters()).device
        encode = model.model.get_video_features if video else model.model.get_image_features
        return encode(pixels.to(device), grids.to(device))

    def tower_passes(self, grids: torch.Tensor) -> int:
        """How many passes through the vision tower `encode_media` makes for items of these `grids`: one
        for all of them (FSDP ranks must make as many as each other, `mmrl.training.media`)."""
        return 1

    def select_media(self, encoded: Any, items: Sequence[int]) -> Any:
        """`encoded` (from `encode_media`) reduced to the listed items, in that order, repeats allowed:
        how the n responses of a prompt share one encoding of its media. Every per-item field goes
        along (DeepStack's per-layer features too), so dropping one cannot happen silently."""
        fields = {"pooler_output": tuple(encoded.pooler_output[i] for i in items)}
        deepstack = getattr(encoded, "deepstack_features", None)
        if deepstack is not None:
            fields["deepstack_features"] = [tuple(layer[i] for i in items) for layer in deepstack]
        return type(encoded)(**fields)

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
        """Last hidden states of the model's own forward, with the media encoded beforehand
        (`mm_encoder_outputs`, from `token_inputs`): every family feature (DeepStack included) goes the
        model's path.
        A list passed as `router_losses` receives a mixture-of-experts model's load-balancing loss.
        No `attention` for packed rows (`mmrl.training.packing`): the positions keep the sequences apart.
        A `cache` holds earlier tokens' keys and values; the forward attends to them and appends its own.
        `attention_kwargs` reach every attention layer (`mmrl.training.segments`' plan)."""
        extra = {"output_router_logits": True} if router_losses is not None else {}
        tokens = self.token_inputs(model, input_ids, media)
        out = model.model(
            **tokens,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=cache is not None,
            **extra,
            **(attention_kwargs or {}),
        )
        if router_losses is not None:
            router_losses.append(self.router_loss(out.router_logits, attention))
        return out.last_hidden_state

    def token_inputs(self, model: Any, input_ids: torch.Tensor, media: dict[str, Any]) -> dict[str, Any]:
        """The forward's token arguments: the ids, and the media encoded beforehand for the model to place."""
        if media and not _takes_encoded_media():
            # Older versions take **kwargs and drop the encoded media without a word: the policy
            # would then train blind, every image token left as its placeholder embedding.
            raise RuntimeError(
                f"transformers {transformers.__version__} cannot take media encoded beforehand "
                "(mm_encoder_outputs), so the policy would not see its images; mmrl needs "
                "transformers>=5.18,<5.20: pip install 'transformers>=5.18,<5.20'"
            )
        return {"input_ids": input_ids, "mm_encoder_outputs": media or None}

    def router_loss(
        self, router_logits: tuple[torch.Tensor, ...], attention: torch.Tensor | None
    ) -> torch.Tensor:
        """The Switch-Transformer load-balancing loss over every MoE layer, as the model's own
        `load_balancing_loss_func` computes it in pre-training (padding excluded; packed rows have none)."""
        if not self.mixture_of_experts:
            raise ValueError(f"{self.name} has no experts: set actor.router_aux_loss_coef to 0")
        module = importlib.import_module(
            f"transformers.models.{self.config.model_type}.modeling_{self.config.model_type}"
        )
        text = self.text_config
        experts = getattr(text, "num_experts", None) or text.num_local_experts  # GLM names it the latter
        return module.load_balancing_loss_func(router_logits, experts, text.num_experts_per_tok, attention)

    def generate_inputs(self, input_ids: torch.Tensor, vision: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Keyword arguments for `model.generate` besides ids and mask."""
        if not self.video_time_in_seconds:
            vision = {k: v for k, v in vision.items() if k != "second_per_grid_ts"}
        return {"mm_token_type_ids": self.media_token_types(input_ids), **vision}

    # ------------------------------------------------------------------ structure
    def language_model(self, model: Any) -> nn.Module:
        return model.model.language_model

    def freeze_vision(self, model: Any) -> None:
        """`model.freeze_vision_tower`: train the language model only."""
        model.model.visual.requires_grad_(False)

    def fsdp_units(self, model: Any) -> list[nn.Module]:
        """Modules that become FSDP units: every vision block and decoder layer (MoE experts
        included), so one layer is gathered at a time."""
        return [*model.model.visual.blocks, *self.language_model(model).layers]

    def lora_prefixes(self, include_vision: bool) -> tuple[str, ...]:
        """Module name prefixes whose linear layers may get LoRA adapters."""
        return ("model.language_model.", *(("model.visual.",) if include_vision else ()))

    def vllm_prompt_ids(self, prompt_ids: Sequence[int], tokenizer: Any) -> list[int]:
        """Prompt ids as vLLM takes them: each run of image (or video) pads cut to one, since vLLM
        expands each to its item's token count itself and would expand an expanded run again. `tokenizer`
        names the run's other special tokens where the config does not (Mistral 3's)."""
        pads = tuple(self.media_token_ids().values())
        ids = list(prompt_ids)
        return [t for i, t in enumerate(ids) if not (t in pads and i and ids[i - 1] == t)]

    def vllm_processor_options(self, images: Sequence[Any]) -> dict[str, Any]:
        """vLLM processor options for one request with these (fitted) images, over the engine's
        (`VLLMEngine._media_options`): none unless the processor must be told how they were sized."""
        return {}

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """A tensor (under its saved name) as the family's released checkpoints, and so vLLM's loader,
        hold it: as in memory unless a family lays it out otherwise or splits it up."""
        yield name, tensor

    def saved_name(self, name: str) -> str:
        """A parameter's in-memory name as its saved checkpoint (and so vLLM's loader) spells it."""
        for memory, saved in self.saved_prefixes.items():
            if name.startswith(memory):
                return saved + name[len(memory) :]
        return name

    # ------------------------------------------------------------------ tiny models
    @classmethod
    def tiny_config(cls, tokenizer: Any) -> Any:
        """A ~1M-parameter config of the real architecture (for CPU tests and the quickstart)."""
        raise NotImplementedError

    @classmethod
    def tiny_processor(cls, tokenizer: Any, min_pixels: int, max_pixels: int, chat_template: str) -> Any:
        """The processor a real checkpoint of this family ships (image and video processors, tokenizer)."""
        raise NotImplementedError


def cut_runs(
    ids: Sequence[int], start: int, end: int, placeholder: int, then: int | None = None
) -> list[int]:
    """`ids` with each run from `start` (when followed by `then`, if given) through `end` cut to one
    `placeholder`: the token vLLM's processor expands back into an image's run (`vllm_prompt_ids`)."""
    ids = list(ids)
    out: list[int] = []
    in_run = False
    for i, token in enumerate(ids):
        if in_run:
            in_run = token != end
        elif token == start and (then is None or ids[i + 1 : i + 2] == [then]):
            in_run = True
            out.append(placeholder)
        else:
            out.append(token)
    return out


def per_expert(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A tensor as a checkpoint of per-expert weights has it (how transformers saves, and vLLM loads,
    Qwen2-style MoE layers whose experts it holds fused): `mlp.experts.gate_up_proj` (E, 2I, H) as each
    expert's gate then up projection, `mlp.experts.down_proj` (E, H, I) as each one's down projection, one
    expert and projection at a time; any other tensor as it is."""
    experts, _, kind = name.rpartition(".")
    if not experts.endswith(".mlp.experts") or kind not in ("gate_up_proj", "down_proj"):
        yield name, tensor
        return
    for e, weight in enumerate(tensor):
        if kind == "down_proj":
            yield f"{experts}.{e}.down_proj.weight", weight
            continue
        gate, up = weight.chunk(2)
        yield f"{experts}.{e}.gate_proj.weight", gate
        yield f"{experts}.{e}.up_proj.weight", up


@functools.cache
def _takes_encoded_media() -> bool:
    """Whether the installed transformers' VLMs accept `mm_encoder_outputs` (5.18 and later)."""
    return Version(transformers.__version__).release >= (5, 18)
