"""The geometry recipe as written, on CPU: `mmrl train configs/qwen25vl_geo.yaml` with the tiny model and
synthetic geometry runs 3 steps, with only the overrides a CPU-sized run needs (paths, batch sizes,
lengths, two CPU workers for eight GPUs, vLLM eager). Everything else (vLLM engine, pixel budget, format prompt, rewards,
KL, clipping) runs as a GPU node would run it."""

from __future__ import annotations

import pytest

from mmrl.cli import main
from mmrl.data.synthetic_geometry import generate_geometry
from mmrl.rollout.vllm import vllm_available
from mmrl.run.logger import read_metrics

CPU_OVERRIDES = [
    "trainer.device=cpu",
    "model.dtype=float32",  # under the suite's AVX2 pin (conftest.py) bf16 is emulated, slower than fp32
    "data.train_batch_size=4",
    "data.val_batch_size=8",
    "data.max_val_samples=8",
    "actor.mini_batch_size=2",
    "rollout.max_new_tokens=32",
    "trainer.n_gpus_per_node=2",  # two CPU workers instead of eight GPUs: FSDP2 on gloo, a vLLM engine each
    "rollout.vllm.max_model_len=2560",
    "rollout.vllm.enforce_eager=true",  # no C++ compilation (~20 s an engine on a fresh machine)
    "trainer.total_steps=3",
    "trainer.val_every=3",
    "trainer.save_every=3",
    "trainer.progress=false",
]


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not vllm_available(), reason="the recipe's engine is vLLM (install requirements-test.lock)"
)
def test_geometry_recipe_runs_three_steps_on_cpu(local_ray, tmp_path, tiny_model_dir) -> None:
    data = tmp_path / "geo"
    generate_geometry(data, n_train=16, n_val=8, seed=0)
    run = tmp_path / "run"
    args = [
        "train",
        "configs/qwen25vl_geo.yaml",
        f"model.path={tiny_model_dir}",
        f"data.train_files={data / 'train.jsonl'}",
        f"data.val_files={data / 'val.jsonl'}",
        f"trainer.output_dir={run}",
        *CPU_OVERRIDES,
    ]
    assert main(args) == 0
    records = read_metrics(run / "metrics.jsonl")
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all("reward/geometry" in r and "reward/format_think_boxed" in r for r in steps)
    assert "val/accuracy" in steps[-1] and (run / "gallery" / "step_00000003.html").exists()
    assert (run / "checkpoints" / "step_00000003").is_dir()
