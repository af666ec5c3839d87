"""The actor's policy gradient equals the textbook one computed by an independent path: the model's own
forward over each full prompt+response sequence (no shared vision features, no response slicing),
−Σ A·log π(y_t) / N_tokens, differentiated by autograd."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from helpers import mixed_prompts

from mmrl.config import ActorConfig
from mmrl.models import load_policy, load_processor, never_generated_ids
from mmrl.rollout import HFEngine, SamplingParams
from mmrl.training.actor import Actor
from mmrl.training.forward import forward_logprobs
from mmrl.training.optim import plan_minibatches


def _reference_loss(model, batch, pad_id: int, positive_lm_coef: float = 0.0) -> torch.Tensor:
    """Token-mean of −A·log π over valid response tokens, one sequence at a time; with `positive_lm_coef`
    μ, plus μ times the token-mean of −log π over the responses that scored above 0 (VAPO)."""
    total, tokens = torch.zeros(()), batch["response_mask"].sum()
    nll, positive_tokens = torch.zeros(()), 0
    blocked = never_generated_ids(model.config)
    for row in range(len(batch)):
        prompt = batch.prompts[int(batch["prompt_index"][row])]
        length = int(batch["response_mask"][row].sum())
        response = batch["response_ids"][row, :length].tolist()
        ids = torch.tensor([prompt.prompt_ids + response])
        extra = {}
        if prompt.pixel_values is not None:
            extra = {"pixel_values": prompt.pixel_values, "image_grid_thw": prompt.image_grid_thw}
        logits = (
            model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                mm_token_type_ids=(ids == model.config.image_token_id).int(),
                **extra,
            )
            .logits[0, len(prompt.prompt_ids) - 1 : -1]
            .float()
        )
        logits[:, blocked] = -1e9
        logp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response)[:, None]).squeeze(1)
        total = total - (batch["advantages"][row, :length] * logp).sum()
        if positive_lm_coef and batch["scores"][row] > 0:
            nll, positive_tokens = nll - logp.sum(), positive_tokens + length
    return total / tokens + (positive_lm_coef * nll / positive_tokens if positive_tokens else 0.0)


def _rollouts(model_dir):
    """The tiny policy, its processor and 3 sampled responses a prompt (mixed images and text), with a
    random advantage per response and the engine's log-probs."""
    model = load_policy(model_dir)
    processor = load_processor(model_dir)
    torch.manual_seed(0)
    batch = HFEngine(model, processor).generate(
        mixed_prompts(processor), SamplingParams(n=3, temperature=1.0, max_new_tokens=6, logprobs=True)
    )
    mask = batch["response_mask"]
    batch.set(advantages=torch.randn(len(batch))[:, None].expand_as(mask).clone() * mask)
    return model, processor, batch


def _actor(model, processor, **settings) -> Actor:
    """An actor without KL or entropy terms, in micro-batches of 5 rows: mixed images and text."""
    cfg = ActorConfig(
        lr=1e-3, mini_batch_size=4, micro_batch_size=5, use_kl_loss=False, entropy_coef=0.0, **settings
    )
    return Actor(
        model, cfg, processor.tokenizer.pad_token_id, temperature=1.0, response_len=6, total_updates=1
    )


def _assert_textbook_gradient(model, expected, pad_id: int, positive_lm_coef: float = 0.0) -> None:
    """The gradient the actor left on `model` equals `_reference_loss`'s on `expected`."""
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    _reference_loss(model, expected, pad_id, positive_lm_coef).backward()
    theirs = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert ours.keys() == theirs.keys() and len(ours) > 50
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("correction", [None, "tis"])
def test_actor_gradient_equals_the_textbook_policy_gradient(tiny_model_dir, correction) -> None:
    """With `actor.rollout_correction=tis` each token's term is weighted by min(π_old/π_rollout, 2): the
    engine's log-probs here sit a random distance below or above the trainer's."""
    model, processor, batch = _rollouts(tiny_model_dir)
    mask, advantages = batch["response_mask"], batch["advantages"]
    actor = _actor(model, processor, rollout_correction=correction)
    expected = batch.select(list(range(len(batch))))
    if correction:
        gap = (torch.rand(mask.shape) - 0.3) * 2  # log(π_old/π_rollout) in [-0.6, 1.4): some past log 2
        batch.set(rollout_logprobs=(batch["rollout_logprobs"] - gap) * mask)
        expected.set(advantages=advantages * gap.exp().clamp(max=2.0))
    model.train()
    model.zero_grad()
    totals = {"num_tokens": float(mask.sum()), "num_seqs": float(len(batch)), "horizon": 6}
    capped = []
    for micro in batch.split(5):
        capped.append(actor._micro_step(micro, totals).get("actor/rollout_is_capped_frac", 0.0))
    if correction:
        assert sum(capped) > 0, "some weights should have been truncated at the cap"
    _assert_textbook_gradient(model, expected, processor.tokenizer.pad_token_id)


def test_positive_example_lm_loss_adds_the_nll_of_positive_responses(tiny_model_dir) -> None:
    """VAPO's μ·L_NLL (`actor.positive_lm_coef`) through the actor's micro-batches equals the textbook
    token-mean NLL of the responses scored above 0, divided by the mini-batch's count of their tokens."""
    model, processor, batch = _rollouts(tiny_model_dir)
    mask = batch["response_mask"]
    batch.set(scores=torch.tensor([1.0, 0.0, -1.0, 0.5] * len(batch))[: len(batch)])
    actor = _actor(model, processor, positive_lm_coef=0.5)
    (step,) = plan_minibatches(batch, len(batch), 1, horizon=6)
    assert step.totals["num_positive_tokens"] == float(mask[batch["scores"] > 0].sum())
    model.train()
    model.zero_grad()
    losses = [actor._micro_step(micro, step.totals)["actor/positive_lm_loss"] for micro in batch.split(5)]
    assert all(loss > 0 for loss in losses)
    _assert_textbook_gradient(model, batch, processor.tokenizer.pad_token_id, positive_lm_coef=0.5)


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_gradient_checkpointing_changes_memory_not_the_gradient(tiny_model_dir, padding_free: bool) -> None:
    """`model.gradient_checkpointing` recomputes activations in the backward pass; the gradient it gives
    is the plain one. (Under checkpointing transformers keeps no cache, so the forward runs each response's
    prompt itself: the plain forward is the one to compare with. Packed rows then keep to transformers'
    own packed attention, which the recomputed forward also runs.)"""
    processor = load_processor(tiny_model_dir)
    pad = processor.tokenizer.pad_token_id
    torch.manual_seed(0)
    batch = HFEngine(load_policy(tiny_model_dir), processor).generate(
        mixed_prompts(processor), SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    )
    grads = []
    for checkpointing in (False, True):
        model = load_policy(tiny_model_dir).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with mock.patch("mmrl.training.forward.shared_prompts", return_value=None):
            logp, _ = forward_logprobs(model, batch, pad, padding_free=padding_free and checkpointing)
        (-(logp * batch["response_mask"]).sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name, grad in grads[0].items():
        if padding_free:  # packed and padded rows sum in other orders: equal to float rounding
            assert (grads[1][name] - grad).norm() <= 1e-5 * grad.norm().clamp(min=1e-12), name
        else:
            torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
