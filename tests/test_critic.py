"""The GAE critic: a value head on the tiny Qwen2.5-VL that starts at zero and fits returns, and a
PPO run that warms the critic up first, trains both, and resumes the critic exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from mmrl.cli import main
from mmrl.config import CriticConfig
from mmrl.data.sample import PromptSample
from mmrl.data.synthetic import generate
from mmrl.models import load_policy, load_processor
from mmrl.processors import (
    PixelBudget,
    build_messages,
    encode_prompt,
    fit_image,
    num_image_tokens,
    pixel_inputs,
)
from mmrl.rollout import HFEngine, SamplingParams
from mmrl.run import checkpoint as ckpt
from mmrl.run.logger import read_metrics
from mmrl.training.critic import Critic, ValueModel
from mmrl.training.optim import plan_minibatches

BUDGET = PixelBudget(min_pixels=56 * 56, max_pixels=56 * 56)
CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "quickstart_ppo.yaml")


def _rollouts(model_dir: Path):
    """Two red and two blue images, two sampled responses each."""
    processor = load_processor(model_dir)
    prompts = []
    for i, colour in enumerate([(220, 20, 20), (20, 20, 220)] * 2):
        image = fit_image(Image.new("RGB", (56, 56), colour), BUDGET)
        ids = encode_prompt(
            processor.tokenizer, build_messages("<image>Colour?", 1), [num_image_tokens(56, 56, BUDGET)]
        )
        inputs = pixel_inputs([image], processor.image_processor)
        prompts.append(
            PromptSample(i, ids, "q", "", [image], [], inputs["pixel_values"], inputs["image_grid_thw"])
        )
    torch.manual_seed(0)
    engine = HFEngine(load_policy(model_dir), processor)
    return engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=6))


def test_critic_starts_at_zero_and_learns_image_dependent_returns(tiny_model_dir) -> None:
    batch = _rollouts(tiny_model_dir)
    critic = Critic(
        ValueModel.from_policy_weights(tiny_model_dir, "cpu"),
        CriticConfig(lr=3e-3, cliprange_value=10.0),
        pad_id=0,
        response_len=6,
        total_updates=100,
        micro_batch_size=4,
    )
    mask = batch["response_mask"].float()
    assert torch.equal(critic.values(batch), torch.zeros_like(mask))  # the zero-initialised head
    # Red images are worth +1, blue ones −1: the critic can only fit this by reading the pixels.
    red = (batch["prompt_index"] % 2 == 0).float()
    batch.set(returns=(2 * red - 1)[:, None] * mask)
    losses = []
    for _ in range(40):
        batch.set(values=critic.values(batch))
        losses.append(
            critic.update(batch, plan_minibatches(batch, len(batch), 1, 6)).metrics["critic/vf_loss"]
        )
    assert losses[0] == pytest.approx(0.5, abs=1e-6)  # ½·mean((0 − ±1)²)
    assert losses[-1] < 0.1 * losses[0], losses
    values = critic.values(batch)
    per_row = (values * mask).sum(1) / mask.sum(1)
    assert (per_row[red.bool()] > 0.5).all() and (per_row[~red.bool()] < -0.5).all(), per_row


SCRAMBLE = "def scramble(sample):\n    return (sum(map(ord, sample.response)) * 7919 % 101) / 100\n"


def _ppo(model: Path, data: Path, out: Path, steps: int, *extra: str) -> int:
    """A short PPO run on a reward that differs between responses, so the critic has targets."""
    reward = data / "scramble.py"
    reward.write_text(SCRAMBLE)
    return main(
        [
            "train",
            CONFIG,
            f"model.path={model}",
            f"data.train_files={data / 'train.jsonl'}",
            "data.val_files=[]",
            f"trainer.output_dir={out}",
            f"trainer.total_steps={steps}",
            "trainer.save_every=2",
            "trainer.val_every=0",
            "trainer.progress=false",
            "trainer.loggers=[jsonl]",
            "warmup.steps=0",
            "data.train_batch_size=4",
            "actor.mini_batch_size=2",
            "actor.lr_schedule=constant",  # the stopped run has fewer total_steps; keep schedules equal
            "critic.lr_schedule=constant",
            "critic.pretrain_steps=1",
            "rollout.n=2",
            f"reward.functions=[{{name: '{reward}:scramble'}}]",
            *extra,
        ]
    )


@pytest.mark.slow
def test_ppo_run_warms_up_the_critic_then_trains_both_and_resumes_exactly(tmp_path, tiny_model_dir) -> None:
    data = tmp_path / "data"
    generate(data, task="color", n_train=32, n_val=0, seed=0, image_size=56)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert _ppo(tiny_model_dir, data, straight, 4) == 0
    assert _ppo(tiny_model_dir, data, stopped, 2) == 0
    assert _ppo(tiny_model_dir, data, stopped, 4, "--resume") == 0

    records = read_metrics(straight / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert "actor/pg_loss" not in records[0]  # step 1 trains only the critic
    assert all("actor/pg_loss" in r for r in records[1:])
    assert all(r["critic/vf_loss"] > 0 and "timing/values" in r for r in records)

    final = [
        ckpt.load_trainer_state(run / "checkpoints" / "step_00000004")["critic"]
        for run in (straight, stopped)
    ]
    weights = [state["model"] for state in final]
    assert weights[0].keys() == weights[1].keys() and "value_head.weight" in weights[0]
    assert all(torch.allclose(weights[0][k], weights[1][k], atol=1e-6) for k in weights[0])
    assert not torch.equal(weights[0]["value_head.weight"], torch.zeros_like(weights[0]["value_head.weight"]))
    assert final[0]["optimizer"]["state"].keys() == final[1]["optimizer"]["state"].keys()
