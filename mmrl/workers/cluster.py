"""Joining the Ray cluster: one place, so the policy group, a rollout worker of its own and the env
workers all join it the same way (and Ray is imported only by runs that use it)."""

from __future__ import annotations

import logging

import ray


def connect(address: str | None) -> None:
    """Join the Ray cluster at `address` ('auto' finds one started with `ray start`), or start a local
    one with every CPU and GPU of this machine."""
    if ray.is_initialized():
        return
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
