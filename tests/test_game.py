"""Games (`mmrl.agent.game`): an env played turn by turn, each frame the next user turn.

Trajectories are driven by scripted turns (`ScriptedEngine`) through the real agent loop and the real
gridnav env, so the rows, rewards and endings checked here are what a training run sees."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.agent import AgentEngine, AgentLimits
from mmrl.agent.game import GameResponder, parse_move, write_game_rows
from mmrl.agent.scripts import SCRIPT, Script, ScriptedEngine
from mmrl.data.dataset import with_pixels
from mmrl.data.sample import PromptSample
from mmrl.envs.gridnav import GridNavEnv, gridnav_expert
from mmrl.processors import PixelBudget, build_messages, encode_prompt, num_image_tokens
from mmrl.rollout import SamplingParams

OPTIONS = {"image_size": 56, "size": 3, "walls": 0, "max_steps": 6, "view": "agent"}
BUDGET = PixelBudget(56 * 56, 56 * 56)
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path) -> Any:
    from mmrl.models import load_processor

    return load_processor(tiny_model_dir)


def _prompt(processor: Any, seed: int, options: dict[str, Any] = OPTIONS) -> PromptSample:
    obs, _ = GridNavEnv(**options).reset(seed=seed)
    image = Image.fromarray(obs["image"])
    text = f"<image>{obs['instruction']}"
    ids = encode_prompt(processor.tokenizer, build_messages(text, 1), [num_image_tokens(56, 56, BUDGET)])
    sample = PromptSample(seed, ids, text, "success", images=[image], extra={"seed": seed})
    return with_pixels(sample, [], processor.image_processor, None)


def _expert_moves(seed: int) -> list[str]:
    """The shortest path's moves from `seed`'s start, as words."""
    env, moves, done = GridNavEnv(**OPTIONS), [], False
    env.reset(seed=seed)
    while not done:
        action = gridnav_expert(env)
        moves.append(next(w for w, a in env.words.items() if np.array_equal(a, action)))
        *_, terminated, truncated, _ = env.step(action)
        done = terminated or truncated
    return moves


def _play(processor: Any, prompts: list[PromptSample], turns: list[list[str]], limits: AgentLimits) -> Any:
    scripted = [replace(p, extra={**p.extra, SCRIPT: Script(t)}) for p, t in zip(prompts, turns, strict=True)]
    agent = AgentEngine(
        ScriptedEngine(processor.tokenizer),
        GameResponder("gridnav", OPTIONS),
        processor.tokenizer,
        processor.image_processor,
        BUDGET,
        limits,
    )
    return agent.generate(scripted, SamplingParams(n=1, max_new_tokens=8))


def test_moves_are_read_from_an_answer_block_or_the_bare_turn() -> None:
    words = GridNavEnv.words
    assert parse_move("<answer>Up</answer>", words) == "up"
    assert parse_move(" left.\n", words) == "left"
    assert parse_move("I go down", words) is None and parse_move("<answer></answer>", words) is None


def test_the_experts_moves_win_and_every_frame_comes_back_as_a_user_turn(processor: Any) -> None:
    seeds = [3, 4]
    moves = [_expert_moves(s) for s in seeds]
    assert all(2 <= len(m) < 6 for m in moves), moves
    batch = _play(processor, [_prompt(processor, s) for s in seeds], moves, AgentLimits(6, 512, 7))
    for row, seed_moves in enumerate(moves):
        extra = batch.prompts[row].extra
        assert extra["agent_ending"] == "done" and not bool(batch["truncated"][row])
        assert extra["env_success"] == 1.0 and extra["env_return"] == 1.0
        assert extra["env_steps"] == len(seed_moves) and extra["env_invalid"] == 0
        roles = [t["role"] for t in extra["agent_turns"]]
        assert roles == ["assistant", "user"] * (len(seed_moves) - 1) + ["assistant"]
        # one frame per turn: the start's and one after each move but the last, all in the row's sample
        assert len(batch.prompts[row].images) == len(seed_moves)
        assert int(batch.prompts[row].image_grid_thw.shape[0]) == len(seed_moves)
        # only the moves train: one word and the end-of-turn token each
        policy = batch["response_mask"][row].sum().item()
        observed = batch["response_attention"][row].sum().item() - policy
        assert (
            policy == sum(len(processor.tokenizer(m)["input_ids"]) + 1 for m in seed_moves) and observed > 0
        )


def test_a_turn_that_names_no_move_is_counted_answered_and_the_env_does_not_step(processor: Any) -> None:
    seed = 3
    moves = _expert_moves(seed)
    batch = _play(processor, [_prompt(processor, seed)], [["jump", *moves]], AgentLimits(6, 512, 7))
    extra = batch.prompts[0].extra
    assert extra["env_invalid"] == 1 and extra["env_steps"] == len(moves) and extra["env_success"] == 1.0
    assert "not a move" in extra["agent_turns"][1]["text"] and not extra["agent_turns"][1]["images"]


def test_an_episode_cut_by_the_env_or_the_turn_limit_is_truncated(processor: Any) -> None:
    seed = 3
    wall = "up"  # find a move that stays put at the start: the episode runs until the env's limit
    env = GridNavEnv(**OPTIONS)
    env.reset(seed=seed)
    for word, action in env.words.items():
        probe = GridNavEnv(**OPTIONS)
        probe.reset(seed=seed)
        probe.step(action)
        if probe.agent == env.agent:
            wall = word
            break
    else:
        pytest.skip("seed 3's start has no wall next to it")
    long = _play(processor, [_prompt(processor, seed)], [[wall] * 8], AgentLimits(8, 512, 9))
    short = _play(processor, [_prompt(processor, seed)], [[wall] * 8], AgentLimits(2, 512, 9))
    assert long.prompts[0].extra["agent_ending"] == "env_steps" and long.prompts[0].extra["env_steps"] == 6
    assert short.prompts[0].extra["agent_ending"] == "max_turns" and short.prompts[0].extra["env_steps"] == 2
    assert bool(long["truncated"][0]) and bool(short["truncated"][0])
    assert long.prompts[0].extra["env_success"] == 0.0


def test_rows_written_with_other_env_options_or_without_a_seed_are_refused(processor: Any) -> None:
    other = _prompt(processor, 3, {**OPTIONS, "size": 4})
    with pytest.raises(ValueError, match="does not draw the row's image"):
        _play(processor, [other], [["up"]], AgentLimits(2, 512, 3))
    seedless = replace(_prompt(processor, 3), extra={})
    with pytest.raises(ValueError, match="no `seed` column"):
        _play(processor, [seedless], [["up"]], AgentLimits(2, 512, 3))


def test_an_env_without_move_words_cannot_be_a_game() -> None:
    with pytest.raises(ValueError, match="names no moves"):
        GameResponder("reach", {})


def test_written_rows_hold_each_seeds_first_frame(tmp_path: Path) -> None:
    write_game_rows(tmp_path, "gridnav", OPTIONS, {"train": [0, 1], "val": [1_000_000]})
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert [r["seed"] for r in rows] == [0, 1] and len((tmp_path / "val.jsonl").read_text().splitlines()) == 1
    obs, _ = GridNavEnv(**OPTIONS).reset(seed=1)
    assert np.array_equal(np.asarray(Image.open(tmp_path / rows[1]["images"][0])), obs["image"])
    assert "up, down, left, right" in rows[1]["problem"] and obs["instruction"] in rows[1]["problem"]


def test_trainer_logprobs_over_a_played_episode_equal_the_engines_and_frames_get_no_gradient(
    tiny_model_dir: Path, processor: Any
) -> None:
    """One forward over a whole episode (a frame in every user turn) gives each move's tokens the
    log-probs the HF engine sampled them with; the frames and instructions get exactly zero gradient."""
    from helpers import Forced, ForcedScript, assert_scored_like_sampled

    from mmrl.models import load_policy
    from mmrl.rollout import HFEngine

    model = load_policy(tiny_model_dir)
    seed = 3
    moves = _expert_moves(seed)
    engine = ForcedScript(HFEngine(Forced(model), processor), processor.tokenizer)
    agent = AgentEngine(
        engine,
        GameResponder("gridnav", OPTIONS),
        processor.tokenizer,
        processor.image_processor,
        BUDGET,
        AgentLimits(6, 512, 7),
    )
    prompt = replace(_prompt(processor, seed), extra={"seed": seed, SCRIPT: Script(moves)})
    batch = agent.generate([prompt], SamplingParams(n=1, max_new_tokens=8, logprobs=True))
    assert batch.prompts[0].extra["env_success"] == 1.0 and len(batch.prompts[0].images) == len(moves) >= 2
    assert_scored_like_sampled(model, batch, processor.tokenizer.pad_token_id)


def test_the_game_graders_read_the_episode_and_refuse_rows_without_one() -> None:
    from mmrl.rewards import RewardInput
    from mmrl.rewards.graders import GRADERS

    played = RewardInput("up", "success", extra={"env_success": 1.0, "env_return": 0.6})
    assert GRADERS["env_success"](played) == 1.0 and GRADERS["env_return"](played) == 0.6
    with pytest.raises(ValueError, match="grades games"):
        GRADERS["env_success"](RewardInput("up", "success"))


def test_an_agent_section_takes_tools_or_a_game_never_both_nor_neither() -> None:
    from mmrl.config import load_config
    from mmrl.errors import ConfigError

    game = "agent.game={task: gridnav}"
    with pytest.raises(ConfigError, match=r"either agent\.tools"):
        load_config(CONFIGS / "quickstart_agent.yaml", [game])
    with pytest.raises(ConfigError, match=r"either agent\.tools"):
        load_config(CONFIGS / "quickstart_game.yaml", ["agent.game=null"])
    assert load_config(CONFIGS / "quickstart_game.yaml").agent.game.task == "gridnav"


def test_an_expert_warmup_plays_the_noisy_expert_in_step_with_the_env(processor: Any) -> None:
    """Without noise the expert's script wins every episode through the real loop (its env copy and the
    responder's stayed in step); with the task's default noise some moves go astray."""
    from mmrl.agent.game import expert_scripts

    responder = GameResponder("gridnav", OPTIONS)
    seeds = list(range(8))
    agent = AgentEngine(
        ScriptedEngine(processor.tokenizer),
        responder,
        processor.tokenizer,
        processor.image_processor,
        BUDGET,
        AgentLimits(6, 512, 7),
    )
    prompts = [_prompt(processor, s) for s in seeds]
    outcomes = {}
    for noise in (0.0, None):
        scripts = expert_scripts(
            responder, ["<answer>{move}</answer>"] * 6, seeds, np.random.default_rng(0), noise
        )
        batch = agent.generate(
            [replace(p, extra={**p.extra, SCRIPT: s}) for p, s in zip(prompts, scripts, strict=True)],
            SamplingParams(n=1, max_new_tokens=8),
        )
        outcomes[noise] = [p.extra["env_success"] for p in batch.prompts]
        assert all(p.extra["env_invalid"] == 0 for p in batch.prompts)
    assert outcomes[0.0] == [1.0] * len(seeds)
    assert 0 < sum(outcomes[None]) < len(seeds)
    from mmrl.config import load_config
    from mmrl.errors import ConfigError

    with pytest.raises(ConfigError, match="expert_noise"):
        load_config(CONFIGS / "quickstart_agent.yaml", ["warmup.expert_noise=1.0"])


def test_gigpo_credits_each_move_by_the_state_it_was_chosen_in(processor: Any) -> None:
    """Two episodes from one start both win, so trajectory-level GRPO gives every move 0. One wastes its
    first move on a word that is not a move; GiGPO's step group at the start state then holds three moves
    with returns-to-go γ^(L-1), γ^L, γ^(L-1) (L the expert's moves), whose GRPO advantages are
    +1/√3, −2/√3, +1/√3 whatever γ is; every later state is met once per episode with equal returns: 0.
    Each move's advantage lands on its own tokens only."""
    from mmrl.agent.credit import turn_advantages, turn_spans
    from mmrl.agent.game import STATES
    from mmrl.algorithms import ADVANTAGE_ESTIMATORS

    seed = 3
    moves = _expert_moves(seed)
    batch = _play(
        processor, [_prompt(processor, seed)] * 2, [moves, ["jump", *moves]], AgentLimits(7, 512, 8)
    )
    direct, wasted = (batch.prompts[i].extra[STATES] for i in range(2))
    assert len(direct) == len(moves) and len(set(direct)) == len(moves)  # a new frame after every move
    assert wasted == [direct[0], *direct]  # the invalid word left the agent where it was
    batch.set(group_index=torch.zeros(2, dtype=torch.long), scores=torch.tensor([1.0, 1.0]))
    advantages, returns = turn_advantages(
        ADVANTAGE_ESTIMATORS["gigpo"], batch, gamma=0.9, step_weight=1.0, norm_adv_by_std=True
    )
    third = 1 / np.sqrt(3)
    expected = [[third] + [0.0] * (len(moves) - 1), [-2 * third, third] + [0.0] * (len(moves) - 1)]
    for row in range(2):
        spans = turn_spans(batch["response_mask"][row])
        assert len(spans) == len(expected[row])
        for (start, end), value in zip(spans, expected[row], strict=True):
            assert torch.allclose(advantages[row, start:end], torch.tensor(float(value)), atol=1e-4)
        assert returns[row, spans[-1][0]].item() == pytest.approx(1.0)  # the winning move's return-to-go
        outside = ~batch["response_mask"][row].bool()
        assert not advantages[row][outside].any()
    assert returns[1, turn_spans(batch["response_mask"][1])[0][0]].item() == pytest.approx(0.9 ** len(moves))


def test_gigpo_is_refused_for_prompts_and_tools_and_taken_for_a_game() -> None:
    from mmrl.config import load_config
    from mmrl.errors import ConfigError

    for recipe in ("quickstart.yaml", "quickstart_agent.yaml"):
        with pytest.raises(ConfigError, match="needs an env section or a game"):
            load_config(CONFIGS / recipe, ["algorithm.adv_estimator=gigpo"])
    game = load_config(CONFIGS / "quickstart_game.yaml", ["algorithm.adv_estimator=gigpo"])
    assert game.algorithm.adv_estimator == "gigpo"


def test_a_game_run_trains_with_gigpo_after_an_expert_warmup(tmp_path: Path) -> None:
    """`mmrl quickstart --task game` end to end at a tiny size: the expert warm-up, two GiGPO steps and
    a validation, with the episodes' outcomes in the step metrics. After 30 warm-up steps some episodes
    are won and some lost, so the policy loss is not zero."""
    from mmrl.quickstart import run_quickstart
    from mmrl.run.logger import read_metrics

    out = tmp_path / "game"
    overrides = [
        "algorithm.adv_estimator=gigpo",
        "warmup.expert_noise=1.0",
        "warmup.steps=30",
        "warmup.batch_size=8",
        "data.train_batch_size=4",
        "data.max_val_samples=4",
        "actor.mini_batch_size=4",
        "rollout.n=4",
        "trainer.total_steps=2",
        "trainer.val_every=2",
        "trainer.save_every=0",
        "trainer.loggers=[jsonl]",
        "trainer.progress=false",
    ]
    assert run_quickstart(str(out), overrides, task="game") == 0
    records = read_metrics(out / "run" / "metrics.jsonl")
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(0 <= r["game/success"] <= 1 and r["game/steps"] > 0 for r in steps)
    assert all(np.isfinite(r["actor/pg_loss"]) for r in steps) and any(r["actor/pg_loss"] for r in steps)
    assert "val/env_success" in records[-1]
