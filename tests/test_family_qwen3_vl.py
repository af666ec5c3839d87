"""Qwen3-VL (`qwen3_vl`) and Qwen3-VL-MoE (`qwen3_vl_moe`): the tiny builds are the real architectures
saved under the names vLLM loads; positions equal the model's `get_rope_index` and vLLM's own layout
(videos as one t=1 grid per temporal patch, timestamps as text); the trainer's log-probs equal the HF
engine's and a plain transformers forward on image, multi-image, video, text-only and mixed prompts, and
stop doing so without DeepStack's features; the real vLLM engine samples at the trainer's log-probs and
takes a weight sync after an update; the MoE experts sit inside the FSDP units."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from family_cases import (
    POSITION_BATCHES,
    assert_positions_are_get_rope_index,
    assert_resync_matches,
    assert_vllm_matches_trainer,
    family_fixtures,
    frames,
    hf_batch_fixture,
    media_at,
    plain_logprobs,
    update_moves,
    vllm_engine_fixture,
    vllm_only,
)
from PIL import Image
from safetensors import safe_open
from transformers import AutoProcessor

from mmrl.config import ActorConfig
from mmrl.data.batch import Batch
from mmrl.data.sample import POSITION_RULE
from mmrl.models import Family, family_of, load_policy, load_processor, save_model
from mmrl.models.qwen2_5_vl import Qwen2_5_VL
from mmrl.processors import (
    PixelBudget,
    PositionRule,
    fit_image,
    keep_frames_kwargs,
    pixel_inputs,
    read_video,
)
from mmrl.rollout.vllm import WeightSyncError, checkpoint_names, vllm_available
from mmrl.training.forward import forward_logprobs

FAMILIES = ["qwen3_vl", "qwen3_vl_moe"]
# 32 px video frames: 2 x 2 patches, one merged token per temporal patch.
MEDIA = media_at(32)
model_dir, model, processor, prompts = family_fixtures(MEDIA, *FAMILIES)


# ------------------------------------------------------------------ the tiny builds
def test_the_tiny_build_is_the_real_architecture_saved_under_the_names_vllm_loads(model, model_dir) -> None:
    family = family_of(model)
    expected = {
        "qwen3_vl": "Qwen3VLForConditionalGeneration",
        "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    }
    assert type(model).__name__ == expected[family.name] == family.model_class
    assert (family.grid().patch, family.grid().merge, family.grid().temporal) == (16, 2, 2)
    assert family.grid().factor == family.tiny_grid_factor == 32
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.head_dim) == (128, 2, 32)
    assert text.rope_parameters["mrope_section"] == [4, 6, 6] and text.rope_parameters["mrope_interleaved"]
    assert (vision.depth, vision.hidden_size, list(vision.deepstack_visual_indexes)) == (2, 64, [0, 1])
    assert model.config.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) < 1_500_000
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        saved = set(f.keys())
    # transformers 5.19 saves Qwen3-VL under its in-memory names (no renaming, unlike Qwen2.5-VL).
    assert (
        {name for name, _ in checkpoint_names(model)} == saved == set(model.state_dict()) - {"lm_head.weight"}
    )
    assert any(k.startswith("model.visual.deepstack_merger_list.") for k in saved)


def test_the_saved_processor_sizes_images_as_fit_image_and_keeps_videoframes(model, model_dir) -> None:
    processor = AutoProcessor.from_pretrained(model_dir)
    assert type(processor).__name__ == "Qwen3VLProcessor"
    assert processor.image_processor.patch_size == 16 and processor.video_processor.patch_size == 16
    size = processor.image_processor.size
    budget = PixelBudget(size["shortest_edge"], size["longest_edge"], 16, 2)
    for w, h in [(40, 40), (128, 128), (64, 160), (333, 97), (700, 500), (17, 300)]:
        raw = Image.new("RGB", (w, h), (200, 30, 30))
        fitted = fit_image(raw, budget)
        grid = processor.image_processor(images=[raw], return_tensors="pt")["image_grid_thw"][0].tolist()
        assert grid == [1, fitted.height // 16, fitted.width // 16], (w, h)
        assert pixel_inputs([fitted], processor.image_processor)["image_grid_thw"][0].tolist() == grid
    video = read_video(frames(6, (64, 96)), MEDIA.wide, fps=3.0)
    out = processor.video_processor(
        videos=[video.frames],
        input_data_format="channels_last",
        return_tensors="pt",
        **keep_frames_kwargs(processor.video_processor),
    )
    assert out["video_grid_thw"][0].tolist() == [
        len(video.frames) // 2,
        video.size[0] // 16,
        video.size[1] // 16,
    ]


def test_video_text_is_timestamped_per_temporal_patch_as_the_processor_writes_it(model, processor) -> None:
    """The family's video text equals what `Qwen3VLProcessor` itself expands `<|video_pad|>` to."""
    family = family_of(model)
    video = read_video(frames(8, (32, 32)), MEDIA.videos, fps=2.0)
    ours = family.video_placeholder(video, MEDIA.videos)
    metadata = {"fps": video.fps, "total_num_frames": len(video.frames), "frames_indices": list(range(8))}
    text = "<|vision_start|><|video_pad|><|vision_end|>"
    out = processor(
        text=[text],
        videos=[video.frames],
        video_metadata=[metadata],
        return_tensors="pt",
        videos_kwargs={**keep_frames_kwargs(processor.video_processor), "input_data_format": "channels_last"},
    )
    expected = processor.tokenizer("<|vision_start|>" + ours + "<|vision_end|>", add_special_tokens=False)[
        "input_ids"
    ]
    assert out["input_ids"][0].tolist() == expected
    assert ours.startswith("<0.2 seconds><|vision_start|><|video_pad|><|vision_end|><1.2 seconds>")


# ------------------------------------------------------------------ positions
@pytest.mark.parametrize("names", POSITION_BATCHES)
def test_position_ids_equal_the_models_get_rope_index(model, processor, names) -> None:
    """One prompt, and five in one left-padded batch (text-only rows padded furthest)."""
    batch = MEDIA.all_prompts(processor, family_of(model), names)
    _, mask, _ = assert_positions_are_get_rope_index(model, processor, batch)
    if len(batch) > 1:
        assert (mask == 0).any()


def test_video_positions_of_different_lengths_and_frame_rates_equal_get_rope_index(model, processor) -> None:
    """Three clips of different lengths, frame rates and sizes in one prompt, next to a text row: every
    temporal patch is its own t=1 grid after its timestamp, whatever the clip's seconds per patch."""
    family = family_of(model)
    batch = MEDIA.wide_batch(processor, family)
    ids, mask, ours = assert_positions_are_get_rope_index(model, processor, batch)
    assert len({float(s) for s in batch[0].second_per_grid_ts}) == 3  # three real frame rates, ignored
    assert torch.equal(ours, family.position_ids(batch, ids, mask, PositionRule("vllm")))
    # Qwen2.5-VL's rule (one t x h x w grid per video) does not even fit: timestamps split its pad run.
    with pytest.raises(ValueError, match="not one run"):
        Qwen2_5_VL(family.config).position_ids(batch, ids, mask)


def _vllm_positions(
    model, tokens: list[int], grids: list[tuple[str, list[int]]], length: int
) -> torch.Tensor:
    """vLLM's own Qwen3-VL mRoPE ids (`_get_mrope_input_positions`, a static method) of a prompt and
    `length` generated tokens, which vLLM places at index + the returned delta. A video's offset is where
    its expansion starts (its first timestamp), as vLLM's prompt update records it."""
    from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration as VLLMQwen3VL

    cfg = model.config
    wrap = SimpleNamespace
    starts = []
    for i, t in enumerate(tokens):
        if t == cfg.image_token_id and tokens[i - 1] != t:
            starts.append(i)
        elif t == cfg.vision_start_token_id and tokens[i + 1] not in (cfg.image_token_id, cfg.video_token_id):
            starts.append(i + 1)  # a video: its expansion starts inside the template's <|vision_start|>
    features = [
        wrap(
            modality=kind,
            mm_position=wrap(offset=offset),
            data={f"{kind}_grid_thw": wrap(data=torch.tensor(g))},
        )
        for offset, (kind, g) in zip(starts, grids, strict=True)
    ]
    prompt, delta = VLLMQwen3VL._get_mrope_input_positions(tokens, features, cfg)
    generated = torch.arange(len(tokens), len(tokens) + length) + delta
    return torch.cat([prompt, generated.expand(3, -1)], dim=1)


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (install requirements-test.lock)")
@pytest.mark.parametrize("name", ["images", "video", "mixed"])
def test_both_position_rules_are_vllms_own_layout(model, processor, name) -> None:
    sample = MEDIA.prompt(processor, family_of(model), 0, name)
    response = [processor.tokenizer.convert_tokens_to_ids("<answer>")] * 5
    ids = torch.tensor([sample.prompt_ids + response])
    grids = [("image", g) for g in (sample.image_grid_thw.tolist() if sample.images else [])]
    grids += [("video", g) for g in (sample.video_grid_thw.tolist() if sample.videos else [])]
    theirs = _vllm_positions(model, sample.prompt_ids, grids, len(response))
    family, mask = family_of(model), torch.ones_like(ids)
    assert torch.equal(family.position_ids([sample], ids, mask, PositionRule("vllm"))[:, 0], theirs)
    assert torch.equal(family.position_ids([sample], ids, mask)[:, 0], theirs)  # identical layouts


# ------------------------------------------------------------------ log-probs
hf_batch = hf_batch_fixture()


def _diffs(model, processor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        ours = forward_logprobs(model, batch, processor.tokenizer.pad_token_id, 0.8)[0]
    engine = (ours - batch["rollout_logprobs"]).abs() * mask
    plain = (ours - plain_logprobs(model, batch, 0.8)).abs() * mask
    return engine, plain, mask


def test_trainer_logprobs_equal_the_hf_engine_and_a_plain_forward(model, processor, hf_batch) -> None:
    engine, plain, mask = _diffs(model, processor, hf_batch)
    for name, i in zip(MEDIA.cases, range(len(MEDIA.cases)), strict=True):  # every case, reported by name
        rows = hf_batch["prompt_index"] == i
        e, p = engine[rows][mask[rows]], plain[rows][mask[rows]]
        print(
            f"{family_of(model).name} {name}: engine max {e.max():.2e} mean {e.mean():.2e}; "
            f"plain max {p.max():.2e} mean {p.mean():.2e}"
        )
    assert engine.max() < 1e-4, f"trainer vs HF engine: max |Δlogp| = {engine.max():.2e}"
    assert plain.max() < 1e-4, f"trainer vs plain forward: max |Δlogp| = {plain.max():.2e}"


def test_dropping_deepstack_features_fails_the_parity_check(model, processor, hf_batch, monkeypatch) -> None:
    """The trainer's forward without DeepStack's per-layer features is a different model: rows with
    images or videos move far beyond the tolerance, text-only rows stay."""
    family_cls = type(family_of(model))
    keep = family_cls.select_media

    def drop_deepstack(self, encoded, items):
        selected = keep(self, encoded, items)
        selected.deepstack_features = []  # no layer gets its DeepStack features
        return selected

    monkeypatch.setattr(family_cls, "select_media", drop_deepstack)
    engine, plain, _ = _diffs(model, processor, hf_batch)
    text_rows = hf_batch["prompt_index"] == list(MEDIA.cases).index("text")
    print(f"{family_cls.name} without DeepStack: max {engine.max():.2e}")
    assert engine.max() > 1e-3 and plain.max() > 1e-3
    for i in range(len(MEDIA.cases)):
        rows = hf_batch["prompt_index"] == i
        assert (engine[rows].max() > 1e-3) == (not bool(text_rows[rows].all())), list(MEDIA.cases)[i]


def test_moe_experts_are_inside_the_fsdp_units_and_the_router_loss_is_opt_in(model) -> None:
    family = family_of(model)
    units = family.fsdp_units(model)
    layers = list(model.model.language_model.layers)
    assert units == [*model.model.visual.blocks, *layers]
    covered = {id(p) for unit in units for p in unit.parameters()}
    if not family.mixture_of_experts:
        assert all(type(layer.mlp).__name__ == "Qwen3VLTextMLP" for layer in layers)
        return
    experts = [p for layer in layers for p in layer.mlp.experts.parameters()]
    assert experts and all(id(p) in covered for p in experts)
    assert all(id(layer.mlp.gate.weight) in covered for layer in layers)
    assert layers[0].mlp.experts.gate_up_proj.shape[0] == model.config.text_config.num_experts == 4
    assert ActorConfig().router_aux_loss_coef == 0  # off unless asked for


# ------------------------------------------------------------------ vLLM
@vllm_only
def test_vllm_prompt_ids_hold_one_pad_per_video_and_image(model, processor, prompts) -> None:
    """What the engine must send for Qwen3-VL, and why the default (pad runs cut to one) is not it."""
    family, cfg = family_of(model), model.config
    for prompt in prompts:
        ids = family.vllm_prompt_ids(prompt.prompt_ids, processor.tokenizer)
        assert ids.count(cfg.image_token_id) == len(prompt.images)
        assert ids.count(cfg.video_token_id) == len(prompt.videos)
        assert (
            ids.count(cfg.vision_start_token_id)
            == ids.count(cfg.vision_end_token_id)
            == len(prompt.images) + len(prompt.videos)
        )
        collapsed = Family.vllm_prompt_ids(family, prompt.prompt_ids, processor.tokenizer)
        assert (ids == collapsed) == (not prompt.videos)


def test_mmrl_saves_experts_in_the_released_layout_which_transformers_reads_back(model, model_dir, tmp_path):
    """transformers 5.19 holds fused experts as (experts, out, in) and `save_pretrained` writes them so;
    Qwen's releases, and vLLM 0.32's loader, have (experts, in, out). Every folder mmrl writes
    (`save_model`: the tiny build here, checkpoints, exports) has the released layout, and transformers
    loads it back as the same model."""
    family = family_of(model)
    resaved = save_model(load_policy(model_dir), load_processor(model_dir), tmp_path / "resaved")
    state = model.state_dict()
    for folder in (model_dir, resaved):
        with safe_open(folder / "model.safetensors", "pt") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
        experts = [k for k in shapes if ".mlp.experts." in k]
        assert bool(experts) == family.mixture_of_experts == family.relaid_out
        for k in experts:
            assert (
                shapes[k] == [state[k].shape[0], state[k].shape[2], state[k].shape[1]] != list(state[k].shape)
            )
        reloaded = load_policy(folder).state_dict()
        assert all(torch.equal(v, reloaded[k]) for k, v in state.items())


vllm_engine = vllm_engine_fixture(
    MEDIA.images
)  # loads the tiny build as mmrl saved it (released expert layout)


@vllm_only
def test_vllm_logprobs_match_the_trainer(vllm_engine, prompts) -> None:
    """Image, two images, video, text and image + video prompts through the real engine."""
    batch = assert_vllm_matches_trainer(vllm_engine, prompts)
    assert batch[POSITION_RULE] == [PositionRule("vllm", torch.float32)] * len(batch)


@vllm_only
def test_vllm_sync_after_an_update_is_verified_and_a_skipped_one_caught(vllm_engine, prompts) -> None:
    """The update moves DeepStack's mergers; after the sync the updated vision tower (DeepStack too) has
    reached vLLM."""
    update_moves(vllm_engine, prompts, lambda m: m.model.visual.deepstack_merger_list[0].linear_fc2.weight)
    with pytest.raises(WeightSyncError, match="did not arrive"):
        vllm_engine.verify()  # sync skipped: vLLM still has the old weights
    assert_resync_matches(vllm_engine, prompts)
