"""The HF engine: log-probs agree with the training forward, stops and placeholders are handled."""

from __future__ import annotations

import pytest
import torch
from helpers import mixed_prompts

from mmrl.models import load_policy, load_processor
from mmrl.rollout import HFEngine, SamplingParams
from mmrl.training.forward import forward_logprobs


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    model = load_policy(tiny_model_dir)
    return HFEngine(model, load_processor(tiny_model_dir))


def test_sampled_logprobs_match_training_forward_on_mixed_batch(engine) -> None:
    prompts = mixed_prompts(load_processor_of(engine))
    torch.manual_seed(0)
    batch = engine.generate(prompts, SamplingParams(n=3, temperature=0.7, max_new_tokens=12, logprobs=True))
    assert len(batch) == 12 and batch["prompt_index"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    with torch.no_grad():
        logp, _ = forward_logprobs(engine.model.eval(), batch, engine.tokenizer.pad_token_id, temperature=0.7)
    mask = batch["response_mask"].bool()
    diff = (logp - batch["rollout_logprobs"])[mask].abs()
    assert mask.sum() > 12 and diff.max() < 1e-4, f"max |Δlogp| = {diff.max():.2e}"
    # A wrong temperature must be visible, or the comparison above proves nothing.
    with torch.no_grad():
        wrong, _ = forward_logprobs(engine.model, batch, engine.tokenizer.pad_token_id, temperature=1.0)
    assert (wrong - batch["rollout_logprobs"])[mask].abs().max() > 1e-3


def test_response_mask_ends_at_first_stop_and_placeholders_are_never_sampled(engine) -> None:
    prompts = mixed_prompts(load_processor_of(engine), with_text_only=False)
    torch.manual_seed(1)
    batch = engine.generate(prompts, SamplingParams(n=4, temperature=1.5, max_new_tokens=10))
    ids, mask = batch["response_ids"], batch["response_mask"]
    cfg = engine.model.config
    blocked = torch.tensor(
        [cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id]
    )
    assert not torch.isin(ids[mask.bool()], blocked).any()
    eos = engine.tokenizer.eos_token_id
    for row, m, truncated in zip(ids, mask, batch["truncated"], strict=True):
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any()  # one contiguous run of valid tokens
        if truncated:
            assert n == ids.shape[1] and eos not in row.tolist()
        else:
            assert row[n - 1] == eos and eos not in row[: n - 1].tolist()


def test_greedy_is_deterministic(engine) -> None:
    prompts = mixed_prompts(load_processor_of(engine))
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    a, b = engine.generate(prompts, params), engine.generate(prompts, params)
    assert torch.equal(a["response_ids"], b["response_ids"])


def load_processor_of(engine: HFEngine):
    return load_processor(engine.model.name_or_path)


def test_image_placeholder_is_blocked_even_when_it_is_the_most_likely_token(tiny_model_dir) -> None:
    model = load_policy(tiny_model_dir)
    processor = load_processor(tiny_model_dir)
    engine = HFEngine(model, processor)
    prompts = mixed_prompts(processor, with_text_only=False)
    pad = model.config.image_token_id
    # Point the image-pad output row along the mean final hidden state, so greedy decoding would
    # choose it at every step if the engine did not suppress it. (Inputs never read this row:
    # image-pad positions are overwritten by vision features.)
    with torch.no_grad():
        ids = torch.tensor([prompts[0].prompt_ids])
        hidden = model.model(
            input_ids=ids,
            pixel_values=prompts[0].pixel_values,
            image_grid_thw=prompts[0].image_grid_thw,
            mm_token_type_ids=(ids == pad).int(),
        ).last_hidden_state
        direction = hidden[0].mean(0)
        model.lm_head.weight[pad] = 1e3 * direction / direction.norm()
        logits = model.lm_head(hidden[0, -1])
    assert int(logits.argmax()) == pad  # without suppression this token would be generated
    batch = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=6))
    assert pad not in batch["response_ids"][batch["response_mask"].bool()].tolist()
