"""The DAPO, Dr.GRPO, PPO (GAE with a critic) and LoRA recipes, and the GRPO recipe with the vLLM engine,
learn the quickstart's visual task as the GRPO recipe with the HF engine does."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmrl.cli import main
from mmrl.logger import read_metrics
from mmrl.rollout.vllm import vllm_available
from mmrl.synthetic import generate


@pytest.fixture(scope="module")
def colour_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("colour")
    generate(data, task="color", n_train=2048, n_val=64, seed=0, image_size=112)
    return data


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize(
    "recipe", ["quickstart_dapo", "quickstart_drgrpo", "quickstart_ppo", "quickstart_lora", "quickstart+vllm"]
)
def test_recipe_learns_colour_from_pixels(recipe: str, colour_data: Path, tmp_path, tiny_model_dir) -> None:
    run = tmp_path / recipe
    config, _, engine = recipe.partition("+")
    if engine and not vllm_available():
        pytest.skip("vLLM is not installed (install requirements-test.lock)")
    engine_overrides = [f"rollout.engine={engine}", "rollout.vllm.max_model_len=512"] if engine else []
    code = main(
        [
            "train",
            f"configs/{config}.yaml",
            *engine_overrides,
            f"model.path={tiny_model_dir}",
            f"data.train_files={colour_data / 'train.jsonl'}",
            f"data.val_files={colour_data / 'val.jsonl'}",
            f"trainer.output_dir={run}",
            "trainer.val_every=100",  # the recipes' own 200 steps
            "trainer.save_every=0",
            "trainer.progress=false",
            "trainer.loggers=[jsonl]",
        ]
    )
    assert code == 0
    records = read_metrics(run / "metrics.jsonl")
    val = [(r["step"], r["val/accuracy"]) for r in records if "val/accuracy" in r]
    assert [step for step, _ in val] == [0, 100, 200]
    (_, first), (_, last) = val[0], val[-1]
    assert last - first >= 0.3, f"{recipe}: validation accuracy went {first:.3f} -> {last:.3f}"
    if recipe == "quickstart_dapo":
        assert any(r.get("dynamic_sampling/filtered_groups", 0) > 0 for r in records)
    if engine:  # the engine sampled what the trainer trained on: log-probs agree token for token
        assert (
            max(r["actor/rollout_logprob_diff"] for r in records if "actor/rollout_logprob_diff" in r) < 1e-3
        )
    if recipe == "quickstart_ppo":
        steps = [r for r in records if r["step"] > 0]
        # critic.pretrain_steps=5: the critic trains alone first, then both train.
        assert not any("actor/pg_loss" in r for r in steps[:5]) and all(
            "actor/pg_loss" in r for r in steps[5:]
        )
        assert steps[-1]["critic/values_mean"] > steps[5]["critic/values_mean"] + 0.2  # it tracked the reward
