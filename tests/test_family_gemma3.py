"""Gemma 3 (`gemma3`): the tiny build is the real architecture (a tiny SigLIP on a tiny Gemma 3 text model with
a sliding-window and a global layer) saved under the names vLLM loads; every image is resized to the tower's
square and prompts are what `Gemma3Processor` writes; the trainer's log-probs equal a plain transformers forward
of each row alone (the model's own masks: bidirectional image blocks, sliding windows) and the HF engine's, the
shared-prompt forward equals the padded one, and two training steps of the quickstart run through the CLI. The
packed forward would not build those masks: `actor.padding_free`, video rows, env and agent runs and the vLLM
engine are refused at start."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from family_cases import (
    IMAGE_CASES,
    REFUSED_AT_START,
    REFUSED_ON_VLLM,
    assert_lora_reaches_the_vision_tower,
    assert_positions_count_attended_tokens,
    assert_refused_at_start,
    assert_trainer_logprobs_match,
    colour_rows,
    family_fixtures,
    hf_batch_fixture,
    image_media,
    processor_outputs,
    shared_and_packed_gaps,
    two_training_steps,
)
from helpers import mixed_media_rows
from PIL import Image
from safetensors import safe_open

from mmrl.models import family_of
from mmrl.models.gemma3 import TINY_IMAGE_TOKENS, TINY_SIDE, TINY_WINDOW, Gemma3, square
from mmrl.processors import fit_image
from mmrl.rollout.vllm import checkpoint_names

MEDIA = image_media(TINY_SIDE, square)
model_dir, model, processor, prompts = family_fixtures(MEDIA, "gemma3", cases=IMAGE_CASES)


def test_the_tiny_build_is_the_real_architecture_saved_under_the_names_vllm_loads(
    model, model_dir, processor
) -> None:
    family = family_of(model)
    # Gemma's vocabulary holds runs of up to four newlines whole, as the tiny tokenizer must too
    assert processor.tokenizer.tokenize("a\n\n\nb\n\n") == ["a", "\n\n\n", "b", "\n\n"]
    assert type(model).__name__ == family.model_class == "Gemma3ForConditionalGeneration"
    assert family.grid().factor == family.tiny_grid_factor == TINY_SIDE  # every image is one square
    text = model.config.text_config
    assert text.model_type == "gemma3_text" and text.sliding_window == TINY_WINDOW
    assert set(text.layer_types) == {"sliding_attention", "full_attention"}
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    sent = dict(checkpoint_names(model))  # what a weight sync sends: the saved checkpoint, name for name
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        saved = set(f.keys())
        assert set(sent) == saved and all(torch.equal(t, f.get_tensor(n)) for n, t in sent.items())
    assert "language_model.model.embed_tokens.weight" in saved
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in saved  # the released name
    units = family.fsdp_units(model)
    assert units == [*model.model.vision_tower.encoder.layers, *model.model.language_model.layers]


def test_prompts_and_pixels_are_what_gemma3processor_gives(model, processor, prompts) -> None:
    """mmrl's prompt ids and pixels equal the processor's own on the same images: each image is `\\n\\n`,
    `<start_of_image>`, 16 `<image_soft_token>`, `<end_of_image>`, `\\n\\n`, its pixels one 56 px square."""
    for sample, out in processor_outputs(processor, prompts):
        if sample.images:
            assert torch.equal(out["pixel_values"], sample.pixel_values)
            assert torch.equal(out["token_type_ids"], family_of(model).media_token_types(out["input_ids"]))
    assert prompts[1].image_grid_thw.tolist() == [[1], [1]]
    assert prompts[1].prompt_ids.count(model.config.image_token_id) == 2 * TINY_IMAGE_TOKENS


@pytest.mark.parametrize("size", [(2, 3), (200, 1), (3000, 15), (57, 113), (640, 480)])
def test_every_image_is_resized_to_the_towers_square_as_the_image_processor_resizes_it(
    processor, size
) -> None:
    fitted = fit_image(Image.new("RGB", size), MEDIA.images)
    original = processor.image_processor(images=[Image.new("RGB", size)], return_tensors="pt")
    assert fitted.size == (TINY_SIDE, TINY_SIDE) == tuple(original["pixel_values"].shape[-2:])


def test_position_ids_count_attended_tokens(model, prompts) -> None:
    assert_positions_count_attended_tokens(model, prompts)


# ------------------------------------------------------------------ log-probs
hf_batch = hf_batch_fixture()


def test_trainer_logprobs_equal_the_hf_engine_and_a_plain_forward(model, processor, hf_batch) -> None:
    """Rows longer than the sliding window, so the window and the image blocks both shape the numbers. The
    plain forward runs the vision tower on the pixels, its own positions and masks from `token_type_ids` as
    `Gemma3Processor` gives them."""
    assert max(len(p.prompt_ids) for p in hf_batch.prompts) > 2 * TINY_WINDOW
    family = family_of(model)
    assert_trainer_logprobs_match(
        model,
        processor,
        hf_batch,
        lambda prompt, ids: {
            "pixel_values": prompt.pixel_values,
            "token_type_ids": family.media_token_types(ids),
        },
    )


def test_the_shared_prompt_forward_equals_the_padded_one_and_packing_would_not(
    model, processor, hf_batch
) -> None:
    """The shared-prompt forward (the groups' prompts run once, their image blocks and windows the model's own)
    equals the padded one to 1e-5. The packed forward, forced on, attends by plain causal masks without the
    window and the image blocks, and is far off: why `actor.padding_free` is refused."""
    forced = mock.patch.object(Gemma3, "packs_sequences", True)
    gaps = shared_and_packed_gaps(model, processor, hf_batch, forced)
    assert gaps["shared"] < 1e-5 and gaps["packed"] > 1e-2


def test_lora_adapters_on_the_vision_tower_are_reached_by_the_loss(model_dir, processor, hf_batch) -> None:
    """`model.lora.include_vision`: the adapters on SigLIP (the projector is a bare matrix)
    get gradients from a batch with images."""
    assert_lora_reaches_the_vision_tower(model_dir, hf_batch, processor.tokenizer.pad_token_id)


# ------------------------------------------------------------------ runs
def test_two_quickstart_training_steps(model_dir, tmp_path) -> None:
    """The image quickstart (each image one 56 px square) on four colour rows: the trainer's log-probs are
    the HF engine's at every step."""
    two_training_steps(model_dir, tmp_path, "configs/quickstart.yaml", colour_rows(tmp_path / "data"), 1e-3)


@pytest.mark.parametrize(("config", "extra", "says"), [*REFUSED_AT_START, REFUSED_ON_VLLM])
def test_video_rows_agent_runs_and_vllm_are_refused_at_start_naming_why(
    model_dir, tmp_path, capsys, config, extra, says
) -> None:
    """Video rows (Gemma 3 takes none), env and agent turns (written with Qwen's image tokens) and the vLLM
    engine stop the run before training, in one line, exit 2."""
    rows = mixed_media_rows(tmp_path / "data")
    assert_refused_at_start(capsys, model_dir, tmp_path, config, rows, extra, says, "gemma3")


def test_packed_rows_are_refused_at_start_naming_why(model_dir, tmp_path, capsys) -> None:
    """`actor.padding_free` would drop the image blocks and windows (the packed gap above): exit 2, one line."""
    rows = colour_rows(tmp_path / "data")
    says = "actor.padding_free: gemma3 models attend both ways"
    assert_refused_at_start(
        capsys, model_dir, tmp_path, "configs/quickstart.yaml", rows, ["actor.padding_free=true"], says
    )


def test_the_auto_engine_is_the_hf_engine_for_gemma3() -> None:
    """`rollout.engine: auto` means vLLM where it is installed and serves the family faithfully: not Gemma 3
    on vLLM 0.32's CPU attention."""
    from mmrl.config import load_config
    from mmrl.models import FAMILIES
    from mmrl.sources.startup import settle_engine

    for family, expected in ((FAMILIES["gemma3"], "hf"), (FAMILIES["internvl"], "auto")):
        cfg = load_config("configs/quickstart.yaml", ["model.path=tiny", "rollout.engine=auto"])
        settle_engine(cfg, family)
        assert cfg.rollout.engine == expected
