"""Loaders: the order in which a dataset's rows become training batches, and the cursor that resumes it.

Both are endless and seeded, and their cursor (epoch, position) is their whole state, so a resumed run
sees exactly the rows an uninterrupted one would. `PromptLoader` permutes an indexable set per epoch;
`StreamLoader` shuffles a streamed one through a buffer. Skipped rows are consumed and replaced.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from mmrl.data.dataset import PromptDataset
from mmrl.data.rows import Row
from mmrl.data.sample import PromptSample

if TYPE_CHECKING:
    from mmrl.config import DataConfig


class PromptLoader:
    """Endless, seeded, resumable batches: epoch e visits rows in permutation(seed, e).

    The cursor (epoch, position) is all the state there is, so a resumed run sees exactly the
    rows an uninterrupted one would. Skipped rows are consumed and replaced from the stream.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if len(dataset) == len(dataset.checked):  # empty, or every row failed `check_rows`
            raise dataset.unusable()
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.dataset))

    def next_batch(self) -> list[PromptSample]:
        batch: list[PromptSample] = []
        order = self._order()
        while len(batch) < self.batch_size:
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
                order = self._order()
            sample = self.dataset.prepare(int(order[self.position]))
            self.position += 1
            if sample is not None:
                batch.append(sample)
            elif len(self.dataset.bad_rows) == len(self.dataset):  # every row tried and skipped
                raise self.dataset.unusable()
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class StreamLoader:
    """`PromptLoader` over a `RowStream`: endless, seeded, resumable batches of rows read in order and
    shuffled through a buffer of `buffer_size` rows drawn with rng(seed, epoch).

    The cursor (epoch, rows taken this epoch) is all the state there is: a resumed run replays the epoch
    up to it (reading rows, not decoding their media) and so sees exactly the rows an uninterrupted one
    would. `datasets`' own stream state does not restore a shuffle buffer, hence this one."""

    def __init__(
        self,
        dataset: PromptDataset,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        buffer_size: int = 10_000,
    ) -> None:
        if dataset.stream is None or not dataset.rows:
            raise dataset.unusable()
        self.dataset, self.stream = dataset, dataset.stream
        self.batch_size, self.seed, self.shuffle, self.buffer_size = batch_size, seed, shuffle, buffer_size
        self.epoch = 0
        self.position = 0
        self._rows = self._epoch_rows()

    def _epoch_rows(self) -> Iterator[tuple[int, Row]]:
        """This epoch's rows with their place in the stream (the key their skips are counted by)."""
        rows = enumerate(self.stream)
        if not self.shuffle:
            yield from rows
            return
        rng = np.random.default_rng([self.seed, self.epoch])
        buffer: list[tuple[int, Row]] = []
        for item in rows:
            if len(buffer) < self.buffer_size:
                buffer.append(item)
                continue
            pick = int(rng.integers(len(buffer)))
            yield buffer[pick]
            buffer[pick] = item
        rng.shuffle(buffer)  # type: ignore[arg-type]
        yield from buffer

    def next_batch(self) -> list[PromptSample]:
        batch: list[PromptSample] = []
        usable_this_epoch = self.position > 0
        while len(batch) < self.batch_size:
            item = next(self._rows, None)
            if item is None:
                if not usable_this_epoch and not batch:
                    raise self.dataset.unusable()  # a whole epoch and not one usable row
                self.epoch, self.position, usable_this_epoch = self.epoch + 1, 0, False
                self._rows = self._epoch_rows()
                continue
            self.position += 1
            sample = self.dataset.prepare(*item)
            if sample is not None:
                batch.append(sample)
                usable_this_epoch = True
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._rows = itertools.islice(self._epoch_rows(), self.position, None)


def make_loader(dataset: PromptDataset, cfg: DataConfig, seed: int) -> PromptLoader | StreamLoader:
    """The training loader: `StreamLoader` for a streamed set (`data.streaming`), else `PromptLoader`."""
    if dataset.stream is not None:
        return StreamLoader(dataset, cfg.train_batch_size, seed, cfg.shuffle, cfg.shuffle_buffer)
    return PromptLoader(dataset, cfg.train_batch_size, seed, cfg.shuffle)
