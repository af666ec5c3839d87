"""The HF engine's sampler: each prompt prefilled once, and finished rows dropped from the decode batch.

`model.generate` with `num_return_sequences=n` copies every prompt n times before its prefill, so a
group's hundreds of visual and text tokens are computed n times, and it decodes every row to the longest
row's end. Here the text all prompts start with is prefilled once, each prompt's rest once
(`mmrl.training.shared_prompt.prompt_states`), their keys and values gathered for the n responses of
each, and each step decodes only the rows that have not stopped. The
forward is the trainer's (`Family.hidden_states`, with the same position ids), so the tokens are
sampled from exactly the distribution the trainer scores them under (on a CPU under bf16 autocast, up to
the rounding of the attention the engine runs in fp32: `mmrl.models.cpu_attention`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from mmrl.algorithms import block_tokens, logprobs_from_logits
from mmrl.data.batch import left_pad
from mmrl.data.sample import PromptSample
from mmrl.models import family_of
from mmrl.rollout.base import SamplingParams
from mmrl.training.media import PromptMedia
from mmrl.training.shared_prompt import common_text, pad_after, prompt_states


def sample_groups(
    model: Any,
    prompts: list[PromptSample],
    params: SamplingParams,
    stop_ids: list[int],
    blocked: list[int],
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`params.n` responses per prompt, the n of a prompt adjacent: the token ids (N, W), padded with
    `pad_id` after each row's stop token (kept), and, with `params.logprobs`, each sampled token's
    log-prob under softmax(logits / temperature) with `blocked` tokens excluded (0 after the stop)."""
    family = family_of(model)
    device = next(model.parameters()).device
    ids, mask = left_pad([p.prompt_ids for p in prompts], pad_id)
    width, steps = ids.shape[1], params.max_new_tokens
    # Response tokens are text, so their positions depend on their count alone: one grid for all steps.
    positions = family.position_ids(
        prompts,
        torch.cat([ids, ids.new_full((len(prompts), steps), pad_id)], dim=1),
        torch.cat([mask, mask.new_ones((len(prompts), steps))], dim=1),
    )
    # The text every prompt starts with (a system prompt, a tool schema) is prefilled once for all.
    common = common_text([p.prompt_ids for p in prompts], blocked)
    ids, mask, positions = pad_after(ids, mask, positions, common)
    positions = positions.to(device)
    rows = torch.arange(len(prompts), device=device).repeat_interleave(params.n)  # each response's prompt
    media = PromptMedia(family, model, prompts, list(range(len(prompts)))).of_rows(list(range(len(prompts))))
    hidden, cache = prompt_states(model, family, ids, mask, positions[..., :width], media, common)
    cache.batch_select_indices(rows)
    logits = model.lm_head(hidden[:, -1])[rows]
    attention = mask.to(device)[rows]
    tokens = torch.full((len(rows), steps), pad_id, device=device)
    logps = torch.zeros(tokens.shape, device=device) if params.logprobs else None
    stop = torch.tensor(stop_ids, device=device)
    live = torch.arange(len(rows), device=device)  # the rows still decoding
    for t in range(steps):
        chosen, logp = _pick(logits, params, blocked)
        tokens[live, t] = chosen
        if logps is not None:
            logps[live, t] = logp
        going = ~torch.isin(chosen, stop)
        if t == steps - 1 or not going.any():
            break
        if not going.all():
            cache.batch_select_indices(going.nonzero()[:, 0])
            live, chosen, attention = live[going], chosen[going], attention[going]
        attention = torch.cat([attention, attention.new_ones((len(live), 1))], dim=1)
        at = positions[..., rows[live], width + t : width + t + 1]
        hidden = family.hidden_states(model, chosen[:, None], attention, at, {}, cache=cache)
        logits = model.lm_head(hidden[:, -1])
    used = t + 1  # the step every row had stopped by, or the last
    return tokens[:, :used], logps[:, :used] if logps is not None else None


def _pick(
    logits: torch.Tensor, params: SamplingParams, blocked: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row and its log-prob: `generate`'s order of processing (blocked tokens
    suppressed, then temperature, top-k, top-p), and the log-prob under the temperature alone, as the
    trainer computes it."""
    raw = block_tokens(logits.float(), blocked)
    if params.greedy:
        chosen = raw.argmax(dim=-1)
        scale = 1.0
    else:
        scale = params.temperature
        scores = raw / scale
        if params.top_k > 0:
            scores = TopKLogitsWarper(params.top_k)(None, scores)
        if params.top_p < 1.0:
            scores = TopPLogitsWarper(params.top_p)(None, scores)
        chosen = torch.multinomial(torch.softmax(scores, dim=-1), 1)[:, 0]
    logp = logprobs_from_logits((raw / scale)[:, None], chosen[:, None])[:, 0]
    return chosen, logp
