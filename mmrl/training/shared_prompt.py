"""The shared-prompt forward: each prompt computed once for all of its group's responses.

A GRPO group's n responses share one prompt, often hundreds of visual and text tokens against a few
dozen response tokens, and the padded forward recomputes that prompt n times. Here the distinct prompts
run once, their keys and values are handed to every response of the group (a `DynamicCache` gathered by
row), and the responses run on top of them (the shared-prefix forward of Prefix Grouper, 2025). Every
response token attends to exactly what it attends to in the padded forward, so log-probs agree to float
rounding; the gather is part of the graph, so the prompt's gradient is the sum over its responses, as n
copies would give.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from mmrl.data.batch import Batch
from mmrl.models import Family


def shares_prompts(model: Any, family: Family, rows: list[int], batch: Batch, router: bool) -> bool:
    """Whether this micro-batch takes the shared-prompt forward: some prompt has several responses, every
    layer's state is its keys and values (a recurrent layer would need its state carried per row), no
    response holds media (an agent's tool images are encoded with their prompt), no MoE router loss
    (it would count the prompt's tokens once, not n times), and no gradient checkpointing (transformers
    drops the cache under it)."""
    if not family.prefix_cache or len(set(rows)) == len(rows) or router or not batch["response_ids"].shape[1]:
        return False
    if getattr(model, "is_gradient_checkpointing", False):
        return False
    media = torch.tensor(list(family.media_token_ids().values()) if family.takes_images else [])
    return not bool(torch.isin(batch["response_ids"], media).any())


def shared_prompt_hidden(
    model: Any,
    family: Family,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    batch: Batch,
    rows: list[int],
    positions: torch.Tensor,
    media: dict[str, Any],
) -> torch.Tensor:
    """Last hidden states (B, T, H) at the positions that predict each response token, as
    `forward.response_hidden` lays them out, with each distinct prompt run once.

    `prompt_ids`/`prompt_mask` are the rows' left-padded prompts (B, P) and `positions` the padded
    layout's position ids over prompt and response columns; `media` is the distinct prompts' encoded
    media, in the order of their prompt index."""
    device = next(model.parameters()).device
    distinct = sorted(set(rows))
    first = torch.tensor([rows.index(i) for i in distinct])  # a row standing for each distinct prompt
    group = torch.tensor([distinct.index(i) for i in rows], device=device)  # each row's distinct prompt
    width = prompt_ids.shape[1]
    cache = DynamicCache(config=model.config)
    prompt_hidden = family.hidden_states(
        model,
        prompt_ids[first].to(device),
        prompt_mask[first].to(device),
        positions[..., first, :width].to(device),
        media,
        cache=cache,
    )
    cache.batch_select_indices(group)
    response_hidden = family.hidden_states(
        model,
        batch["response_ids"].to(device),
        torch.cat([prompt_mask, batch.attention.long()], dim=1).to(device),
        positions[..., width:].to(device),
        {},
        cache=cache,
    )
    # The prompt's last state predicts the first response token; each response state the next.
    return torch.cat([prompt_hidden[group, -1:], response_hidden[:, :-1]], dim=1)
