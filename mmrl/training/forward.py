"""The model forward that training, the reference, the critic and the engines' parity checks share.

A training row is its prompt (left-padded) followed by its response (right-padded), so
every response starts at the same column and its log-probs are one slice of the logits.
Only the hidden states of scored response positions go through the LM head, which keeps memory
flat for real 150k-token vocabularies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from mmrl.algorithms import (
    block_tokens,
    entropy_from_logits,
    logprobs_from_logits,
)
from mmrl.data.batch import Batch, left_pad
from mmrl.data.sample import POSITION_RULE
from mmrl.models import ActionHead, action_head_of, autocast_for, family_of, never_generated_ids
from mmrl.processors import TRANSFORMERS_RULE
from mmrl.training.media import PromptMedia
from mmrl.training.micro_batches import Layout, micro_batches, scatter_rows
from mmrl.training.packing import pack, unpack
from mmrl.training.segments import PLAN, SegmentPlan, segment_attention
from mmrl.training.shared_prompt import packed_media, shared_prompt_hidden, shared_prompts

SHARDED_LOGPROBS = "mmrl_response_logprobs"  # the method `response_logprobs` looks for on a sharded policy
# Logits computed at once by `head_logprobs` (2**27: 512 MB per fp32 copy; 883 tokens at a 152 k vocabulary).
LOGIT_CHUNK_ELEMENTS = 2**27
LOGIT_CHUNK_MIN_TOKENS = 64


def response_hidden(
    model: Any,
    batch: Batch,
    pad_id: int,
    router_losses: list[torch.Tensor] | None = None,
    padding_free: bool = False,
) -> torch.Tensor:
    """Last hidden states (B, T, H) at the positions that predict each response token.

    The shared trunk of the policy's log-probs and the critic's values: position t holds the
    state after the prompt and the first t response tokens. The family adapter runs the model's
    own forward, with each prompt's media encoded once for its n responses (`PromptMedia`).

    Positions follow the engine that sampled each row (`POSITION_RULE`): the trainer's log-probs
    must be of the tokens at the positions they were sampled at, or the PPO ratio compares two
    different inputs. transformers and vLLM place the text after a long video differently
    (`mmrl.processors.rope`); rows without a rule were sampled by the HF engine. Run under `autocast_for`.
    `router_losses` collects a mixture-of-experts model's load-balancing loss (`Family.hidden_states`).
    A prompt with several responses in the micro-batch runs once for all of them
    (`mmrl.training.shared_prompt`): the same states. `padding_free` also packs the rows into one sequence
    without pad tokens (`packed_hidden`): the same states again, with no compute spent on padding."""
    device = next(model.parameters()).device
    family = family_of(model)
    rows = batch["prompt_index"].tolist()
    prompts = [batch.prompts[i] for i in rows]
    prompt_ids, prompt_mask = left_pad([p.prompt_ids for p in prompts], pad_id)
    response = batch["response_ids"]
    input_ids = torch.cat([prompt_ids, response], dim=1)
    attention = torch.cat([prompt_mask, batch.attention.long()], dim=1)
    rules = batch.lists.get(POSITION_RULE, TRANSFORMERS_RULE)
    positions = family.position_ids(prompts, input_ids, attention, rules)
    if padding_free:
        return packed_hidden(
            model, batch, input_ids, attention, positions, prompt_ids.shape[1], router_losses
        )
    sharing = shared_prompts(model, family, rows, batch, router_losses is not None)
    media = PromptMedia(family, model, batch.prompts, rows)
    if sharing is not None:
        hidden = shared_prompt_hidden(
            model, family, sharing, prompt_ids, prompt_mask, batch, positions, media
        )
        return media.tied(hidden)
    hidden = family.hidden_states(
        model,
        input_ids.to(device),
        attention.to(device),
        positions.to(device),
        media.of_rows(rows),
        router_losses,
    )
    start = prompt_ids.shape[1] - 1  # the position whose output predicts the first response token
    return media.tied(hidden[:, start : start + response.shape[1]])


def packed_hidden(
    model: Any,
    batch: Batch,
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    positions: torch.Tensor,
    prompt_width: int,
    router_losses: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """`response_hidden` of the padded rows (`input_ids`, `attention`, `positions`; `prompt_width` prompt
    columns) packed into one sequence: each group's prompt once where rows share it, and attention by
    segment (`mmrl.training.segments`). Under gradient checkpointing, which re-runs each layer's forward
    in the backward pass outside the segment attention, rows are packed whole and kept apart by their
    positions (transformers' own packed attention)."""
    device = next(model.parameters()).device
    family = family_of(model)
    rows = batch["prompt_index"].tolist()
    by_segment = not getattr(model, "is_gradient_checkpointing", False)
    sharing = (
        shared_prompts(model, family, rows, batch, router_losses is not None, packed=True)
        if by_segment
        else None
    )
    packed = pack(input_ids, attention, positions, prompt_width, sharing)
    media = PromptMedia(family, model, batch.prompts, rows)
    shown = media.of_rows(rows) if sharing is None else packed_media(sharing, rows, media)
    args = (model, packed.input_ids.to(device), None, packed.positions.to(device), shown, router_losses)
    if not by_segment:
        return media.tied(unpack(family.hidden_states(*args), packed))
    plan = SegmentPlan(packed.segments, device)
    with segment_attention(family.language_model(model)):
        return media.tied(unpack(family.hidden_states(*args, attention_kwargs={PLAN: plan}), packed))


def response_logprobs(
    model: Any,
    batch: Batch,
    pad_id: int,
    temperature: float = 1.0,
    with_entropy: bool | Literal["grad"] = False,
    router_losses: list[torch.Tensor] | None = None,
    padding_free: bool = False,
    *,
    through_shards: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (N,) of the N scored response tokens (`response_mask`), in row order, and optionally
    their entropies.

    Padding and a multi-turn row's tool responses are never scored, so their (B, T, V) logits, and the
    softmaxes over them forward and backward, would be work thrown away: in an agent's batch, most of it.
    A policy sharded with FSDP2 carries this computation as a registered forward method
    (`mmrl.workers.fsdp.shard_policy`), so its shards are gathered around it and its gradients
    reduced after it, as for `forward` itself."""
    sharded = getattr(model, SHARDED_LOGPROBS, None) if through_shards else None
    if sharded is not None:  # it calls back here with through_shards=False, its shards gathered
        return sharded(batch, pad_id, temperature, with_entropy, router_losses, padding_free)
    hidden = response_hidden(model, batch, pad_id, router_losses, padding_free)
    scored = batch["response_mask"].to(hidden.device).bool()
    labels = batch["response_ids"].to(hidden.device)[scored]
    return head_logprobs(
        model.lm_head, hidden[scored], labels, temperature, never_generated_ids(model.config), with_entropy
    )


def logit_chunk(vocab: int) -> int:
    """Scored tokens whose logits are computed at once: about `LOGIT_CHUNK_ELEMENTS` logits."""
    return max(LOGIT_CHUNK_MIN_TOKENS, LOGIT_CHUNK_ELEMENTS // vocab)


def head_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    blocked: list[int],
    with_entropy: bool | Literal["grad"] = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output layer over `hidden` (N, H): log-probs of `labels` (N,) at `temperature`, with `blocked`
    ids never sampled, and optionally entropies.

    Each logit is computed in the compute dtype and then handled in fp32, where its log-softmax, its
    entropy's terms and its gradient make about six (N, V) fp32 copies: 30 GB for 4 x 2,048 responses
    over a 152 k vocabulary. So beyond `logit_chunk` tokens the output layer runs chunk by chunk under
    activation checkpointing: a chunk's logits exist only while its log-probs are taken, forward and
    (recomputed) backward, and only the hidden states are kept in between."""

    def piece(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = block_tokens(head(h).float() / temperature, blocked)
        logp = logprobs_from_logits(logits, y)
        if with_entropy == "grad":
            return logp, entropy_from_logits(logits)
        if with_entropy:
            with torch.no_grad():
                return logp, entropy_from_logits(logits.detach())
        return logp, None

    chunk = logit_chunk(head.out_features)
    if len(hidden) <= chunk:
        return piece(hidden, labels)
    from torch.utils.checkpoint import checkpoint

    parts = [
        checkpoint(piece, h, y, use_reentrant=False)
        for h, y in zip(hidden.split(chunk), labels.split(chunk), strict=True)
    ]
    entropy = torch.cat([e for _, e in parts]) if with_entropy else None
    return torch.cat([logp for logp, _ in parts]), entropy


def forward_logprobs(
    model: Any,
    batch: Batch,
    pad_id: int,
    temperature: float = 1.0,
    with_entropy: bool | Literal["grad"] = False,
    compute_dtype: torch.dtype = torch.float32,
    router_losses: list[torch.Tensor] | None = None,
    padding_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, T) of `response_ids` under `model`, and optionally per-token entropy; both 0 where
    `response_mask` is 0, which every consumer masks out.

    Entropy is returned without a graph: it is a metric, and an autograd graph over (B, T, V)
    softmaxes would cost gigabytes at real vocabulary sizes. The entropy bonus asks for
    `with_entropy="grad"`. A policy with a continuous action head scores its sampled `actions` instead
    (`chunk_logprobs`)."""
    head = action_head_of(model)
    if head is not None:
        with autocast_for(model, compute_dtype):
            hidden = response_hidden(model, batch, pad_id, router_losses, padding_free)
        return chunk_logprobs(head, hidden, batch, temperature, with_entropy)
    with autocast_for(model, compute_dtype):
        logp, entropy = response_logprobs(
            model, batch, pad_id, temperature, with_entropy, router_losses, padding_free
        )
    scored = batch["response_mask"].to(logp.device).bool()
    return _rows(scored, logp), None if entropy is None else _rows(scored, entropy)


def chunk_logprobs(
    head: ActionHead,
    hidden: torch.Tensor,
    batch: Batch,
    temperature: float = 1.0,
    with_entropy: bool | Literal["grad"] = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-densities (B, chunk) of a continuous head's recorded draws (`ActionHead.draw_keys`: the sampled
    `actions`, a flow expert's denoising `chain`), one per chunk step, and optionally its entropy: the
    token path's contract, so the PPO ratio, the KL and the aggregation modes treat each chunk step as
    the token path treats a token. `hidden` (B, chunk, H) are the states that predict the action
    queries, the rows' response; the head reads them in fp32."""
    logp = head.log_prob(hidden, {key: batch[key] for key in head.draw_keys}, temperature)
    entropy = None
    if with_entropy == "grad":
        entropy = head.entropy(hidden, temperature)
    elif with_entropy:
        with torch.no_grad():
            entropy = head.entropy(hidden.detach(), temperature)
    return logp, entropy


def query_batch(prompts: list[Any], rows: list[int] | torch.Tensor, head: ActionHead) -> Batch:
    """Rows of `prompts` (by index) each followed by the head's action queries as its response."""
    queries = torch.tensor(head.spec.query_ids).expand(len(rows), -1)
    tensors = {
        "prompt_index": torch.as_tensor(rows),
        "response_ids": queries.clone(),
        "response_mask": torch.ones_like(queries),
    }
    return Batch(tensors=tensors, prompts=prompts)


def _rows(scored: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per-position `values` of the scored positions back into (B, T), 0 elsewhere (differentiable)."""
    return values.new_zeros(scored.shape).masked_scatter(scored, values)


def evaluate_rows(
    model: Any,
    batch: Batch,
    micro_batch_size: int,
    fn: Callable[[Batch], torch.Tensor],
    layout: Layout | None = None,
) -> torch.Tensor:
    """`fn` over micro-batches in eval mode without gradients, gathered on the CPU in row order: how
    the policy, the reference and the critic score a whole rollout batch. Micro-batches are chunks of
    `micro_batch_size` rows, or `layout`'s token-budget groups (`mmrl.training.micro_batches`)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        if layout is None:
            out = torch.cat([fn(micro).cpu() for micro in batch.split(micro_batch_size)])
        else:
            parts = [fn(micro).cpu() for micro in micro_batches(batch, layout)]
            out = scatter_rows(len(batch), batch["response_ids"].shape[1], layout, parts)
    model.train(was_training)
    return out
