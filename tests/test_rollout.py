"""The HF engine: log-probs agree with the training forward, stops and placeholders are handled."""

from __future__ import annotations

from itertools import pairwise
from unittest import mock

import pytest
import torch
from helpers import mixed_prompts
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mmrl.models import family_of, load_policy, load_processor, reduced_attention
from mmrl.models.cpu_attention import FP32_SDPA
from mmrl.models.reduced_attention import sdpa_in_fp32
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


def test_the_sampler_prefills_each_prompt_once_and_decodes_only_unfinished_rows(engine) -> None:
    """`mmrl.rollout.decode`: one prefill row per prompt for its n responses, then decode batches that
    shrink as rows stop, never growing back; the rows' tokens still end at their first stop."""
    prompts = mixed_prompts(load_processor_of(engine))
    family = type(family_of(engine.model))
    stops = tuple(range(100, 400))  # a third of the vocabulary: rows stop early, at different steps
    torch.manual_seed(0)
    with mock.patch.object(family, "hidden_states", autospec=True, side_effect=family.hidden_states) as calls:
        batch = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=12, stop_token_ids=stops))
    rows = [call.args[2].shape[0] for call in calls.call_args_list]
    assert rows[0] == len(prompts) and rows[1] <= 4 * len(prompts)
    assert all(b <= a for a, b in pairwise(rows[1:])) and rows[-1] < rows[1], rows
    lengths = batch["response_mask"].sum(dim=1)
    assert len(set(lengths.tolist())) > 1 and len(rows) == int(lengths.max()), (rows, lengths)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"top_k": 1}, {"top_p": 1e-6}])
def test_the_sampler_picks_what_transformers_generate_picks(engine, sampling) -> None:
    """Greedy decoding, and sampling cut to one token by top-k or top-p, give transformers' `generate`
    tokens and log-probs: the same positions, media and cache, and the filters applied."""
    prompts = mixed_prompts(load_processor_of(engine))
    params = SamplingParams(n=1, max_new_tokens=10, logprobs=True, **sampling)
    ours = engine.generate(prompts, params)
    with mock.patch.object(type(family_of(engine.model)), "prefix_cache", False):
        theirs = engine.generate(prompts, params)
    assert torch.equal(ours["response_ids"], theirs["response_ids"])
    assert (ours["rollout_logprobs"] - theirs["rollout_logprobs"]).abs().max() < 1e-5


def test_prompts_that_start_with_one_tool_schema_prefill_it_once_and_sample_as_generate(engine) -> None:
    """Distinct prompts after the same tool preamble: the sampler prefills the common text once
    (`shared_prompt.common_text`) and still decodes greedily what transformers' `generate` decodes."""
    from helpers import zoom_prompts

    from mmrl.models import never_generated_ids
    from mmrl.processors import PixelBudget
    from mmrl.training.shared_prompt import MIN_COMMON, common_text

    grid = family_of(engine.model).grid()
    budget = PixelBudget(
        112 * 112, 112 * 112, grid.patch, grid.merge, family_of(engine.model).image_size_rule
    )
    prompts = zoom_prompts(load_processor_of(engine), budget, 3, {"function": "image_zoom"})
    assert (
        common_text([p.prompt_ids for p in prompts], never_generated_ids(engine.model.config)) >= MIN_COMMON
    )
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=10, logprobs=True)
    ours = engine.generate(prompts, params)
    with mock.patch.object(type(family_of(engine.model)), "prefix_cache", False):
        theirs = engine.generate(prompts, params)
    assert torch.equal(ours["response_ids"], theirs["response_ids"])
    assert (ours["rollout_logprobs"] - theirs["rollout_logprobs"]).abs().max() < 1e-5


def test_decoding_in_bf16_on_a_cpu_attends_in_fp32(engine, monkeypatch) -> None:
    """CPU flash attention is several times slower in bf16 than in fp32 for one query per row, so the HF
    engine samples under bf16 autocast with its language model attending in fp32 (`mmrl.models.cpu_attention`):
    every attention call, with autocast off, only inside `generate`; and with the same tokens and log-probs
    as transformers' SDPA wherever the inputs are fp32 already."""
    language_model = family_of(engine.model).language_model(engine.model)
    calls = []
    real = reduced_attention.sdpa_attention_forward

    def inner(module, query, key, value, *args, **kwargs):
        calls.append((torch.is_autocast_enabled("cpu"), query.dtype, key.dtype, value.dtype))
        return real(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(reduced_attention, "sdpa_attention_forward", inner)
    prompts = mixed_prompts(load_processor_of(engine))
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=6, logprobs=True)
    bf16 = HFEngine(engine.model, load_processor_of(engine), torch.bfloat16)
    assert len(bf16.generate(prompts, params)) == 8
    layers = engine.model.config.get_text_config().num_hidden_layers
    assert len(calls) >= layers * 6, "every layer of the prefill and of each decode step"
    assert set(calls) == {(False, torch.float32, torch.float32, torch.float32)}
    assert language_model.config._attn_implementation == "sdpa"
    calls.clear()
    plain = engine.generate(prompts, params)  # fp32: transformers' own SDPA
    # none at all where transformers' `sdpa` is its own (on an AMX CPU under an AVX2 pin it is mmrl's,
    # `reduced_attention`, which calls it: then in fp32 too)
    assert set(calls) <= {(False, torch.float32, torch.float32, torch.float32)}
    calls.clear()
    # The fp32 attention passes masks (left padding, text-only rows) and grouped keys through unchanged.
    language_model.config._attn_implementation = FP32_SDPA
    try:
        forced = engine.generate(prompts, params)
    finally:
        language_model.config._attn_implementation = "sdpa"
    assert calls and torch.equal(forced["response_ids"], plain["response_ids"])
    assert torch.equal(forced["rollout_logprobs"], plain["rollout_logprobs"])


def test_fp32_attention_equals_sdpa_on_fp32_copies(engine) -> None:
    """bf16 in, bf16 out under bf16 autocast, and in between exactly transformers' SDPA on the inputs cast to
    fp32 (autocast would run it in bf16), grouped keys and a padding mask included."""
    attention = family_of(engine.model).language_model(engine.model).layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads = attention.config.num_attention_heads, attention.config.num_key_value_heads
    q = torch.randn(2, heads, 5, attention.head_dim, generator=gen).bfloat16()
    k, v = (torch.randn(2, kv_heads, 5, attention.head_dim, generator=gen).bfloat16() for _ in range(2))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    mask[0, ..., :2] = False  # row 0 is left-padded by two
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = sdpa_in_fp32(attention, q, k, v, mask, scaling=attention.scaling)
        in_bf16, _ = sdpa_attention_forward(attention, q, k, v, mask, scaling=attention.scaling)
    want, _ = sdpa_attention_forward(
        attention, q.float(), k.float(), v.float(), mask, scaling=attention.scaling
    )
    assert out.dtype == torch.bfloat16 and kv_heads < heads
    assert torch.equal(out, want.bfloat16()) and not torch.equal(out, in_bf16)
