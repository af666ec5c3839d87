"""LLaVA-OneVision (`llava_onevision`): the tiny build is the real architecture (a tiny SigLIP on a tiny Qwen2,
28 px base squares in the released 1..6 by 1..6 grids) saved under the names vLLM loads; images are sized to a
grid the any-resolution rule picks again, prompts and crops are what `LlavaOnevisionProcessor` gives; the
trainer's log-probs equal a plain transformers forward of each row alone (the model's own tiling, unpadding,
pooling and newlines on the processor's pixels) and the HF engine's, packed and shared-prompt forwards equal
the padded one, two training steps of the quickstart run through the CLI, and vLLM's log-probs equal the
trainer's before and after a weight sync. Video rows, env and agent runs are refused at start."""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import pytest
import torch
from family_cases import media_at, update_on_samples, vllm_diff, vllm_engine_for, vllm_only
from helpers import FAST, mixed_media_rows
from PIL import Image
from safetensors import safe_open
from transformers.image_processing_utils import select_best_resolution

from mmrl.algorithms import block_tokens
from mmrl.cli import main
from mmrl.data.batch import Batch
from mmrl.data.sample import PromptSample
from mmrl.data.synthetic import generate
from mmrl.models import family_of, load_policy, load_processor
from mmrl.models.llava_onevision import TINY_BASE, pinpoint_canvas, pinpoints
from mmrl.processors import build_messages, fit_image
from mmrl.rollout import HFEngine, SamplingParams
from mmrl.rollout.vllm import checkpoint_names
from mmrl.run.logger import read_metrics
from mmrl.training import forward
from mmrl.training.forward import forward_logprobs

_AT = media_at(TINY_BASE)
# Images of 2..4 base squares a side, within 4..16 squares: a 4 x 4 grid (pooled), 5 x 2 and 3 x 3.
MEDIA = replace(_AT, images=replace(_AT.images, rule=pinpoint_canvas))
CASES = ["image", "images", "text"]  # the family cases without video


@pytest.fixture(scope="module")
def model_dir(tiny_family_dir):
    return tiny_family_dir("llava_onevision")


@pytest.fixture(scope="module")
def model(model_dir):
    return load_policy(model_dir).eval()


@pytest.fixture(scope="module")
def processor(model_dir):
    return load_processor(model_dir)


@pytest.fixture(scope="module")
def prompts(model, processor) -> list[PromptSample]:
    family = family_of(model)
    return [MEDIA.prompt(processor, family, i, name) for i, name in enumerate(CASES)]


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
    family = family_of(model)
    for name, sample in zip(CASES, prompts, strict=True):
        text = processor.tokenizer.apply_chat_template(
            build_messages(MEDIA.cases[name][0], len(sample.images)),
            tokenize=False,
            add_generation_prompt=True,
        )
        out = processor(text=[text], images=sample.images or None, return_tensors="pt")
        assert out["input_ids"][0].tolist() == sample.prompt_ids
        if sample.images:
            vision = {"pixel_values": sample.pixel_values, "image_grid_thw": sample.image_grid_thw}
            ours = family.generate_inputs(out["input_ids"], vision)
            assert torch.equal(ours["pixel_values"], out["pixel_values"])
            assert torch.equal(ours["image_sizes"], out["image_sizes"])
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
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    ids = torch.zeros_like(mask)
    assert family_of(model).position_ids(prompts[:2], ids, mask).tolist() == [
        [0, 0, 0, 1, 2],
        [0, 1, 2, 3, 4],
    ]


# ------------------------------------------------------------------ log-probs
@pytest.fixture(scope="module")
def hf_batch(model, processor, prompts) -> Batch:
    """One image, two images of different grids and text only, two responses each, from the HF engine."""
    torch.manual_seed(0)
    batch = HFEngine(model, processor).generate(
        prompts, SamplingParams(n=2, temperature=0.8, max_new_tokens=10, logprobs=True)
    )
    assert batch["response_mask"].sum() > 2 * len(prompts)
    return batch


def plain_logprobs(model, processor, batch: Batch, temperature: float) -> torch.Tensor:
    """Each row alone, unpadded, through the model's own full forward on the processor's own pixels and
    `image_sizes` (its tiling, unpadding, pooling and newlines), `<image>` and `<video>` blocked."""
    out = torch.zeros(batch["response_ids"].shape)
    blocked = family_of(model).never_generated_ids()
    for row, (p, response, mask) in enumerate(
        zip(batch["prompt_index"], batch["response_ids"], batch["response_mask"], strict=True)
    ):
        prompt = batch.prompts[int(p)]
        n = int(mask.sum())
        ids = torch.tensor([prompt.prompt_ids + response[:n].tolist()])
        media = {}
        if prompt.images:
            pixels = processor.image_processor(images=prompt.images, return_tensors="pt")
            media = {"pixel_values": pixels["pixel_values"], "image_sizes": pixels["image_sizes"]}
        with torch.no_grad():
            logits = model(input_ids=ids, **media).logits[0]
        start = len(prompt.prompt_ids) - 1
        logits = block_tokens(logits[start : start + n].float(), blocked)
        out[row, :n] = torch.log_softmax(logits / temperature, dim=-1).gather(1, response[:n, None])[:, 0]
    return out


def test_trainer_logprobs_equal_the_hf_engine_and_a_plain_forward(model, processor, hf_batch) -> None:
    mask = hf_batch["response_mask"].bool()
    with torch.no_grad():
        ours = forward_logprobs(model, hf_batch, processor.tokenizer.pad_token_id, 0.8)[0]
    engine = (ours - hf_batch["rollout_logprobs"]).abs()[mask]
    plain = (ours - plain_logprobs(model, processor, hf_batch, 0.8)).abs()[mask]
    print(f"llava_onevision: HF engine max {engine.max():.2e}; plain forward max {plain.max():.2e}")
    assert engine.max() < 1e-4, f"trainer vs HF engine: max |Δlogp| = {engine.max():.2e}"
    assert plain.max() < 1e-4, f"trainer vs plain forward: max |Δlogp| = {plain.max():.2e}"


def test_packed_and_shared_prompt_forwards_equal_the_padded_one(model, processor, hf_batch) -> None:
    """The padded forward with every response running its own prompt copy, against the shared-prompt forward
    (the groups' prompts run once) and the packed one, both to 1e-5."""
    pad = processor.tokenizer.pad_token_id
    mask = hf_batch["response_mask"].bool()
    found, real = [], forward.shared_prompts
    with torch.no_grad():
        with mock.patch.object(forward, "shared_prompts", return_value=None):
            padded = forward_logprobs(model, hf_batch, pad, 0.8)[0]
        with mock.patch.object(
            forward, "shared_prompts", lambda *a, **k: found.append(real(*a, **k)) or found[-1]
        ):
            shared = forward_logprobs(model, hf_batch, pad, 0.8)[0]
        packed = forward_logprobs(model, hf_batch, pad, 0.8, padding_free=True)[0]
    assert any(s is not None for s in found), "the forward should have shared the prompts"
    gaps = {"shared": (shared - padded).abs()[mask].max(), "packed": (packed - padded).abs()[mask].max()}
    print(f"llava_onevision vs padded: shared {gaps['shared']:.2e}, packed {gaps['packed']:.2e}")
    assert max(gaps.values()) < 1e-5


# ------------------------------------------------------------------ runs
def test_two_quickstart_training_steps(model_dir, tmp_path) -> None:
    """The image quickstart (its 112 px budget: each image a 4 x 4 grid and the base square) on four colour
    rows: the trainer's log-probs are the HF engine's at every step."""
    run = tmp_path / "run"
    generate(tmp_path / "data", task="color", n_train=4, n_val=0, seed=0, image_size=56)
    args = [
        "train",
        "configs/quickstart.yaml",
        f"model.path={model_dir}",
        f"data.train_files={tmp_path / 'data' / 'train.jsonl'}",
        "data.val_files=[]",
        f"trainer.output_dir={run}",
        "actor.rollout_correction=tis",  # the engine then returns its log-probs, and the gap is logged
        *FAST,
    ]
    assert main(args) == 0
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    print(f"rollout_logprob_diff: {[r['actor/rollout_logprob_diff'] for r in records]}")
    assert all(r["actor/rollout_logprob_diff"] < 1e-3 for r in records)


@pytest.mark.parametrize(
    ("config", "extra", "says"),
    [
        ("configs/quickstart_video.yaml", [], "mmrl cannot show videos yet"),
        ("configs/quickstart_agent.yaml", [], "models cannot run"),
    ],
)
def test_video_rows_and_agent_runs_are_refused_at_start_naming_why(
    model_dir, tmp_path, capsys, config, extra, says
) -> None:
    """Video rows (not written yet) and env and agent turns (written with Qwen's image tokens) stop the run
    before training, in one line, exit 2."""
    data = f"data.train_files={mixed_media_rows(tmp_path / 'data')}"
    args = [
        "train",
        config,
        f"model.path={model_dir}",
        f"trainer.output_dir={tmp_path / 'run'}",
        data,
        "data.val_files=[]",
        *extra,
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert says in err and "llava_onevision" in err and "Traceback" not in err


# ------------------------------------------------------------------ vLLM
def test_vllm_prompt_ids_hold_one_image_token_per_image(model, prompts) -> None:
    """What vLLM's LLaVA-OneVision processor expands: one `<image>` per image."""
    family = family_of(model)
    for prompt in prompts:
        ids = family.vllm_prompt_ids(prompt.prompt_ids)
        assert ids.count(model.config.image_token_id) == len(prompt.images)


@pytest.fixture(scope="module")
def vllm_engine(model_dir):
    yield from vllm_engine_for(model_dir, images=MEDIA.images)


@vllm_only
def test_vllm_logprobs_match_the_trainer(vllm_engine, prompts) -> None:
    """Image (pooled grid), two images and text prompts through the real engine (its expanded prompts are
    checked to be the trainer's, token for token, on the first batch)."""
    torch.manual_seed(0)
    batch = vllm_engine.generate(
        prompts, SamplingParams(n=2, temperature=0.7, max_new_tokens=10, logprobs=True)
    )
    diff = vllm_diff(vllm_engine, batch, 0.7)
    print(f"llava_onevision vLLM: max {diff.max():.2e} mean {diff.mean():.2e}")
    assert diff.max() < 1e-4, f"max |Δlogp| = {diff.max():.2e}, mean {diff.mean():.2e}"


@vllm_only
def test_vllm_sync_after_an_update_reaches_the_vision_tower(vllm_engine, prompts) -> None:
    """SigLIP's weights (synced under the released `vision_tower.vision_model.` names) and the image newline
    arrive: rows sampled after the sync match the updated trainer."""
    vllm_engine.sync_weights()
    tower = vllm_engine.model.model.vision_tower.embeddings.patch_embedding.weight.detach().clone()
    update_on_samples(vllm_engine, prompts)
    assert not torch.equal(tower, vllm_engine.model.model.vision_tower.embeddings.patch_embedding.weight)
    vllm_engine.sync_weights()
    assert vllm_engine.verify() < 1e-4
    sampled = vllm_engine.generate(
        prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, logprobs=True)
    )
    diff = vllm_diff(vllm_engine, sampled, 1.0)
    print(f"llava_onevision vLLM after update: max {diff.max():.2e}")
    assert diff.max() < 1e-4, f"after the update: max |Δlogp| = {diff.max():.2e}, mean {diff.mean():.2e}"
