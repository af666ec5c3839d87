"""The reward section: the functions that score responses and how their calls are isolated."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from mmrl.config.base import Section


class RewardFunctionConfig(Section):
    """One reward function; an `async def` one is detected and its calls in a batch run concurrently."""

    name: str = Field(description="A built-in grader's short name, or path/to/file.py:function")
    weight: float = Field(1.0, description="Weight of this function in the summed score")
    kwargs: dict[str, Any] = Field({}, description="Keyword arguments passed to the function")
    batched: bool | None = Field(
        None,
        description="Called once per batch with list[RewardInput], returning one score per sample; "
        "unset: per sample, except built-in model rewards (reward_model, llm_judge)",
    )


class RewardConfig(Section):
    functions: list[RewardFunctionConfig] = Field([RewardFunctionConfig(name="answer_match")])
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="Seconds a call of your function may take before it scores 0 (unset: 10); enforced in "
        "worker processes and on async functions, so refused for a plain one under isolation: inline",
    )
    isolation: Literal["inline", "process"] = Field(
        "process",
        description="process: functions from files run in worker processes, so a hang, exit or crash costs "
        "one score, not the run; inline: in the trainer's process (trusted code only). Built-in graders "
        "run in-process either way",
    )
    num_workers: int = Field(2, gt=0, description="Worker processes for isolation: process")
    max_all_failed_steps: int = Field(
        3,
        ge=0,
        description="Stop the run after this many steps in a row in which one reward function failed on "
        "every sample (0: never), naming the function and its first error",
    )
