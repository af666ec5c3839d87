"""Token-budget micro-batches (`actor.max_tokens_per_micro_batch`): the packing keeps its budget, runs
every row once and balances workers by tokens; the gradient it accumulates is the fixed-count one,
for every loss aggregation, because each loss is divided by the whole mini-batch's totals."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from helpers import mixed_prompts

from mmrl.algorithms.aggregation import LOSS_AGG_MODES
from mmrl.config import ActorConfig, CriticConfig
from mmrl.models import load_policy, load_processor
from mmrl.rollout import HFEngine, SamplingParams
from mmrl.training import micro_batches
from mmrl.training.actor import Actor
from mmrl.training.critic import Critic, ValueModel
from mmrl.training.micro_batches import (
    deal,
    micro_layout,
    padded_tokens,
    rank_rows,
    row_lengths,
    worker_layouts,
)
from mmrl.training.optim import plan_minibatches

HORIZON = 8
DTYPE = torch.float64  # fp32 rounding alone moves a gradient by ~5e-7 when rows are regrouped


def _lengths(count: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(5, 60), rng.randint(1, 40)) for _ in range(count)]


def _flat(layout: list[list[int]]) -> list[int]:
    return [row for micro in layout for row in micro]


@pytest.mark.parametrize("seed", range(5))
def test_packing_keeps_the_budget_and_runs_every_row_once(seed: int) -> None:
    lengths = _lengths(37, seed)
    (layout,) = worker_layouts(lengths, 1, max_tokens=300)
    assert sorted(_flat(layout)) == list(range(37))
    assert all(padded_tokens(lengths, micro) <= 300 for micro in layout)
    longest = [max(sum(lengths[r]) for r in micro) for micro in layout]
    assert longest == sorted(longest, reverse=True)  # longest rows first, similar lengths together
    assert worker_layouts(lengths, 1, max_tokens=300) == [layout]  # deterministic


@pytest.mark.parametrize("seed", range(5))
def test_two_workers_get_equal_tokens_and_equal_micro_batch_counts(seed: int) -> None:
    lengths = _lengths(37, seed)
    tokens = [sum(sum(lengths[r]) for r in share) for share in deal(lengths, 2)]
    assert abs(tokens[0] - tokens[1]) <= max(sum(length) for length in lengths)
    layouts = worker_layouts(lengths, 2, max_tokens=300)
    assert len(layouts[0]) == len(layouts[1])  # FSDP: every rank runs as many forwards
    assert sorted(_flat(layouts[0]) + _flat(layouts[1])) == list(range(37))
    assert all(padded_tokens(lengths, micro) <= 300 for layout in layouts for micro in layout)


def test_a_worker_with_fewer_forwards_splits_its_largest_then_runs_blanks() -> None:
    # rank 0 packs [[2], [1]]; rank 1 packs [[0, 3]], split in two to match
    assert worker_layouts([(5, 20), (10, 5), (10, 20), (5, 20)], 2, max_tokens=50) == [
        [[2], [1]],
        [[0], [3]],
    ]
    # rank 0 holds one long row, rank 1 needs two forwards for its three short ones: rank 0 runs a blank
    layouts = worker_layouts([(10, 90), (10, 5), (10, 5), (10, 5)], 2, max_tokens=40)
    assert layouts == [[[0], []], [[1, 2], [3]]]
    rows, local = rank_rows(layouts[0], blank=7)
    assert rows == [0, 7] and local == [[0], [1]]


def test_a_row_over_the_budget_runs_alone_with_one_warning(monkeypatch, caplog) -> None:
    monkeypatch.setattr(micro_batches, "_warned_oversized", False)
    lengths = [(50, 60), (5, 5), (5, 5)]
    with caplog.at_level(logging.WARNING, logger="mmrl.training.micro_batches"):
        for _ in range(2):
            assert worker_layouts(lengths, 1, max_tokens=100) == [[[0], [1, 2]]]
    assert len(caplog.records) == 1 and "110 tokens" in caplog.messages[0]


@pytest.fixture(scope="module")
def scored(tiny_model_dir):
    """Rollout rows of image and text prompts with responses of 0 to 8 tokens, and everything the
    loss reads: advantages, old and reference log-probs, values and returns."""
    processor = load_processor(tiny_model_dir)
    torch.manual_seed(0)
    batch = HFEngine(load_policy(tiny_model_dir), processor).generate(
        mixed_prompts(processor), SamplingParams(n=3, temperature=1.0, max_new_tokens=HORIZON)
    )
    width = batch["response_mask"].shape[1]
    lengths = torch.tensor([(3 * i) % (width + 1) for i in range(len(batch))])
    mask = (torch.arange(width) < lengths[:, None]).long()
    pad = processor.tokenizer.pad_token_id
    shape = mask.shape
    batch.set(
        response_mask=mask,
        response_ids=batch["response_ids"].masked_fill(mask == 0, pad),
        advantages=torch.randn(shape[0], 1).expand(shape) * mask,
        old_logprobs=-torch.rand(shape) * 3,
        ref_logprobs=-torch.rand(shape) * 3,
        values=torch.randn(shape) * mask,
        returns=torch.randn(shape) * mask,
    )
    return batch, pad


def _budget(batch) -> int:
    """A budget that gives micro-batches of different sizes, none of them the fixed count's."""
    longest = max(sum(length) for length in row_lengths(batch))
    return int(longest * 2.5)


def _relative_error(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    assert ours.keys() == theirs.keys() and len(ours) > 10
    diff = sum(float((ours[n] - theirs[n]).pow(2).sum()) for n in ours) ** 0.5
    return diff / sum(float(theirs[n].pow(2).sum()) for n in ours) ** 0.5


def _actor_gradient(model_dir, batch, pad: int, plan, mode: str, budget: int | None):
    model = load_policy(model_dir, DTYPE)
    cfg = ActorConfig(
        lr=1e-9,
        mini_batch_size=len(batch),
        micro_batch_size=4,
        max_tokens_per_micro_batch=budget,
        loss_agg_mode=mode,
        entropy_coef=0.01,
        kl_loss_coef=0.1,
        max_grad_norm=1e9,  # no clipping: the accumulated gradient itself is compared
    )
    actor = Actor(model, cfg, pad, temperature=1.0, response_len=HORIZON, total_updates=1)
    actor.update(batch, plan)  # one step; the gradient it stepped on stays in .grad
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_token_budget_gradient_equals_the_fixed_count_gradient(tiny_model_dir, scored, mode: str) -> None:
    batch, pad = scored
    budget = _budget(batch)
    layout = micro_layout(batch, budget)
    sizes = sorted(len(micro) for micro in layout)
    assert len(layout) >= 3 and sizes[0] != sizes[-1]
    plan = plan_minibatches(batch, len(batch), 1, HORIZON)
    fixed = _actor_gradient(tiny_model_dir, batch, pad, plan, mode, None)
    packed = _actor_gradient(tiny_model_dir, batch, pad, plan, mode, budget)
    error = _relative_error(packed, fixed)
    print(f"{mode}: relative gradient error {error:.2e}")
    assert error < 1e-6


def test_token_budget_scores_rows_as_the_fixed_count_does(tiny_model_dir, scored) -> None:
    """Old and reference log-probs come back in row order, 0 past each micro-batch's longest response."""
    batch, pad = scored
    model = load_policy(tiny_model_dir)
    scores = []
    for budget in (None, _budget(batch)):
        cfg = ActorConfig(micro_batch_size=4, max_tokens_per_micro_batch=budget)
        actor = Actor(model, cfg, pad, temperature=1.0, response_len=HORIZON, total_updates=1)
        scores.append(actor.logprobs(batch) * batch["response_mask"])
    torch.testing.assert_close(scores[1], scores[0], rtol=1e-5, atol=1e-6)


def test_critic_token_budget_gradient_equals_the_fixed_count_gradient(tiny_model_dir, scored) -> None:
    batch, pad = scored
    plan_rows = len(batch)
    grads = []
    for budget in (None, _budget(batch)):
        torch.manual_seed(0)
        model = ValueModel(load_policy(tiny_model_dir, DTYPE))
        torch.nn.init.normal_(model.value_head.weight)  # a zero head would pass no gradient to the trunk
        cfg = CriticConfig(lr=1e-9, max_grad_norm=1e9)
        critic = Critic(model, cfg, pad, HORIZON, 1, micro_batch_size=4, max_tokens=budget)
        torch.manual_seed(1)  # the same mini-batch order in both
        critic.update(batch, plan_minibatches(batch, plan_rows, 1, HORIZON))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert all(float(g.abs().max()) > 0 for g in grads[0].values())
    assert _relative_error(grads[1], grads[0]) < 1e-6
