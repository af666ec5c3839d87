"""Gemma 3 (`gemma3`): the tiny build is the real architecture (a tiny SigLIP on a tiny Gemma 3 text model with
a sliding-window and a global layer) saved under the names vLLM loads; every image is resized to the tower's
square and prompts are what `Gemma3Processor` writes; the trainer's log-probs equal a plain transformers forward
of each row alone (the model's own masks: bidirectional image blocks, sliding windows) and the HF engine's, the
shared-prompt forward equals the padded one, and two training steps of the quickstart run through the CLI. The
packed forward would not build those masks: `actor.padding_free`, video rows, env and agent runs and the vLLM
engine are refused at start."""

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
from mmrl.models.gemma3 import TINY_IMAGE_TOKENS, TINY_SIDE, TINY_WINDOW, Gemma3, square
from mmrl.processors import build_messages, fit_image
from mmrl.rollout import HFEngine, SamplingParams
from mmrl.rollout.vllm import checkpoint_names
from mmrl.run.logger import read_metrics
from mmrl.training import forward
from mmrl.training.forward import forward_logprobs

_AT = media_at(TINY_SIDE)
MEDIA = replace(_AT, images=replace(_AT.images, rule=square))
CASES = ["image", "images", "text"]  # the family cases without video


@pytest.fixture(scope="module")
def model_dir(tiny_family_dir):
    return tiny_family_dir("gemma3")


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
    assert "vision_tower.embeddings.patch_embedding.weight" in saved
    units = family.fsdp_units(model)
    assert units == [*model.model.vision_tower.encoder.layers, *model.model.language_model.layers]


def test_prompts_and_pixels_are_what_gemma3processor_gives(model, processor, prompts) -> None:
    """mmrl's prompt ids and pixels equal the processor's own on the same images: each image is `\\n\\n`,
    `<start_of_image>`, 16 `<image_soft_token>`, `<end_of_image>`, `\\n\\n`, its pixels one 56 px square."""
    for name, sample in zip(CASES, prompts, strict=True):
        text = processor.tokenizer.apply_chat_template(
            build_messages(MEDIA.cases[name][0], len(sample.images)),
            tokenize=False,
            add_generation_prompt=True,
        )
        out = processor(text=[text], images=sample.images or None, return_tensors="pt")
        assert out["input_ids"][0].tolist() == sample.prompt_ids
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
    """Each row alone, unpadded, through the model's own full forward: its vision tower on the pixels, its
    own positions and masks from `token_type_ids` as `Gemma3Processor` gives them, image tokens blocked."""
    family = family_of(model)
    out = torch.zeros(batch["response_ids"].shape)
    for row, (p, response, mask) in enumerate(
        zip(batch["prompt_index"], batch["response_ids"], batch["response_mask"], strict=True)
    ):
        prompt = batch.prompts[int(p)]
        n = int(mask.sum())
        ids = torch.tensor([prompt.prompt_ids + response[:n].tolist()])
        types = family.media_token_types(ids)
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=prompt.pixel_values, token_type_ids=types).logits[0]
        start = len(prompt.prompt_ids) - 1
        logits = block_tokens(logits[start : start + n].float(), family.never_generated_ids())
        out[row, :n] = torch.log_softmax(logits / temperature, dim=-1).gather(1, response[:n, None])[:, 0]
    return out


def test_trainer_logprobs_equal_the_hf_engine_and_a_plain_forward(model, processor, hf_batch) -> None:
    """Rows longer than the sliding window, so the window and the image blocks both shape the numbers."""
    assert max(len(p.prompt_ids) for p in hf_batch.prompts) > 2 * TINY_WINDOW
    mask = hf_batch["response_mask"].bool()
    with torch.no_grad():
        ours = forward_logprobs(model, hf_batch, processor.tokenizer.pad_token_id, 0.8)[0]
    engine = (ours - hf_batch["rollout_logprobs"]).abs()[mask]
    plain = (ours - plain_logprobs(model, hf_batch, 0.8)).abs()[mask]
    print(f"gemma3: HF engine max {engine.max():.2e}; plain forward max {plain.max():.2e}")
    assert engine.max() < 1e-4, f"trainer vs HF engine: max |Δlogp| = {engine.max():.2e}"
    assert plain.max() < 1e-4, f"trainer vs plain forward: max |Δlogp| = {plain.max():.2e}"


def test_the_shared_prompt_forward_equals_the_padded_one_and_packing_would_not(
    model, processor, hf_batch
) -> None:
    """The shared-prompt forward (the groups' prompts run once, their image blocks and windows the model's own)
    equals the padded one to 1e-5. The packed forward, forced on, attends by plain causal masks without the
    window and the image blocks, and is far off: why `actor.padding_free` is refused."""
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
        with mock.patch.object(Gemma3, "packs_sequences", True):
            packed = forward_logprobs(model, hf_batch, pad, 0.8, padding_free=True)[0]
    assert any(s is not None for s in found), "the forward should have shared the prompts"
    gaps = {"shared": (shared - padded).abs()[mask].max(), "packed": (packed - padded).abs()[mask].max()}
    print(f"gemma3 vs padded: shared {gaps['shared']:.2e}, packed (refused) {gaps['packed']:.2e}")
    assert gaps["shared"] < 1e-5 and gaps["packed"] > 1e-2


# ------------------------------------------------------------------ runs
def test_two_quickstart_training_steps(model_dir, tmp_path) -> None:
    """The image quickstart (each image one 56 px square) on four colour rows: the trainer's log-probs are
    the HF engine's at every step."""
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
    """Video rows (Gemma 3 takes none), env and agent turns (written with Qwen's image tokens) and the vLLM
    engine stop the run before training, in one line, exit 2."""
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
    assert says in err and "gemma3" in err and "Traceback" not in err


def test_packed_rows_are_refused_at_start_naming_why(model_dir, tmp_path, capsys) -> None:
    """`actor.padding_free` would drop the image blocks and windows (the packed gap above): exit 2, one line."""
    generate(tmp_path / "data", task="color", n_train=4, n_val=0, seed=0, image_size=56)
    args = [
        "train",
        "configs/quickstart.yaml",
        f"model.path={model_dir}",
        f"data.train_files={tmp_path / 'data' / 'train.jsonl'}",
        "data.val_files=[]",
        f"trainer.output_dir={tmp_path / 'run'}",
        "actor.padding_free=true",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "actor.padding_free: gemma3 models attend both ways" in err and "Traceback" not in err
