"""Token-budget micro-batches: rows grouped by length so each forward stays within a token count.

A fixed `micro_batch_size` sizes every forward for the longest rows; packing by tokens lets many
short rows share a forward and gives a long one fewer companions. The padded count a forward
computes is rows × (longest prompt + longest response) of its micro-batch (prompts are left-padded
to the longest, responses cut to the longest), so rows are sorted by length before packing.
Grouping never changes the gradient: every loss is divided by the whole mini-batch's totals
(`optim.MiniBatch`), whichever rows share a forward.
"""

from __future__ import annotations

import logging

import torch

from mmrl.data.batch import Batch

log = logging.getLogger("mmrl.training.micro_batches")

Layout = list[list[int]]  # the row indices of each micro-batch, in the order they run
_warned_oversized = False  # a row over the budget is logged once per process, not every step


def row_lengths(batch: Batch) -> list[tuple[int, int]]:
    """(prompt tokens, response tokens) of every row: what its forward computes before padding.

    The response counts up to its last valid token, as `micro_batches` cuts it."""
    responses = _response_lengths(batch.attention)
    prompts = [len(batch.prompts[i].prompt_ids) for i in batch["prompt_index"].tolist()]
    return list(zip(prompts, responses, strict=True))


def padded_tokens(lengths: list[tuple[int, int]], rows: list[int]) -> int:
    """Tokens one forward over `rows` computes: rows × (longest prompt + longest response)."""
    if not rows:
        return 0
    return len(rows) * (max(lengths[r][0] for r in rows) + max(lengths[r][1] for r in rows))


def pack_rows(lengths: list[tuple[int, int]], rows: list[int], max_tokens: int) -> Layout:
    """`rows` longest first, each micro-batch filled while its padded count stays within `max_tokens`.

    Sorted rows put similar lengths together, so little of a forward is padding. A row over the
    budget on its own still runs, alone, with a warning."""
    global _warned_oversized
    layout: Layout = []
    for row in sorted(rows, key=lambda r: (-sum(lengths[r]), r)):
        if layout and padded_tokens(lengths, [*layout[-1], row]) <= max_tokens:
            layout[-1].append(row)
            continue
        if sum(lengths[row]) > max_tokens and not _warned_oversized:
            _warned_oversized = True
            log.warning(
                "a row of %d tokens is over actor.max_tokens_per_micro_batch=%d: it runs alone in its "
                "micro-batch (logged once)",
                sum(lengths[row]),
                max_tokens,
            )
        layout.append([row])
    return layout


def deal(lengths: list[tuple[int, int]], world: int) -> list[list[int]]:
    """Rows dealt to `world` workers, longest first, each to the worker with the fewest tokens so far.

    The workers' token counts then differ by at most one row's tokens."""
    shares: list[list[int]] = [[] for _ in range(world)]
    loads = [0] * world
    for row in sorted(range(len(lengths)), key=lambda r: (-sum(lengths[r]), r)):
        rank = loads.index(min(loads))
        shares[rank].append(row)
        loads[rank] += sum(lengths[row])
    return shares


def worker_layouts(lengths: list[tuple[int, int]], world: int, max_tokens: int) -> list[Layout]:
    """Each worker's micro-batches over its share of the rows, the same number on every worker.

    FSDP's collectives need every rank to run the same forwards, so a worker with fewer micro-batches
    splits its largest in two (still within budget) until it has as many; an empty micro-batch, where
    it has too few rows for that, stands for a blank one that carries no loss."""
    layouts = [pack_rows(lengths, share, max_tokens) for share in deal(lengths, world)]
    count = max(len(layout) for layout in layouts)
    for layout in layouts:
        while len(layout) < count:
            largest = max(range(len(layout)), key=lambda i: len(layout[i]), default=None)
            if largest is None or len(layout[largest]) < 2:
                layout.append([])
                continue
            rows = layout[largest]
            layout[largest : largest + 1] = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    return layouts


def micro_layout(batch: Batch, max_tokens: int | None) -> Layout | None:
    """One process's micro-batches under a token budget; None without one (fixed-count chunks)."""
    if max_tokens is None:
        return None
    return worker_layouts(row_lengths(batch), 1, max_tokens)[0]


def micro_batches(batch: Batch, layout: Layout) -> list[Batch]:
    """The micro-batches of `layout`, each cut to its longest response: the padding columns past it
    hold no valid token and, under causal attention, change nothing before them."""
    return [_cut_to_response(batch.select(rows)) for rows in layout]


def rank_rows(layout: Layout, blank: int) -> tuple[list[int], Layout]:
    """A worker's rows in micro-batch order, an empty micro-batch running the row `blank` alone, and
    its micro-batches as positions in those rows: what the worker group sends each rank."""
    rows: list[int] = []
    local: Layout = []
    for micro in layout:
        members = micro or [blank]
        local.append(list(range(len(rows), len(rows) + len(members))))
        rows += members
    return rows, local


def scatter_rows(size: int, width: int, layout: Layout, parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-token outputs (rows, tokens) of each micro-batch put back in row order, right-padded
    with 0 to `width`."""
    out = parts[0].new_zeros(size, width)
    for rows, part in zip(layout, parts, strict=True):
        out[rows, : part.shape[1]] = part
    return out


def _response_lengths(mask: torch.Tensor) -> list[int]:
    """Up to each row's last valid token, and at least one (a forward needs a column)."""
    positions = torch.arange(1, mask.shape[1] + 1).expand_as(mask)
    return torch.where(mask.bool(), positions, 0).amax(dim=1).clamp(min=1).tolist()


def _cut_to_response(micro: Batch) -> Batch:
    width = micro["response_ids"].shape[1]
    keep = max(_response_lengths(micro.attention))
    tensors = {k: v[:, :keep] if v.dim() > 1 and v.shape[1] == width else v for k, v in micro.tensors.items()}
    return Batch(tensors=tensors, lists=micro.lists, prompts=micro.prompts)
