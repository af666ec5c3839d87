"""Side-by-side GRPO throughput and memory: mmrl against TRL's GRPOTrainer on the same tiny VLM.

Both systems train the same tiny random-init Qwen2.5-VL (after one shared format warm-up, so the
answer reward is not all zero) on the same 112x112 colour images, in the same order, with the same
prompt tokens, the same `answer_match` reward, the same batch (prompts x n), the same completion
budget, the same sampling (temperature 1, no top-p/top-k, the four vision placeholder tokens never
sampled), AdamW at the same constant learning rate, clip 0.2, no KL and no entropy bonus, and the same
number of optimizer steps (one per batch). `--seed` seeds the warm-up and both systems, but they draw
their samples differently, so one seed does not give both the same completions: compare learning
over several seeds. `--check-update` takes sampling out: TRL replays mmrl's completions for `--steps`
steps and the script compares their gradients. Runs alternate mmrl, TRL, mmrl, TRL, ... and each run is
its own subprocess, so peak RSS (the child's own VmHWM) is per system. Medians over repeats; step
times skip each run's first step. On a shared 2-core machine pass `--threads 1`: two torch threads
per run next to other jobs' threads can stall steps 50-100x and wreck the medians.

TRL is not an mmrl dependency. It lives in a separate, git-ignored environment:

    uv venv bench/.venv -p .venv/bin/python \
      && uv pip install -p bench/.venv/bin/python -r requirements.lock trl==1.16.0 \
      && uv pip install -p bench/.venv/bin/python --no-deps -e .

Then:

    bench/.venv/bin/python bench/vs_trl.py --batch 8 --n 4 --max-new-tokens 8 --steps 10 \
        --repeats 3 --out bench/results/vs_trl.json
    bench/.venv/bin/python bench/vs_trl.py --batch 32 --n 8 --steps 100 --repeats 1 --seed 2  # learning
    bench/.venv/bin/python bench/vs_trl.py --check-update --batch 32 --n 8 --steps 3

`--shape realistic` swaps the tiny model for a random-init Qwen2.5-VL of the same family at 108.6 M
parameters (language model 768 wide, 12 layers; vision tower 6.3 M, 256 wide, 4 layers), 448 px images
(256 visual tokens), 2 prompts x n=8 with up to 256 new tokens, 3 steps, 2 repeats, lr 1e-6 and no
format warm-up; it runs three systems, alternating: mmrl as configured by default (the rollout engine
`auto`, vLLM where it is installed; `actor.padding_free: auto`, packed at this width: each prompt once before
its responses), TRL, and mmrl on the HF engine (`mmrl-hf`). A random-init model's next-token distribution is near uniform, so it would end a
response with probability 1/vocab per token and most responses would reach the cap; the
`<|im_end|>` embedding row is scaled by `--eos-scale` (7; tied, so its logit's spread grows) to give
a real spread of lengths, which each run reports (min / median / max over its samples). Gradient
checkpointing is off on both sides unless `--gradient-checkpointing` (TRL's own default is on).

    bench/.venv/bin/python bench/vs_trl.py --shape realistic --threads 1 --out bench/results/vs_trl_realistic.json

`--shape 3b` is for a GPU: Qwen2.5-VL-3B's layer sizes (3.1 B parameters with the tiny tokenizer's
vocabulary), bf16 autocast over fp32 weights on both sides, 448 px images, 2 prompts x n=8 at up to 256
new tokens, 4 steps, mmrl and TRL. Each run also reports its peak GPU memory.

    bench/.venv/bin/python bench/vs_trl.py --shape 3b --out bench/results/vs_trl_3b.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from common import (
    QUESTION,
    QUICKSTART,
    data_overrides,
    load_average,
    machine,
    make_workspace,
    median,
    run_in_workspace,
    write_result,
)

from mmrl.run.logger import peak_rss_gb

SYSTEMS = ("mmrl", "trl")
# mmrl with its actor's padding removed (packed) or kept (padded, where each prompt runs once for its
# group), or on the HF engine: `--systems mmrl,trl,mmrl-packed`.
VARIANTS = {
    "mmrl-padded": ("mmrl", ["actor.padding_free=false", "actor.max_tokens_per_micro_batch=null"]),
    "mmrl-packed": ("mmrl", ["actor.padding_free=true"]),
    "mmrl-hf": ("mmrl", ["rollout.engine=hf"]),
}
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {
        "batch": 8,
        "n": 4,
        "max_new_tokens": 8,
        "image_size": 112,
        "steps": 10,
        "repeats": 3,
        "lr": 1e-3,
        "warmup_steps": 40,
        "systems": "mmrl,trl",
        "mmrl_override": [],
    },
    # 2 prompts x n=8 (the group people train with) at up to 256 new tokens: a step is 0.5-2 minutes per
    # system on one CPU thread. mmrl as it runs by default (the engine `auto`, not the tiny quickstart's
    # HF; packed at this width) against TRL, and mmrl on the HF engine.
    "realistic": {
        "batch": 2,
        "n": 8,
        "max_new_tokens": 256,
        "image_size": 448,
        "steps": 3,
        "repeats": 2,
        "lr": 1e-6,
        "warmup_steps": 0,
        "systems": "mmrl,trl,mmrl-hf",
        "mmrl_override": ["rollout.engine=auto"],
    },
    # Qwen2.5-VL-3B's layer sizes on a GPU, bf16 compute over fp32 weights on both sides: 2 prompts x
    # n=8 at up to 256 new tokens. The tokenizer is still the tiny one (1,003 ids, not 151,936), so the
    # output layer is about 10% of a real 3B's per-token FLOPs short.
    "3b": {
        "batch": 2,
        "n": 8,
        "max_new_tokens": 256,
        "image_size": 448,
        "steps": 4,
        "repeats": 1,
        "lr": 1e-6,
        "warmup_steps": 0,
        "systems": "mmrl,trl",
        "mmrl_override": [],
        "dtype": "bfloat16",
    },
}
# The realistic shape's sizes over the tiny Qwen2.5-VL config (head_dim 64: mrope_section sums to 32).
REALISTIC_TEXT = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
}
REALISTIC_VISION = {
    "depth": 4,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_heads": 4,
    "out_hidden_size": 768,
    "window_size": 112,
    "fullatt_block_indexes": [3],
}
# Qwen2.5-VL-3B-Instruct's published config (head_dim 128: mrope_section sums to 64).
QWEN25VL_3B_TEXT = {
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
}
QWEN25VL_3B_VISION = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 2048,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
}
# The random-init model each larger shape builds (text sizes, vision sizes).
SIZES = {"realistic": (REALISTIC_TEXT, REALISTIC_VISION), "3b": (QWEN25VL_3B_TEXT, QWEN25VL_3B_VISION)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="tiny", help="model size and defaults below")
    p.add_argument("--batch", type=int, default=None, help="prompts per step")
    p.add_argument("--n", type=int, default=None, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    p.add_argument("--repeats", type=int, default=None, help="runs per system")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default=None, help="compute dtype (weights stay fp32)"
    )
    p.add_argument("--warmup-steps", type=int, default=None, help="shared format warm-up before RL")
    p.add_argument(
        "--systems", default=None, help=f"comma-separated, alternating: {SYSTEMS + tuple(VARIANTS)}"
    )
    p.add_argument(
        "--mmrl-override",
        action="append",
        default=None,
        help="mmrl config override after the shape's (repeatable)",
    )
    p.add_argument("--eos-scale", type=float, default=7.0, help="realistic shape: <|im_end|> row scale")
    p.add_argument("--gradient-checkpointing", action="store_true", help="on both sides")
    p.add_argument("--seed", type=int, default=1, help="seeds the shared warm-up and both systems")
    p.add_argument("--window", type=int, default=20, help="steps per window of the printed trajectories")
    p.add_argument(
        "--check-update",
        action="store_true",
        help="instead of timing: run --steps mmrl steps, replay its completions through TRL, compare gradients",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    p.add_argument("--workdir", type=Path, default=None, help="reuse a folder (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    p.add_argument(
        "--role", choices=("parent", *SYSTEMS, *VARIANTS, "replay"), default="parent", help=argparse.SUPPRESS
    )
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.mmrl_added = args.mmrl_override or []  # after the shape's own (the realistic shape's engine, say)
    args.mmrl_override = None
    for key, value in {"dtype": "float32", **SHAPES[args.shape]}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.mmrl_override = [*args.mmrl_override, *args.mmrl_added]
    args.systems = args.systems.split(",") if isinstance(args.systems, str) else args.systems
    unknown = set(args.systems) - set(SYSTEMS) - set(VARIANTS)
    if unknown or not {"mmrl", "trl"} <= set(args.systems):
        p.error(f"--systems needs mmrl and trl, and knows only {SYSTEMS + tuple(VARIANTS)}")
    return args


# ------------------------------------------------------------------ shared set-up (parent)
def prepare(args: argparse.Namespace, root: Path) -> Path:
    """Tiny (or realistic) model + colour data, then one format warm-up; returns the shared starting
    checkpoint."""
    from mmrl.config import load_config
    from mmrl.trainer import Trainer

    if args.shape in SIZES and not (root / "tiny-model" / "config.json").exists():
        build_realistic(root / "tiny-model", args.image_size, args.eos_scale, *SIZES[args.shape])
    model_dir, data_dir = make_workspace(root, max(512, args.batch * args.steps), args.image_size)
    start = root / "start-model"
    if (start / "config.json").exists():
        return start
    shutil.copytree(model_dir, start)
    if args.warmup_steps:
        cfg = load_config(
            QUICKSTART,
            [
                *data_overrides(start, data_dir, root / "warmup-run", args.image_size),
                f"warmup.steps={args.warmup_steps}",
                f"trainer.seed={args.seed}",
            ],
        )
        trainer = Trainer(cfg)  # runs the format warm-up as it starts, into its run's warmup_model/
        shutil.copytree(trainer.run_dir / "warmup_model", start, dirs_exist_ok=True)
        trainer.logger.close()
        trainer.source.close()
        trainer.lock.release()
    return start


def build_realistic(
    out: Path, image_size: int, eos_scale: float, text: dict[str, Any], vision: dict[str, Any]
) -> None:
    """A larger random-init Qwen2.5-VL with the eos row scaled; prints its parameter count."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from mmrl.models import build_tiny

    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # a 3B random init is minutes on CPU
        build_tiny(out, max_pixels=image_size**2, text=text, vision=vision)
    eos = json.loads((out / "config.json").read_text())["text_config"]["eos_token_id"]  # <|im_end|>
    count = vision_count = 0
    for weights in sorted(out.glob("*.safetensors")):  # one file, or several shards
        with safe_open(weights, "pt") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
        count += sum(_numel(s) for s in shapes.values())
        vision_count += sum(_numel(s) for k, s in shapes.items() if "visual." in k)
        if embed := [k for k in shapes if k.endswith("embed_tokens.weight")]:  # tied: the output row too
            tensors = load_file(weights)
            tensors[embed[0]][eos] *= eos_scale
            save_file(tensors, weights, metadata={"format": "pt"})
    print(f"model: {count / 1e6:.1f} M parameters ({vision_count / 1e6:.1f} M in the vision tower), float32")


def _numel(shape: list[int]) -> int:
    return functools.reduce(lambda a, b: a * b, shape, 1)


def lengths_summary(lengths: list[int]) -> dict[str, float]:
    """Min / median / max / mean response length over a run's samples."""
    return {
        "min": min(lengths),
        "median": median(lengths),
        "max": max(lengths),
        "mean": sum(lengths) / len(lengths),
        "samples": len(lengths),
    }


# ------------------------------------------------------------------ mmrl (child)
def run_mmrl(args: argparse.Namespace, root: Path, extra: list[str] | None = None) -> dict[str, Any]:
    """GRPO steps through mmrl's Trainer; timings from its metrics.jsonl."""
    from mmrl.config import load_config
    from mmrl.rollout.base import GeneratesAtOnce
    from mmrl.run.logger import read_metrics
    from mmrl.trainer import Trainer

    # Every in-process engine (HF, vLLM) reports each training batch through
    # `GeneratesAtOnce.rollout_metrics` (validation's answers do not pass there).
    lengths: list[int] = []
    report = GeneratesAtOnce.rollout_metrics

    def report_and_count(self: Any, batch: Any) -> dict[str, float]:
        lengths.extend(batch["response_mask"].sum(dim=1).tolist())
        return report(self, batch)

    GeneratesAtOnce.rollout_metrics = report_and_count  # type: ignore[method-assign]

    run_dir = root / f"mmrl-{time.time_ns()}"
    overrides = [
        *data_overrides(root / "start-model", root / "data", run_dir, args.image_size),
        "data.shuffle=false",
        f"data.train_batch_size={args.batch}",
        f"rollout.n={args.n}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.temperature=1.0",
        f"actor.lr={args.lr}",
        "actor.lr_schedule=constant",
        "actor.warmup_steps=0",
        "actor.weight_decay=0.0",
        "actor.max_grad_norm=1.0",
        "actor.clip_ratio_low=0.2",
        "actor.clip_ratio_high=0.2",
        "actor.loss_agg_mode=token-mean",
        f"actor.mini_batch_size={args.batch}",
        f"actor.micro_batch_size={max(256, args.batch * args.n)}",
        "actor.use_kl_loss=false",
        "actor.entropy_coef=0.0",
        "reward.functions=[{name: answer_match, weight: 1.0}]",
        "warmup.steps=0",
        f"trainer.total_steps={args.steps}",
        f"trainer.seed={args.seed}",
        f"model.gradient_checkpointing={str(args.gradient_checkpointing).lower()}",
        f"model.dtype={args.dtype}",
        *args.mmrl_override,
        *(extra or []),
    ]
    cfg = load_config(QUICKSTART, overrides)
    trainer = Trainer(cfg)
    # TRL runs with save_strategy="no"; mmrl always writes a final checkpoint (27 GB at the 3b shape),
    # which is not what this benchmark times.
    trainer.save = lambda *_, **__: None  # type: ignore[method-assign]
    t0 = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - t0
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "timing/step" in r]
    phases: dict[str, list[float]] = defaultdict(list)
    for r in records[1:]:
        for k, v in r.items():
            if k.startswith("timing/") and k != "timing/step":
                phases[k.removeprefix("timing/")].append(v)
    return {
        "step_s": [r["timing/step"] for r in records],
        "reward": [r["reward/mean"] for r in records],
        "entropy": [r["actor/entropy"] for r in records],
        "response_length": [r["response_length/mean"] for r in records],
        "phases_s": {k: median(v) for k, v in phases.items()},
        "train_wall_s": wall,
        "lengths": lengths_summary(lengths),
    }


# ------------------------------------------------------------------ TRL (child)
class PhaseClock:
    """Wall time of chosen GRPOTrainer methods, accumulated per optimizer step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, cls: type, method: str, label: str) -> None:
        fn = getattr(cls, method)

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.current[label] += time.perf_counter() - t0

        setattr(cls, method, timed)


def trl_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """TRL-style reward: mmrl's `answer_match` grader on each completion's text."""
    from mmrl.rewards import GRADERS, RewardInput

    grade = GRADERS["answer_match"]
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(grade(RewardInput(response=t, ground_truth=a))) for t, a in zip(texts, answer, strict=True)]


def run_trl(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The same GRPO steps through TRL's GRPOTrainer, on the GPU if there is one, without vLLM."""
    import torch
    from datasets import Dataset
    from PIL import Image
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mmrl.models import never_generated_ids
    from mmrl.processors.chat import build_messages, encode_prompt

    start = root / "start-model"
    rows = [json.loads(line) for line in (root / "data" / "train.jsonl").read_text().splitlines()]
    rows = rows[: args.batch * args.steps]
    dataset = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": QUESTION}],
                "image": Image.open(root / "data" / r["images"][0]).convert("RGB"),
                "answer": r["answer"],
            }
            for r in rows
        ]
    )
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        start, dtype=torch.float32, attn_implementation="sdpa"
    )
    processor = AutoProcessor.from_pretrained(start)
    config = GRPOConfig(
        output_dir=str(root / f"trl-{time.time_ns()}"),
        per_device_train_batch_size=args.batch * args.n,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.n,
        num_iterations=1,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        # mmrl's engines never sample any vision placeholder (image, video, vision start/end); TRL by
        # default suppresses only the image token.
        generation_kwargs={"suppress_tokens": never_generated_ids(model.config)},
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        gradient_checkpointing=args.gradient_checkpointing,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        max_steps=args.steps,
        shuffle_dataset=False,
        remove_unused_columns=False,
        use_vllm=False,
        use_cpu=not torch.cuda.is_available(),
        bf16=args.dtype == "bfloat16",  # autocast over fp32 weights, like mmrl's model.dtype
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=args.seed,
    )
    clock = PhaseClock()
    clock.wrap(GRPOTrainer, "_generate_and_score_completions", "rollout_and_scoring")
    clock.wrap(GRPOTrainer, "_generate", "generate")
    clock.wrap(GRPOTrainer, "_calculate_rewards", "reward")
    clock.wrap(GRPOTrainer, "compute_loss", "loss_forward")
    seen: dict[str, Any] = {}
    tokenize = GRPOTrainer._tokenize_prompts

    def spy(self: Any, prompts: list) -> Any:
        out = tokenize(self, prompts)
        seen.setdefault("prompt_ids", list(out[0][0]))
        return out

    GRPOTrainer._tokenize_prompts = spy  # type: ignore[method-assign]
    lengths: list[int] = []
    score = GRPOTrainer._generate_and_score_completions

    def score_and_count(self: Any, *a: Any, **k: Any) -> Any:
        out = score(self, *a, **k)
        lengths.extend(out["completion_mask"].sum(dim=1).tolist())
        return out

    GRPOTrainer._generate_and_score_completions = score_and_count  # type: ignore[method-assign]

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step, generation included."""

        def __init__(self) -> None:
            self.t0 = 0.0
            self.step_s: list[float] = []

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            clock.current.clear()
            self.t0 = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.step_s.append(time.perf_counter() - self.t0)
            clock.steps.append(dict(clock.current))

    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[trl_reward],
        args=config,
        train_dataset=dataset,
        processing_class=processor,
        callbacks=[timer],
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    history = [h for h in trainer.state.log_history if "reward" in h]
    phases: dict[str, list[float]] = defaultdict(list)
    for s, p in zip(timer.step_s[1:], clock.steps[1:], strict=True):
        prep = p.get("rollout_and_scoring", 0.0)
        phases["generate"].append(p.get("generate", 0.0))
        phases["reward"].append(p.get("reward", 0.0))
        phases["other_scoring"].append(prep - p.get("generate", 0.0) - p.get("reward", 0.0))
        phases["loss_forward"].append(p.get("loss_forward", 0.0))
        phases["backward_optimizer_rest"].append(s - prep - p.get("loss_forward", 0.0))
    expected = encode_prompt(
        processor.tokenizer,
        build_messages(f"<image>{QUESTION}", 1),
        [(args.image_size // 28) ** 2],
    )
    return {
        "step_s": timer.step_s,
        "reward": [h["reward"] for h in history],
        "entropy": [h["entropy"] for h in history],
        "response_length": [h["completions/mean_length"] for h in history],
        "phases_s": {k: median(v) for k, v in phases.items()},
        "train_wall_s": wall,
        "prompt_tokens": len(seen.get("prompt_ids", [])),
        "prompt_matches_mmrl": seen.get("prompt_ids") == expected,
        "lengths": lengths_summary(lengths),
    }


# ------------------------------------------------------------------ same completions, both systems (child)
def check_update(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """mmrl runs `--steps` steps and records its completions; TRL then runs as many steps replaying them
    (its `_generate_single_turn` returns mmrl's token ids). With sampling taken out, what is left to
    differ is the update itself: rewards, advantages, loss, gradient, clipping, AdamW.

    Both call `torch.nn.utils.clip_grad_norm_` (pre-clip norm recorded) and an optimizer step (the
    clipped gradient of every parameter recorded just before it)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from transformers import Qwen2_5_VLForConditionalGeneration
    from trl import GRPOTrainer

    from mmrl.models import never_generated_ids
    from mmrl.rollout.hf import HFEngine

    record: dict[str, dict[str, list]] = {s: {"norm": [], "grads": []} for s in SYSTEMS}
    live: dict[str, Any] = {"system": "mmrl", "model": None}
    load = Qwen2_5_VLForConditionalGeneration.from_pretrained.__func__

    def from_pretrained(cls: type, *a: Any, **k: Any) -> Any:
        live["model"] = load(cls, *a, **k)  # both systems load the policy through this
        return live["model"]

    Qwen2_5_VLForConditionalGeneration.from_pretrained = classmethod(from_pretrained)  # type: ignore[method-assign]
    clip = torch.nn.utils.clip_grad_norm_

    def clip_and_record(params: Any, *a: Any, **k: Any) -> torch.Tensor:
        norm = clip(params, *a, **k)
        record[live["system"]]["norm"].append(float(norm))
        return norm

    torch.nn.utils.clip_grad_norm_ = clip_and_record

    def grads_before_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        names = {id(p): n for n, p in live["model"].named_parameters()}
        record[live["system"]]["grads"].append(
            {
                names[id(p)]: p.grad.clone()
                for g in optimizer.param_groups
                for p in g["params"]
                if p.grad is not None
            }
        )

    register_optimizer_step_pre_hook(grads_before_step)
    completions: list[list[list[int]]] = []
    generate = HFEngine.generate

    def generate_and_record(self: Any, prompts: list, params: Any) -> Any:
        batch = generate(self, prompts, params)
        rows = zip(batch["response_ids"], batch["response_mask"], strict=True)
        completions.append([r[m.bool()].tolist() for r, m in rows])
        return batch

    HFEngine.generate = generate_and_record  # type: ignore[method-assign]
    rewards = {"mmrl": run_mmrl(args, root)["reward"]}
    after = {"mmrl": {n: p.detach().clone() for n, p in live["model"].named_parameters()}}

    def replay(self: Any, prompt_ids: list, *_: Any, **__: Any) -> tuple[list[list[int]], None]:
        out = completions[self.state.global_step]
        assert len(out) == len(prompt_ids), "TRL's batch is not mmrl's"
        return out, None

    GRPOTrainer._generate_single_turn = replay  # type: ignore[method-assign]
    live["system"] = "trl"
    rewards["trl"] = run_trl(args, root)["reward"]
    after["trl"] = {n: p.detach().clone() for n, p in live["model"].named_parameters()}

    steps = []
    for i in range(args.steps):
        gm, gt = record["mmrl"]["grads"][i], record["trl"]["grads"][i]
        names = sorted(set(gm) & set(gt))
        flat_m = torch.cat([gm[n].flatten() for n in names])
        flat_t = torch.cat([gt[n].flatten() for n in names])
        cosines = [
            float(torch.nn.functional.cosine_similarity(gm[n].flatten(), gt[n].flatten(), dim=0))
            for n in names
        ]
        steps.append(
            {
                "reward": (rewards["mmrl"][i], rewards["trl"][i]),
                "grad_norm_before_clip": (record["mmrl"]["norm"][i], record["trl"]["norm"][i]),
                "grad_rel_diff": float((flat_m - flat_t).norm() / flat_t.norm()),
                "min_tensor_cosine": min(cosines),
                "params_with_grad_on_one_side": sorted(set(gm) ^ set(gt)),
            }
        )
    embed = "model.language_model.embed_tokens.weight"
    delta = {n: (after["mmrl"][n] - after["trl"][n]).abs() for n in after["mmrl"]}
    blocked = never_generated_ids(live["model"].config)
    return {
        "steps": steps,
        "max_param_diff": max(float(d.max()) for d in delta.values()),
        "max_param_diff_outside_blocked_rows": max(
            float((d if n != embed else d[[r for r in range(len(d)) if r not in blocked]]).max())
            for n, d in delta.items()
        ),
        "blocked_token_ids": blocked,
    }


def print_check(args: argparse.Namespace, result: dict[str, Any]) -> None:
    print(f"\nsame completions through both ({args.batch} prompts x n={args.n}, seed {args.seed}):")
    for i, s in enumerate(result["steps"]):
        print(
            f"  step {i + 1}: reward mmrl {s['reward'][0]:.4f} TRL {s['reward'][1]:.4f}; "
            f"grad norm before clipping mmrl {s['grad_norm_before_clip'][0]:.6f} "
            f"TRL {s['grad_norm_before_clip'][1]:.6f}; gradient relative difference {s['grad_rel_diff']:.1e}, "
            f"lowest per-tensor cosine {s['min_tensor_cosine']:.6f}"
        )
        if s["params_with_grad_on_one_side"]:
            print(f"    gradient on one side only: {s['params_with_grad_on_one_side']}")
    print(
        f"  largest parameter difference after {args.steps} steps: {result['max_param_diff']:.1e} "
        f"({result['max_param_diff_outside_blocked_rows']:.1e} outside the embedding rows of the "
        f"placeholder tokens {result['blocked_token_ids']}, which mmrl's loss leaves out of the softmax)"
    )


def child(args: argparse.Namespace) -> int:
    """One system's run; writes its result (with its own peak RSS) as JSON."""
    root = args.workdir
    if args.role in VARIANTS:
        result = run_mmrl(args, root, VARIANTS[args.role][1])
    else:
        result = {"mmrl": run_mmrl, "trl": run_trl, "replay": check_update}[args.role](args, root)
    result["peak_rss_gb"] = peak_rss_gb()
    result["peak_gpu_gb"] = _peak_gpu_gb()
    args.result.write_text(json.dumps(result))
    return 0


def _peak_gpu_gb() -> float | None:
    """Peak GPU memory held by tensors in this process (None without a GPU)."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


# ------------------------------------------------------------------ orchestration (parent)
def launch(args: argparse.Namespace, system: str, root: Path, index: int) -> dict[str, Any]:
    """Run one system in a fresh interpreter and read back its result."""
    result_path = root / f"result-{system}-{index}.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--role",
        system,
        "--result",
        str(result_path),
        "--workdir",
        str(root),
        *(
            f"--{k.replace('_', '-')}={getattr(args, k)}"
            for k in (
                "shape",
                "batch",
                "n",
                "max_new_tokens",
                "image_size",
                "steps",
                "lr",
                "dtype",
                "seed",
                "threads",
            )
        ),
        *(f"--mmrl-override={o}" for o in args.mmrl_added),  # the child adds its shape's own again
        *(["--gradient-checkpointing"] if args.gradient_checkpointing else []),
    ]
    load_before = load_average()
    t0 = time.perf_counter()
    # The thread count in the environment too, so that vLLM-CPU binds as many OpenMP threads as torch uses.
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RuntimeError(f"{system} run {index} failed with exit code {proc.returncode}")
    result = json.loads(result_path.read_text())
    result["process_wall_s"] = time.perf_counter() - t0
    result["load_avg"] = (load_before[0], load_average()[0])
    result["load_avg_1_5_15"] = (load_before, load_average())
    return result


def summarise(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per system and the mmrl/TRL ratios."""
    samples = args.batch * args.n
    out: dict[str, Any] = {}
    for system, rs in runs.items():
        step = median([median(r["step_s"][1:] or r["step_s"]) for r in rs])
        first_k = max(1, min(3, args.steps // 3))
        out[system] = {
            "median_step_s": step,
            "samples_per_s": samples / step,
            "peak_rss_gb": median([r["peak_rss_gb"] for r in rs]),
            "peak_gpu_gb": rs[0]["peak_gpu_gb"] and median([r["peak_gpu_gb"] for r in rs]),
            "train_wall_s": median([r["train_wall_s"] for r in rs]),
            "process_wall_s": median([r["process_wall_s"] for r in rs]),
            "reward_first": median([sum(r["reward"][:first_k]) / first_k for r in rs]),
            "reward_last": median([sum(r["reward"][-first_k:]) / first_k for r in rs]),
            "phases_s": {k: median([r["phases_s"][k] for r in rs]) for k in rs[0]["phases_s"]},
            "reward_steps_averaged": first_k,
        }
    for system, rs in runs.items():
        out[system]["min_step_s"] = min(min(r["step_s"][1:] or r["step_s"]) for r in rs)
    for system in [s for s in runs if s in VARIANTS]:
        out[system]["update_time_over_mmrl"] = median(  # this variant's update time / mmrl's, per repeat
            [
                b["phases_s"]["update"] / a["phases_s"]["update"]
                for a, b in zip(runs["mmrl"], runs[system], strict=True)
            ]
        )
    m, t = out["mmrl"], out["trl"]
    # Each repeat's mmrl and TRL runs are neighbours in time, so their ratio cancels slow drifts
    # in the machine's load better than the ratio of the two medians does.
    pairwise = [
        median(b["step_s"][1:] or b["step_s"]) / median(a["step_s"][1:] or a["step_s"])
        for a, b in zip(runs["mmrl"], runs["trl"], strict=True)
    ]
    out["ratio_mmrl_over_trl"] = {
        "samples_per_s": m["samples_per_s"] / t["samples_per_s"],
        "samples_per_s_pairwise_median": median(pairwise),
        "samples_per_s_pairwise": pairwise,
        "samples_per_s_best_step": t["min_step_s"] / m["min_step_s"],
        "step_time": m["median_step_s"] / t["median_step_s"],
        "peak_rss": m["peak_rss_gb"] / t["peak_rss_gb"],
    }
    return out


def print_table(args: argparse.Namespace, summary: dict[str, Any], runs: dict[str, list]) -> None:
    """Plain-text tables: throughput, memory, learning, and the phase split."""
    m, t, r = summary["mmrl"], summary["trl"], summary["ratio_mmrl_over_trl"]
    k = m["reward_steps_averaged"]
    print(
        f"\nmmrl vs TRL GRPO: {args.batch} prompts x n={args.n}, {args.max_new_tokens} new tokens, "
        f"{args.image_size}px, {args.steps} steps, {args.repeats} alternating repeats (medians)"
    )
    rows = [
        ("measure", "mmrl", "TRL", "mmrl/TRL"),
        ("samples/s", f"{m['samples_per_s']:.1f}", f"{t['samples_per_s']:.1f}", f"{r['samples_per_s']:.2f}x"),
        ("step time (s)", f"{m['median_step_s']:.3f}", f"{t['median_step_s']:.3f}", f"{r['step_time']:.2f}x"),
        (
            "fastest step (s)",
            f"{m['min_step_s']:.3f}",
            f"{t['min_step_s']:.3f}",
            f"{r['samples_per_s_best_step']:.2f}x",
        ),
        ("samples/s, per-repeat ratio", "", "", f"{r['samples_per_s_pairwise_median']:.2f}x"),
        ("peak RSS (GiB)", f"{m['peak_rss_gb']:.2f}", f"{t['peak_rss_gb']:.2f}", f"{r['peak_rss']:.2f}x"),
        *(
            [
                (
                    "peak GPU memory (GiB)",
                    f"{m['peak_gpu_gb']:.2f}",
                    f"{t['peak_gpu_gb']:.2f}",
                    f"{m['peak_gpu_gb'] / t['peak_gpu_gb']:.2f}x",
                )
            ]
            if m["peak_gpu_gb"] and t["peak_gpu_gb"]
            else []
        ),
        ("train wall (s)", f"{m['train_wall_s']:.1f}", f"{t['train_wall_s']:.1f}", ""),
        ("process wall (s)", f"{m['process_wall_s']:.1f}", f"{t['process_wall_s']:.1f}", ""),
        (f"reward, first {k} steps", f"{m['reward_first']:.3f}", f"{t['reward_first']:.3f}", ""),
        (f"reward, last {k} steps", f"{m['reward_last']:.3f}", f"{t['reward_last']:.3f}", ""),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print(
            "  "
            + "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    for system in runs:
        split = ", ".join(f"{p} {v:.3f}" for p, v in summary[system]["phases_s"].items())
        print(f"  {system} phases (s, median): {split}")
        loads = ", ".join(f"{a:.1f}->{b:.1f}" for a, b in (run["load_avg"] for run in runs[system]))
        print(f"  {system} 1-min load average per run: {loads}")
    ratios = ", ".join(f"{x:.2f}x" for x in r["samples_per_s_pairwise"])
    print(f"  samples/s mmrl/TRL per repeat: {ratios}")
    for system in runs:
        spread = "; ".join(
            "/".join(f"{run['lengths'][q]:g}" for q in ("min", "median", "max")) for run in runs[system]
        )
        print(f"  {system} response length min/median/max per run: {spread}")
    for system in [s for s in runs if s in VARIANTS]:
        v = summary[system]
        print(
            f"  mmrl vs {system}: update {m['phases_s']['update']:.2f} s vs {v['phases_s']['update']:.2f} s "
            f"({system}'s update time over mmrl's, per-repeat median {v['update_time_over_mmrl']:.2f}x), peak RSS "
            f"{m['peak_rss_gb']:.2f} vs {v['peak_rss_gb']:.2f} GiB, step {m['median_step_s']:.2f} vs "
            f"{v['median_step_s']:.2f} s"
        )
    trl_runs = runs["trl"]
    if trl_runs and not all(run.get("prompt_matches_mmrl") for run in trl_runs):
        print("  WARNING: TRL's prompt tokens differ from mmrl's")
    gain = {s: summary[s]["reward_last"] - summary[s]["reward_first"] for s in SYSTEMS}
    # One step's reward mean over prompts x n samples near 1/6 has a standard error of about
    # sqrt(p(1-p)/samples); averaged over k steps the difference of two such means is this noisy:
    noise = 2 * (2 * (1 / 6) * (5 / 6) / (args.batch * args.n * k)) ** 0.5
    text = f"reward change first->last {k} steps: mmrl {gain['mmrl']:+.3f}, TRL {gain['trl']:+.3f}"
    if max(abs(g) for g in gain.values()) < noise:
        print(f"  {text}; both within noise (+-{noise:.3f}): too few steps to compare learning")
    elif abs(gain["mmrl"] - gain["trl"]) > noise:
        # Only the sampling noise of the step means: runs with different seeds vary far more (one
        # seed may stay at chance for 100 steps while another reaches 0.7), so compare several seeds.
        print(
            f"  NOTE: {text}; differ by more than the sampling noise (+-{noise:.3f}); "
            "one seed cannot tell a systematic gap from seed luck"
        )
    else:
        print(f"  {text}; comparable (noise +-{noise:.3f})")


def windows(values: list[float], size: int) -> list[float]:
    """Means of consecutive `size`-step windows (the last one may be shorter)."""
    return [sum(values[i : i + size]) / len(values[i : i + size]) for i in range(0, len(values), size)]


def print_trajectories(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> None:
    """Each run's mean reward, entropy and response length per window of steps: how it learned."""
    size = max(1, min(args.window, args.steps))
    bounds = [f"{i + 1}-{min(i + size, args.steps)}" for i in range(0, args.steps, size)]
    print(f"\nper-run means over steps {' / '.join(bounds)} (seed {args.seed}):")
    for system in runs:
        for i, run in enumerate(runs[system]):
            for key in ("reward", "entropy", "response_length"):
                values = " / ".join(f"{v:.3f}" for v in windows(run[key], size))
                print(f"  {system} run {i + 1} {key}: {values}")


def parent(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    prepare(args, root)
    config = {
        k: getattr(args, k)
        for k in (
            "batch",
            "n",
            "max_new_tokens",
            "image_size",
            "steps",
            "repeats",
            "lr",
            "dtype",
            "warmup_steps",
            "seed",
            "threads",
            "window",
            "check_update",
            "shape",
            "systems",
            "mmrl_override",
            "eos_scale",
            "gradient_checkpointing",
        )
    }
    if args.check_update:
        check = launch(args, "replay", root, 0)
        print_check(args, check)
        return {"config": config, "check_update": check, "machine": machine()}
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
    for i in range(args.repeats):
        for system in args.systems:
            result = launch(args, system, root, i)
            runs[system].append(result)
            print(
                f"run {i + 1}/{args.repeats} {system}: median step {median(result['step_s'][1:]):.3f} s, "
                f"peak RSS {result['peak_rss_gb']:.2f} GiB, GPU {result['peak_gpu_gb'] or 0:.2f} GiB, "
                f"load {result['load_avg'][0]:.1f}, "
                f"phases {', '.join(f'{k} {v:.2f}' for k, v in result['phases_s'].items())}, response lengths "
                f"{', '.join(f'{k} {v:g}' for k, v in result['lengths'].items())}",
                flush=True,
            )
    summary = summarise(args, runs)
    print_table(args, summary, runs)
    print_trajectories(args, runs)
    return {
        "config": config,
        "summary": summary,
        "runs": runs,
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:  # the parent's format warm-up too
        import torch

        torch.set_num_threads(args.threads)
    if args.role != "parent":
        return child(args)
    result = run_in_workspace(args.workdir, "mmrl-vs-trl-", lambda folder: parent(args, folder))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
