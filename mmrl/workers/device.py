"""The device a Ray worker computes on: the GPU Ray assigned it, or the CPU.

Ray normally makes an actor's assigned GPU the only one it sees (`cuda:0`). Under
`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`, common on clusters set up for verl, every GPU stays
visible, and a worker that took `cuda:0` would share GPU 0 with every other rank. So the index comes from
`ray.get_gpu_ids()`, as a position among the visible devices, and becomes the process's current device:
NCCL, FSDP2 and vLLM's `LOCAL_RANK` (`torch.cuda.current_device()`) all follow it.
"""

from __future__ import annotations

import os

import torch


def visible_index(gpu_ids: list, visible: str | None) -> int:
    """The index, among the devices `CUDA_VISIBLE_DEVICES` = `visible` shows, of the first of `gpu_ids`
    (Ray's ids, which are physical ids); 0 without an assigned GPU."""
    if not gpu_ids:
        return 0
    gpu = str(gpu_ids[0])
    if not visible:
        return int(gpu)
    shown = [d.strip() for d in visible.split(",")]
    if gpu not in shown:
        raise RuntimeError(f"Ray assigned GPU {gpu}, which CUDA_VISIBLE_DEVICES={visible} does not show")
    return shown.index(gpu)


def worker_device() -> torch.device:
    """This worker's device, made the current CUDA device where it is a GPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    import ray

    ids = ray.get_gpu_ids() if ray.is_initialized() else []
    device = torch.device("cuda", visible_index(ids, os.environ.get("CUDA_VISIBLE_DEVICES")))
    torch.cuda.set_device(device)
    return device
