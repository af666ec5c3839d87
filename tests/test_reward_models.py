"""Model-based rewards on tiny random-init models built here: a vision reward model that reads the
images, a text reward model, and a generative judge asked through the HF rollout engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from mmrl.models import build_tokenizer, load_processor
from mmrl.rewards import RewardInput, RewardManager
from mmrl.sources.reward_models import (
    GenerativeJudge,
    TextRewardModel,
    VisionRewardModel,
    init_vision_reward_model,
    parse_verdict,
    prompt_sample,
)

RED, BLUE = Image.new("RGB", (56, 56), (220, 20, 20)), Image.new("RGB", (56, 84), (20, 20, 220))


def _inputs() -> list[RewardInput]:
    return [
        RewardInput("<answer>red</answer>", "red", [RED], prompt="<image>What colour is the shape?"),
        RewardInput("<answer>red</answer>", "red", [BLUE], prompt="<image>What colour is the shape?"),
        RewardInput("a much longer answer that goes on", "two", [], prompt="How many circles?"),
        RewardInput("blue", "blue", [RED, BLUE], prompt="<image> and <image>: which is blue?"),
    ]


@pytest.fixture(scope="module")
def vision_rm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> VisionRewardModel:
    return VisionRewardModel(init_vision_reward_model(tiny_model_dir, tmp_path_factory.mktemp("rm") / "rm"))


def test_vision_reward_model_sees_the_images_and_is_batch_independent(vision_rm) -> None:
    samples = _inputs()
    batched = vision_rm(samples)
    alone = [vision_rm([s])[0] for s in samples]
    assert all(torch.isfinite(torch.tensor(batched)))
    assert batched == pytest.approx(alone, abs=1e-5)  # padding in a mixed batch changes nothing
    assert abs(batched[0] - batched[1]) > 1e-4  # same text, different image, different score


def test_vision_reward_model_score_equals_the_hf_forward_by_hand(vision_rm) -> None:
    """The score is the head on the hidden state of the last response token in the model's own
    forward over the full sequence (images, mRoPE and all): an independent path."""
    sample = _inputs()[0]
    processor = vision_rm.processor
    prompt = prompt_sample(sample, sample.prompt, processor)
    response = processor.tokenizer(sample.response, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt.prompt_ids + response + [processor.tokenizer.eos_token_id]])
    model = vision_rm.model.model
    with torch.no_grad():
        out = model(
            input_ids=ids,
            pixel_values=prompt.pixel_values,
            image_grid_thw=prompt.image_grid_thw,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=(ids == model.config.image_token_id).int(),  # marks image slots for mRoPE
        )
        expected = vision_rm.model.value_head(out.last_hidden_state[0, -2]).item()  # after the response
    assert vision_rm([sample])[0] == pytest.approx(expected, abs=1e-5)


def test_vision_reward_model_refuses_a_folder_without_a_head(tiny_model_dir) -> None:
    with pytest.raises(FileNotFoundError, match="TextRewardModel"):
        VisionRewardModel(tiny_model_dir)


@pytest.fixture(scope="module")
def text_rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("text_rm")
    tok = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    Qwen2ForSequenceClassification(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_text_reward_model_scores_each_sample_as_if_alone(text_rm_dir) -> None:
    rm = TextRewardModel(text_rm_dir, batch_size=3)
    samples = _inputs()
    batched = rm(samples)
    alone = [rm([s])[0] for s in samples]
    assert batched == pytest.approx(alone, abs=1e-5)
    assert len(set(round(x, 5) for x in batched)) > 1


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("yes", 1.0),
        ("Yes, the answer is right.", 1.0),
        ("  correct", 1.0),
        ("No.", 0.0),
        ("incorrect: it is blue", 0.0),
        ("Score: 0.7", 0.7),
        ("1", 1.0),
        ("score 3 of 5", None),  # no number in [0, 1]
        ("nobody knows", None),  # "no" only as a whole word
        ("", None),
    ],
)
def test_parse_verdict(reply: str, expected: float | None) -> None:
    assert parse_verdict(reply) == expected


def test_generative_judge_shows_the_images_and_counts_unparsed_replies(tiny_model_dir) -> None:
    judge = GenerativeJudge(tiny_model_dir, max_new_tokens=4, batch_size=3)
    samples = _inputs()
    text = judge.render(samples[0])
    assert "What colour is the shape?" in text and "<answer>red</answer>" in text and "red" in text
    prompt = prompt_sample(samples[0], text, load_processor(tiny_model_dir))
    image_pad = judge.engine.model.config.image_token_id
    assert prompt.prompt_ids.count(image_pad) == 4  # 56x56 px -> 2x2 merged patches
    scores = judge(samples)
    assert [s["overall"] for s in scores] == [s["overall"] for s in judge(samples)]  # greedy: repeatable
    # A random-init judge replies gibberish: every reply is unparsed, scores 0, and is counted.
    assert judge.unparsed == 2 * sum(s["parsed"] == 0.0 for s in scores)
    assert all(s["overall"] == 0.0 for s in scores if s["parsed"] == 0.0)


def test_model_rewards_are_named_in_the_config_like_any_grader(vision_rm, tiny_model_dir, tmp_path) -> None:
    rm_dir = init_vision_reward_model(tiny_model_dir, tmp_path / "rm")
    specs = [
        {"name": "reward_model", "kwargs": {"path": str(rm_dir)}},
        {"name": "llm_judge", "weight": 0.5, "kwargs": {"path": str(tiny_model_dir), "max_new_tokens": 3}},
    ]
    samples = _inputs()
    with RewardManager(specs) as manager:  # batched by default: one forward pass per batch
        result = manager.score(samples)
    assert result.components["reward_model"] == pytest.approx(vision_rm(samples), abs=1e-5)
    assert "llm_judge/parsed" in result.components and not result.failures
    with pytest.raises(ValueError, match="scores whole batches"):
        RewardManager([{**specs[0], "batched": False}])
