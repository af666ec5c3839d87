"""The trainer section: the run's length, its checkpoints and loggers, and where its workers run."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from mmrl.config.base import Section


class TrainerConfig(Section):
    total_steps: int = Field(100, gt=0, description="Training steps of the run")
    val_every: int = Field(10, ge=0, description="0 disables periodic validation")
    val_before_train: bool = Field(True, description="Validate once before the first step")
    stop_at: dict[str, float] = Field(
        {},
        description="Validation targets, e.g. {val/accuracy: 0.9}: the run ends, saved as at its last step, "
        "at the first periodic validation where every named metric is at least its value (a run to a "
        "target accuracy rather than a step count)",
    )
    stop_at_gain: dict[str, float] = Field(
        {},
        description="Validation gains, e.g. {val/accuracy: 0.3}: as stop_at, with each target this much "
        "above the metric's value in the validation before training",
    )
    save_every: int = Field(0, ge=0, description="0 saves only at the end")
    keep_checkpoints: int = Field(2, gt=0, description="Checkpoints kept; older ones are deleted")
    max_consecutive_bad_steps: int = Field(
        3,
        gt=0,
        description="Steps in a row whose every update had a non-finite gradient before the run stops "
        "(after saving the last good state)",
    )
    output_dir: str = Field(
        "runs/{experiment_name}", description="Where the run writes; {experiment_name} is filled in"
    )
    experiment_name: str = Field("mmrl", description="The run's name in logs and output_dir")
    device: str = Field("auto", description="auto (CUDA when present, else CPU), cpu or cuda")
    seed: int = Field(1, description="Seed of data order, sampling and initialisation")
    loggers: list[Literal["console", "jsonl", "tensorboard", "wandb", "swanlab"]] = Field(
        ["console", "jsonl", "tensorboard"], description="Where metrics go"
    )
    progress: bool = Field(True, description="Show a progress bar on the console")
    gallery_samples: int = Field(32, ge=0, description="Validation samples per gallery page; 0 writes none")
    nnodes: int = Field(1, gt=0, description="Nodes of the Ray cluster that run actor workers")
    n_gpus_per_node: int = Field(
        1,
        gt=0,
        description="Actor workers per node, one GPU each; on machines without GPUs each takes "
        "trainer.cpus_per_worker CPU cores. nnodes x n_gpus_per_node > 1 trains with FSDP2 across Ray workers",
    )
    cpus_per_worker: int = Field(1, gt=0, description="CPU cores of each Ray actor worker")
    ray_address: str | None = Field(
        None,
        description="Join a running Ray cluster ('auto', or the head's host:port from `ray start --head`); "
        "unset starts a local one when workers are used",
    )
    dist_timeout_s: float = Field(600.0, gt=0, description="How long a collective waits for a silent rank")

    @field_validator("device")
    @classmethod
    def _a_torch_device(cls, device: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
            raise ValueError(f"{device!r} is no device mmrl trains on: use auto, cpu, cuda or cuda:N")
        return device

    @field_validator("output_dir")
    @classmethod
    def _only_the_experiment_name_is_filled_in(cls, output_dir: str) -> str:
        try:
            output_dir.format(experiment_name="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"{output_dir!r}: only {{experiment_name}} is filled in (braces of a literal name doubled: "
                f"{{{{ }}}}); {type(err).__name__}: {err}"
            ) from None
        return output_dir

    @field_validator("stop_at", "stop_at_gain")
    @classmethod
    def _targets_are_validation_metrics(cls, targets: dict[str, float]) -> dict[str, float]:
        odd = [name for name in targets if not name.startswith("val/")]
        if odd:
            raise ValueError(
                f"stop_at names {odd}: a target is a validation metric, such as val/accuracy (the val/* "
                "keys of metrics.jsonl)"
            )
        return targets

    @model_validator(mode="after")
    def _targets_need_validation(self) -> TrainerConfig:
        if (self.stop_at or self.stop_at_gain) and not self.val_every:
            raise ValueError(
                "trainer.stop_at is checked at each periodic validation: set trainer.val_every > 0"
            )
        if self.stop_at_gain and not self.val_before_train:
            raise ValueError(
                "trainer.stop_at_gain counts from the validation before training: set trainer.val_before_train=true"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.nnodes * self.n_gpus_per_node

    @property
    def uses_workers(self) -> bool:
        """Ray worker groups (and FSDP2) instead of training inside the controller's process."""
        return self.world_size > 1 or self.ray_address is not None

    def torch_device(self) -> str:
        """`device`, with "auto" resolved to cuda where a GPU is visible."""
        import torch

        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"
