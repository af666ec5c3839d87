"""LLaVA-OneVision (`llava_onevision`): the tiny build is the real architecture (a tiny SigLIP on a tiny Qwen2,
28 px base squares in the released 1..6 by 1..6 grids) saved under the names vLLM loads; images are sized to a
grid the any-resolution rule picks again, prompts and crops are what `LlavaOnevisionProcessor` gives; the
trainer's log-probs equal a plain transformers forward of each row alone (the model's own tiling, unpadding,
pooling and newlines on the processor's pixels) and the HF engine's, packed and shared-prompt forwards equal
the padded one, two training steps of the quickstart run through the CLI, and vLLM's log-probs equal the
trainer's before and after a weight sync. Video rows, env and agent runs are refused at start."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from family_cases import (
    IMAGE_CASES,
    REFUSED_AT_START,
    assert_lora_reaches_the_vision_tower,
    assert_padded_pixels_are_the_processors,
    assert_positions_count_attended_tokens,
    assert_refused_at_start,
    assert_resync_matches,
    assert_trainer_logprobs_match,
    assert_vllm_matches_trainer,
    colour_rows,
    family_fixtures,
    hf_batch_fixture,
    image_media,
    processor_pixels,
    shared_and_packed_gaps,
    two_training_steps,
    update_moves,
    vllm_engine_fixture,
    vllm_only,
)
from helpers import mixed_media_rows
from PIL import Image
from safetensors import safe_open
from transformers.image_processing_utils import select_best_resolution

from mmrl.models import family_of
from mmrl.models.llava_onevision import TINY_BASE, pinpoint_canvas, pinpoints
from mmrl.processors import fit_image
from mmrl.rollout.vllm import checkpoint_names

# Images of 2..4 base squares a side, within 4..16 squares: a 4 x 4 grid (pooled), 5 x 2 and 3 x 3.
MEDIA = image_media(TINY_BASE, pinpoint_canvas)
model_dir, model, processor, prompts = family_fixtures(MEDIA, "llava_onevision", cases=IMAGE_CASES)


def test_the_tiny_build_is_the_real_architecture_saved_under_the_names_vllm_loads(model, model_dir) -> None:
    family = family_of(model)
    assert type(model).__name__ == family.model_class == "LlavaOnevisionForConditionalGeneration"
    assert family.grid().factor == family.tiny_grid_factor == TINY_BASE
    assert model.config.vision_config.model_type == "siglip_vision_model"
    assert model.config.text_config.model_type == "qwen2"
    assert model.config.image_grid_pinpoints == pinpoints(TINY_BASE)
    assert model.config.vision_aspect_ratio == "anyres_max_9"  # as released
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    sent = dict(checkpoint_names(model))  # what a weight sync sends: the saved checkpoint, name for name
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        saved = set(f.keys())
        assert set(sent) == saved and all(torch.equal(t, f.get_tensor(n)) for n, t in sent.items())
    assert {"language_model.model.embed_tokens.weight", "image_newline"} <= saved
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in saved  # as released
    units = family.fsdp_units(model)
    assert units == [*model.model.vision_tower.encoder.layers, *model.model.language_model.layers]


def test_prompts_and_crops_are_what_llavaonevisionprocessor_gives(model, processor, prompts) -> None:
    """mmrl's prompt ids equal the processor's on the same images, and its crops (zero-padded to its grid)
    are the processor's, which the HF engine hands the model as the processor batches them."""
    assert_padded_pixels_are_the_processors(model, processor, prompts)
    # 4 x 4 crops and the base square; 5 x 2 (a tall image) and 3 x 3; each padded to (rows+1) x (columns+1)
    assert prompts[0].image_grid_thw.tolist() == [[5, 5]]
    assert prompts[1].image_grid_thw.tolist() == [[6, 3], [4, 4]]
    assert prompts[1].images[0].size == (2 * TINY_BASE, 5 * TINY_BASE)
    assert len(prompts[1].pixel_values) == 18 + 16 and not prompts[1].pixel_values[11:18].any()
    image = model.config.image_token_id
    # base 2 x 2 patches + the grid's patches, pooled from 8 x 8 to 6 x 6 past anyres_max_9, + a newline per row
    assert prompts[0].prompt_ids.count(image) == 4 + 6 * 6 + 6
    assert prompts[1].prompt_ids.count(image) == (4 + 10 * 4 + 10) + (4 + 6 * 6 + 6)


@pytest.mark.parametrize("size", [(1, 1), (200, 1), (3000, 15), (57, 113), (640, 480), (56, 168)])
def test_images_are_sized_to_the_grid_the_image_processor_tiles_them_into(processor, size) -> None:
    """With every grid in budget, the fitted image is the grid of base squares `LlavaOnevisionImageProcessor`
    tiles the original into; a smaller budget keeps to the grids it allows."""
    every = replace(MEDIA.images, min_pixels=TINY_BASE**2, max_pixels=36 * TINY_BASE**2)
    fitted = fit_image(Image.new("RGB", size), every)
    original = processor.image_processor(images=[Image.new("RGB", size)], return_tensors="pt")
    best = select_best_resolution((size[1], size[0]), pinpoints(TINY_BASE))
    assert (fitted.height, fitted.width) == tuple(best)
    assert original["pixel_values"].shape[1] == 1 + (fitted.height // TINY_BASE) * (fitted.width // TINY_BASE)
    small = fit_image(Image.new("RGB", size), MEDIA.images)
    assert MEDIA.images.min_pixels <= small.height * small.width <= MEDIA.images.max_pixels


def test_position_ids_count_attended_tokens(model, prompts) -> None:
    assert_positions_count_attended_tokens(model, prompts)


# ------------------------------------------------------------------ log-probs
hf_batch = hf_batch_fixture()


def test_trainer_logprobs_equal_the_hf_engine_and_a_plain_forward(model, processor, hf_batch) -> None:
    """The plain forward runs on the processor's own pixels and `image_sizes` (the model's own tiling,
    unpadding, pooling and newlines)."""
    assert_trainer_logprobs_match(model, processor, hf_batch, processor_pixels(processor))


def test_packed_and_shared_prompt_forwards_equal_the_padded_one(model, processor, hf_batch) -> None:
    """The padded forward with every response running its own prompt copy, against the shared-prompt forward
    (the groups' prompts run once) and the packed one, both to 1e-5."""
    assert max(shared_and_packed_gaps(model, processor, hf_batch).values()) < 1e-5


def test_lora_adapters_on_the_vision_tower_are_reached_by_the_loss(model_dir, processor, hf_batch) -> None:
    """`model.lora.include_vision`: the adapters on SigLIP and the projector get gradients from a batch with images."""
    assert_lora_reaches_the_vision_tower(model_dir, hf_batch, processor.tokenizer.pad_token_id)


# ------------------------------------------------------------------ runs
def test_two_quickstart_training_steps(model_dir, tmp_path) -> None:
    """The image quickstart (its 112 px budget: each image a 4 x 4 grid and the base square) on four colour
    rows: the trainer's log-probs are the HF engine's at every step."""
    two_training_steps(model_dir, tmp_path, "configs/quickstart.yaml", colour_rows(tmp_path / "data"), 1e-3)


@pytest.mark.parametrize(("config", "extra", "says"), REFUSED_AT_START)
def test_video_rows_and_agent_runs_are_refused_at_start_naming_why(
    model_dir, tmp_path, capsys, config, extra, says
) -> None:
    """Video rows (not written yet) and env and agent turns (written with Qwen's image tokens) stop the run
    before training, in one line, exit 2."""
    rows = mixed_media_rows(tmp_path / "data")
    assert_refused_at_start(capsys, model_dir, tmp_path, config, rows, extra, says, "llava_onevision")


# ------------------------------------------------------------------ vLLM
def test_vllm_prompt_ids_hold_one_image_token_per_image(model, processor, prompts) -> None:
    """What vLLM's LLaVA-OneVision processor expands: one `<image>` per image."""
    family = family_of(model)
    for prompt in prompts:
        ids = family.vllm_prompt_ids(prompt.prompt_ids, processor.tokenizer)
        assert ids.count(model.config.image_token_id) == len(prompt.images)


vllm_engine = vllm_engine_fixture(MEDIA.images)


@vllm_only
def test_vllm_logprobs_match_the_trainer(vllm_engine, prompts) -> None:
    """Image (pooled grid), two images and text prompts through the real engine (its expanded prompts are
    checked to be the trainer's, token for token, on the first batch)."""
    assert_vllm_matches_trainer(vllm_engine, prompts)


@vllm_only
def test_vllm_sync_after_an_update_reaches_the_vision_tower(vllm_engine, prompts) -> None:
    """SigLIP's weights (synced under the released `vision_tower.vision_model.` names) and the image newline
    arrive: rows sampled after the sync match the updated trainer."""
    update_moves(vllm_engine, prompts, lambda m: m.model.vision_tower.embeddings.patch_embedding.weight)
    assert_resync_matches(vllm_engine, prompts)
