"""GLM-4.1V (`glm4v`) and GLM-4.5V (`glm4v_moe`): the tiny builds are the real architectures saved under
the names vLLM loads; prompts are what `Glm4vProcessor` writes (a video's frames as `<|image|>` runs, each
followed by its second); positions equal the model's `get_rope_index`; the trainer's log-probs equal a plain
transformers forward of each row alone, packed rows equal padded ones, and the HF engine and the real vLLM
engine sample at the trainer's log-probs, also after a weight sync; two training steps run on image, video
and mixed rows through the data layer."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from family_cases import (
    POSITION_BATCHES,
    assert_lora_reaches_the_vision_tower,
    assert_positions_are_get_rope_index,
    assert_resync_matches,
    assert_trainer_logprobs_match,
    assert_vllm_matches_trainer,
    family_fixtures,
    hf_batch_fixture,
    media_at,
    two_training_steps,
    update_moves,
    vllm_engine_fixture,
    vllm_only,
)
from helpers import mixed_media_rows
from safetensors import safe_open

from mmrl.cli import main
from mmrl.config import load_config
from mmrl.data.sample import POSITION_RULE, vision_inputs
from mmrl.errors import ConfigError
from mmrl.models import family_of
from mmrl.processors import PositionRule, build_messages, keep_frames_kwargs
from mmrl.rollout.vllm import checkpoint_names
from mmrl.sources.prompts import build_datasets
from mmrl.training.forward import forward_logprobs

FAMILIES = ["glm4v", "glm4v_moe"]
# 28 px video frames: 2 x 2 patches, one merged token per temporal patch.
MEDIA = media_at(28)
# transformers' own GLM forward cannot take an image and a video in one prompt (see below): these are
# checked against it, and "mixed" against the engines and `get_rope_index` only.
PLAIN_CASES = ["image", "images", "video", "text"]
model_dir, model, processor, prompts = family_fixtures(MEDIA, *FAMILIES)


# ------------------------------------------------------------------ the tiny builds
def test_the_tiny_build_is_the_real_architecture_saved_under_the_names_vllm_loads(model, model_dir) -> None:
    family = family_of(model)
    expected = {"glm4v": "Glm4vForConditionalGeneration", "glm4v_moe": "Glm4vMoeForConditionalGeneration"}
    assert type(model).__name__ == expected[family.name] == family.model_class
    assert (family.grid().patch, family.grid().merge, family.grid().temporal) == (14, 2, 2)
    assert family.grid().factor == family.tiny_grid_factor == 28
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, vision.depth, vision.hidden_size) == (128, 2, 2, 64)
    assert text.rope_parameters["partial_rotary_factor"] == 0.5
    assert text.attention_bias  # vLLM builds q, k and v biases only then (the weight sync test shows why)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    sent = dict(checkpoint_names(model))  # what a weight sync sends: the saved checkpoint, name for name
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        saved = set(f.keys())
        assert set(sent) == saved and all(torch.equal(t, f.get_tensor(n)) for n, t in sent.items())
    layers = list(model.model.language_model.layers)
    units = family.fsdp_units(model)
    assert units == [*model.model.visual.blocks, *layers]
    if family.mixture_of_experts:
        # Fused in memory, saved per expert: layer 0 dense, layer 1 routed experts, a shared expert and a router.
        assert "model.language_model.layers.1.mlp.experts.3.gate_proj.weight" in saved
        assert type(layers[0].mlp).__name__ == "Glm4vMoeTextMLP"
        covered = {id(p) for unit in units for p in unit.parameters()}
        assert all(id(p) in covered for p in layers[1].mlp.parameters())
    else:
        assert saved == set(model.state_dict())  # in-memory names, untied head included


def test_prompts_are_what_glm4vprocessor_writes(model, processor) -> None:
    """mmrl's prompt ids and media token types for an image and a 3 fps clip (frames at 0, 0.67, 1.33 ...
    seconds, written as whole seconds) equal the processor's own expansion of the chat text."""
    family = family_of(model)
    case = ("<image> then <video>: what changed?", [(3 * 28, 2 * 28)], [(12, 3.0, (28, 28))])
    sample = MEDIA.prompt(processor, family, 0, case, replace(MEDIA.videos, fps=3.0))
    video = sample.videos[0]
    text = processor.tokenizer.apply_chat_template(
        build_messages(case[0], 1, num_videos=1), tokenize=False, add_generation_prompt=True
    )
    metadata = {"fps": video.fps, "total_num_frames": len(video.frames), "frames_indices": list(range(12))}
    out = processor(
        text=[text],
        images=sample.images,
        videos=[video.frames],
        video_metadata=[metadata],
        images_kwargs={"do_resize": False},
        videos_kwargs={**keep_frames_kwargs(processor.video_processor), "input_data_format": "channels_last"},
        return_tensors="pt",
    )
    assert out["input_ids"][0].tolist() == sample.prompt_ids
    assert torch.equal(out["mm_token_type_ids"][0], family.media_token_types(torch.tensor(sample.prompt_ids)))
    assert torch.equal(out["image_grid_thw"], sample.image_grid_thw)
    assert torch.equal(out["video_grid_thw"], sample.video_grid_thw)
    seconds = processor.tokenizer.decode(sample.prompt_ids).split("<|end_of_image|>")[2:]
    assert [s[0] for s in seconds] == ["0", "0", "1", "2", "2", "3"]


# ------------------------------------------------------------------ positions
@pytest.mark.parametrize("names", POSITION_BATCHES)
def test_position_ids_equal_the_models_get_rope_index(model, processor, names) -> None:
    """One prompt, and five in one left-padded batch; vLLM's rule lays GLM out the same way."""
    family = family_of(model)
    batch = MEDIA.all_prompts(processor, family, names)
    ids, mask, ours = assert_positions_are_get_rope_index(model, processor, batch)
    assert torch.equal(ours, family.position_ids(batch, ids, mask, PositionRule("vllm")))


def test_video_positions_of_different_lengths_and_frame_rates_equal_get_rope_index(model, processor) -> None:
    assert_positions_are_get_rope_index(model, processor, MEDIA.wide_batch(processor, family_of(model)))


# ------------------------------------------------------------------ log-probs
hf_batch = hf_batch_fixture()


def test_trainer_logprobs_equal_the_hf_engine_and_a_plain_forward(model, processor, hf_batch) -> None:
    """The trainer scores the whole batch at once (image and video rows together, which the model's own
    forward refuses); the plain forward runs each row alone, on the `PLAIN_CASES` rows."""
    rows = torch.isin(
        hf_batch["prompt_index"], torch.tensor([list(MEDIA.cases).index(c) for c in PLAIN_CASES])
    )
    assert_trainer_logprobs_match(model, processor, hf_batch, rows=rows)


def test_packed_rows_equal_padded_rows(model, processor, hf_batch) -> None:
    pad = processor.tokenizer.pad_token_id
    mask = hf_batch["response_mask"].bool()
    with torch.no_grad():
        padded = forward_logprobs(model, hf_batch, pad, 0.8)[0]
        packed = forward_logprobs(model, hf_batch, pad, 0.8, padding_free=True)[0]
    gap = (packed - padded).abs()[mask]
    print(f"{family_of(model).name}: packed vs padded max {gap.max():.2e}")
    assert gap.max() < 1e-5


def test_lora_adapters_on_the_vision_tower_are_reached_by_the_loss(model_dir, processor, hf_batch) -> None:
    """`model.lora.include_vision`: the adapters on GLM's vision tower get gradients from a batch with images."""
    assert_lora_reaches_the_vision_tower(model_dir, hf_batch, processor.tokenizer.pad_token_id)


def test_the_models_own_forward_refuses_an_image_with_a_video(model, processor, prompts) -> None:
    """Why the family places the media itself (`Glm4v.token_inputs`): transformers 5.19's GLM forward takes
    a video frame's `<|image|>` tokens for image slots too."""
    mixed = prompts[list(MEDIA.cases).index("mixed")]
    ids = torch.tensor([mixed.prompt_ids])
    inputs = family_of(model).generate_inputs(ids, vision_inputs([mixed]))
    with pytest.raises(ValueError, match="Image features and image tokens do not match"), torch.no_grad():
        model(input_ids=ids, **inputs)


def test_the_router_loss_is_the_models_own_and_opt_in(model, processor, hf_batch) -> None:
    losses: list[torch.Tensor] = []
    family = family_of(model)
    if not family.mixture_of_experts:
        with pytest.raises(ValueError, match="no experts"):
            family.router_loss((), None)
        return
    with torch.no_grad():
        forward_logprobs(model, hf_batch, processor.tokenizer.pad_token_id, router_losses=losses)
    assert len(losses) == 1 and torch.isfinite(losses[0]) and losses[0] > 0


def test_two_training_steps_on_image_video_and_mixed_rows(model_dir, tmp_path) -> None:
    """The video quickstart through the CLI on rows with an image, a video, both, and none (and three broken
    videos, skipped): the trainer's log-probs are the HF engine's at every step."""
    rows = mixed_media_rows(tmp_path / "data")
    two_training_steps(model_dir, tmp_path, "configs/quickstart_video.yaml", rows, 1e-4)


@pytest.mark.parametrize("config", ["configs/vla_mujoco_reach.yaml", "configs/quickstart_agent.yaml"])
def test_env_and_agent_runs_are_refused_at_start_naming_why(model_dir, tmp_path, capsys, config) -> None:
    """Observations and tool results are written as Qwen chat turns with Qwen's image tokens, which GLM
    does not read: the run stops before any model loads, in one line, exit 2."""
    args = ["train", config, f"model.path={model_dir}", f"trainer.output_dir={tmp_path / 'run'}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "models cannot run" in err and "Qwen-VL model" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_images_beside_videos_on_fsdp_workers_with_the_hf_engine_are_refused_at_start(
    model, model_dir, processor, tmp_path
) -> None:
    """On FSDP workers the HF engine samples with transformers' `generate`, whose GLM forward takes images
    or videos, not both in one batch: rows that mix them are refused as the run builds its data, before
    training, naming the ways out. On one process (mmrl's own sampler places the media) they are taken."""
    rows = mixed_media_rows(tmp_path / "data")
    base = [f"model.path={model_dir}", f"data.train_files={rows}", "data.val_files=[]", "rollout.engine=hf"]
    train, _ = build_datasets(load_config("configs/quickstart.yaml", base), processor, model.config)
    assert train.rows_by_media()["image"] and train.rows_by_media()["video"]
    workers = load_config("configs/quickstart.yaml", [*base, "trainer.n_gpus_per_node=2"])
    with pytest.raises(ConfigError, match=r"not both in one batch\. Set rollout\.engine=vllm"):
        build_datasets(workers, processor, model.config)


# ------------------------------------------------------------------ vLLM
def test_vllm_prompt_ids_hold_one_placeholder_per_image_and_video(model, processor, prompts) -> None:
    """What vLLM's GLM-4V processor expands: one `<|image|>` per image, one `<|video|>` per video between
    its delimiters (its frames, their image tokens and seconds gone)."""
    family, cfg = family_of(model), model.config
    for prompt in prompts:
        ids = family.vllm_prompt_ids(prompt.prompt_ids, processor.tokenizer)
        assert ids.count(cfg.image_token_id) == len(prompt.images)
        assert ids.count(cfg.video_token_id) == len(prompt.videos)
        assert ids.count(cfg.image_start_token_id) == len(prompt.images)
        if prompt.videos:
            start = ids.index(cfg.video_start_token_id)
            assert ids[start : start + 3] == [
                cfg.video_start_token_id,
                cfg.video_token_id,
                cfg.video_end_token_id,
            ]


vllm_engine = vllm_engine_fixture(MEDIA.images)


@vllm_only
def test_vllm_logprobs_match_the_trainer(vllm_engine, prompts) -> None:
    """Image, two images, video, text and image + video prompts through the real engine (its expanded
    prompts are checked to be the trainer's, token for token, on the first batch)."""
    batch = assert_vllm_matches_trainer(vllm_engine, prompts)
    assert batch[POSITION_RULE] == [PositionRule("vllm", torch.float32)] * len(batch)


@vllm_only
def test_vllm_sync_after_an_update_reaches_the_vision_tower(vllm_engine, prompts) -> None:
    """vLLM warns "Glm4vVisionEmbeddings: Failed to load weights" on every reload (its non-persistent
    `position_ids` buffer); the learned position grid itself does arrive: image and video rows sampled
    after the sync match the updated trainer."""
    update_moves(vllm_engine, prompts, lambda m: m.model.visual.embeddings.position_embedding.weight)
    assert_resync_matches(vllm_engine, prompts)
