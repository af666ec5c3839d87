"""Joining the Ray cluster: one place, so the policy group, a rollout worker of its own and the env
workers all join it the same way (and Ray is imported only by runs that use it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray

from mmrl.errors import ResourceError


def connect(address: str | None) -> None:
    """Join the Ray cluster at `address` ('auto' finds one started with `ray start`), or start a local
    one with every CPU and GPU of this machine."""
    if ray.is_initialized():
        return
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)


@dataclass(frozen=True)
class Request:
    """`count` Ray actors that one setting asks for, each of `cpus` CPUs, and a GPU where the cluster has any."""

    setting: str  # what the user set, e.g. "env.num_workers=64"
    count: int
    cpus: float
    gpu: bool = False


def check_capacity(requests: list[Request]) -> None:
    """Refuse at start what the cluster can never hold: an actor bigger than every node, or more CPUs or
    GPUs in all than the cluster has. Ray would otherwise wait for them (a placement, a worker's start)
    until a timeout minutes later, and then blame whatever it was starting."""
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    has_gpu = any(n.get("GPU", 0) > 0 for n in nodes)
    have = {kind: sum(n.get(kind, 0) for n in nodes) for kind in ("CPU", "GPU")}
    largest = max((n.get("CPU", 0) for n in nodes), default=0)
    asked = {
        r.setting: {"CPU": r.count * r.cpus, "GPU": r.count if r.gpu and has_gpu else 0} for r in requests
    }
    cluster = f"the Ray cluster has {have['CPU']:g} CPU(s) and {have['GPU']:g} GPU(s) on {len(nodes)} node(s)"
    for r in requests:
        if r.cpus > largest:
            raise ResourceError(
                f"{r.setting} asks for an actor of {r.cpus:g} CPUs, and no node has that many ({cluster}, "
                f"{largest:g} on the largest): set it to at most {largest:g}"
            )
    for kind in ("CPU", "GPU"):
        total = sum(a[kind] for a in asked.values())
        if total > have[kind]:
            parts = " + ".join(f"{s} ({a[kind]:g})" for s, a in asked.items() if a[kind])
            raise ResourceError(
                f"this run asks Ray for {total:g} {kind}(s): {parts}, and {cluster}, so its workers could "
                f"never all start; lower {' or '.join(s.partition('=')[0] for s, a in asked.items() if a[kind])} "
                f"to fit {have[kind]:g} {kind}(s) in all, or add nodes (`ray start --address=<head>:6379`, "
                "then trainer.ray_address=auto)"
            )
