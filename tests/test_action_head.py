"""A continuous action head on the VLM backbone (`mmrl.models.action_head`), on a real tiny Qwen2.5-VL and
real MuJoCo frames: the Gaussian's log-density against its formula, sampled chunks' log-probs recomputed by
the trainer, cloning by L1, saving beside the backbone, exact resume, and what it refuses at start."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from helpers import tiny_vla_config
from safetensors.torch import load_file

from mmrl.config import SftConfig
from mmrl.envs.actions import ActionStats, ContinuousActions, InvalidAction
from mmrl.envs.vector import LocalEnvs
from mmrl.errors import ConfigError
from mmrl.models import (
    GaussianActionHead,
    HeadSpec,
    action_head_of,
    attach_action_head,
    load_policy,
    load_processor,
    save_model,
)
from mmrl.models.flow_expert import FlowActionExpert
from mmrl.processors import PixelBudget
from mmrl.rollout import SamplingParams, make_engine
from mmrl.rollout.action_head import ActionHeadEngine
from mmrl.run.logger import read_metrics
from mmrl.sources.startup import check_action_head
from mmrl.trainer import Trainer
from mmrl.training.forward import forward_logprobs
from mmrl.training.lora import export_plain
from mmrl.training.optim import make_optimizer
from mmrl.training.supervised import regression_step
from mmrl.vla.episodes import run_episodes
from mmrl.vla.observations import ObservationPrompts
from mmrl.vla.sft import median_l1

BUDGET = PixelBudget(min_pixels=56 * 56, max_pixels=56 * 56)
STATS = ActionStats(q01=np.array([-2.0, -1.0]), q99=np.array([2.0, 3.0]))


def spec_for(model, kind: str, chunk: int = 3, std: float = 0.3) -> HeadSpec:
    text = model.config.get_text_config()
    return HeadSpec(
        kind=kind,
        action_dim=2,
        chunk=chunk,
        query_start=text.vocab_size - chunk,
        hidden_size=text.hidden_size,
        std_init=std,
        stats=STATS.to_dict(),
        width=32,
        denoise_steps=3,
    )


@pytest.fixture(scope="module", params=["gaussian", "flow"])
def head_dir(request, tiny_model_dir, tmp_path_factory):
    """The tiny model with a fresh 3-step head of each kind, saved as `mmrl sft` saves such a policy."""
    model = load_policy(tiny_model_dir)
    torch.manual_seed(0)
    attach_action_head(model, spec_for(model, request.param))
    folder = tmp_path_factory.mktemp(request.param) / "policy"
    return save_model(model, load_processor(tiny_model_dir), folder)


@pytest.fixture(scope="module")
def frames():
    """Three reach observations (frame, instruction, state) from seeds 1-3."""
    envs = LocalEnvs("reach", 3, {"image_size": 56})
    obs = [r[0] for r in envs.reset([1, 2, 3])]
    envs.close()
    return obs


def test_the_head_density_is_the_gaussian_formula_summed_over_each_steps_dimensions() -> None:
    torch.manual_seed(0)
    spec = HeadSpec(action_dim=2, chunk=2, query_start=0, hidden_size=4, std_init=0.5)
    head = GaussianActionHead(spec)
    with torch.no_grad():
        head.log_std.copy_(torch.log(torch.tensor([0.5, 0.25])))
    hidden = torch.randn(1, 2, 4)
    actions = torch.tensor([[[0.1, -0.3], [0.7, 0.2]]])
    mean = torch.tanh(head.net(hidden))
    for temperature in (1.0, 0.5):
        std = torch.tensor([0.5, 0.25]) * temperature
        by_hand = (-0.5 * ((actions - mean) / std) ** 2 - torch.log(std) - 0.5 * math.log(2 * math.pi)).sum(
            -1
        )
        assert torch.allclose(head.log_prob(hidden, {"actions": actions}, temperature), by_hand, atol=1e-6)
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + torch.log(std)).sum()
        assert torch.allclose(head.entropy(hidden, temperature), entropy.expand(1, 2), atol=1e-6)


def test_the_flow_chains_density_is_each_euler_steps_gaussian_summed_over_the_chain() -> None:
    torch.manual_seed(0)
    spec = HeadSpec(
        kind="flow", action_dim=2, chunk=2, query_start=0, hidden_size=4, width=8, denoise_steps=3
    )
    head = FlowActionExpert(spec)
    with torch.no_grad():
        head.log_std.copy_(torch.log(torch.tensor([0.5, 0.25])))
    hidden = torch.randn(1, 2, 4)
    chain = torch.randn(1, 4, 2, 2)  # start noise and three steps
    context = head.context(hidden)
    for temperature in (1.0, 0.5):
        s = torch.tensor([0.5, 0.25]) * temperature * math.sqrt(1 / 3)  # each step's noise: σ √Δ
        by_hand = torch.zeros(1, 2)
        for i in range(3):
            v = head.velocity(chain[:, i], torch.full((1,), i / 3), context)
            z = (chain[:, i + 1] - chain[:, i] - v / 3) / s
            by_hand += (-0.5 * z**2 - torch.log(s) - 0.5 * math.log(2 * math.pi)).sum(-1)
        assert torch.allclose(head.log_prob(hidden, {"chain": chain}, temperature), by_hand, atol=1e-5)
        entropy = 3 * (0.5 + 0.5 * math.log(2 * math.pi) + torch.log(s)).sum()
        assert torch.allclose(head.entropy(hidden, temperature), entropy.expand(1, 2), atol=1e-5)


def test_continuous_actions_map_the_demo_range_onto_minus_one_to_one_and_back() -> None:
    actions = ContinuousActions(action_dim=2, chunk=2, stats=STATS)
    env = np.array([[0.0, 1.0], [2.0, -1.0]])
    assert np.allclose(actions.encode(env), [[0.0, 0.0], [1.0, -1.0]])
    assert np.allclose(actions.decode(actions.encode(env)), env)
    assert np.allclose(
        actions.decode(np.array([[3.0, -5.0], [0.0, 0.0]])), [[2.0, -1.0], [0.0, 1.0]]
    )  # a tail clipped
    assert isinstance(actions.decode(np.zeros((1, 2))), InvalidAction)
    assert actions.decode(np.array([[np.nan, 0.0], [0.0, 0.0]])).kind == "out_of_range"


def test_sampled_chunks_log_probs_recomputed_by_the_trainer_equal_those_recorded(head_dir, frames) -> None:
    model, processor = load_policy(head_dir), load_processor(head_dir)
    head = action_head_of(model)
    assert head is not None, "load_policy attaches the saved head"
    engine = make_engine("hf", model, processor, torch.float32)
    assert isinstance(engine, ActionHeadEngine)
    prompts = ObservationPrompts(processor, BUDGET)(frames)
    pad = processor.tokenizer.pad_token_id
    for temperature in (1.0, 0.6):
        torch.manual_seed(1)
        batch = engine.generate(prompts, SamplingParams(n=2, temperature=temperature))
        assert batch["actions"].shape == (6, 3, 2) and batch["rollout_logprobs"].shape == (6, 3)
        if head.spec.kind == "flow":  # the whole denoising chain, from the start noise to the chunk
            assert batch["chain"].shape == (6, 4, 3, 2) and torch.equal(
                batch["chain"][:, -1], batch["actions"]
            )
        assert not torch.equal(batch["actions"][0], batch["actions"][1]), "two draws from one prompt differ"
        with torch.no_grad():
            logp, entropy = forward_logprobs(model.eval(), batch, pad, temperature, with_entropy=True)
        assert (logp - batch["rollout_logprobs"]).abs().max() < 1e-5
        assert entropy is not None and entropy.shape == (6, 3)
        # a different draw is less likely under the trainer's recomputation: the density reads the draw
        shuffled = {key: batch[key].roll(1, dims=0) for key in head.draw_keys}
        batch.set(**shuffled)
        with torch.no_grad():
            assert not torch.allclose(forward_logprobs(model, batch, pad, temperature)[0], logp)
    torch.manual_seed(2)
    greedy = [engine.generate(prompts, SamplingParams(temperature=0.0))["actions"] for _ in range(2)]
    assert torch.equal(greedy[0], greedy[1]), "greedy acting draws no noise"


def test_episodes_execute_the_heads_chunks_open_loop(head_dir) -> None:
    model, processor = load_policy(head_dir), load_processor(head_dir)
    engine = make_engine("hf", model, processor, torch.float32)
    envs = LocalEnvs("reach", 2, {"image_size": 56, "max_steps": 7})
    torch.manual_seed(0)
    episodes = run_episodes(
        engine, envs, ObservationPrompts(processor, BUDGET), action_head_of(model).spec.actions, [5, 6],
        SamplingParams(temperature=1.0),
    )  # fmt: skip
    envs.close()
    assert episodes.lengths.tolist() == [3, 3]  # 7 steps in chunks of 3: three decisions each
    assert episodes.invalid == {} and episodes.batch["actions"].shape == (6, 3, 2)


def test_cloning_fits_the_demo_chunks_each_frame_shows(head_dir, frames) -> None:
    """L1 for the Gaussian head, flow matching for the expert: either way, after cloning, the greedy chunk
    of each frame is nearer its own demo chunk than one chunk for every frame could be."""
    model, processor = load_policy(head_dir), load_processor(head_dir)
    prompts = ObservationPrompts(processor, BUDGET)(frames)
    targets = torch.tensor([[[0.5, -0.5]] * 3, [[-0.2, 0.4]] * 3, [[0.0, 0.8]] * 3])
    # Flow matching regresses a velocity at random noise and times: it needs more steps than L1.
    steps = 400 if action_head_of(model).spec.kind == "flow" else 100
    sft = SftConfig(base_model=str(head_dir), lr=3e-3, steps=steps)
    optimizer, _ = make_optimizer([p for p in model.parameters() if p.requires_grad], sft, sft.steps)
    torch.manual_seed(0)
    for _ in range(sft.steps):
        regression_step(model, optimizer, prompts, [0, 1, 2] * 4, targets.repeat(4, 1, 1), 0)
    engine = make_engine("hf", model, processor, torch.float32)
    acted = engine.generate(prompts, SamplingParams(temperature=0.0))["actions"]
    error = float((acted - targets).abs().mean())
    prior = median_l1(list(targets.numpy()))  # the error of one chunk for every frame: 0.33
    assert error < 0.5 * prior, f"greedy L1 {error:.3f}, the median's {prior:.3f}"


def test_the_head_is_saved_beside_a_plain_backbone_and_loads_whole(head_dir, tiny_model_dir) -> None:
    assert json.loads((head_dir / "action_head.json").read_text())["chunk"] == 3
    backbone = load_file(head_dir / "model.safetensors")
    assert not any(k.startswith("action_head") for k in backbone), "transformers and vLLM load the folder"
    assert backbone.keys() == load_file(tiny_model_dir / "model.safetensors").keys()
    saved = load_file(head_dir / "action_head.safetensors")
    loaded = action_head_of(load_policy(head_dir)).state_dict()
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_a_head_policys_run_checkpoints_the_head_and_resumes_exactly(tmp_path, head_dir) -> None:
    # Shaped returns differ between a group's episodes, so every step updates.
    args = (
        "env.options={image_size: 56, max_steps: 4, shaping: 1.0}",
        "trainer.total_steps=2",
        "trainer.save_every=1",
    )
    cfg = tiny_vla_config(head_dir, tmp_path / "run", *args, "env.val_episodes=0")
    Trainer(cfg).fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["actor/updates"] == 1 for r in records if r["step"])
    assert max(r["actor/rollout_logprob_diff"] for r in records if r["step"]) < 1e-5
    last = tmp_path / "run" / "checkpoints" / "step_00000002" / "model"
    whole = load_file(last / "action_head.safetensors")
    start = load_file(head_dir / "action_head.safetensors")
    assert any(not torch.equal(whole[k], start[k]) for k in whole), "RL moved the head"
    shutil.rmtree(last.parent)
    Trainer(cfg, resume=True).fit()
    resumed = load_file(last / "action_head.safetensors")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    exported = export_plain(last, tmp_path / "export")  # `mmrl export`: the head goes with the backbone
    assert load_file(exported / "action_head.safetensors").keys() == whole.keys()
    assert action_head_of(load_policy(exported)).spec == action_head_of(load_policy(head_dir)).spec


def test_a_head_policy_trains_beside_a_critic_of_its_decisions(tmp_path, head_dir) -> None:
    # PPO with GAE (algorithm.adv_estimator=gae): the critic, the VLM with a value head starting at V = 0,
    # values every decision of the episodes and regresses on each decision's return (reach's shaped reward).
    cfg = tiny_vla_config(
        head_dir,
        tmp_path / "run",
        "env.options={image_size: 56, max_steps: 4, shaping: 1.0}",
        "env.val_episodes=0",
        "algorithm.adv_estimator=gae",
        "critic.lr=3e-3",
        "trainer.total_steps=3",
    )
    Trainer(cfg).fit()
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"]]
    assert records[0]["critic/values_mean"] == 0.0 and records[-1]["critic/values_mean"] != 0.0
    assert all(r["actor/updates"] == 1 for r in records)
    assert max(r["actor/rollout_logprob_diff"] for r in records) < 1e-5


@pytest.mark.parametrize(
    "override",
    ["rollout.engine=vllm", "model.lora.rank=8", "trainer.n_gpus_per_node=2"],
)
def test_a_head_policy_refuses_at_start_what_would_take_it_out_of_its_process(
    tmp_path, head_dir, override
) -> None:
    cfg = tiny_vla_config(head_dir, tmp_path / "run", override)
    with pytest.raises(ConfigError, match="continuous action head"):
        check_action_head(cfg)


@pytest.mark.parametrize("kind", ["gaussian", "flow"])
def test_cli_sft_writes_a_head_policy_that_eval_reads(tmp_path, tiny_model_dir, kind) -> None:
    from mmrl.cli import main

    common = [
        f"model.path={tmp_path / 'sft'}",
        f"sft.base_model={tiny_model_dir}",
        f"sft.policy={kind}",
        "sft.demos=3",
        "sft.steps=2",
        "sft.batch_size=8",
        "env.chunk=2",
        "env.options={image_size: 56, max_steps: 4}",
        "env.val_episodes=2",
    ]
    config = "configs/vla_mujoco_reach.yaml"
    assert main(["sft", config, *common]) == 0
    spec = json.loads((tmp_path / "sft" / "action_head.json").read_text())
    assert (spec["kind"], spec["chunk"], spec["action_dim"]) == (kind, 2, 2)
    assert not (tmp_path / "sft" / "action_tokenizer.json").exists()
    out = tmp_path / "eval.json"
    assert main(["eval", config, *common, "--checkpoint", str(tmp_path / "sft"), "--out", str(out)]) == 0
    metrics = json.loads(out.read_text())
    assert metrics["eval/episodes"] == 2 and metrics["eval/episode_length"] == 2  # 4 steps, chunks of 2


def test_the_flow_width_check_knows_the_experts_head_count() -> None:
    """`sft.flow_width` is refused unless the expert's heads divide it; the config keeps their count apart
    from the model code (the config layer does not import models), so the two must agree."""
    from mmrl.config.vla import FLOW_HEADS

    assert HeadSpec(action_dim=2, chunk=1, query_start=0, hidden_size=4).heads == FLOW_HEADS
    with pytest.raises(ValueError, match="4 attention heads split its width evenly"):
        SftConfig(base_model="m", flow_width=30)
