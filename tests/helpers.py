"""Inputs shared by the engine tests: prompts that mix image sizes and text-only rows, data rows that
mix images, videos and text, and one actor update on a rollout batch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from PIL import Image

from mmrl.agent.scripts import SCRIPT
from mmrl.config import Config, VLLMConfig, load_config
from mmrl.data.batch import Batch
from mmrl.data.sample import PromptSample
from mmrl.data.synthetic import generate
from mmrl.data.synthetic_video import QUESTION, generate_video
from mmrl.models import family_of, load_processor
from mmrl.processors import (
    PixelBudget,
    build_messages,
    encode_prompt,
    fit_image,
    num_image_tokens,
    pixel_inputs,
)
from mmrl.rollout import make_engine
from mmrl.training.actor import build_actor
from mmrl.training.optim import UpdateStats, plan_minibatches

BUDGET = PixelBudget(min_pixels=56 * 56, max_pixels=112 * 112)

# A tiny `mmrl train` on the quickstart recipe: two steps of 4 prompts x 2 responses, no validation,
# checkpoints, warm-up or progress bar.
FAST = [
    "trainer.total_steps=2",
    "trainer.val_every=0",
    "trainer.save_every=0",
    "trainer.progress=false",
    "trainer.loggers=[jsonl]",
    "warmup.steps=0",
    "data.train_batch_size=4",
    "actor.mini_batch_size=4",
    "rollout.n=2",
]


def vllm_engine(model: Any, model_dir: Path, dtype: torch.dtype, settings: VLLMConfig) -> Any:
    """A real vLLM engine over `model` (saved in `model_dir`) at the suite's pixel budget."""
    from mmrl.rollout.vllm import VLLMEngine

    engine = make_engine(
        "vllm",
        model,
        load_processor(model_dir),
        dtype,
        model_path=model_dir,
        vllm=settings,
        pixels=(BUDGET.min_pixels, BUDGET.max_pixels),
    )
    assert isinstance(engine, VLLMEngine)
    return engine


def mixed_prompts(processor, with_text_only: bool = True) -> list[PromptSample]:
    """Three images of different shapes (so different token counts) and, optionally, a text-only prompt
    second, as the trainer prepares them."""
    tok = processor.tokenizer
    samples = []
    for i, (size, colour) in enumerate(
        [((112, 112), (220, 20, 20)), ((56, 140), (20, 20, 220)), ((84, 84), (0, 160, 0))]
    ):
        image = fit_image(Image.new("RGB", size, colour), BUDGET)
        count = num_image_tokens(image.height, image.width, BUDGET)
        ids = encode_prompt(tok, build_messages("<image>What colour is the shape?", 1), [count])
        inputs = pixel_inputs([image], processor.image_processor)
        samples.append(
            PromptSample(i, ids, "q", "red", [image], [], inputs["pixel_values"], inputs["image_grid_thw"])
        )
    if with_text_only:
        ids = encode_prompt(tok, build_messages("How many circles?", 0), [])
        samples.insert(1, PromptSample(9, ids, "q", "one"))
    return samples


def mixed_media_rows(root: Path) -> Path:
    """Image, video, image+video and text-only rows, then three rows with broken videos."""
    generate(root / "img", task="color", n_train=2, n_val=0, seed=0, image_size=56)
    generate_video(root / "vid", n_train=2, n_val=0, seed=0, image_size=56, task="motion")
    image, video = "img/images/train_000000.png", "vid/videos/train_000000.mp4"
    shutil.copy(root / "vid/videos/train_000001.mp4", root / "truncated.mp4")
    data = (root / "truncated.mp4").read_bytes()
    (root / "truncated.mp4").write_bytes(data[: len(data) // 3])
    (root / "empty.mp4").write_bytes(b"")
    rows = [
        {"problem": "<image>What colour is the shape?", "answer": "red", "images": [image]},
        {"problem": f"<video>{QUESTION}", "answer": "left", "videos": [video]},
        {
            "problem": f"<image>colour? <video>{QUESTION}",
            "answer": "up",
            "images": [image],
            "videos": [video],
        },
        {"problem": "How many circles?", "answer": "one"},
        {"problem": f"<video>{QUESTION}", "answer": "left", "videos": ["truncated.mp4"]},
        {"problem": f"<video>{QUESTION}", "answer": "left", "videos": ["empty.mp4"]},
        {"problem": f"<video>{QUESTION}", "answer": "left", "videos": ["missing.mp4"]},
    ]
    path = root / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def mixed_media_dataset(
    root: Path, model_dir: Path, processor: Any, model_config: Any, overrides: tuple[str, ...] = ()
) -> tuple[Config, Any]:
    """The video quickstart recipe over `mixed_media_rows`: its config and training dataset."""
    from mmrl.sources.prompts import build_datasets

    cfg = load_config(
        "configs/quickstart_video.yaml",
        [
            f"model.path={model_dir}",
            f"data.train_files={mixed_media_rows(root)}",
            "data.val_files=[]",
            *overrides,
        ],
    )
    train, _ = build_datasets(cfg, processor, model_config)
    return cfg, train


def update_once(cfg: Config, model: Any, batch: Batch, pad_id: int, horizon: int) -> UpdateStats:
    """One actor update on a rollout batch, with advantages that separate its rows; the vision tower,
    which the batch's images and videos went through, must learn."""
    scores = torch.arange(len(batch), dtype=torch.float32) % 3
    batch.set(advantages=(scores - scores.mean())[:, None].expand_as(batch["response_mask"]).clone())
    before = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("model.visual.")}
    actor = build_actor(cfg, model, pad_id, torch.float32)
    stats = actor.update(batch, plan_minibatches(batch, len(batch), epochs=1, horizon=horizon))
    assert stats.skipped_steps == 0
    after = model.state_dict()
    assert any(not torch.equal(v, after[k]) for k, v in before.items()), "the vision tower learned nothing"
    return stats


def tiny_vla_config(model_dir: Path, output_dir: Path, *overrides: str) -> Config:
    """A minimal episode-training run on reach: 2 initial states x 2 episodes of at most 4 steps."""
    return load_config(
        None,
        [
            f"model.path={model_dir}",
            "env.task=reach",
            "env.options={image_size: 56, max_steps: 4}",
            "data.min_pixels=3136",
            "data.max_pixels=3136",
            "data.train_batch_size=2",
            "actor.mini_batch_size=2",
            "rollout.engine=hf",
            "rollout.n=2",
            f"trainer.output_dir={output_dir}",
            "trainer.loggers=[jsonl]",
            "trainer.progress=false",
            *overrides,
        ],
    )


OVERLAPPED = ("rollout.max_staleness=1", "actor.rollout_correction=tis")


def train_quickstart(model: Path, data: Path, out: Path, *extra: str) -> list[dict]:
    """`mmrl train` of the tiny quickstart on the rows in `data`: 3 steps of 4 prompts x 4 answers, each
    saved, with steps large enough that a one-update-old policy samples visibly differently."""
    from mmrl.cli import main
    from mmrl.run.logger import read_metrics

    code = main(
        [
            "train",
            "configs/quickstart.yaml",
            f"model.path={model}",
            f"data.train_files={data / 'train.jsonl'}",
            "data.val_files=[]",
            f"trainer.output_dir={out}",
            "data.train_batch_size=4",
            "actor.mini_batch_size=4",
            "rollout.n=4",
            "warmup.steps=0",
            "actor.lr=3e-2",
            "trainer.total_steps=3",
            "trainer.save_every=1",
            "trainer.progress=false",
            *extra,
        ]
    )
    assert code == 0
    return read_metrics(out / "metrics.jsonl")


def overlapped_config(model_dir: Path, root: Path, *overrides: str) -> Config:
    """A tiny quickstart run on 16 colour rows rendered under `root`, its rollouts one update behind."""
    generate(root / "data", task="color", n_train=16, n_val=0, seed=0, image_size=56)
    return load_config(
        "configs/quickstart.yaml",
        [
            f"model.path={model_dir}",
            f"data.train_files={root / 'data' / 'train.jsonl'}",
            "data.val_files=[]",
            f"trainer.output_dir={root / 'run'}",
            "data.train_batch_size=4",
            "actor.mini_batch_size=4",
            "rollout.n=2",
            "warmup.steps=0",
            "trainer.progress=false",
            *OVERLAPPED,
            *overrides,
        ],
    )


# A zoom call in the tiny model's format, and a short tool schema: the Qwen tool preamble alone takes
# most of a 512-token context there.
ZOOM_CALL = '<tool_call>\n{"name": "image_zoom", "arguments": {"bbox_2d": [56, 0, 112, 56]}}\n</tool_call>'
SHORT_ZOOM = {"function": "image_zoom", "description": "Zoom in", "parameters": {"type": "object"}}


def zoom_prompts(processor: Any, budget: PixelBudget, count: int, tool: dict[str, Any]) -> list[PromptSample]:
    """Zoom-task prompts (`mmrl.data.synthetic_zoom`) describing `tool`, with their full-size originals."""
    import numpy as np

    from mmrl.agent import ToolSpec
    from mmrl.data.dataset import with_pixels
    from mmrl.data.synthetic_zoom import draw

    tools = [ToolSpec.from_config(tool).schema()]
    rng = np.random.default_rng(0)
    out = []
    for i in range(count):
        original, _ = draw(rng, "red", i % 4)
        fitted = fit_image(original, budget)
        count_ = num_image_tokens(fitted.height, fitted.width, budget)
        ids = encode_prompt(processor.tokenizer, build_messages("<image>Zoom in.", 1), [count_], tools=tools)
        sample = PromptSample(i, ids, "Zoom in.", "red", images=[fitted], originals=[original])
        out.append(with_pixels(sample, [], processor.image_processor, None))
    return out


class Forced:
    """The model, with `generate` forced to emit given token lists: the HF engine then samples exactly a
    scripted trajectory and reports its real sampling log-probs (from the unprocessed logits)."""

    def __init__(self, model: Any) -> None:
        self.model, self.rows = model, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        width, rows = input_ids.shape[1], self.rows

        def allowed(row: int, ids: torch.Tensor) -> list[int]:
            k = ids.shape[0] - width
            return [rows[row][min(k, len(rows[row]) - 1)]]

        return self.model.generate(input_ids=input_ids, prefix_allowed_tokens_fn=allowed, **kwargs)


class ForcedScript:
    """The HF engine over `Forced`, taking each prompt's next turn from its script. The forcing goes
    through `generate`'s `prefix_allowed_tokens_fn`, so the engine takes transformers' loop here (its own
    sampler, `mmrl.rollout.decode`, is what it runs otherwise)."""

    logprobs_are_free = False

    def __init__(self, engine: Any, tokenizer: Any) -> None:
        self.engine, self.tokenizer = engine, tokenizer

    def generate(self, prompts: list[Any], params: Any) -> Any:
        self.engine.model.rows = [
            self.tokenizer(p.extra[SCRIPT].next(), add_special_tokens=False)["input_ids"]
            + [self.tokenizer.eos_token_id]
            for p in prompts
        ]
        with mock.patch.object(type(family_of(self.engine.model)), "prefix_cache", False):
            return self.engine.generate(prompts, params)


def assert_scored_like_sampled(model: Any, batch: Batch, pad_id: int) -> None:
    """The trainer's one forward over each multi-turn trajectory gives every policy token the log-prob the
    engine sampled it with, and a loss on the policy tokens sends exactly zero gradient to the tokens the
    policy did not write (tool responses, env frames)."""
    from mmrl.algorithms import logprobs_from_logits
    from mmrl.training.forward import forward_logprobs, response_hidden, response_logprobs

    policy = batch["response_mask"].bool()
    observation = batch["response_attention"].bool() & ~policy
    assert observation.any() and policy.any()
    logp, _ = forward_logprobs(model, batch, pad_id)
    sampled = batch["rollout_logprobs"]
    assert torch.allclose(logp[policy], sampled[policy], atol=1e-4), (logp - sampled)[policy].abs().max()
    assert (sampled[observation] == 0).all()
    scored, _ = response_logprobs(model, batch, pad_id)
    assert scored.shape[0] == int(policy.sum()), "only the policy's own tokens may reach the LM head"
    logits = model.lm_head(response_hidden(model, batch, pad_id)[policy])
    logits.retain_grad()
    (-logprobs_from_logits(logits.float(), batch["response_ids"][policy]).sum()).backward()
    assert (logits.grad.abs().sum(dim=-1) > 0).all()
