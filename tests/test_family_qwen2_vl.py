"""Qwen2-VL (`qwen2_vl`): positions equal the model's `get_rope_index` and vLLM's own layout (a video's
time ids are its patch indices, never scaled by seconds); the trainer's log-probs equal the HF engine's
and a plain transformers forward on image, multi-image, video, text-only and mixed prompts; the real vLLM
engine samples at the trainer's log-probs and takes a weight sync after an update."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from mmrl.actor import Actor, forward_logprobs
from mmrl.algorithms import block_tokens
from mmrl.batch import Batch
from mmrl.config import ActorConfig, VLLMConfig
from mmrl.data import PromptSample
from mmrl.models import family_of, load_policy, load_processor
from mmrl.models.qwen2_5_vl import Qwen2_5_VL
from mmrl.optim import plan_minibatches
from mmrl.rollout import HFEngine, SamplingParams, make_engine
from mmrl.rollout.base import POSITION_RULE
from mmrl.rollout.hf import left_pad, vision_inputs
from mmrl.rollout.vllm import VLLMEngine, WeightSyncError, checkpoint_names, vllm_available
from processors import (
    TRANSFORMERS_RULE,
    PixelBudget,
    PositionRule,
    VideoBudget,
    build_messages,
    encode_prompt,
    fit_image,
    num_image_tokens,
    pixel_inputs,
    read_video,
    video_pixel_inputs,
)

IMAGES = PixelBudget(min_pixels=56 * 56, max_pixels=112 * 112)
# 28 px frames: 2 x 2 patches, one merged token per temporal patch, so a clip's time ids (one per two
# frames) outrun its 1 x 1 grid and the engines' rules for the text after it part.
VIDEOS = VideoBudget(
    fps=2.0, max_frames=12, min_pixels=28 * 28, max_pixels=28 * 28, max_total_pixels=12 * 28 * 28
)
WIDE = VideoBudget(
    fps=2.0, max_frames=8, min_pixels=28 * 28, max_pixels=56 * 84, max_total_pixels=8 * 56 * 84
)

# name: (text, image sizes, videos as (frames, source fps, frame size))
PROMPTS = {
    "image": ("<image>What colour is the shape?", [(112, 112)], []),
    "images": ("<image> and <image>: which is red?", [(56, 140), (84, 84)], []),
    "video": ("<video>Which way does it move?", [], [(8, 2.0, (28, 28))]),
    "text": ("How many circles?", [], []),
    "mixed": ("Look: <image> then <video> - what changed?", [(84, 56)], [(4, 1.0, (28, 28))]),
}


def _frames(count: int, size: tuple[int, int]) -> np.ndarray:
    rng = np.random.default_rng(count)
    return rng.integers(0, 255, (count, size[1], size[0], 3), dtype=np.uint8)


def _prompt(
    processor, family, index: int, name: str, budget: VideoBudget = VIDEOS, spec=None
) -> PromptSample:
    """One prompt as the data layer builds it: fitted images, sampled and sized clips, expanded pads."""
    text, image_sizes, clips = spec or PROMPTS[name]
    colours = [(220, 20, 20), (20, 20, 220), (0, 160, 0)]
    images = [fit_image(Image.new("RGB", s, colours[i % 3]), IMAGES) for i, s in enumerate(image_sizes)]
    videos = [read_video(_frames(n, size), budget, fps=fps) for n, fps, size in clips]
    ids = encode_prompt(
        processor.tokenizer,
        build_messages(text, len(images), num_videos=len(videos)),
        [num_image_tokens(i.height, i.width, IMAGES) for i in images],
        [family.video_placeholder(v, budget) for v in videos],
    )
    sample = PromptSample(index, ids, text, "red", images=images)
    if images:
        inputs = pixel_inputs(images, processor.image_processor)
        sample.pixel_values, sample.image_grid_thw = inputs["pixel_values"], inputs["image_grid_thw"]
    if videos:
        v = video_pixel_inputs(videos, processor.video_processor)
        sample.videos = videos
        sample.pixel_values_videos, sample.video_grid_thw = v["pixel_values_videos"], v["video_grid_thw"]
        sample.second_per_grid_ts = v["second_per_grid_ts"]
    return sample


@pytest.fixture(scope="module")
def model_dir(tiny_family_dir):
    return tiny_family_dir("qwen2_vl")


@pytest.fixture(scope="module")
def model(model_dir):
    return load_policy(model_dir).eval()


@pytest.fixture(scope="module")
def processor(model_dir):
    return load_processor(model_dir)


@pytest.fixture(scope="module")
def prompts(model, processor) -> list[PromptSample]:
    family = family_of(model)
    return [_prompt(processor, family, i, name) for i, name in enumerate(PROMPTS)]


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
    sample = _prompt(processor, family_of(model), 0, "video")
    ids = torch.tensor([sample.prompt_ids])
    vision = vision_inputs([sample])
    assert "second_per_grid_ts" in vision
    with pytest.raises(ValueError, match="second_per_grid_ts"):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **vision, max_new_tokens=1)
    extra = family_of(model).generate_inputs(ids, vision)
    assert "second_per_grid_ts" not in extra and "mm_token_type_ids" in extra
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **extra, max_new_tokens=1)


def _rope_index(model, prompts: list[PromptSample], ids, mask) -> torch.Tensor:
    cfg = model.config
    mm_types = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
    grids = vision_inputs(prompts)
    theirs, _ = model.model.get_rope_index(
        ids, mm_types, grids.get("image_grid_thw"), grids.get("video_grid_thw"), attention_mask=mask
    )
    return theirs


@pytest.mark.parametrize(
    "names", [["images"], ["video"], ["mixed"], ["image", "text", "images", "video", "mixed"]]
)
def test_position_ids_equal_the_models_get_rope_index(model, processor, names) -> None:
    family = family_of(model)
    batch = [_prompt(processor, family, i, name) for i, name in enumerate(names)]
    ids, mask = left_pad([p.prompt_ids for p in batch], processor.tokenizer.pad_token_id)
    assert torch.equal(family.position_ids(batch, ids, mask), _rope_index(model, batch, ids, mask))


def test_video_time_ids_are_patch_indices_whatever_the_frame_rate(model, processor) -> None:
    """Videos of different lengths, frame rates and sizes in one padded batch: still the model's ids,
    and not Qwen2.5-VL's seconds-scaled ones (which the recorded `second_per_grid_ts` would give)."""
    family = family_of(model)
    spec = (
        "<video> vs <video> vs <video>",
        [],
        [(30, 3.0, (56, 56)), (5, 1.0, (28, 56)), (12, 7.5, (56, 28))],
    )
    batch = [_prompt(processor, family, 0, "", WIDE, spec), _prompt(processor, family, 1, "text")]
    ids, mask = left_pad([p.prompt_ids for p in batch], processor.tokenizer.pad_token_id)
    ours = family.position_ids(batch, ids, mask)
    assert torch.equal(ours, _rope_index(model, batch, ids, mask))
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
    sample = _prompt(processor, family_of(model), 0, name)
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


def _plain_logprobs(model, batch: Batch, temperature: float) -> torch.Tensor:
    """Each row alone, unpadded, through the model's own forward (its own vision tower and positions),
    over the distribution the engines sample from: vision placeholders blocked."""
    cfg = model.config
    out = torch.zeros(batch["response_ids"].shape)
    for row, (p, response, mask) in enumerate(
        zip(batch["prompt_index"], batch["response_ids"], batch["response_mask"], strict=True)
    ):
        prompt = batch.prompts[int(p)]
        n = int(mask.sum())
        ids = torch.tensor([prompt.prompt_ids + response[:n].tolist()])
        vision = {k: v for k, v in vision_inputs([prompt]).items() if k != "second_per_grid_ts"}
        types = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=types, **vision).logits[0]
        start = len(prompt.prompt_ids) - 1
        logits = block_tokens(logits[start : start + n].float(), family_of(model).never_generated_ids())
        logp = torch.log_softmax(logits / temperature, dim=-1)
        out[row, :n] = logp.gather(1, response[:n, None])[:, 0]
    return out


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
    plain = (ours - _plain_logprobs(model, batch, 0.8))[mask].abs()
    assert engine.max() < 1e-4, f"trainer vs HF engine: max |Δlogp| = {engine.max():.2e}"
    assert plain.max() < 1e-4, f"trainer vs plain forward: max |Δlogp| = {plain.max():.2e}"


# ------------------------------------------------------------------ vLLM
def vllm_only(test):
    """The vLLM tests' markers (as in test_vllm.py): slow, one xdist worker, skipped without vLLM."""
    for mark in (
        pytest.mark.slow,
        pytest.mark.xdist_group("vllm"),
        pytest.mark.skipif(
            not vllm_available(), reason="vLLM is not installed (install requirements-test.lock)"
        ),
    ):
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def vllm_engine(model_dir):
    policy = load_policy(model_dir).eval()
    settings = VLLMConfig(max_model_len=512, enforce_eager=True, verify_sync_every=0)
    engine = make_engine(
        "vllm",
        policy,
        load_processor(model_dir),
        torch.float32,
        model_path=model_dir,
        vllm=settings,
        pixels=(IMAGES.min_pixels, IMAGES.max_pixels),
    )
    assert isinstance(engine, VLLMEngine)
    yield engine
    del engine
    gc.collect()


def _vllm_diff(engine: VLLMEngine, batch: Batch, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        ours = forward_logprobs(engine.model, batch, engine.tokenizer.pad_token_id, temperature)[0]
    return (ours - batch["rollout_logprobs"])[batch["response_mask"].bool()].abs()


@vllm_only
def test_vllm_logprobs_match_the_trainer_at_vllms_positions(vllm_engine, prompts) -> None:
    torch.manual_seed(0)
    batch = vllm_engine.generate(
        prompts, SamplingParams(n=2, temperature=0.7, max_new_tokens=10, logprobs=True)
    )
    assert batch[POSITION_RULE] == [PositionRule("vllm", torch.float32)] * len(batch)
    diff = _vllm_diff(vllm_engine, batch, 0.7)
    assert diff.max() < 1e-4, f"max |Δlogp| = {diff.max():.2e}, mean {diff.mean():.2e}"
    # Under transformers' layout the rows after a video disagree: the recorded rule is what matches.
    batch.set(**{POSITION_RULE: [TRANSFORMERS_RULE] * len(batch)})
    assert _vllm_diff(vllm_engine, batch, 0.7).max() > 1e-3


@vllm_only
def test_vllm_sync_after_an_update_is_verified_and_a_skipped_one_caught(vllm_engine, prompts) -> None:
    vllm_engine.sync_weights()
    torch.manual_seed(3)
    batch = vllm_engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8))
    scores = (batch["response_ids"][:, 0] % 7).float()
    batch.set(advantages=(scores - scores.mean())[:, None].expand_as(batch["response_mask"]).clone())
    actor = Actor(
        vllm_engine.model,
        ActorConfig(lr=0.05, mini_batch_size=len(prompts), micro_batch_size=10, use_kl_loss=False),
        vllm_engine.tokenizer.pad_token_id,
        temperature=1.0,
        response_len=8,
        total_updates=1,
    )
    visual = vllm_engine.model.model.visual.patch_embed.proj.weight.detach().clone()
    actor.update(batch, plan_minibatches(batch, len(batch), epochs=1, horizon=8))
    vllm_engine.model.eval()
    assert not torch.equal(visual, vllm_engine.model.model.visual.patch_embed.proj.weight)
    with pytest.raises(WeightSyncError, match="did not arrive"):
        vllm_engine.verify()  # sync skipped: vLLM still has the old weights
    vllm_engine.sync_weights()
    assert vllm_engine.verify() < 1e-4
    sampled = vllm_engine.generate(
        prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, logprobs=True)
    )
    diff = _vllm_diff(vllm_engine, sampled, 1.0)  # the updated vision tower reached vLLM too
    assert diff.max() < 1e-4, f"after the update: max |Δlogp| = {diff.max():.2e}, mean {diff.mean():.2e}"
