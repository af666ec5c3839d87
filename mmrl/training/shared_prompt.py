"""The shared-prompt forward: what rows have in common computed once, not once per row.

A GRPO group's n responses share one prompt, often hundreds of visual and text tokens against a few
dozen response tokens, and the padded forward recomputes that prompt n times; the rows of a batch often
share more still, a system prompt or a tool schema before their images. Here the forward runs in three
stages on one cache of keys and values (a `DynamicCache`, gathered by row between stages):
1. the text every row's prompt starts with, once for the whole micro-batch;
2. the rest of each distinct prompt (its images, its question), once per group;
3. every row's response, on top of its group's prompt.
Every token attends to exactly what it attends to in the padded forward (the shared-prefix forward of
Prefix Grouper, 2025), so log-probs agree to float rounding; the gathers are part of the graph, so a
shared token's gradient is the sum over the rows that read it, as separate copies would give.

A multi-turn agent's trajectories each carry their own prompt sample (the first prompt plus every image
a tool or env returned, `mmrl.agent.loop`); trajectories of one group share the first prompt, and each
response stage brings its own images.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from mmrl.data.batch import Batch
from mmrl.models import Family, never_generated_ids
from mmrl.training.media import PromptMedia

# Fewer leading tokens in common than this and stage 1 is not worth its own pass.
MIN_COMMON = 16


@dataclass(frozen=True)
class Sharing:
    """How a micro-batch's rows share their prompts: `common` leading prompt tokens every row has; `first[g]`
    a row standing for group g (its distinct prompt) and `group[r]` row r's group; `prompt_images[r]` the
    images row r's prompt shows (the rest are in its response)."""

    common: int
    first: list[int]
    group: list[int]
    prompt_images: list[int]


def shared_prompts(
    model: Any, family: Family, rows: list[int], batch: Batch, router: bool, packed: bool = False
) -> Sharing | None:
    """How this micro-batch's rows share prompts, or None where the shared-prompt forward should not run:
    nothing worth sharing, a layer whose state is not its keys and values (a recurrent layer would need
    its state carried per row), a video in a response, an MoE router loss (it would count shared tokens
    once, not per row), gradient checkpointing (transformers drops the cache under it), or a policy
    sharded over several processes: FSDP's gathers must come in the same order on every rank, and another
    rank's micro-batch may not share. Rows `packed` into one sequence (`mmrl.training.packing`) share in
    one forward, so neither of the last two stands in their way.

    Rows share a prompt when they point at one prompt sample, or, for an agent's trajectories, when they
    are of one group (`group_index`) with the same prompt tokens and prompt pixels."""
    if not family.prefix_cache or router or not batch["response_ids"].shape[1]:
        return None
    if not packed and (getattr(model, "is_gradient_checkpointing", False) or _sharded()):
        return None
    tokens = family.media_token_ids() if family.takes_images else {}
    if "video" in tokens and bool((batch["response_ids"] == tokens["video"]).any()):
        return None
    groups = batch["group_index"].tolist() if "group_index" in batch else rows
    images_of = {i: _images_in(batch.prompts[i].prompt_ids, tokens.get("image")) for i in set(rows)}
    prompt_images = [images_of[i] for i in rows]
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
    common = common_text(
        [batch.prompts[rows[r]].prompt_ids for r in first], never_generated_ids(model.config)
    )
    if len(first) == len(rows) and common < MIN_COMMON:
        return None
    return Sharing(common=common, first=first, group=group, prompt_images=prompt_images)


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
    `forward.response_hidden` lays them out, from the three stages.

    `prompt_ids`/`prompt_mask` are the rows' left-padded prompts (B, P) and `positions` the padded
    layout's position ids over prompt and response columns; `media` holds every row's images and videos.
    Each prompt's padding moves to just after the common text, so those columns line up across rows."""
    device = next(model.parameters()).device
    rows = batch["prompt_index"].tolist()
    width, common = prompt_ids.shape[1], sharing.common
    ids, mask, positions = pad_after(prompt_ids, prompt_mask, positions, common)
    positions = positions.to(device)
    first = torch.tensor(sharing.first)
    group = torch.tensor(sharing.group, device=device)
    shown = media.take(
        {
            "image": [
                j for r in sharing.first for j in media.items("image", rows[r])[: sharing.prompt_images[r]]
            ],
            "video": [j for r in sharing.first for j in media.items("video", rows[r])],
        }
    )
    prompt_hidden, cache = prompt_states(
        model, family, ids[first], mask[first], positions[..., first.to(device), :width], shown, common
    )
    cache.batch_select_indices(group)
    returned = media.take(
        {
            "image": [
                j for r, i in enumerate(rows) for j in media.items("image", i)[sharing.prompt_images[r] :]
            ]
        }
    )
    response_hidden = family.hidden_states(  # stage 3: every response
        model,
        batch["response_ids"].to(device),
        torch.cat([mask, batch.attention.long()], dim=1).to(device),
        positions[..., width:],
        returned,
        cache=cache,
    )
    # The prompt's last state predicts the first response token; each response state the next.
    return torch.cat([prompt_hidden[group, -1:], response_hidden[:, :-1]], dim=1)


def packed_media(sharing: Sharing, rows: list[int], media: PromptMedia) -> dict[str, Any]:
    """The media of a micro-batch packed with `sharing` (`mmrl.training.packing.pack`), in the order its
    placeholders come: each group's prompt images and videos once, then the images of its rows' responses."""
    images: list[int] = []
    videos: list[int] = []
    for g, first in enumerate(sharing.first):
        images += media.items("image", rows[first])[: sharing.prompt_images[first]]
        videos += media.items("video", rows[first])
        for r in (r for r, group in enumerate(sharing.group) if group == g):
            images += media.items("image", rows[r])[sharing.prompt_images[r] :]
    return media.take({"image": images, "video": videos})


def prompt_states(
    model: Any,
    family: Family,
    ids: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    media: dict[str, Any],
    common: int,
) -> tuple[torch.Tensor, DynamicCache]:
    """Stages 1 and 2 over distinct prompts (G, P) laid out by `pad_after`: their first `common` tokens
    once (they are the same in every row), then the rest of each. The last hidden states of the prompt
    columns after the common ones, and the cache holding every prompt column's keys and values."""
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    if common:
        family.hidden_states(
            model,
            ids[:1, :common].to(device),
            mask[:1, :common].to(device),
            positions[..., :1, :common],
            {},
            cache=cache,
        )
        cache.batch_select_indices(torch.zeros(len(ids), dtype=torch.long, device=device))
    hidden = family.hidden_states(
        model, ids[:, common:].to(device), mask.to(device), positions[..., common:], media, cache=cache
    )
    return hidden, cache


def common_text(prompts: list[list[int]], media_ids: list[int]) -> int:
    """How many leading tokens all `prompts` (several distinct ones) share before any media token, if at
    least `MIN_COMMON`; each keeps at least its last token for stage 2, which predicts the first response
    token."""
    if len(prompts) < 2:
        return 0
    shortest = min(len(p) for p in prompts) - 1
    count = 0
    while (
        count < shortest
        and prompts[0][count] not in media_ids
        and all(p[count] == prompts[0][count] for p in prompts)
    ):
        count += 1
    return count if count >= MIN_COMMON else 0


def pad_after(
    ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, common: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompts (B, P), their mask, and position ids over them and any columns after, with each
    prompt's padding moved to just after its first `common` tokens: those columns then hold the same
    tokens in every row, and the rest keep their places."""
    width = ids.shape[1]
    pads = (mask == 0).sum(dim=1, keepdim=True)
    column = torch.arange(width)[None]
    order = torch.where(
        column < common, pads + column, torch.where(column < common + pads, column - common, column)
    )
    moved = positions[..., :width].gather(-1, order.expand_as(positions[..., :width]))
    return ids.gather(1, order), mask.gather(1, order), torch.cat([moved, positions[..., width:]], dim=-1)


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
