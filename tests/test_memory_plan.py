"""The GPU memory planner (`mmrl plan`): its formulas by hand, its counts against published models, its
prediction against the measured peak of mmrl's own update, and every GPU recipe fitting its GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmrl.cli import main
from mmrl.config import load_config
from mmrl.errors import ConfigError
from mmrl.models import load_policy, load_processor
from mmrl.rollout import HFEngine, SamplingParams
from mmrl.workers import memory
from mmrl.workers.memory import GIB, ModelShape, plan_memory, shape_for, what_fits

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
# Each GPU recipe and the GPUs it is written for (the count is the recipe's own trainer.n_gpus_per_node).
RECIPE_GPUS = {
    "gemma3_geo_lora": "h100-80g",
    "glm41v_geo_lora": "h100-80g",
    "internvl35_geo_lora": "h100-80g",
    "llava_onevision_geo_lora": "h100-80g",
    "mistral3_geo_lora": "h200-141g",
    "qwen25vl_geo": "h100-80g",
    "qwen25vl_geo_3b_lora": "h100-80g",
    "qwen25vl_geo_dapo": "h100-80g",
    "qwen25vl_grounding": "h100-80g",
    "qwen35_geo": "h100-80g",
    "qwen3_math": "h100-80g",
    "qwen3vl_4b_geo_lora": "h100-80g",
    "qwen3vl_geo": "h100-80g",
    "qwen3vl_zoom": "h100-80g",
}
SMALL = ModelShape(
    params=1_000_000,
    vision_params=200_000,
    lora_params=0,
    root_params=100_000,
    unit_params=50_000,
    layers=2,
    hidden=64,
    intermediate=128,
    heads=4,
    kv_heads=2,
    head_dim=16,
    vocab=1000,
)


def _cfg(*overrides: str):
    return load_config(QUICKSTART, ["model.path=unused", "rollout.engine=hf", *overrides])


def test_the_update_phase_by_hand() -> None:
    """bf16 compute, one GPU, full fine-tuning with a KL reference, micro-batches of 2 rows of 10 + 6 tokens."""
    cfg = _cfg(
        "model.dtype=bfloat16",
        "actor.use_kl_loss=true",
        "actor.kl_loss_coef=0.01",
        "actor.micro_batch_size=2",
        "data.max_prompt_length=10",
        "rollout.max_new_tokens=6",
        "model.freeze_vision_tower=true",
    )
    plan = plan_memory(cfg, SMALL, "h100-80g")
    update = plan.phases[1].parts
    trained, frozen = 800_000, 200_000  # the frozen tower is held in bf16
    assert update["weights"] == 4 * trained + 2 * frozen
    assert update["optimizer (AdamW)"] == 8 * trained
    assert update["KL reference"] == 2 * 1_000_000
    assert update["autocast weight copies"] == 2 * trained
    # Per token of a layer: bf16 (1.5*64 + 3*128 + 1.5*(4+4)*16) = 672 elements, fp32 7*64 = 448 elements.
    per_layer = 2 * 672 + 4 * 448
    gradients_late = 4 * trained + 32 * per_layer
    early = 32 * 2 * per_layer + 12 * 1000 * (2 + 4 * 6)  # 2 x (10 + 6) tokens, 2 x 6 scored
    assert gradients_late > early  # a model this small peaks at the end of backward, with every gradient
    assert update["gradients + one layer"] == gradients_late
    assert "activations" not in update


def test_fsdp_divides_the_state_and_gathers_one_unit() -> None:
    cfg = _cfg("model.dtype=bfloat16", "trainer.n_gpus_per_node=4")
    one = plan_memory(_cfg("model.dtype=bfloat16"), SMALL, "h100-80g").phases[1].parts
    four = plan_memory(cfg, SMALL, "h100-80g").phases[1].parts
    assert four["weights"] == one["weights"] / 4
    assert four["optimizer (AdamW)"] == one["optimizer (AdamW)"] / 4
    assert four["gathered units"] == 2 * (100_000 + 2 * 50_000)
    assert "autocast weight copies" not in four  # FSDP's mixed precision gathers bf16 instead


def test_published_shapes_count_the_released_parameters() -> None:
    """Built on the meta device from the published sizes: the released checkpoints' parameter counts."""
    seven = shape_for(load_config(REPO / "configs" / "qwen25vl_geo.yaml"))
    three = shape_for(load_config(REPO / "configs" / "qwen25vl_geo_3b_lora.yaml"))
    assert seven.params == 8_292_166_656
    assert three.params == 3_754_622_976
    assert three.lora_params > 0 and three.lora_params < three.params / 20
    assert (seven.layers, seven.hidden, seven.kv_heads, seven.vocab) == (28, 3584, 4, 152064)


def test_a_local_models_config_wins(tiny_model_dir) -> None:
    shape = shape_for(load_config(QUICKSTART, [f"model.path={tiny_model_dir}"]))
    assert shape.params == sum(p.numel() for p in load_policy(tiny_model_dir).parameters())


@pytest.mark.parametrize("recipe", sorted(RECIPE_GPUS))
def test_every_gpu_recipe_fits_its_gpus(recipe) -> None:
    cfg = load_config(REPO / "configs" / f"{recipe}.yaml")
    plan = plan_memory(cfg, shape_for(cfg), RECIPE_GPUS[recipe])
    assert plan.fits, plan.table()


def test_a_run_that_does_not_fit_is_told_which_keys_would() -> None:
    cfg = load_config(REPO / "configs" / "qwen25vl_geo.yaml", ["model.gradient_checkpointing=false"])
    shape = shape_for(cfg)
    assert not plan_memory(cfg, shape, "h100-80g").fits
    assert what_fits(cfg, shape, "h100-80g") == ["model.gradient_checkpointing=true"]


def test_train_refuses_at_start_on_a_gpu_too_small(monkeypatch) -> None:
    """No GPU here: CUDA's availability and the device's size are stood in for (a 24 GiB card)."""

    class Card:
        total_memory = 24 * GIB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Card())
    cfg = load_config(REPO / "configs" / "qwen25vl_geo_3b_lora.yaml", ["trainer.device=cuda"])
    with pytest.raises(ConfigError, match=r"needs [\d.]+ GiB per GPU .* holds 24.0 GiB"):
        memory.refuse_what_cannot_fit(cfg)


def test_mmrl_plan_prints_the_table_and_says_whether_it_fits(capsys) -> None:
    assert main(["plan", str(REPO / "configs" / "qwen25vl_geo.yaml")]) == 0
    out = capsys.readouterr().out
    assert "fits on 8 x h100-80g" in out and "activations" in out and "vLLM's KV cache holds" in out
    assert (
        main(["plan", str(REPO / "configs" / "qwen25vl_geo.yaml"), "model.gradient_checkpointing=false"]) == 1
    )
    assert "to fit: model.gradient_checkpointing=true" in capsys.readouterr().out
    assert main(["plan", QUICKSTART, "--gpu", "tpu"]) == 2
    assert "the planner knows" in capsys.readouterr().err
    assert main(["plan", QUICKSTART, "model.path=someone/unknown-model"]) == 2
    assert "huggingface-cli download someone/unknown-model config.json" in " ".join(
        capsys.readouterr().err.split()
    )


def test_the_hf_engine_decodes_at_most_hf_max_seqs_at_once(monkeypatch, tiny_model_dir) -> None:
    """Whole groups per pass; greedy answers are those of one pass."""
    from helpers import mixed_prompts

    from mmrl.rollout import hf

    model, processor = load_policy(tiny_model_dir), load_processor(tiny_model_dir)
    prompts = mixed_prompts(processor)  # three images and a text-only prompt
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=6)
    whole = HFEngine(model, processor).generate(prompts, params)
    passes: list[int] = []
    decode = hf.sample_groups
    monkeypatch.setattr(hf, "sample_groups", lambda m, ps, *a: passes.append(len(ps)) or decode(m, ps, *a))
    parts = HFEngine(model, processor, max_seqs=5).generate(prompts, params)
    assert passes == [2, 2]  # 5 sequences allow 2 groups of 2
    assert torch.equal(parts["prompt_index"], whole["prompt_index"])
    width = min(parts["response_ids"].shape[1], whole["response_ids"].shape[1])
    assert torch.equal(parts["response_ids"][:, :width], whole["response_ids"][:, :width])
    assert parts.lists["response_text"] == whole.lists["response_text"]


def test_the_prediction_is_within_15_percent_of_the_measured_peak(tmp_path) -> None:
    """`bench/memory_plan.py --quick`: mmrl's update on tiny and held-out mid-size shapes, every live
    tensor's bytes tracked, against the planner's update phase for the same tokens."""
    out = tmp_path / "rows.json"
    subprocess.run(
        [sys.executable, str(REPO / "bench" / "memory_plan.py"), "--quick", "--json", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    rows = json.loads(out.read_text())
    assert len(rows) == 3
    for row in rows:
        ratio = row["predicted_mib"] / row["measured_mib"]
        assert 0.85 <= ratio <= 1.15, row
