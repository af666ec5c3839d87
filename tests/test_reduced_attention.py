"""bf16 attention on every CPU (`mmrl.models.reduced_attention`): where PyTorch's CPU attention would raise
(AMX, ATen pinned below AVX-512) every call mmrl and transformers make attends in fp32, and a vLLM engine
that cannot is refused at start; everywhere else nothing changes.

No machine here has to be such a CPU for the tests to mean something: the real paths run under the suite's
pin and the machine's own kernels on whatever CPU the suite lands on (on an AMX Xeon, the first of them is
the failing combination itself), and the routing is checked on every CPU by declaring the combination."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bf16_paths import run
from family_cases import vllm_only
from helpers import BUDGET
from transformers import AttentionInterface

from mmrl.errors import ConfigError
from mmrl.models import load_policy, load_processor, reduced_attention
from mmrl.rollout import make_engine

TESTS = Path(__file__).resolve().parent
# bf16 against fp32 on the tiny model: 1.2e-3 to 7.3e-3 (2026-12-07, AMD EPYC, both pins)
TOLERANCE = 0.05


@pytest.mark.parametrize(
    ("capability", "amx", "amx_fp16", "failing"),
    [
        ("AVX2", True, False, {torch.bfloat16}),  # Sapphire Rapids under the suite's pin
        ("DEFAULT", True, True, {torch.bfloat16, torch.float16}),  # Granite Rapids, ATen at its lowest
        ("AVX512", True, True, set()),  # ATen's AVX-512 kernels have the packing
        ("AVX2", False, False, set()),  # no AMX (AMD EPYC): nothing is packed
    ],
)
def test_bf16_attention_fails_only_on_amx_below_avx512(
    monkeypatch, capability, amx, amx_fp16, failing
) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: amx_fp16)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    assert {d for d in dtypes if reduced_attention._fails_here(d)} == failing


def _assert_ran(results: dict, where: str) -> None:
    assert set(results) == {"hf_engine", "train_padded", "train_packed", "model_forward"}, where
    for path, r in results.items():
        assert r["finite"] and r["max_diff"] < TOLERANCE, f"{path} ({where}): {r}"
        assert min(r["queries"], r["keys"]) >= 64, f"{path} ({where}) never reached the packing size: {r}"


def test_every_bf16_attention_path_runs_under_the_suites_pin_and_the_machines_own(tiny_model_dir) -> None:
    """The engine's sampling, the padded and packed training forwards with their backward, and
    transformers' own forward, all in bf16: in this process (the suite's AVX2 pin on x86) and in a fresh
    interpreter on the kernels ATen picks for this CPU, neither raising and each within bf16's rounding
    of fp32. On an AMX CPU the first is the combination where PyTorch alone would raise."""
    pinned = run(tiny_model_dir)
    _assert_ran(pinned, f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', 'unset')}")
    if reduced_attention.FAILING_DTYPES:
        assert all(r["dtypes"] == ["float32"] for r in pinned.values()), pinned
    own = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    out = subprocess.run(
        [sys.executable, str(TESTS / "bf16_paths.py"), str(tiny_model_dir)],
        env=own | {"PYTHONPATH": str(TESTS)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    _assert_ran(json.loads(out.stdout.splitlines()[-1]), "the machine's own kernels")


@pytest.fixture
def amx_below_avx512(monkeypatch) -> None:
    """This process as if it ran on an AMX CPU with ATen pinned below AVX-512: what the module decides
    at import there (bf16 failing, transformers' `sdpa` replaced), undone after the test."""
    monkeypatch.setattr(reduced_attention, "FAILING_DTYPES", frozenset({torch.bfloat16}))
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", reduced_attention.sdpa_where_it_runs)


@pytest.mark.usefixtures("amx_below_avx512")
def test_where_bf16_attention_fails_every_call_attends_in_fp32(tiny_model_dir) -> None:
    results = run(tiny_model_dir)
    _assert_ran(results, "declared AMX below AVX-512")
    assert {p: r["dtypes"] for p, r in results.items()} == {p: ["float32"] for p in results}


@vllm_only
@pytest.mark.usefixtures("amx_below_avx512")
def test_a_vllm_engine_that_would_attend_in_bf16_there_is_refused_at_start(tiny_model_dir) -> None:
    with pytest.raises(ConfigError) as refused:
        make_engine(
            "vllm",
            load_policy(tiny_model_dir),
            load_processor(tiny_model_dir),
            torch.bfloat16,
            model_path=tiny_model_dir,
            pixels=(BUDGET.min_pixels, BUDGET.max_pixels),
        )
    message = str(refused.value)
    assert "\n" not in message and "AMX" in message and "ATEN_CPU_CAPABILITY" in message, message
    assert "model.dtype=float32" in message
