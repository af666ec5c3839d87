"""The VLA loop's parts on a real tiny Qwen2.5-VL and real MuJoCo envs: prompts from frames, lockstep
episodes, trajectory-level advantages (hand-computed), demo targets, GIFs, configs and the trainer."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import tiny_vla_config
from PIL import Image

from mmrl.algorithms import get_advantage_estimator
from mmrl.config import SftConfig, load_config
from mmrl.data.batch import Batch
from mmrl.envs import make_env
from mmrl.envs.actions import ActionStats, ActionTokenizer
from mmrl.envs.experts import Demo
from mmrl.envs.vector import LocalEnvs
from mmrl.errors import ConfigError
from mmrl.models import ACTION_TOKENS, load_policy, load_processor
from mmrl.processors import PixelBudget
from mmrl.rollout import SamplingParams
from mmrl.rollout.hf import HFEngine
from mmrl.sources.episodes import decision_advantages, episode_advantages, step_advantages, train_seeds
from mmrl.trainer import Trainer
from mmrl.training.forward import forward_logprobs
from mmrl.training.supervised import supervised_step
from mmrl.vla import sft as sft_module
from mmrl.vla.episodes import run_episodes
from mmrl.vla.media import episodes_gif
from mmrl.vla.observations import ObservationPrompts, frame_history
from mmrl.vla.sft import behaviour_clone, demo_steps, label_prior_loss, loss_curve

BUDGET = PixelBudget(min_pixels=56 * 56, max_pixels=56 * 56)


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(tiny_model_dir, torch.float32, "cpu").eval(), load_processor(tiny_model_dir)


def test_observation_prompts_carry_one_frame_each_with_matching_placeholders(policy) -> None:
    _, processor = policy
    prompts = ObservationPrompts(processor, BUDGET)
    frames = [np.full((64, 64, 3), c, dtype=np.uint8) for c in (0, 255)]
    samples = prompts([{"image": f, "instruction": "touch the red ball"} for f in frames], row_ids=[7, 9])
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for sample, row in zip(samples, [7, 9], strict=True):
        assert sample.row_id == row and sample.images[0].size == (56, 56)
        assert sample.image_grid_thw.tolist() == [[1, 4, 4]]  # 56 px / 14 px patches
        assert len(sample.pixel_values) == 16
        assert sample.prompt_ids.count(pad) == 4  # 16 patches merged 2x2
    assert not torch.equal(samples[0].pixel_values, samples[1].pixel_values)
    with pytest.raises(ValueError, match="one <image> marker"):
        ObservationPrompts(processor, BUDGET, "{instruction}")


def test_history_prompts_hold_the_last_frames_oldest_first_and_the_state_as_text(policy) -> None:
    _, processor = policy
    prompts = ObservationPrompts(processor, BUDGET, "<image>{instruction} state: {state}", history=3)
    episode = [np.full((56, 56, 3), c, dtype=np.uint8) for c in (10, 120, 250)]
    # Decision 1 of an episode: frame 0 stands in for the step before the episode began.
    history = frame_history(episode, 1, 3)
    assert [int(f[0, 0, 0]) for f in history] == [10, 10, 120]
    obs = {"image": episode[1], "instruction": "reach the red goal", "state": np.array([0.125, -1.0, 2])}
    (sample,) = prompts([obs], frames=[history])
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert sample.prompt_ids.count(pad) == 3 * 4 and sample.image_grid_thw.tolist() == [[1, 4, 4]] * 3
    assert sample.prompt_text == "<image><image><image>reach the red goal state: 0.12 -1.00 2.00"
    assert "0.12 -1.00 2.00" in processor.tokenizer.decode(sample.prompt_ids)
    # Each frame's patches, in order: the first two are the same frame, the third differs.
    first, second, third = sample.pixel_values.split(16)
    assert torch.equal(first, second) and not torch.equal(second, third)
    assert len(sample.images) == 3 and len(sample.image_sizes) == 3
    with pytest.raises(ValueError, match="last 3 frames"):
        prompts([obs])


def test_episodes_run_in_lockstep_and_each_decision_earns_its_episode_return(policy) -> None:
    model, processor = policy
    vocab = model.config.text_config.vocab_size
    # Every id is an action token, so a random-init model always emits valid actions.
    tokenizer = ActionTokenizer(action_dim=2, start_id=0, n_bins=vocab)
    envs = LocalEnvs("reach", 4, {"image_size": 56, "max_steps": 6})
    torch.manual_seed(0)
    seeds = [11, 11, 12, 12]
    episodes = run_episodes(
        HFEngine(model, processor), envs, ObservationPrompts(processor, BUDGET), tokenizer, seeds[:3],
        SamplingParams(temperature=1.0), group_size=2, record=2,
    )  # fmt: skip
    batch = episodes.batch
    assert len(batch) == int(episodes.lengths.sum()) and episodes.lengths.max() <= 6
    assert batch["group_index"].tolist() == [e // 2 for e in batch["episode_index"].tolist()]
    assert torch.equal(batch["scores"], episodes.returns[batch["episode_index"]])
    assert batch["response_mask"].sum(dim=1).eq(2).all() and not batch["truncated"].any()
    assert len(batch.prompts) == len(batch)  # a frame per decision
    assert [len(f) for f in episodes.frames] == (episodes.lengths[:2] + 1).tolist()  # reset frame + steps
    assert episodes.invalid == {}
    # GiGPO's inputs: each decision's own reward sums to its episode's return, and the two episodes
    # from seed 11 start from one state (one anchor), which seed 12's first state is not.
    per_episode = torch.zeros(3).index_add_(0, batch["episode_index"], batch["step_rewards"])
    assert torch.allclose(per_episode, episodes.returns)
    first = [int((batch["episode_index"] == e).nonzero()[0]) for e in range(3)]
    anchors = batch["anchor_index"][first].tolist()
    assert anchors[0] == anchors[1] != anchors[2]


def test_more_episodes_than_envs_run_in_waves_with_the_outcome_of_one_batch(policy) -> None:
    model, processor = policy
    tokenizer = ActionTokenizer(action_dim=2, start_id=0, n_bins=model.config.text_config.vocab_size)
    seeds = [5, 5, 6, 6, 7]  # with 3 envs: waves [5, 5, 6] and [6, 7]; seed 6's group straddles them
    engine, prompts = HFEngine(model, processor), ObservationPrompts(processor, BUDGET)
    whole, waves = (
        run_episodes(
            engine,
            LocalEnvs("reach", size, {"image_size": 56, "max_steps": 4}),
            prompts,
            tokenizer,
            seeds,
            SamplingParams(temperature=0.0),
            group_size=2,
            record=4,
        )
        for size in (5, 3)
    )
    assert torch.equal(whole.returns, waves.returns) and torch.equal(whole.lengths, waves.lengths)

    def by_episode(run, column):
        order = torch.sort(run.batch["episode_index"], stable=True).indices
        return run.batch[column][order]

    for column in ("episode_index", "group_index", "response_ids", "scores"):
        assert torch.equal(by_episode(whole, column), by_episode(waves, column)), column
    # Seed 6's two episodes, one per wave, start from one state: one anchor for GiGPO.
    first = [int((waves.batch["episode_index"] == e).nonzero()[0]) for e in range(5)]
    anchors = waves.batch["anchor_index"][first].tolist()
    assert anchors[0] == anchors[1] != anchors[2] == anchors[3] != anchors[4]
    assert len(waves.frames) == 4  # three from the first wave, one from the second
    for ours, theirs in zip(waves.frames, whole.frames, strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))


class RenderingEveryStep(LocalEnvs):
    """Renders each step whatever the episode loop asks: the reference that skipping must match."""

    def step(self, actions, render=None):
        return super().step(actions)


def count_renders(envs: LocalEnvs) -> list[int]:
    """A one-item list that counts the frames `envs` render from now on."""
    calls = [0]
    for env in envs.envs:

        def counted(draw=env.render):
            calls[0] += 1
            return draw()

        env.render = counted
    return calls


def test_chunked_episodes_render_only_the_frames_their_decisions_see(policy) -> None:
    model, processor = policy
    tokenizer = ActionTokenizer(action_dim=2, start_id=0, n_bins=model.config.text_config.vocab_size, chunk=4)
    prompts = ObservationPrompts(processor, BUDGET, history=2)
    runs = []
    for envs in (
        LocalEnvs("reach", 2, {"image_size": 56, "max_steps": 10}),
        RenderingEveryStep("reach", 2, {"image_size": 56, "max_steps": 10}),
    ):
        renders = count_renders(envs)
        episodes = run_episodes(
            HFEngine(model, processor), envs, prompts, tokenizer, [3, 4], SamplingParams(temperature=0.0)
        )
        runs.append((episodes, renders[0]))
    (skipped, drawn), (reference, every) = runs
    assert skipped.lengths.tolist() == [3, 3] and not skipped.success.any()  # 10 steps: chunks of 4, 4, 2
    assert every == 2 * (1 + 10)
    # Per env: the reset frame, then the last 2 frames (the history) of each full chunk; the last chunk
    # ends the episode at its second step, so no decision sees its frames.
    assert drawn == 2 * (1 + 2 + 2)
    assert torch.equal(skipped.batch["response_ids"], reference.batch["response_ids"])
    assert torch.equal(skipped.returns, reference.returns)
    for ours, theirs in zip(skipped.batch.prompts, reference.batch.prompts, strict=True):
        assert torch.equal(ours.pixel_values, theirs.pixel_values)


def test_malformed_actions_are_counted_penalised_and_applied_as_zero(policy) -> None:
    model, processor = policy
    # Bins that the untrained model practically never emits: almost every decision is invalid.
    tokenizer = ActionTokenizer(action_dim=2, start_id=0, n_bins=2)
    envs = LocalEnvs("reach", 2, {"image_size": 56, "max_steps": 5})
    episodes = run_episodes(
        HFEngine(model, processor), envs, ObservationPrompts(processor, BUDGET), tokenizer, [3, 4],
        SamplingParams(temperature=1.0), invalid_penalty=0.5,
    )  # fmt: skip
    assert episodes.invalid.get("out_of_range", 0) >= 8
    # Reach pays nothing unless the arm touches the target, so the returns are the penalties alone: one
    # per malformed decision of any kind (an untrained model's draw may also end a response early).
    bad = sum(episodes.invalid.values())
    assert episodes.returns.sum().item() == pytest.approx(-0.5 * bad + episodes.success.sum().item())
    # The zero action does not move the arm: the frames of an invalid-only episode never change.
    with make_env("reach", image_size=56) as still:
        first = still.reset(seed=3)[0]["image"]
        after = still.step(np.zeros(2))[0]["image"]
    assert np.array_equal(first, after)


def test_a_vla_policy_emits_and_is_scored_over_its_action_bins_alone(tiny_model_dir) -> None:
    processor = load_processor(tiny_model_dir)
    model = load_policy(tiny_model_dir, torch.float32, "cpu").eval()
    vocab = model.config.text_config.vocab_size
    # 4 bins of ~1000 ids: unconstrained, the untrained model would almost never emit an action.
    tokenizer = ActionTokenizer.for_vocab(vocab, action_dim=2, n_bins=4)
    setattr(model.config, ACTION_TOKENS, [tokenizer.start_id, vocab])  # what `mmrl sft` saves
    torch.manual_seed(0)
    episodes = run_episodes(
        HFEngine(model, processor), LocalEnvs("reach", 3, {"image_size": 56, "max_steps": 4}),
        ObservationPrompts(processor, BUDGET), tokenizer, [1, 2, 3], SamplingParams(temperature=1.0),
    )  # fmt: skip
    assert episodes.invalid == {} and episodes.batch["response_ids"].ge(tokenizer.start_id).all()
    # The trainer's log-probs are over the same bins: one decision's four first tokens share all the mass.
    rows = episodes.batch.select([0, 0, 0, 0])
    rows.tensors["response_ids"][:, 0] = torch.tensor(list(tokenizer.token_ids))
    logp, _ = forward_logprobs(model, rows, processor.tokenizer.pad_token_id)
    assert logp[:, 0].exp().sum().item() == pytest.approx(1.0, abs=1e-5)


def test_trajectory_grpo_normalises_over_episodes_not_decisions() -> None:
    # Two groups of two episodes. Group 0: returns 1 (1 decision) and 0 (3 decisions); group 1: 1 and 1.
    episode = torch.tensor([0, 1, 1, 1, 2, 2, 3, 3])
    returns = torch.tensor([1.0, 0.0, 1.0, 1.0])
    batch = Batch(
        tensors={
            "episode_index": episode,
            "group_index": episode // 2,
            "scores": returns[episode],
            "response_mask": torch.tensor([[1, 1]] * 8),
        }
    )
    advantages, _ = episode_advantages(get_advantage_estimator("grpo"), batch, norm_adv_by_std=True)
    # Per group over episodes: mean 0.5, unbiased std sqrt(0.5), so A = ±0.5 / sqrt(0.5) = ±0.7071.
    # Over decisions instead, group 0 would have mean 0.25 and different values.
    a = 0.5 / math.sqrt(0.5)
    expected = torch.tensor([a, -a, -a, -a, 0.0, 0.0, 0.0, 0.0])[:, None].expand(8, 2)
    assert torch.allclose(advantages, expected, atol=1e-5)


def test_gigpo_over_episodes_credits_the_decision_that_differed_from_a_shared_state() -> None:
    # One group, γ = 1: both episodes start in state 0; episode 0 then succeeds (reward 1 on its second
    # decision, from state 1), episode 1 fails from state 2. Centred only (no std):
    # A^E = ±0.5; the shared first state compares to-go 1 vs 0 -> ±0.5; states 1 and 2 are met once -> 0.
    batch = Batch(
        tensors={
            "episode_index": torch.tensor([0, 0, 1, 1]),
            "group_index": torch.tensor([0, 0, 0, 0]),
            "step_rewards": torch.tensor([0.0, 1.0, 0.0, 0.0]),
            "anchor_index": torch.tensor([0, 1, 0, 2]),
            "response_mask": torch.tensor([[1, 1]] * 4),
        }
    )
    advantages, to_go = step_advantages(
        get_advantage_estimator("gigpo"), batch, norm_adv_by_std=False, gamma=1.0, step_weight=1.0
    )
    assert torch.allclose(advantages[:, 0], torch.tensor([1.0, 0.5, -1.0, -0.5]))
    assert torch.allclose(to_go[:, 1], torch.tensor([1.0, 1.0, 0.0, 0.0]))


def test_gae_over_episodes_credits_each_decision_with_what_followed_it() -> None:
    # Two episodes in lockstep rows (episode 0 takes three decisions, episode 1 two), γ = 0.9, λ = 0.5,
    # V(s_t) the critic's value at each decision's first action token. By hand, δ_t = r_t + γV_{t+1} − V_t
    # with V = 0 after the last decision, Â_t = δ_t + γλÂ_{t+1}:
    #   episode 0: r (0, 0, 1), V (0.5, 0.4, 0.8): δ (-0.14, 0.32, 0.2), Â (0.0445, 0.41, 0.2)
    #   episode 1: r (0, 1),    V (0.2, 0.6):      δ (0.34, 0.4),        Â (0.52, 0.4)
    # returns Â + V; the policy gets Â whitened over the five decisions.
    values = torch.tensor([0.5, 0.2, 0.4, 0.6, 0.8])
    batch = Batch(
        tensors={
            "episode_index": torch.tensor([0, 1, 0, 1, 0]),
            "group_index": torch.tensor([0, 0, 0, 0, 0]),
            "step_rewards": torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0]),
            "values": torch.stack([values, values + 5.0], dim=1),  # later tokens' values are not read
            "response_mask": torch.tensor([[1, 1]] * 5),
        }
    )
    advantages, returns = decision_advantages(get_advantage_estimator("gae"), batch, gamma=0.9, lam=0.5)
    raw = torch.tensor([0.0445, 0.52, 0.41, 0.4, 0.2])
    whitened = (raw - raw.mean()) / (raw.std() + 1e-6)
    assert torch.allclose(advantages, whitened[:, None].expand(5, 2), atol=1e-5)
    assert torch.allclose(returns[:, 0], raw + values, atol=1e-6)
    assert torch.equal(returns[:, 0], returns[:, 1])


def test_clipped_cloning_steps_move_the_weights_no_further_than_the_clip(tiny_model_dir) -> None:
    # Plain SGD at lr 1: the step is the (clipped) gradient itself, so its norm is the clip.
    processor = load_processor(tiny_model_dir)
    frame = {"image": np.full((56, 56, 3), 90, np.uint8), "instruction": "touch the red ball"}
    samples = ObservationPrompts(processor, BUDGET)([frame])
    moved = []
    for clip in (None, 1e-3):
        model = load_policy(tiny_model_dir, torch.float32, "cpu")
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        supervised_step(model, optimizer, samples, [0], [[5, 6]], processor.tokenizer.pad_token_id, clip)
        moved.append(float((torch.cat([p.detach().flatten() for p in model.parameters()]) - before).norm()))
    assert moved[0] > 1e-2 and moved[1] == pytest.approx(1e-3, rel=1e-3)


def test_cloning_follows_the_configured_warm_up_and_cosine_schedule(tiny_model_dir, monkeypatch) -> None:
    # lr 1e-2, one warm-up step, then cosine to 0 over the remaining 4: factors 1, 1, 0.854, 0.5, 0.146
    rates = []

    def record(model, optimizer, *args) -> float:
        rates.append(optimizer.param_groups[0]["lr"])
        return 0.0

    monkeypatch.setattr(sft_module, "supervised_step", record)
    processor = load_processor(tiny_model_dir)
    demo = Demo(
        seed=0,
        instruction="touch the red ball",
        frames=np.zeros((2, 56, 56, 3), np.uint8),
        actions=np.zeros((2, 2), np.float32),
        success=True,
        states=np.zeros((2, 4), np.float32),
        expert_actions=np.zeros((2, 2), np.float32),
    )
    steps = demo_steps([demo], ActionTokenizer(action_dim=2, start_id=100, n_bins=16))
    sft = SftConfig(base_model=str(tiny_model_dir), steps=5, lr=1e-2, warmup_steps=1, lr_schedule="cosine")
    behaviour_clone(
        torch.nn.Linear(1, 1), ObservationPrompts(processor, BUDGET), steps, sft=sft, seed=0, pad_id=0
    )
    factors = [1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]
    assert rates == pytest.approx([1e-2 * f for f in factors])


def test_label_prior_loss_is_the_per_position_entropy_of_the_labels() -> None:
    # position 0: ids 1, 1, 2, 2 (ln 2); position 1: 5, 5, 5, 5 (0) -> mean ln 2 / 2
    assert label_prior_loss([[1, 5], [1, 5], [2, 5], [2, 5]]) == pytest.approx(math.log(2) / 2)
    assert label_prior_loss([[3, 4]] * 5) == 0.0


def test_the_loss_curve_averages_equal_spans_of_the_run() -> None:
    assert loss_curve([4.0, 2.0, 1.0, 1.0, 0.5, 0.5], points=3) == [3.0, 1.0, 0.5]
    assert loss_curve([2.0, 1.0], points=20) == [2.0, 1.0]  # fewer updates than points: one each


def test_demo_targets_are_action_chunks_with_the_last_action_repeated() -> None:
    frames = np.zeros((3, 8, 8, 3), np.uint8)
    actions = np.array([[-0.9, 0.9], [0.0, 0.5], [0.6, -0.3]], dtype=np.float32)  # 3 steps: odd
    clean = np.array([[-1.0, 1.0], [0.0, 1.0], [1.0, -0.5]], dtype=np.float32)  # the expert, noise-free
    states = np.zeros((3, 4), np.float32)
    demo = Demo(
        seed=0,
        instruction="touch the red ball",
        frames=frames,
        actions=actions,
        success=True,
        states=states,
        expert_actions=clean,
    )
    tokenizer = ActionTokenizer(action_dim=2, start_id=100, n_bins=16, chunk=2)
    steps = demo_steps([demo], tokenizer)
    assert [(t, ids) for _, t, ids in steps] == [
        (0, tokenizer.encode(actions[:2])),
        (2, tokenizer.encode(actions[[2, 2]])),  # the episode ends mid-chunk: its last action fills it
    ]
    dart = demo_steps([demo], tokenizer, labels="expert")  # sft.labels: the expert's own actions
    assert [ids for *_, ids in dart] == [tokenizer.encode(clean[:2]), tokenizer.encode(clean[[2, 2]])]
    stats = ActionStats.from_demos([actions])
    with_stats = ActionTokenizer(action_dim=2, start_id=100, n_bins=16, chunk=2, stats=stats)
    restored = ActionTokenizer.from_dict(json.loads(json.dumps(with_stats.to_dict())))
    ids = with_stats.encode(actions[:2])
    assert restored.decode(ids).tolist() == with_stats.decode(ids).tolist()
    assert restored.to_dict() == with_stats.to_dict()


def test_episode_gif_holds_every_step_and_frames_ended_episodes(tmp_path) -> None:
    frames = [[np.full((8, 8, 3), 10 * t, np.uint8) for t in range(n)] for n in (3, 5)]
    path = episodes_gif(frames, [True, False], tmp_path / "ep.gif", scale=1)
    gif = Image.open(path)
    assert gif.n_frames == 5 and gif.size == (2 * 14, 14)
    gif.seek(4)
    rgb = np.asarray(gif.convert("RGB"))
    assert tuple(rgb[0, 0]) == (40, 200, 60) and tuple(rgb[0, 14]) == (220, 40, 40)  # green ok, red failed


def test_training_seeds_repeat_for_a_step_and_stay_below_the_evaluation_seeds() -> None:
    assert train_seeds(1, 5, 8, 1000) == train_seeds(1, 5, 8, 1000)
    assert train_seeds(1, 5, 8, 1000) != train_seeds(1, 6, 8, 1000)
    assert max(train_seeds(1, 5, 64, 1000)) < 1000


def _cfg(tmp_path, model_dir, *overrides):
    return tiny_vla_config(
        model_dir,
        tmp_path / "run",
        "env.val_episodes=3",
        "env.media_episodes=2",
        "trainer.total_steps=2",
        "trainer.val_every=2",
        *overrides,
    )


def test_env_configs_refuse_what_episodes_cannot_use(tmp_path, tiny_model_dir) -> None:
    with pytest.raises(ConfigError, match=r"data\.train_files is required"):
        load_config(None, [f"model.path={tiny_model_dir}"])
    with pytest.raises(ConfigError, match=r"warmup.steps > 0.*mmrl sft"):
        _cfg(tmp_path, tiny_model_dir, "warmup.steps=5")
    with pytest.raises(ConfigError, match="remax"):
        _cfg(tmp_path, tiny_model_dir, "algorithm.adv_estimator=remax")


def test_episode_trainer_trains_validates_and_checkpoints_the_action_tokenizer(
    tmp_path, tiny_model_dir
) -> None:
    cfg = _cfg(tmp_path, tiny_model_dir)
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert {"episode/success", "episode/episode_length", "reward/mean", "val/success"} <= records[-1].keys()
    assert records[-1]["actor/updates"] == 1
    moved = max((trainer.policy.model.state_dict()[k] - v).abs().max().item() for k, v in before.items())
    assert moved > 0
    assert sorted(p.name for p in (tmp_path / "run" / "media").iterdir()) == [
        "step_000000.gif",
        "step_000002.gif",
    ]
    saved = tmp_path / "run" / "checkpoints" / "step_00000002" / "model" / "action_tokenizer.json"
    assert json.loads(saved.read_text())["action_dim"] == 2


def test_cli_sft_writes_a_policy_that_eval_and_train_start_from(tmp_path, tiny_model_dir, capsys) -> None:
    from mmrl.cli import main

    common = [
        f"model.path={tmp_path / 'sft'}",
        f"sft.base_model={tiny_model_dir}",
        "sft.demos=3",
        "sft.steps=2",
        "sft.batch_size=8",
        "env.options={image_size: 56, max_steps: 4}",
        "env.val_episodes=3",
    ]
    config = "configs/vla_mujoco_reach.yaml"
    assert main(["train", config, *common]) == 2  # no policy yet: the error names `mmrl sft`
    assert "run `mmrl sft`" in capsys.readouterr().err
    assert main(["sft", config, *common]) == 0
    tokenizer = json.loads((tmp_path / "sft" / "action_tokenizer.json").read_text())
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["text_config"]["vocab_size"]
    assert tokenizer["n_bins"] == 256 and tokenizer["start_id"] == vocab - 256  # OpenVLA: the last ids
    # the policy's config names its action tokens, so every engine and the trainer keep to them
    assert json.loads((tmp_path / "sft" / "config.json").read_text())[ACTION_TOKENS] == [vocab - 256, vocab]
    assert json.loads((tmp_path / "sft" / "sft_report.json").read_text())["demos"] == 3
    out = tmp_path / "eval.json"
    assert main(["eval", config, *common, "--checkpoint", str(tmp_path / "sft"), "--out", str(out)]) == 0
    metrics = json.loads(out.read_text())
    assert metrics["eval/episodes"] == 3 and 0.0 <= metrics["eval/success"] <= 1.0
    assert out.with_suffix(".gif").exists()
