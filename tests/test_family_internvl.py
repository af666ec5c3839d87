"""InternVL3.5 (`internvl`): the tiny build is the real architecture (a tiny InternViT on a tiny Qwen3) saved
under the names vLLM loads; images are tiled by transformers' own rule and prompts are what `InternVLProcessor`
writes; the trainer's log-probs equal a plain transformers forward of each row alone (the model's own vision
tower and positions) and the HF engine's, packed and shared-prompt forwards equal the padded one, and two
training steps of the quickstart run through the CLI. Video rows, env and agent runs are refused at start."""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import pytest
import torch
from family_cases import media_at
from helpers import FAST, mixed_media_rows
from PIL import Image
from safetensors import safe_open

from mmrl.algorithms import block_tokens
from mmrl.cli import main
from mmrl.data.batch import Batch
from mmrl.data.sample import PromptSample
from mmrl.data.synthetic import generate
from mmrl.models import family_of, load_policy, load_processor
from mmrl.models.internvl import TINY_TILE, tile_range, tiled_canvas
from mmrl.processors import build_messages, fit_image
from mmrl.rollout import HFEngine, SamplingParams
from mmrl.rollout.vllm import checkpoint_names
from mmrl.run.logger import read_metrics
from mmrl.training import forward
from mmrl.training.forward import forward_logprobs

_AT = media_at(TINY_TILE)
# Images of 2..4 tiles a side, sized by InternVL's tiling rule: 4 to 16 tiles, and a thumbnail.
MEDIA = replace(_AT, images=replace(_AT.images, rule=tiled_canvas))
CASES = ["image", "images", "text"]  # the family cases without video


@pytest.fixture(scope="module")
def model_dir(tiny_family_dir):
    return tiny_family_dir("internvl")


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
    for name, sample in zip(CASES, prompts, strict=True):
        text = processor.tokenizer.apply_chat_template(
            build_messages(MEDIA.cases[name][0], len(sample.images)),
            tokenize=False,
            add_generation_prompt=True,
        )
        out = processor(
            text=[text],
            images=sample.images or None,
            images_kwargs={"min_patches": low, "max_patches": high},
            return_tensors="pt",
        )
        assert out["input_ids"][0].tolist() == sample.prompt_ids
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
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    ids = torch.zeros_like(mask)
    assert family_of(model).position_ids(prompts[:2], ids, mask).tolist() == [
        [0, 0, 0, 1, 2],
        [0, 1, 2, 3, 4],
    ]


# ------------------------------------------------------------------ log-probs
@pytest.fixture(scope="module")
def hf_batch(model, processor, prompts) -> Batch:
    """One image, two images and text only, two responses each, from the HF engine."""
    torch.manual_seed(0)
    batch = HFEngine(model, processor).generate(
        prompts, SamplingParams(n=2, temperature=0.8, max_new_tokens=10, logprobs=True)
    )
    assert batch["response_mask"].sum() > 2 * len(prompts)
    return batch


def plain_logprobs(model, batch: Batch, temperature: float) -> torch.Tensor:
    """Each row alone, unpadded, through the model's own full forward: its vision tower on the tiles, its
    own positions, `<IMG_CONTEXT>` blocked as the engines block it."""
    out = torch.zeros(batch["response_ids"].shape)
    blocked = family_of(model).never_generated_ids()
    for row, (p, response, mask) in enumerate(
        zip(batch["prompt_index"], batch["response_ids"], batch["response_mask"], strict=True)
    ):
        prompt = batch.prompts[int(p)]
        n = int(mask.sum())
        ids = torch.tensor([prompt.prompt_ids + response[:n].tolist()])
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=prompt.pixel_values).logits[0]
        start = len(prompt.prompt_ids) - 1
        logits = block_tokens(logits[start : start + n].float(), blocked)
        out[row, :n] = torch.log_softmax(logits / temperature, dim=-1).gather(1, response[:n, None])[:, 0]
    return out


def test_trainer_logprobs_equal_the_hf_engine_and_a_plain_forward(model, processor, hf_batch) -> None:
    mask = hf_batch["response_mask"].bool()
    with torch.no_grad():
        ours = forward_logprobs(model, hf_batch, processor.tokenizer.pad_token_id, 0.8)[0]
    engine = (ours - hf_batch["rollout_logprobs"]).abs()[mask]
    plain = (ours - plain_logprobs(model, hf_batch, 0.8)).abs()[mask]
    print(f"internvl: HF engine max {engine.max():.2e}; plain forward max {plain.max():.2e}")
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
    print(f"internvl vs padded: shared {gaps['shared']:.2e}, packed {gaps['packed']:.2e}")
    assert max(gaps.values()) < 1e-5


# ------------------------------------------------------------------ runs
def test_two_quickstart_training_steps(model_dir, tmp_path) -> None:
    """The image quickstart (2 x 2 tiles and a thumbnail per image) on four colour rows: the trainer's
    log-probs are the HF engine's at every step."""
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
        ("configs/quickstart.yaml", ["rollout.engine=vllm"], "do not run on mmrl's vLLM engine"),
    ],
)
def test_video_rows_agent_runs_and_vllm_are_refused_at_start_naming_why(
    model_dir, tmp_path, capsys, config, extra, says
) -> None:
    """Video rows (mmrl places each kind's features by kind; InternVL's video frames are image tokens),
    env and agent turns (written with Qwen's image tokens) and the vLLM engine (vLLM 0.32 expands and tiles
    InternVL images its own way: 125 prompt tokens where the trainer has 87) stop the run before training,
    in one line, exit 2. (`rollout.engine: auto` picks the HF engine for InternVL.)"""
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
    assert says in err and "internvl" in err and "Traceback" not in err


def test_the_auto_engine_is_the_hf_engine_for_internvl() -> None:
    """`rollout.engine: auto` means vLLM where it is installed and serves the family: not InternVL yet."""
    from mmrl.config import load_config
    from mmrl.models import FAMILIES
    from mmrl.sources.startup import settle_engine

    for family, expected in ((FAMILIES["internvl"], "hf"), (FAMILIES["qwen2_5_vl"], "auto")):
        cfg = load_config("configs/quickstart.yaml", ["model.path=tiny", "rollout.engine=auto"])
        settle_engine(cfg, family)
        assert cfg.rollout.engine == expected
