"""The VLA sections: a simulator task whose episodes are the data, and the behaviour cloning before RL."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from mmrl.config.base import Section
from mmrl.config.training import OptimSection

FLOW_HEADS = 4  # the flow-matching expert's attention heads (mmrl.models.action_head.HeadSpec.heads)


class EnvConfig(Section):
    """A simulator task instead of prompt rows (VLA training): each step runs `rollout.n` episodes from
    each of `data.train_batch_size` initial states, and every decision earns its episode's return.
    Training episodes act at `rollout.temperature`; evaluation episodes at `rollout.val` (greedy)."""

    task: str = Field(description="A registered env (envs.registered_envs(): reach, push, ...)")
    options: dict[str, Any] = Field(
        {}, description="make_env keyword arguments, e.g. image_size, camera, max_steps, shaping"
    )
    prompt: str = Field(
        "<image>{instruction}",
        description="The prompt per decision: one <image> marker (the frames), {instruction}, optionally "
        "{state} (the proprioceptive state, two decimals a number)",
    )
    history: int = Field(
        1, gt=0, description="Frames per decision: the current one and the history-1 env steps before it"
    )
    n_bins: int = Field(256, gt=1, description="Action bins per dimension when no SFT tokenizer is found")
    chunk: int = Field(1, gt=0, description="Env steps per decision when no SFT tokenizer is found")
    invalid_penalty: float = Field(
        0.0, ge=0, description="Subtracted from an episode's return per malformed action (applied as zero)"
    )
    num_workers: int = Field(
        0, ge=0, description="Ray env worker processes; 0 steps the envs in the trainer's process"
    )
    max_envs: int | None = Field(
        None,
        gt=0,
        description="Envs alive at once; more episodes than this run in waves. Bounds memory for heavy "
        "simulators (a Meta-World env holds ~180 MB); default: one env per episode",
    )
    timeout_s: float = Field(60.0, gt=0, description="Per reset/step call on a worker before it is replaced")
    max_restarts: int = Field(3, ge=0, description="Replacements of one worker within one call")

    @field_validator("prompt")
    @classmethod
    def _one_frame_marker(cls, prompt: str) -> str:
        if prompt.count("<image>") != 1 or "{instruction}" not in prompt:
            raise ValueError(
                "the prompt per decision needs exactly one <image> marker (where the frames go) and "
                "{instruction}, as in '<image>{instruction}'"
            )
        return prompt

    val_episodes: int = Field(50, ge=0, description="Greedy evaluation episodes at each validation")
    val_seed: int = Field(1_000_000, ge=0, description="First evaluation seed; training seeds stay below it")
    media_episodes: int = Field(4, ge=0, description="Evaluation episodes drawn into each validation GIF")


class SftConfig(OptimSection):
    """`mmrl sft`: behaviour cloning on noisy scripted demos, writing the model RL starts from (model.path)."""

    base_model: str = Field(description="The model cloning starts from (e.g. `mmrl model init-tiny` output)")
    demos: int = Field(200, gt=0, description="Expert episodes")
    demo_seed: int = Field(500_000, ge=0, description="First env seed of the demos")
    demo_workers: int = Field(
        1, gt=0, description="Processes collecting the demos (each a slice of the seeds; same demos as one)"
    )
    noise: float | None = Field(None, ge=0, description="Expert action noise std; None: the task's default")
    success_only: bool = Field(False, description="Clone only the demos that succeeded")
    labels: Literal["executed", "expert"] = Field(
        "executed",
        description="What the clone is taught at each demo frame: the noisy action the demo executed, or "
        "the expert's noise-free action there (DART: noise only widens the states the demos visit)",
    )
    policy: Literal["tokens", "gaussian", "flow"] = Field(
        "tokens",
        description="What the clone emits: action tokens (256 bins a dimension, OpenVLA); a continuous chunk "
        "from a head on the backbone, decoded in one forward and taught by L1 (OpenVLA-OFT), which RL samples "
        "as a Gaussian (gaussian); or a chunk denoised by a flow-matching action expert (pi0), which RL samples "
        "with noise at each denoising step (flow)",
    )
    action_std: float = Field(
        0.2,
        gt=0,
        description="gaussian, flow: the starting standard deviation (normalised units) of an action, or of a "
        "whole denoising chain's injected noise",
    )
    learn_std: bool = Field(
        True, description="gaussian, flow: RL learns the standard deviation; else it stays"
    )
    flow_steps: int = Field(4, gt=0, description="flow: denoising (Euler) steps per chunk")
    flow_width: int = Field(64, gt=0, description="flow: the action expert's width (its 2 layers, 4 heads)")
    steps: int = Field(300, gt=0, description="Optimizer steps (the schedule's length)")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate")
    batch_size: int = Field(64, gt=0, description="Demo frames per step")

    max_grad_norm: float | None = Field(
        None, gt=0, description="Clip each step's gradient norm; None: no clipping"
    )

    @field_validator("flow_width")
    @classmethod
    def _heads_divide_width(cls, width: int) -> int:
        if width % FLOW_HEADS:
            raise ValueError(
                f"the flow expert's {FLOW_HEADS} attention heads split its width evenly: give a multiple "
                f"of {FLOW_HEADS}, such as {max(FLOW_HEADS, width // FLOW_HEADS * FLOW_HEADS)}"
            )
        return width
