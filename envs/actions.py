"""Continuous actions as tokens a VLM can emit, and back, following the OpenVLA recipe.

Each action dimension is normalised to [-1, 1] with the 1st/99th percentiles of demonstration
actions (robust to outliers, clipped beyond them), cut into ``n_bins`` uniform bins, and each bin is
one reserved token id. By default the ids are the last ``n_bins`` of the model's vocabulary, as in
OpenVLA: on Qwen2.5-VL those embedding rows are padding no text token uses. A policy may emit
``chunk`` steps per decision (``chunk * action_dim`` tokens, step-major). Malformed output is data,
not a crash: ``decode`` returns an ``InvalidAction`` with a reason the rollout loop can count and
penalise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = ["ActionStats", "ActionTokenizer", "ContinuousActions", "InvalidAction"]


@dataclass(frozen=True, eq=False)
class ActionStats:
    """Per-dimension 1st and 99th percentiles of demonstration actions."""

    q01: np.ndarray
    q99: np.ndarray

    @classmethod
    def from_demos(cls, actions: np.ndarray | Sequence[np.ndarray]) -> ActionStats:
        """Statistics over every step of the demos: an (N, dim) array or a list of (T_i, dim) episodes."""
        steps = [
            np.asarray(a, dtype=np.float64)
            for a in ([actions] if isinstance(actions, np.ndarray) else actions)
        ]
        if not steps or any(a.ndim != 2 for a in steps) or len({a.shape[1] for a in steps}) != 1:
            raise ValueError("demo actions must be an (N, dim) array or a non-empty list of (T, dim) arrays")
        flat = np.concatenate(steps)
        if len(flat) == 0 or not np.all(np.isfinite(flat)):
            raise ValueError("demo actions must contain at least one step and only finite values")
        return cls(q01=np.quantile(flat, 0.01, axis=0), q99=np.quantile(flat, 0.99, axis=0))

    @classmethod
    def from_dict(cls, data: dict[str, list[float]]) -> ActionStats:
        """Inverse of ``to_dict``, for statistics saved next to a checkpoint."""
        return cls(
            q01=np.asarray(data["q01"], dtype=np.float64), q99=np.asarray(data["q99"], dtype=np.float64)
        )

    def to_dict(self) -> dict[str, list[float]]:
        """JSON-ready, because a policy is useless without the statistics it was trained with."""
        return {"q01": self.q01.tolist(), "q99": self.q99.tolist()}

    def normalize(self, actions: np.ndarray) -> np.ndarray:
        """Map [q01, q99] onto [-1, 1], clipping beyond; a constant dimension maps to 0."""
        span = self.q99 - self.q01
        scaled = np.divide(
            2.0 * (np.asarray(actions) - self.q01), span, out=np.ones(np.shape(actions)), where=span > 0
        )
        return np.clip(scaled - 1.0, -1.0, 1.0)

    def unnormalize(self, actions: np.ndarray) -> np.ndarray:
        """Map [-1, 1] back onto [q01, q99]."""
        return self.q01 + (np.asarray(actions) + 1.0) * 0.5 * (self.q99 - self.q01)


@dataclass(frozen=True)
class InvalidAction:
    """Why a token sequence is not an action; ``kind`` is a fixed label for counting, ``reason`` for logs."""

    kind: Literal["length", "out_of_range"]
    reason: str


@dataclass(frozen=True)
class ActionTokenizer:
    """Uniform bins over [-1, 1] per dimension, bin ``b`` being token id ``start_id + b``."""

    action_dim: int
    start_id: int
    n_bins: int = 256
    chunk: int = 1
    stats: ActionStats | None = None

    def __post_init__(self) -> None:
        for name in ("action_dim", "n_bins", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.start_id < 0:
            raise ValueError(f"start_id must be a non-negative token id, got {self.start_id}")
        if self.stats is not None and self.stats.q01.shape != (self.action_dim,):
            raise ValueError(
                f"stats are for {self.stats.q01.shape} actions, not action_dim={self.action_dim}"
            )

    @classmethod
    def for_vocab(
        cls,
        vocab_size: int,
        action_dim: int,
        *,
        n_bins: int = 256,
        chunk: int = 1,
        stats: ActionStats | None = None,
    ) -> ActionTokenizer:
        """The OpenVLA convention: the last ``n_bins`` ids of a ``vocab_size`` vocabulary are the bins."""
        if vocab_size < n_bins:
            raise ValueError(f"a vocabulary of {vocab_size} ids cannot hold {n_bins} action bins")
        return cls(
            action_dim=action_dim, start_id=vocab_size - n_bins, n_bins=n_bins, chunk=chunk, stats=stats
        )

    def to_dict(self) -> dict[str, object]:
        """JSON-ready, saved beside a policy: its actions mean nothing without the bins and statistics."""
        return {
            "action_dim": self.action_dim,
            "start_id": self.start_id,
            "n_bins": self.n_bins,
            "chunk": self.chunk,
            "stats": None if self.stats is None else self.stats.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ActionTokenizer:
        stats = data.get("stats")
        return cls(
            action_dim=int(data["action_dim"]),
            start_id=int(data["start_id"]),
            n_bins=int(data["n_bins"]),
            chunk=int(data["chunk"]),
            stats=None if stats is None else ActionStats.from_dict(stats),
        )

    @property
    def n_tokens(self) -> int:
        """Tokens per decision."""
        return self.chunk * self.action_dim

    @property
    def token_ids(self) -> range:
        """The reserved ids, e.g. to constrain generation to them."""
        return range(self.start_id, self.start_id + self.n_bins)

    def encode(self, actions: np.ndarray) -> list[int]:
        """Token ids for one decision's ``(chunk, action_dim)`` actions (``(action_dim,)`` if chunk is 1)."""
        a = np.asarray(actions, dtype=np.float64)
        if a.shape == (self.action_dim,) and self.chunk == 1:
            a = a[None]
        if a.shape != (self.chunk, self.action_dim):
            raise ValueError(f"expected actions of shape ({self.chunk}, {self.action_dim}), got {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError("actions must be finite")
        normalised = self.stats.normalize(a) if self.stats is not None else np.clip(a, -1.0, 1.0)
        bins = np.clip(np.floor((normalised + 1.0) * 0.5 * self.n_bins), 0, self.n_bins - 1).astype(np.int64)
        return (bins.reshape(-1) + self.start_id).tolist()

    def decode(self, ids: Sequence[int] | np.ndarray) -> np.ndarray | InvalidAction:
        """``(chunk, action_dim)`` actions at bin centres (unnormalised with ``stats``), or InvalidAction."""
        ids = np.asarray(ids).reshape(-1)
        if len(ids) != self.n_tokens:
            return InvalidAction(
                "length",
                f"expected {self.n_tokens} action tokens ({self.chunk} step(s) x {self.action_dim} dims), "
                f"got {len(ids)}",
            )
        bins = ids - self.start_id
        bad = np.flatnonzero((bins < 0) | (bins >= self.n_bins))
        if len(bad):
            first = int(bad[0])
            return InvalidAction(
                "out_of_range",
                f"{len(bad)} of {len(ids)} tokens are not action tokens (first: id {int(ids[first])} at "
                f"position {first}); action ids are {self.start_id}..{self.start_id + self.n_bins - 1}",
            )
        centres = -1.0 + (bins.reshape(self.chunk, self.action_dim) + 0.5) * (2.0 / self.n_bins)
        return self.stats.unnormalize(centres) if self.stats is not None else centres


@dataclass(frozen=True)
class ContinuousActions:
    """A continuous head's actions: ``chunk`` steps of ``action_dim`` values in [-1, 1], the demos'
    q01/q99 mapped onto that range as the tokenizer's bins are. One action query per chunk step."""

    action_dim: int
    chunk: int = 1
    stats: ActionStats | None = None

    @property
    def n_tokens(self) -> int:
        """Action queries per decision: one per chunk step."""
        return self.chunk

    def encode(self, actions: np.ndarray) -> np.ndarray:
        """Normalised ``(chunk, action_dim)`` targets for one decision's env actions."""
        a = np.asarray(actions, dtype=np.float64).reshape(self.chunk, self.action_dim)
        return self.stats.normalize(a) if self.stats is not None else np.clip(a, -1.0, 1.0)

    def decode(self, values: np.ndarray) -> np.ndarray | InvalidAction:
        """Env actions for a sampled chunk: clipped to [-1, 1] (a Gaussian's tail), then unnormalised."""
        a = np.asarray(values, dtype=np.float64)
        if a.shape != (self.chunk, self.action_dim):
            return InvalidAction(
                "length", f"expected a ({self.chunk}, {self.action_dim}) chunk, got {a.shape}"
            )
        if not np.all(np.isfinite(a)):
            return InvalidAction("out_of_range", "the head emitted a non-finite action")
        a = np.clip(a, -1.0, 1.0)
        return self.stats.unnormalize(a) if self.stats is not None else a
