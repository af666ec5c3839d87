"""A batch of responses: per-row tensors and lists, plus the prompts the rows point into.

Rows are responses; `prompt_index[i]` says which prompt in `prompts` produced row i. The
trainer fills in scores, log-probs and advantages as named tensors, and mini/micro-batching
and (later) splitting across workers are all `select`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor]
    lists: dict[str, list[Any]] = field(default_factory=dict)
    prompts: list[Any] = field(default_factory=list)

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, key: str) -> Any:
        return self.tensors[key] if key in self.tensors else self.lists[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.lists

    def set(self, **values: Any) -> None:
        """Add or replace columns; each must have one entry per row."""
        for key, value in values.items():
            if len(value) != len(self):
                raise ValueError(f"column {key} has {len(value)} rows, batch has {len(self)}")
            (self.tensors if isinstance(value, torch.Tensor) else self.lists)[key] = value

    def select(self, rows: Sequence[int] | torch.Tensor) -> Batch:
        """The given rows, in the given order; the prompt list is shared, not copied."""
        index = torch.as_tensor(rows, dtype=torch.long)
        picked = index.tolist()
        return Batch(
            tensors={k: v[index] for k, v in self.tensors.items()},
            lists={k: [v[i] for i in picked] for k, v in self.lists.items()},
            prompts=self.prompts,
        )

    def compact(self) -> Batch:
        """The same rows with only the prompts they point into, so a worker is sent its own
        prompts' images and not the whole batch's."""
        used, index = self["prompt_index"].unique(sorted=True, return_inverse=True)
        tensors = {**self.tensors, "prompt_index": index}
        return Batch(
            tensors=tensors, lists=dict(self.lists), prompts=[self.prompts[i] for i in used.tolist()]
        )

    @property
    def attention(self) -> torch.Tensor:
        """(rows, response tokens): which response tokens exist. Only the policy's own tokens train
        (`response_mask`); a multi-turn row also holds tool responses between them (`mmrl.agent`)."""
        return self.tensors.get("response_attention", self.tensors["response_mask"])

    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of at most `size` rows."""
        return [self.select(range(i, min(i + size, len(self)))) for i in range(0, len(self), size)]


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as a left-padded (B, L) id tensor and its attention mask."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask


def right_pad(
    rows: Sequence[Sequence[float]], value: float = 0, dtype: torch.dtype = torch.long
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists as a right-padded (B, T) tensor (at least one column) and the mask of their entries: how
    responses given as token lists become response columns."""
    width = max(1, max(map(len, rows), default=0))
    out = torch.full((len(rows), width), value, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
        mask[i, : len(row)] = 1
    return out, mask


def concat(batches: Sequence[Batch]) -> Batch:
    """The rows of `batches` in order; prompt lists are joined and each `prompt_index` shifted to match.

    Per-token columns of different widths (generation stops when its longest response does)
    are right-padded with 0, which every consumer masks out with `response_mask`.
    """
    prompts: list[Any] = []
    shifted = []
    for batch in batches:
        shifted.append(batch["prompt_index"] + len(prompts))
        prompts += batch.prompts
    first = batches[0]
    tensors = {k: _cat_padded([b.tensors[k] for b in batches]) for k in first.tensors}
    tensors["prompt_index"] = torch.cat(shifted)
    lists = {k: [item for b in batches for item in b.lists[k]] for k in first.lists}
    return Batch(tensors=tensors, lists=lists, prompts=prompts)


def _cat_padded(parts: list[torch.Tensor]) -> torch.Tensor:
    if parts[0].dim() < 2:
        return torch.cat(parts)
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


def token_count(batch: Batch) -> int:
    """Tokens the step computed: every row's prompt and its attended positions (tool responses between
    turns included), the throughput metrics' numerator."""
    prompt_tokens = sum(len(batch.prompts[i].prompt_ids) for i in batch["prompt_index"].tolist())
    return prompt_tokens + int(batch.attention.sum())


def response_metrics(batch: Batch) -> dict[str, float]:
    """Response and prompt lengths, and how many responses hit the length limit."""
    lengths = batch["response_mask"].sum(dim=1).float()
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_frac": float(batch["truncated"].float().mean()),
        "prompt_length/mean": sum(len(p.prompt_ids) for p in batch.prompts) / len(batch.prompts),
    }
