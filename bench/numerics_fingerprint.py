"""Whether this machine computes the suite's numbers bit for bit as another does: a hash per library.

An RL run turns a last-bit difference into another trajectory, so a learning test tuned on one CPU (its
seed, where it stops) can run longer or learn less on another. The suite pins what it can (`tests/conftest.py`:
one thread, ATen and MKL on AVX2); this prints, under those pins, a hash of what each library the training
step leans on computes (MKL's GEMM, ATen's vectorised kernels, oneDNN's convolution (Qwen-VL patch
embeddings), numpy's BLAS, the tiny model's forward and gradients), so two machines' tables show which
library, if any, differs. `docs/benchmarks.md` ("The suite's numerics across CPUs") has the tables so far.

    python bench/numerics_fingerprint.py            # under the suite's pins
    python bench/numerics_fingerprint.py --native   # under the machine's own kernels
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import sys
import tempfile
from pathlib import Path

SUITE_PINS = {"OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def _hash(array) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()[:12]


def cpu() -> str:
    """The CPU's model name and which of `FLAGS` it has."""
    name, flags = platform.processor() or platform.machine(), set()
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return f"{name} ({', '.join(f for f in FLAGS if f in flags) or 'none of ' + ', '.join(FLAGS)})"


def fingerprint() -> dict[str, str]:
    """One hash per computation, each on fixed seeded inputs."""
    import numpy as np
    import torch
    from transformers.utils import logging

    from mmrl.models import build_tiny, load_policy

    logging.disable_progress_bar()

    torch.manual_seed(0)
    a, b = torch.randn(300, 257), torch.randn(257, 129)
    x = torch.randn(64, 3, 2, 14, 14)
    conv = torch.nn.Conv3d(3, 64, (2, 14, 14), stride=(2, 14, 14), bias=False)
    rows = {
        "MKL sgemm": _hash((a @ b).numpy()),
        "ATen softmax, exp, layer norm": _hash(
            torch.cat([a.softmax(-1), a.exp(), torch.nn.functional.layer_norm(a, (257,))]).numpy()
        ),
        "oneDNN conv3d (patch embedding)": _hash(conv(x).detach().numpy()),
        "numpy matmul (its BLAS)": _hash(np.random.default_rng(0).random((200, 300)) @ np.ones((300, 50))),
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = load_policy(build_tiny(Path(tmp) / "model", seed=0))
    ids = torch.randint(0, 200, (2, 48), generator=torch.Generator().manual_seed(0))
    pixels = torch.randn(64, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    logits = model(input_ids=ids).logits
    vision = model.model.visual(pixels, grid_thw=torch.tensor([[1, 8, 8]]))
    vision = getattr(vision, "pooler_output", vision)
    logits.float().logsumexp(-1).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    rows |= {
        "tiny Qwen2.5-VL: language model logits": _hash(logits.detach().numpy()),
        "tiny Qwen2.5-VL: vision tower": _hash(vision.detach().numpy()),
        "tiny Qwen2.5-VL: gradients": _hash(grads.numpy()),
    }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--native", action="store_true", help="the machine's own kernels, not the suite's pins"
    )
    args = parser.parse_args()
    pins = {"OMP_NUM_THREADS": "1"} if args.native else SUITE_PINS
    if any(os.environ.get(k) != v for k, v in pins.items()) or (
        args.native and {"ATEN_CPU_CAPABILITY", "MKL_CBWR"} & set(os.environ)
    ):  # the pins act only when torch loads: run again with them set (and the native run without them)
        env = {k: v for k, v in os.environ.items() if not args.native or k not in SUITE_PINS} | pins
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    import torch

    rows = fingerprint()
    print(f"CPU: {cpu()}")
    print(
        f"ATen kernels: {torch.backends.cpu.get_cpu_capability()}, MKL_CBWR={os.environ.get('MKL_CBWR', 'unset')}"
    )
    print("| computation | hash |\n|---|---|")
    for name, digest in rows.items():
        print(f"| {name} | `{digest}` |")
    print(f"| all of the above | `{hashlib.sha256(''.join(rows.values()).encode()).hexdigest()[:12]}` |")


if __name__ == "__main__":
    main()
