"""`bench/gpu_smoke.py --dry`: the first GPU session's script, run on the CPU with tiny models through the
same code (one FSDP2 worker with its vLLM engine on Ray, the LoRA recipe at the real vocabulary, the
planner against the run), so it cannot rot before a GPU is lent."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_gpu_smoke_script_runs_dry(local_ray, tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import gpu_smoke

    out = tmp_path / "rows.json"
    assert gpu_smoke.main(["--dry", "--json", str(out), "--work", str(tmp_path / "work")]) == 0
    rows = {r["check"]: r for r in json.loads(out.read_text())}
    assert list(rows) == [name for name, _ in gpu_smoke.CHECKS]
    assert all(r["status"] in ("ok", "skip") for r in rows.values()), rows
    assert rows["fsdp2_vllm"]["detail"].startswith("2 steps") and rows["lora_3b"]["detail"].startswith(
        "2 steps"
    )
    assert "planned" in rows["planner"]["detail"]
    sys.modules.pop("gpu_smoke", None)
