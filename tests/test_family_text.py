"""Text-only causal LMs (the `text` family: Qwen3, Qwen2, Llama through `AutoModelForCausalLM`): the
trainer's log-probs equal the HF engine's and a plain transformers forward, on one prompt and on a
left-padded batch; datasets take a tokenizer for a processor and refuse image rows up front; the real
vLLM engine samples at the trainer's log-probs and takes a weight sync after an update."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_cases import (
    CPU_OVERRIDES,
    assert_resync_matches,
    plain_logprobs,
    update_on_samples,
    vllm_diff,
    vllm_engine_for,
    vllm_only,
)

from mmrl.config import ActorConfig, load_config
from mmrl.data.sample import PromptSample
from mmrl.errors import ConfigError
from mmrl.models import family_of, load_policy, load_processor, tokenizer_of
from mmrl.processors import build_messages, encode_prompt
from mmrl.rollout import HFEngine, SamplingParams
from mmrl.rollout.vllm import WeightSyncError
from mmrl.training.actor import Actor
from mmrl.training.forward import forward_logprobs
from mmrl.training.optim import plan_minibatches

QUESTIONS = [
    "What is 3 + 4?",
    "Find x: the side of a square is 5 cm, what is the area in cm?",
    "How many?",
]


@pytest.fixture(scope="module")
def text_dir(tiny_family_dir):
    return tiny_family_dir("text")


@pytest.fixture(scope="module")
def model(text_dir):
    return load_policy(text_dir).eval()


@pytest.fixture(scope="module")
def tokenizer(text_dir):
    return load_processor(text_dir)


def _prompts(tokenizer, questions=QUESTIONS) -> list[PromptSample]:
    return [
        PromptSample(i, encode_prompt(tokenizer, build_messages(q, 0), []), q, "7")
        for i, q in enumerate(questions)
    ]


def test_the_tiny_text_model_is_a_causal_lm_with_a_tokenizer_for_processor(model, tokenizer) -> None:
    family = family_of(model)
    assert family.name == "text" and not family.takes_images and not family.takes_video
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.tie_word_embeddings
    assert tokenizer_of(tokenizer) is tokenizer and not hasattr(tokenizer, "image_processor")
    assert family.media_token_ids() == {} and family.never_generated_ids() == []
    assert family.fsdp_units(model) == list(model.model.layers)
    assert family.lora_prefixes(True) == family.lora_prefixes(False) == ("model.",)
    assert family.saved_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="text-only model"):
        family.grid()
    for model_type in ("qwen3", "qwen2", "llama"):
        assert family_of(type("C", (), {"model_type": model_type})()).name == "text"


def test_position_ids_count_attended_tokens_as_generate_does(model) -> None:
    """The trainer's rule equals the one `generate` applies to a left-padded prompt."""
    attention = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    ids = torch.ones_like(attention)
    ours = family_of(model).position_ids([], ids, attention)
    assert ours.tolist() == [[0, 0, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 6]]
    theirs = model._prepare_position_ids_for_generation(ids, {"attention_mask": attention})
    assert torch.equal(ours[:, :6], theirs[:, :6])  # generate's prompt positions (no response yet)


@pytest.mark.parametrize("questions", [QUESTIONS[:1], QUESTIONS], ids=["plain", "left_padded"])
def test_trainer_logprobs_equal_the_hf_engine_and_a_plain_forward(model, tokenizer, questions) -> None:
    prompts = _prompts(tokenizer, questions)
    assert len({len(p.prompt_ids) for p in prompts}) == len(prompts)  # different lengths: real padding
    torch.manual_seed(0)
    batch = HFEngine(model, tokenizer).generate(
        prompts, SamplingParams(n=3, temperature=0.8, max_new_tokens=12, logprobs=True)
    )
    mask = batch["response_mask"].bool()
    assert mask.sum() > 3 * len(prompts)
    with torch.no_grad():
        ours = forward_logprobs(model, batch, tokenizer.pad_token_id, 0.8)[0]
    engine = (ours - batch["rollout_logprobs"])[mask].abs()
    plain = (ours - plain_logprobs(model, batch, 0.8))[mask].abs()
    assert engine.max() < 1e-4, f"trainer vs HF engine: max |Δlogp| = {engine.max():.2e}"
    assert plain.max() < 1e-4, f"trainer vs plain forward: max |Δlogp| = {plain.max():.2e}"


def _math_config(tmp_path, text_dir, rows: list[dict]) -> object:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(
        "configs/qwen3_math.yaml",
        [f"model.path={text_dir}", f"data.train_files={path}", f"data.val_files={path}"],
    )


def test_text_datasets_use_the_tokenizer_and_refuse_media_rows_up_front(tmp_path, text_dir, model, tokenizer):
    from mmrl.sources.prompts import build_datasets

    rows = [
        {"problem": f"Tom has {i} apples and buys 2 more. How many?", "answer": str(i + 2)} for i in range(4)
    ]
    train, val = build_datasets(_math_config(tmp_path, text_dir, rows), tokenizer, model.config)
    assert len(val) == 4 and val[0].pixel_values is None and val[0].images == []
    assert tokenizer.decode(val[0].prompt_ids).startswith("<|im_start|>user\nTom has 0 apples")
    assert train.prepare(3).ground_truth == "5"

    media = [
        {"problem": "<image>What colour?", "answer": "red", "images": ["a.png"]},
        {"problem": "<video>Which way?", "answer": "left", "videos": ["a.mp4"]},
        {"problem": "No media here.", "answer": "1", "images": [], "videos": []},
    ]
    with pytest.raises(ConfigError, match=r"2 of 7 rows have images or videos.*text-only model.*qwen3"):
        build_datasets(_math_config(tmp_path, text_dir, rows + media), tokenizer, model.config)


def test_an_actor_update_trains_the_text_model(tmp_path, text_dir, tokenizer) -> None:
    model = load_policy(text_dir)
    prompts = _prompts(tokenizer)
    torch.manual_seed(1)
    batch = HFEngine(model, tokenizer).generate(
        prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    )
    scores = (batch["response_ids"][:, 0] % 5).float()
    batch.set(advantages=(scores - scores.mean())[:, None].expand_as(batch["response_mask"]).clone())
    before = model.lm_head.weight.detach().clone()
    actor = Actor(
        model,
        ActorConfig(lr=1e-2, mini_batch_size=3, micro_batch_size=6, use_kl_loss=False),
        tokenizer.pad_token_id,
        temperature=1.0,
        response_len=6,
        total_updates=1,
    )
    stats = actor.update(batch, plan_minibatches(batch, len(batch), epochs=1, horizon=6))
    assert stats.skipped_steps == 0 and not torch.equal(before, model.lm_head.weight)


# ------------------------------------------------------------------ vLLM
@pytest.fixture(scope="module")
def vllm_engine(text_dir):
    yield from vllm_engine_for(text_dir)


def _greedy(engine, prompts) -> torch.Tensor:
    batch = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    return batch["response_ids"] * batch["response_mask"]


@vllm_only
def test_vllm_logprobs_match_the_trainer_and_greedy_matches_hf(vllm_engine, tokenizer) -> None:
    prompts = _prompts(tokenizer)
    torch.manual_seed(0)
    batch = vllm_engine.generate(
        prompts, SamplingParams(n=3, temperature=0.7, max_new_tokens=12, logprobs=True)
    )
    assert batch["response_mask"].sum() > 9
    diff = vllm_diff(vllm_engine, batch, 0.7)
    assert diff.max() < 1e-4, f"max |Δlogp| = {diff.max():.2e}, mean {diff.mean():.2e}"
    assert vllm_diff(vllm_engine, batch, 1.0).max() > 1e-3  # the wrong temperature disagrees
    assert torch.equal(
        _greedy(vllm_engine, prompts), _greedy(HFEngine(vllm_engine.model, tokenizer), prompts)
    )


@vllm_only
def test_vllm_sync_after_an_update_is_verified_and_a_skipped_one_caught(vllm_engine, tokenizer) -> None:
    prompts = _prompts(tokenizer)
    vllm_engine.sync_weights()
    update_on_samples(vllm_engine, prompts, n=4)
    with pytest.raises(WeightSyncError, match="did not arrive"):
        vllm_engine.verify()  # sync skipped: vLLM still has the old weights
    assert_resync_matches(vllm_engine, prompts)


# ------------------------------------------------------------------ the recipe
def _word_problems(out):
    """`examples/data/math_word_problems.py`, the recipe's data script, imported from its file."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / "data" / "math_word_problems.py"
    spec = importlib.util.spec_from_file_location("math_word_problems", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write(out, n_train=8, n_val=4, seed=0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_qwen3_math_recipe_runs_two_steps_on_cpu(tmp_path, text_dir) -> None:
    """configs/qwen3_math.yaml as written, with the tiny text model and only the overrides a CPU-sized
    run needs (paths, batch sizes, lengths, one process instead of a GPU node). In a process of its own, as
    a user runs it: in-process, after other tests on the same pytest worker, its vLLM engine once failed to
    set up ("pipeline model parallel group is not initialized", 2026-12-03)."""
    from forked import run_python

    from mmrl.run.logger import read_metrics

    data = _word_problems(tmp_path / "math")
    run = tmp_path / "run"
    args = [
        "train",
        "configs/qwen3_math.yaml",
        f"model.path={text_dir}",
        f"data.train_files={data}@train",
        f"data.val_files={data}@val",
        f"trainer.output_dir={run}",
        *CPU_OVERRIDES,
    ]
    log = tmp_path / "train.log"
    assert run_python(["-m", "mmrl.cli", *args], log).wait() == 0, log.read_text()[-4000:]
    steps = [r for r in read_metrics(run / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    assert all("reward/geometry" in r and "actor/pg_loss" in r for r in steps)
    assert "val/accuracy" in steps[-1]
