"""The memory planner against measured memory: mmrl's own update, its peak tensor bytes tracked exactly.

For each shape (a random-init Qwen2.5-VL of the given language-model sizes, the tiny tokenizer, the
vision tower frozen) one micro-batch of full-length responses is generated and one actor update runs
under PyTorch's `MemTracker`, which counts every live tensor (weights, gradients, AdamW moments,
activations, backward temporaries). The planner's update phase for the same tokens (`plan_memory`,
without the GPU's fixed overhead) is printed beside it. `--quick` runs the two shapes the suite checks.

    .venv/bin/python bench/memory_plan.py            # tiny and two ~30 M shapes, fp32 and bf16
    .venv/bin/python bench/memory_plan.py --quick    # what tests/test_memory_plan.py runs
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch
from common import QUICKSTART, data_overrides, make_workspace
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


class PeakTensorBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once while active: the `held` tensors' storages, plus
    every storage an operation creates, until it is freed. (PyTorch's `MemTracker` cannot follow a module
    called twice in one step, as the shared-prompt forward calls the language model.)"""

    def __init__(self, held: list[torch.Tensor]) -> None:
        super().__init__()
        self.seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for tensor in held:
            self._count(tensor.untyped_storage())
        self.now = self.peak = self.held = sum(self.seen.values())

    def _count(self, storage: Any) -> None:
        if storage in self.seen or storage.device.type == "meta":
            return
        size = storage.nbytes()
        self.seen[storage] = size
        if hasattr(self, "now"):
            self.now += size
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._freed, size)

    def _freed(self, size: int) -> None:
        self.now -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._count(value.untyped_storage())
        return out


SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    # Wide output layer and MLP, few layers: logits and activations both matter.
    "mid": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 32000,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
    },
}
# Held out of the fit of the planner's constants: another MLP ratio, depth and vocabulary.
SHAPES["wide"] = {
    **SHAPES["mid"],
    "hidden_size": 384,
    "intermediate_size": 4096,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "vocab_size": 8192,
}


def measure(
    shape: str, dtype: str, rows: int, response: int, checkpointing: bool, root: Path
) -> dict[str, Any]:
    """Measured peak of one actor update and the planner's prediction for the same micro-batch, in MiB."""
    from mmrl.config import load_config
    from mmrl.data.sample import PromptSample
    from mmrl.models import build_tiny, load_policy, load_processor
    from mmrl.models import load_config as load_config_json
    from mmrl.processors.chat import build_messages, encode_prompt
    from mmrl.rollout import HFEngine, SamplingParams
    from mmrl.training.actor import build_actor, update_plan
    from mmrl.training.micro_batches import row_lengths
    from mmrl.training.setup import add_adapters, load_trainable
    from mmrl.workers.memory import GIB, plan_memory, shape_of

    _, data = make_workspace(root, n_train=8, image_size=56)
    model_dir = root / f"model-{shape}"
    if not (model_dir / "config.json").exists():
        build_tiny(model_dir, seed=0, text=SHAPES[shape] or None)
    overrides = [
        *data_overrides(model_dir, data, root / "run", 56),
        f"model.dtype={dtype}",
        "model.freeze_vision_tower=true",
        f"model.gradient_checkpointing={str(checkpointing).lower()}",
        f"rollout.n={rows}",
        f"rollout.max_new_tokens={response}",
        "data.train_batch_size=1",
        "actor.mini_batch_size=1",
        f"actor.micro_batch_size={rows}",
        "actor.padding_free=false",
        "actor.use_kl_loss=false",
        "rollout.engine=hf",
    ]
    cfg = load_config(QUICKSTART, overrides)
    processor = load_processor(model_dir)
    torch.manual_seed(0)
    sampler = load_policy(model_dir)
    # A text prompt: the (frozen) tower does not run, so the language model's sizes alone set the peak.
    ids = encode_prompt(processor.tokenizer, build_messages("How many circles are there?", 0), [])
    prompts = [PromptSample(0, ids, "q", "3")]
    # No stop tokens: every response runs to max_new_tokens, the planner's worst case.
    batch = HFEngine(sampler, processor).generate(
        prompts, SamplingParams(n=rows, max_new_tokens=response, stop_token_ids=())
    )
    del sampler
    batch.set(advantages=torch.randn(len(batch), 1).expand(batch["response_mask"].shape).clone())
    compute = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    model = load_trainable(model_dir, cfg)
    add_adapters(model, cfg, model_dir, compute)
    actor = build_actor(cfg, model, processor.tokenizer.pad_token_id, compute)
    plan = update_plan(cfg).minibatches(batch)
    actor.update(
        batch, plan
    )  # once outside the tracker: the optimizer's moments now exist, as at any later step
    held = [*model.parameters(), *(t for s in actor.optimizer.state.values() for t in s.values())]
    with PeakTensorBytes(held) as tracker:
        actor.update(batch, plan)
    measured = {
        "Total": tracker.peak,
        "state": tracker.held,
        "made during the update": tracker.peak - tracker.held,
    }
    lengths = row_lengths(batch)
    tokens = len(lengths) * (max(p for p, _ in lengths) + max(r for _, r in lengths))
    scored = int(batch["response_mask"].sum())
    cfg.data.max_prompt_length = max(p for p, _ in lengths)
    cfg.rollout.max_new_tokens = max(r for _, r in lengths)
    model_shape = shape_of(load_config_json(model_dir), cfg)
    update = plan_memory(cfg, model_shape, "cpu", 1e15).phases[1].parts
    update.pop("CUDA, NCCL, allocator")
    mib = 2**20
    return {
        "shape": shape,
        "dtype": dtype,
        "checkpointing": checkpointing,
        "params_m": model_shape.params / 1e6,
        "tokens": tokens,
        "scored": scored,
        "measured_mib": measured["Total"] / mib,
        "measured_parts_mib": {k: round(v / mib, 1) for k, v in measured.items() if k != "Total"},
        "predicted_mib": sum(update.values()) / mib,
        "predicted_parts_mib": {k: round(v / mib, 1) for k, v in update.items()},
        "gib": GIB,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the suite's cases only")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    from mmrl.models.loading import cpu_runs_bf16

    bf16 = "bfloat16" if cpu_runs_bf16() else "float32"
    cases = [
        ("tiny", "float32", 4, 32, False),
        ("wide", bf16, 8, 64, False),
        ("wide", "float32", 4, 64, True),
    ]
    if not args.quick:
        cases += [
            ("wide", bf16, 8, 96, False),
            ("wide", "float32", 8, 96, True),
            ("mid", "float32", 4, 64, False),
            ("mid", bf16, 4, 64, False),
            ("mid", "float32", 4, 64, True),
            ("mid", bf16, 8, 128, False),
            ("wide", "float32", 8, 96, False),
        ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            rows.append(measure(*case, root=Path(tmp)))
    print(
        f"{'shape':<6}{'dtype':<10}{'ckpt':<6}{'params':>8}{'tokens':>8}{'measured':>10}{'planned':>10}{'ratio':>7}"
    )
    for r in rows:
        ratio = r["predicted_mib"] / r["measured_mib"]
        print(
            f"{r['shape']:<6}{r['dtype']:<10}{r['checkpointing']!s:<6}{r['params_m']:>7.1f}M{r['tokens']:>8}"
            f"{r['measured_mib']:>9.1f}M{r['predicted_mib']:>9.1f}M{ratio:>7.3f}"
        )
        print(f"      measured {r['measured_parts_mib']}\n      planned  {r['predicted_parts_mib']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
