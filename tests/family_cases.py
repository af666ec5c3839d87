"""What the per-family tests (`test_family_*.py`) share: prompts of every media mix sized to a family's
pixel grid and built as the data layer builds them, the model's own position ids and full forward to
check the trainer against, and the vLLM tests' markers, engine and one policy update."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.algorithms import block_tokens
from mmrl.config import ActorConfig, VLLMConfig
from mmrl.data.batch import Batch
from mmrl.data.dataset import with_pixels
from mmrl.data.sample import PromptSample, vision_inputs
from mmrl.models import Family, family_of, load_policy, load_processor
from mmrl.processors import (
    PixelBudget,
    VideoBudget,
    build_messages,
    encode_prompt,
    fit_image,
    read_video,
)
from mmrl.rollout import SamplingParams, make_engine
from mmrl.rollout.vllm import VLLMEngine, vllm_available
from mmrl.training.actor import Actor
from mmrl.training.forward import forward_logprobs
from mmrl.training.optim import plan_minibatches

# What a recipe needs to run on a CPU: paths aside, only batch sizes, lengths and one process.
CPU_OVERRIDES = [
    "trainer.device=cpu",
    "model.dtype=float32",  # the suite pins ATen to AVX2 (conftest.py), where its bf16 matmuls refuse to run
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
    so a clip's temporal patches outnumber its grid, and `wide` clips of several frame sizes."""

    images: PixelBudget
    videos: VideoBudget
    wide: VideoBudget
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

    def all_prompts(self, processor, family: Family) -> list[PromptSample]:
        """Every case once, in order: image, two images, video, text only, image + video."""
        return [self.prompt(processor, family, i, name) for i, name in enumerate(self.cases)]


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
        cases={
            "image": ("<image>What colour is the shape?", [(4 * g, 4 * g)], []),
            "images": ("<image> and <image>: which is red?", [(2 * g, 5 * g), (3 * g, 3 * g)], []),
            "video": ("<video>Which way does it move?", [], [(8, 2.0, (g, g))]),
            "text": ("How many circles?", [], []),
            "mixed": ("Look: <image> then <video> - what changed?", [(3 * g, 2 * g)], [(4, 1.0, (g, g))]),
        },
    )


def wide_clips(g: int) -> Case:
    """Three clips of different lengths, frame rates and frame sizes in one prompt."""
    return (
        "<video> vs <video> vs <video>",
        [],
        [(30, 3.0, (2 * g, 2 * g)), (5, 1.0, (g, 2 * g)), (12, 7.5, (2 * g, g))],
    )


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


def plain_logprobs(model, batch: Batch, temperature: float) -> torch.Tensor:
    """Each row alone, unpadded, through the model's own full forward (its own vision tower and positions,
    none given), over the distribution the engines sample from: vision placeholders blocked."""
    family = family_of(model)
    out = torch.zeros(batch["response_ids"].shape)
    for row, (p, response, mask) in enumerate(
        zip(batch["prompt_index"], batch["response_ids"], batch["response_mask"], strict=True)
    ):
        prompt = batch.prompts[int(p)]
        n = int(mask.sum())
        ids = torch.tensor([prompt.prompt_ids + response[:n].tolist()])
        media = {}
        if family.takes_images:
            media = {k: v for k, v in vision_inputs([prompt]).items() if k != "second_per_grid_ts"}
            media["mm_token_type_ids"] = family.media_token_types(ids)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **media).logits[0]
        start = len(prompt.prompt_ids) - 1
        logits = block_tokens(logits[start : start + n].float(), family.never_generated_ids())
        out[row, :n] = torch.log_softmax(logits / temperature, dim=-1).gather(1, response[:n, None])[:, 0]
    return out


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
