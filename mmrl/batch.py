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

    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of at most `size` rows."""
        return [self.select(range(i, min(i + size, len(self)))) for i in range(0, len(self), size)]
