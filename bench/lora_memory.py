"""Peak resident memory of LoRA against full fine-tuning, on the tiny model and a larger one.

Each (model, mode) pair trains a few GRPO steps with a KL loss in its own process, so the peak
is that run's alone. Full fine-tuning holds the weights, their gradients, two AdamW moments and
a frozen reference copy; LoRA holds the weights once (the reference is the same weights with the
adapter off) plus the small adapters and their optimizer state.

    .venv/bin/python bench/lora_memory.py --steps 3 --out bench/results/lora_memory.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from common import (
    QUICKSTART,
    data_overrides,
    load_average,
    make_workspace,
    provenance,
    run_in_workspace,
    write_result,
)

# A ~150M-parameter Qwen2.5-VL (12 layers, width 1024): big enough that weights, not the Python
# runtime, dominate memory; small enough to train on a laptop CPU.
LARGER = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 12, "num_attention_heads": 16}


def build_larger(tiny: Path, out: Path) -> Path:
    """The tiny model's tokenizer and vision tower with a wider, deeper language model, random init."""
    from transformers import AutoProcessor, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if (out / "config.json").exists():
        return out
    config = Qwen2_5_VLConfig.from_pretrained(tiny)
    for key, value in LARGER.items():
        setattr(config.text_config, key, value)
    config.text_config.layer_types = ["full_attention"] * LARGER["num_hidden_layers"]
    config.text_config.rope_parameters["mrope_section"] = [8, 12, 12]  # head_dim 64 / 2
    config.vision_config.out_hidden_size = LARGER["hidden_size"]
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny).generation_config
    model.save_pretrained(out)
    AutoProcessor.from_pretrained(tiny).save_pretrained(out)
    return out


def one_run(model: Path, data: Path, run_dir: Path, lora: bool, steps: int) -> dict[str, Any]:
    """Train in this process and report its peak RSS (called in a child process)."""
    from mmrl.config import load_config
    from mmrl.trainer import Trainer

    overrides = [
        *data_overrides(model, data, run_dir, 56),
        f"trainer.total_steps={steps}",
        "data.train_batch_size=4",
        "actor.mini_batch_size=4",
        "rollout.n=4",
        "warmup.steps=0",
        "actor.use_kl_loss=true",
        *(["model.lora.rank=16", "model.lora.alpha=32"] if lora else []),
    ]
    trainer = Trainer(load_config(QUICKSTART, overrides))
    params = sum(p.numel() for p in trainer.policy.model.parameters())
    trainer.fit()  # LoRA adapters go in here
    trainable = sum(p.numel() for p in trainer.policy.model.parameters() if p.requires_grad)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"params_m": params / 1e6, "trainable_m": trainable / 1e6, "peak_rss_gb": peak}


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    tiny, data = make_workspace(root, n_train=64, image_size=56)
    models = {"tiny": tiny, "larger": build_larger(tiny, root / "larger-model")}
    before = load_average()
    rows = []
    for name, path in models.items():
        for mode in ("full", "lora"):
            child = [sys.executable, __file__, "--child", str(path), str(data), str(root / f"{name}-{mode}")]
            child += ["--steps", str(args.steps)] + (["--lora"] if mode == "lora" else [])
            out = (
                subprocess.run(child, capture_output=True, text=True, check=True)
                .stdout.strip()
                .splitlines()[-1]
            )
            rows.append({"model": name, "mode": mode, **json.loads(out)})
    print(f"{'model':8} {'mode':5} {'params (M)':>11} {'trainable (M)':>14} {'peak RSS (GiB)':>15}")
    for r in rows:
        print(
            f"{r['model']:8} {r['mode']:5} {r['params_m']:11.1f} {r['trainable_m']:14.2f} {r['peak_rss_gb']:15.2f}"
        )
    return {"steps": args.steps, "rows": rows, **provenance(before)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--child", nargs=3, type=Path, metavar=("MODEL", "DATA", "RUN_DIR"), help=argparse.SUPPRESS
    )
    p.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(one_run(*args.child, lora=args.lora, steps=args.steps)))
        return
    write_result(args.out, run_in_workspace(args.workdir, "mmrl-lora-mem-", lambda root: run(args, root)))


if __name__ == "__main__":
    main()
