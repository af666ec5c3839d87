"""Mistral 3 (`mistral3`): the tiny build is the real architecture (a tiny Pixtral, 14 px patches merged 2 x 2,
on a tiny Mistral) saved under the names vLLM loads; images keep their own sizes as `PixtralImageProcessor`
sizes them, prompts and pixels are what `PixtralProcessor` gives; the trainer's log-probs equal a plain
transformers forward of each row alone (the model's own tower and patch merger on the processor's padded
pixels) and the HF engine's, packed and shared-prompt forwards equal the padded one, and two training steps
of the quickstart run through the CLI. Video rows, env and agent runs and the vLLM engine are refused at
start."""

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
from mmrl.models.mistral3 import BREAK, END, IMAGE, pixtral_size
from mmrl.processors import build_messages, fit_image
from mmrl.rollout import HFEngine, SamplingParams
from mmrl.rollout.vllm import checkpoint_names
from mmrl.run.logger import read_metrics
from mmrl.training import forward
from mmrl.training.forward import forward_logprobs

G = 28  # the tiny build's patch x merge
_AT = media_at(G)
# Longest edge 112 px: 4 x 4 merged patches; a 56 x 140 image scaled to 44 x 112, then 56 x 112; 84 x 84 as is.
MEDIA = replace(_AT, images=replace(_AT.images, rule=pixtral_size))
CASES = ["image", "images", "text"]  # the family cases without video


@pytest.fixture(scope="module")
def model_dir(tiny_family_dir):
    return tiny_family_dir("mistral3")


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
    family = family_of(model)
    assert type(processor).__name__ == "PixtralProcessor"
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
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    ids = torch.zeros_like(mask)
    assert family_of(model).position_ids(prompts[:2], ids, mask).tolist() == [
        [0, 0, 0, 1, 2],
        [0, 1, 2, 3, 4],
    ]


# ------------------------------------------------------------------ log-probs
@pytest.fixture(scope="module")
def hf_batch(model, processor, prompts) -> Batch:
    """One image, two images of different sizes and text only, two responses each, from the HF engine."""
    torch.manual_seed(0)
    batch = HFEngine(model, processor).generate(
        prompts, SamplingParams(n=2, temperature=0.8, max_new_tokens=10, logprobs=True)
    )
    assert batch["response_mask"].sum() > 2 * len(prompts)
    return batch


def plain_logprobs(model, processor, batch: Batch, temperature: float) -> torch.Tensor:
    """Each row alone, unpadded, through the model's own full forward on the processor's own padded pixels
    and `image_sizes`, `[IMG]` blocked."""
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
    print(f"mistral3: HF engine max {engine.max():.2e}; plain forward max {plain.max():.2e}")
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
    print(f"mistral3 vs padded: shared {gaps['shared']:.2e}, packed {gaps['packed']:.2e}")
    assert max(gaps.values()) < 1e-5


# ------------------------------------------------------------------ runs
def test_two_quickstart_training_steps(model_dir, tmp_path) -> None:
    """The image quickstart (112 px longest edge; its 56 px images kept as they are, 2 x 2 merged patches) on
    four colour rows: the trainer's log-probs are the HF engine's at every step."""
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
    """Video rows (Mistral 3 takes none), env and agent turns (written with Qwen's image tokens) and the vLLM
    engine (which would expand mmrl's already expanded image runs again) stop the run before training, in
    one line, exit 2."""
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
    assert says in err and "mistral3" in err and "Traceback" not in err
