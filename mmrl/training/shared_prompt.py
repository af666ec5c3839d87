"""The shared-prompt forward: each prompt computed once for all of its group's responses.

A GRPO group's n responses share one prompt, often hundreds of visual and text tokens against a few
dozen response tokens, and the padded forward recomputes that prompt n times. Here each group's prompt
runs once, its keys and values are handed to every response of the group (a `DynamicCache` gathered by
row), and the responses run on top of them (the shared-prefix forward of Prefix Grouper, 2025). Every
response token attends to exactly what it attends to in the padded forward, so log-probs agree to float
rounding; the gather is part of the graph, so the prompt's gradient is the sum over its responses, as n
copies would give.

A multi-turn agent's trajectories each carry their own prompt sample (the first prompt plus every image
a tool or env returned, `mmrl.agent.loop`); trajectories of one group share the first prompt, which
runs once, and each response part brings its own images.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from mmrl.data.batch import Batch
from mmrl.models import Family
from mmrl.training.media import PromptMedia


@dataclass(frozen=True)
class Sharing:
    """Which rows share a prompt: `first[g]` is a row standing for group g, `group[r]` row r's group;
    `prompt_images[r]` counts the images row r's prompt shows (the rest are in its response)."""

    first: list[int]
    group: list[int]
    prompt_images: list[int]


def shared_prompts(model: Any, family: Family, rows: list[int], batch: Batch, router: bool) -> Sharing | None:
    """How this micro-batch's rows share prompts, or None where the shared-prompt forward should not run:
    no prompt with several responses, a layer whose state is not its keys and values (a recurrent layer
    would need its state carried per row), a video in a response, an MoE router loss (it would count the
    prompt's tokens once, not n times), gradient checkpointing (transformers drops the cache under it), or
    a policy sharded over several processes: FSDP's gathers must come in the same order on every rank, and
    another rank's micro-batch may not share.

    Rows share when they point at one prompt sample, or, for an agent's trajectories, when they are of
    one group (`group_index`) with the same prompt tokens and prompt pixels."""
    if not family.prefix_cache or router or not batch["response_ids"].shape[1]:
        return None
    if getattr(model, "is_gradient_checkpointing", False) or _sharded():
        return None
    tokens = family.media_token_ids() if family.takes_images else {}
    if "video" in tokens and bool((batch["response_ids"] == tokens["video"]).any()):
        return None
    groups = batch["group_index"].tolist() if "group_index" in batch else rows
    prompt_images = [_images_in(batch.prompts[i].prompt_ids, tokens.get("image")) for i in rows]
    number: dict[Any, int] = {}  # each group's place in order of appearance
    first, group = [], []
    for r, i in enumerate(rows):
        key = (groups[r], tuple(batch.prompts[i].prompt_ids))
        if key not in number:
            number[key] = len(first)
            first.append(r)
        elif not _same_prompt_media(batch, rows[first[number[key]]], i, prompt_images[r]):
            return None
        group.append(number[key])
    if len(first) == len(rows):
        return None
    return Sharing(first=first, group=group, prompt_images=prompt_images)


def shared_prompt_hidden(
    model: Any,
    family: Family,
    sharing: Sharing,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    batch: Batch,
    positions: torch.Tensor,
    media: PromptMedia,
) -> torch.Tensor:
    """Last hidden states (B, T, H) at the positions that predict each response token, as
    `forward.response_hidden` lays them out, with each group's prompt run once.

    `prompt_ids`/`prompt_mask` are the rows' left-padded prompts (B, P) and `positions` the padded
    layout's position ids over prompt and response columns; `media` holds every row's images and videos."""
    device = next(model.parameters()).device
    rows = batch["prompt_index"].tolist()
    first = torch.tensor(sharing.first)
    group = torch.tensor(sharing.group, device=device)
    width = prompt_ids.shape[1]
    shown = media.take(
        {
            "image": [
                j for r in sharing.first for j in media.items("image", rows[r])[: sharing.prompt_images[r]]
            ],
            "video": [j for r in sharing.first for j in media.items("video", rows[r])],
        }
    )
    cache = DynamicCache(config=model.config)
    prompt_hidden = family.hidden_states(
        model,
        prompt_ids[first].to(device),
        prompt_mask[first].to(device),
        positions[..., first, :width].to(device),
        shown,
        cache=cache,
    )
    cache.batch_select_indices(group)
    returned = media.take(
        {
            "image": [
                j for r, i in enumerate(rows) for j in media.items("image", i)[sharing.prompt_images[r] :]
            ]
        }
    )
    response_hidden = family.hidden_states(
        model,
        batch["response_ids"].to(device),
        torch.cat([prompt_mask, batch.attention.long()], dim=1).to(device),
        positions[..., width:].to(device),
        returned,
        cache=cache,
    )
    # The prompt's last state predicts the first response token; each response state the next.
    return torch.cat([prompt_hidden[group, -1:], response_hidden[:, :-1]], dim=1)


def _sharded() -> bool:
    """Whether this process is one of several ranks training together."""
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and (torch.distributed.get_world_size() > 1)
    )


def _images_in(prompt_ids: list[int], image_token: int | None) -> int:
    """How many images a prompt shows: each is one run of placeholder tokens."""
    if image_token is None:
        return 0
    ids = torch.tensor(prompt_ids)
    starts = (ids == image_token) & ~torch.cat([torch.tensor([False]), ids[:-1] == image_token])
    return int(starts.sum())


def _same_prompt_media(batch: Batch, a: int, b: int, images: int) -> bool:
    """Whether prompt samples `a` and `b` show the same pixels in their first `images` images and the
    same videos: what two trajectories of one group must share to share a prompt forward."""
    if a == b:
        return True
    pa, pb = batch.prompts[a], batch.prompts[b]
    if images:
        grids_a, grids_b = pa.image_grid_thw[:images], pb.image_grid_thw[:images]
        patches = int(grids_a.prod(dim=-1).sum())
        if not torch.equal(grids_a, grids_b) or not torch.equal(
            pa.pixel_values[:patches], pb.pixel_values[:patches]
        ):
            return False
    for field in ("video_grid_thw", "pixel_values_videos"):
        va, vb = getattr(pa, field), getattr(pb, field)
        if (va is None) != (vb is None) or (va is not None and not torch.equal(va, vb)):
            return False
    return True
