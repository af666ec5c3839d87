"""The next batch of prompts prepared on a background thread while the current step trains.

Decoding, sizing and tokenizing a batch's images is work a step otherwise waits for at its start; PIL's
decoders and torch's tensor ops release the GIL, so a thread overlaps most of it with rollout and update.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from mmrl.data.loaders import PromptLoader, StreamLoader
from mmrl.data.sample import PromptSample


class PrefetchLoader:
    """A training loader that draws batch k+1 in the background once batch k is handed out.

    Batches are exactly the wrapped loader's: batch k+1 starts from the cursor and skip records batch k
    left. What a checkpoint of step k holds (`source_state`: cursor, skipped rows, huge images) is taken
    when batch k is handed out, before batch k+1 starts, so it never includes the batch being prepared
    and a resumed run draws the same batches; the step's metrics read the same snapshot. `enabled=False`
    draws each batch when asked (`data.prefetch: false`)."""

    def __init__(self, loader: PromptLoader | StreamLoader, enabled: bool = True) -> None:
        self.loader, self.dataset = loader, loader.dataset
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mmrl-prefetch") if enabled else None
        self._next: Future[list[PromptSample]] | None = None
        self._state = self._snapshot()

    def next_batch(self) -> list[PromptSample]:
        batch = self._next.result() if self._next is not None else self.loader.next_batch()
        self._state = self._snapshot()
        if self._pool is not None:
            self._next = self._pool.submit(self.loader.next_batch)
        return batch

    def _snapshot(self) -> dict[str, Any]:
        return {
            "loader": self.loader.state_dict(),
            "bad_rows": dict(self.dataset.bad_rows),
            "huge_rows": dict(self.dataset.huge_rows),
        }

    @property
    def epoch(self) -> int:
        return self._state["loader"]["epoch"]

    @property
    def skipped(self) -> Counter[str]:
        """Distinct rows skipped by reason, up to the batch last handed out."""
        return Counter(self._state["bad_rows"].values())

    @property
    def huge_images(self) -> int:
        return sum(self._state["huge_rows"].values())

    def source_state(self) -> dict[str, Any]:
        """What a checkpoint holds of the data: as of the batch last handed out."""
        return {key: dict(value) for key, value in self._state.items()}

    def load_source_state(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint's data state; a batch prepared from the state before is dropped."""
        self._drop_pending()
        self.loader.load_state_dict(state["loader"])
        self.dataset.bad_rows = dict(state["bad_rows"])
        self.dataset.huge_rows = dict(state.get("huge_rows", {}))  # absent in older checkpoints
        self._state = self._snapshot()

    def close(self) -> None:
        self._drop_pending()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _drop_pending(self) -> None:
        if self._next is not None:
            self._next.exception()  # wait for it: it may still be writing the dataset's skip records
            self._next = None
