"""Qwen2-VL (`qwen2_vl`): positions equal the model's `get_rope_index` and vLLM's own layout (a video's
time ids are its patch indices, never scaled by seconds); the trainer's log-probs equal the HF engine's
and a plain transformers forward on image, multi-image, video, text-only and mixed prompts; the real vLLM
engine samples at the trainer's log-probs and takes a weight sync after an update."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from family_cases import (
    assert_positions_are_get_rope_index,
    assert_resync_matches,
    assert_vllm_matches_trainer,
    family_fixtures,
    media_at,
    plain_logprobs,
    update_moves,
    vllm_diff,
    vllm_engine_fixture,
    vllm_only,
)
from safetensors import safe_open

from mmrl.data.sample import POSITION_RULE, vision_inputs
from mmrl.models import family_of
from mmrl.models.qwen2_5_vl import Qwen2_5_VL
from mmrl.processors import TRANSFORMERS_RULE, PositionRule
from mmrl.rollout import HFEngine, SamplingParams
from mmrl.rollout.vllm import WeightSyncError, checkpoint_names, vllm_available
from mmrl.training.forward import forward_logprobs

# 28 px video frames: 2 x 2 patches, one merged token per temporal patch, so a clip's time ids (one per
# two frames) outrun its 1 x 1 grid and the engines' rules for the text after it part.
MEDIA = media_at(28)
model_dir, model, processor, prompts = family_fixtures(MEDIA, "qwen2_vl")


def test_the_tiny_qwen2_vl_is_the_real_architecture_saved_under_the_names_vllm_loads(
    model, model_dir
) -> None:
    family = family_of(model)
    assert family.name == "qwen2_vl" and type(model).__name__ == "Qwen2VLForConditionalGeneration"
    vision = model.config.vision_config
    assert (vision.depth, vision.embed_dim, vision.hidden_size) == (
        2,
        64,
        model.config.text_config.hidden_size,
    )
    assert (family.grid().patch, family.grid().merge, family.grid().temporal) == (14, 2, 2)
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        saved = set(f.keys())
    assert {name for name, _ in checkpoint_names(model)} == saved  # the in-memory names, as saved
    assert any(k.startswith("visual.") for k in saved) and not any(
        k.startswith("model.visual") for k in saved
    )


def test_generate_refuses_second_per_grid_ts_so_the_family_drops_it(model, processor) -> None:
    sample = MEDIA.prompt(processor, family_of(model), 0, "video")
    ids = torch.tensor([sample.prompt_ids])
    vision = vision_inputs([sample])
    assert "second_per_grid_ts" in vision
    with pytest.raises(ValueError, match="second_per_grid_ts"):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **vision, max_new_tokens=1)
    extra = family_of(model).generate_inputs(ids, vision)
    assert "second_per_grid_ts" not in extra and "mm_token_type_ids" in extra
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra, max_new_tokens=1)


@pytest.mark.parametrize(
    "names", [["images"], ["video"], ["mixed"], ["image", "text", "images", "video", "mixed"]]
)
def test_position_ids_equal_the_models_get_rope_index(model, processor, names) -> None:
    assert_positions_are_get_rope_index(
        model, processor, MEDIA.all_prompts(processor, family_of(model), names)
    )


def test_video_time_ids_are_patch_indices_whatever_the_frame_rate(model, processor) -> None:
    """Videos of different lengths, frame rates and sizes in one padded batch: still the model's ids,
    and not Qwen2.5-VL's seconds-scaled ones (which the recorded `second_per_grid_ts` would give)."""
    family = family_of(model)
    batch = MEDIA.wide_batch(processor, family)
    ids, mask, ours = assert_positions_are_get_rope_index(model, processor, batch)
    assert sorted({float(s) for s in batch[0].second_per_grid_ts}) != [1.0]  # real seconds were recorded
    scaled = Qwen2_5_VL(family.config).position_ids(batch, ids, mask)  # the Qwen2.5-VL rule
    assert not torch.equal(ours, scaled)


def _vllm_positions(
    model, tokens: list[int], grids: list[tuple[str, list[int]]], length: int
) -> torch.Tensor:
    """vLLM's own Qwen2-VL mRoPE ids (`get_mrope_input_positions`, called as a plain function) of a
    prompt and `length` generated tokens, which vLLM places at index + the returned delta. Its Qwen2-VL
    inputs carry no `second_per_grid_ts`, and the config no `tokens_per_second`."""
    from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration as VLLMQwen2VL

    cfg = model.config
    wrap = SimpleNamespace
    offsets = [i for i, t in enumerate(tokens) if t in (cfg.image_token_id, cfg.video_token_id)]
    starts = [i for i in offsets if i == 0 or tokens[i - 1] != tokens[i]]
    features = [
        wrap(
            modality=kind,
            mm_position=wrap(offset=offset),
            data={f"{kind}_grid_thw": wrap(data=torch.tensor(grid))},
        )
        for offset, (kind, grid) in zip(starts, grids, strict=True)
    ]
    stub = wrap(config=wrap(vision_config=wrap(spatial_merge_size=cfg.vision_config.spatial_merge_size)))
    stub.iter_mm_grid_thw = lambda feats: VLLMQwen2VL.iter_mm_grid_thw(stub, feats)
    prompt, delta = VLLMQwen2VL.get_mrope_input_positions(stub, tokens, features)
    generated = torch.arange(len(tokens), len(tokens) + length) + delta
    return torch.cat([prompt, generated.expand(3, -1)], dim=1)


@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (install requirements-test.lock)")
@pytest.mark.parametrize("name", ["images", "video", "mixed"])
def test_the_vllm_position_rule_is_vllms_own(model, processor, name) -> None:
    sample = MEDIA.prompt(processor, family_of(model), 0, name)
    response = [processor.tokenizer.convert_tokens_to_ids("<answer>")] * 5
    ids = torch.tensor([sample.prompt_ids + response])
    grids = [("image", g) for g in (sample.image_grid_thw.tolist() if sample.images else [])]
    grids += [("video", g) for g in (sample.video_grid_thw.tolist() if sample.videos else [])]
    if name == "mixed":  # the image comes first in the text
        assert sample.prompt_text.index("<image>") < sample.prompt_text.index("<video>")
    ours = family_of(model).position_ids([sample], ids, torch.ones_like(ids), PositionRule("vllm"))[:, 0]
    assert torch.equal(ours, _vllm_positions(model, sample.prompt_ids, grids, len(response)))
    if sample.videos:  # the text after a video parts from transformers' layout, so the test has teeth
        assert not torch.equal(ours, family_of(model).position_ids([sample], ids, torch.ones_like(ids))[:, 0])


def test_trainer_logprobs_equal_the_hf_engine_and_a_plain_forward(model, processor, prompts) -> None:
    """Image, two images, a video, text only and image + video in one left-padded batch."""
    torch.manual_seed(0)
    batch = HFEngine(model, processor).generate(
        prompts, SamplingParams(n=2, temperature=0.8, max_new_tokens=10, logprobs=True)
    )
    mask = batch["response_mask"].bool()
    assert mask.sum() > 2 * len(prompts)
    with torch.no_grad():
        ours = forward_logprobs(model, batch, processor.tokenizer.pad_token_id, 0.8)[0]
    engine = (ours - batch["rollout_logprobs"])[mask].abs()
    plain = (ours - plain_logprobs(model, batch, 0.8))[mask].abs()
    assert engine.max() < 1e-4, f"trainer vs HF engine: max |Δlogp| = {engine.max():.2e}"
    assert plain.max() < 1e-4, f"trainer vs plain forward: max |Δlogp| = {plain.max():.2e}"


# ------------------------------------------------------------------ vLLM
vllm_engine = vllm_engine_fixture(MEDIA.images)


@vllm_only
def test_vllm_logprobs_match_the_trainer_at_vllms_positions(vllm_engine, prompts) -> None:
    batch = assert_vllm_matches_trainer(vllm_engine, prompts)
    assert batch[POSITION_RULE] == [PositionRule("vllm", torch.float32)] * len(batch)
    # Under transformers' layout the rows after a video disagree: the recorded rule is what matches.
    batch.set(**{POSITION_RULE: [TRANSFORMERS_RULE] * len(batch)})
    assert vllm_diff(vllm_engine, batch, 0.7).max() > 1e-3


@vllm_only
def test_vllm_sync_after_an_update_is_verified_and_a_skipped_one_caught(vllm_engine, prompts) -> None:
    """The update moves the vision tower's patch embedding, which reaches vLLM with the sync."""
    update_moves(vllm_engine, prompts, lambda m: m.model.visual.patch_embed.proj.weight)
    with pytest.raises(WeightSyncError, match="did not arrive"):
        vllm_engine.verify()  # sync skipped: vLLM still has the old weights
    assert_resync_matches(vllm_engine, prompts)
