"""The run configuration: one YAML file, typed and validated before any work starts.

Every section forbids unknown keys, so a typo fails at start with the key's dotted name,
a close match if there is one, and what to do. `key.sub=value` overrides from the command
line are parsed as YAML scalars and checked the same way.
"""

from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mmrl.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Section):
    """LoRA adapters (peft) instead of full fine-tuning; the KL reference is then the base model with
    the adapter switched off, so no second copy of the weights is held."""

    rank: int = Field(0, ge=0, description="0 trains all weights (full fine-tuning)")
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | None = Field(
        None,
        description="Linear layer names (q_proj, ...); default: every linear layer of the language model",
    )
    include_vision: bool = Field(False, description="Also adapt the vision tower's linear layers")


class ModelConfig(_Section):
    path: str = Field(
        description="A model folder or hub id of a supported family (README), or `mmrl model init-tiny` output"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    freeze_vision_tower: bool = False
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute layer activations in the backward pass: less memory, about 30% more time",
    )
    lora: LoraConfig = LoraConfig()


class DataConfig(_Section):
    train_files: list[str] = Field(
        [],
        description="jsonl/json/parquet/arrow files, dataset folders (save_to_disk or split files), "
        "or FOLDER@SPLIT; required unless an env section makes episodes the data",
    )
    val_files: list[str] = []
    image_dir: str | None = Field(
        None, description="Base folder for relative image paths (default: the file's, or the named folder)"
    )
    format: Literal["auto", "easyr1", "verl"] = Field(
        "auto",
        description="Row layout; auto: verl if there are prompt and reward_model columns and no problem",
    )
    prompt_key: str | None = Field(
        None,
        description="Text or chat-messages column (default: problem, or prompt for verl); a.b reaches a field",
    )
    answer_key: str | None = Field(
        None, description="Ground-truth column (default: answer, or reward_model.ground_truth for verl)"
    )
    image_key: str = "images"
    video_key: str = Field(
        "videos",
        description="Column of videos: a path, bytes or {bytes|path}, or a list of them; <video> marks each",
    )
    system_prompt: str | None = Field(
        None, description="For rows whose prompt has no system message of its own"
    )
    format_prompt: str | None = Field(
        None, description="Jinja template around the prompt, with {{ content }}"
    )
    max_prompt_length: int = Field(
        1024, gt=0, description="Tokens, images included; longer prompts are skipped"
    )
    min_pixels: int = Field(28 * 28, gt=0)
    max_pixels: int = Field(1024 * 28 * 28, gt=0)
    video_fps: float = Field(2.0, gt=0, description="Frames sampled per second of video")
    video_max_frames: int = Field(
        32, gt=0, description="At most this many frames per video (a multiple of 2)"
    )
    video_min_pixels: int = Field(128 * 28 * 28, gt=0, description="Per frame")
    video_max_pixels: int = Field(768 * 28 * 28, gt=0, description="Per frame")
    video_max_total_pixels: int = Field(
        4096 * 28 * 28, gt=0, description="Over all frames of a video: longer clips get smaller frames"
    )
    train_batch_size: int = Field(
        8,
        gt=0,
        description="Prompts per training step (with an env: initial states, each run rollout.n times)",
    )
    val_batch_size: int = Field(64, gt=0, description="Prompts per validation generation call")
    max_val_samples: int | None = Field(None, gt=0)
    shuffle: bool = True
    streaming: bool = Field(
        False,
        description="Read train_files one row at a time as training goes, without converting or caching "
        "them (data larger than the disk, hub ids not worth caching whole); resume replays the epoch's rows",
    )
    prefetch: bool = Field(
        True,
        description="Prepare the next training batch (images decoded, sized, tokenized) on a background "
        "thread while the current step runs; the batches are the same either way",
    )
    shuffle_buffer: int = Field(
        10_000,
        gt=0,
        description="With streaming: rows held to shuffle from (a seeded buffer, as in datasets)",
    )

    @model_validator(mode="before")
    @classmethod
    def _files_as_lists(cls, values: Any) -> Any:
        for key in ("train_files", "val_files"):
            if isinstance(values, dict) and isinstance(values.get(key), str):
                values[key] = [values[key]]
        return values

    @model_validator(mode="after")
    def _pixels_ordered(self) -> DataConfig:
        if self.min_pixels > self.max_pixels:
            raise ValueError("data.min_pixels must not exceed data.max_pixels")
        return self


class SamplingConfig(_Section):
    n: int = Field(1, gt=0, description="Responses per prompt")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1 disables top-k")


class ValSamplingConfig(SamplingConfig):
    """Validation sampling: greedy, one answer per prompt, unless set otherwise."""

    n: int = Field(1, gt=0)
    temperature: float = Field(0.0, ge=0.0)


class VLLMConfig(_Section):
    """The vLLM engine (rollout.engine=vllm): colocated with training in the same process."""

    gpu_memory_utilization: float = Field(0.6, gt=0, le=1, description="Share of GPU memory vLLM may take")
    max_num_batched_tokens: int = Field(8192, gt=0)
    max_model_len: int = Field(4096, gt=0, description="Prompt + response tokens per sequence")
    enforce_eager: bool = Field(False, description="Skip CUDA graphs: slower decoding, faster start")
    tensor_parallel_size: int = Field(
        1,
        gt=0,
        description="Ranks one engine spans: each group of this many consecutive Ray workers runs one engine "
        "with the weights split between them (vLLM's external launcher) and generates the same prompts",
    )
    kv_cache_gb: float = Field(1.0, gt=0, description="KV cache size on CPU (GPUs use the memory share)")
    sleep_between_rollouts: bool = Field(
        True, description="Give the engine's GPU memory back while training (CUDA only; no-op on CPU)"
    )
    sleep_level: Literal[1, 2] = Field(
        2,
        description="1: free the KV cache and move the weights to host memory; 2: free both (the weights "
        "come back from the policy at the next sync, so no host copy of them is kept)",
    )
    verify_sync_every: int = Field(
        10, ge=0, description="Check vLLM's log-probs against the trainer's every N weight syncs; 0 never"
    )


class RolloutConfig(_Section):
    engine: Literal["auto", "hf", "vllm"] = Field(
        "auto", description="auto: vLLM where it is installed, else the HF transformers engine"
    )
    vllm: VLLMConfig = VLLMConfig()
    n: int = Field(5, gt=0, description="Responses per prompt (the GRPO group size)")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    max_new_tokens: int = Field(512, gt=0, description="Response length budget in tokens")
    max_staleness: int = Field(
        0,
        ge=0,
        description="0: generate, then train (synchronous). K > 0: a rollout worker of its own generates "
        "the next K batches while the trainer updates, each sampled by a policy at most K updates old; "
        "needs actor.rollout_correction",
    )
    worker_cpus: int = Field(
        1,
        gt=0,
        description="With max_staleness > 0: CPU cores of the rollout worker (the trainer keeps the rest)",
    )
    val: ValSamplingConfig = ValSamplingConfig()


KLEstimatorName = Literal[
    "k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"
]  # the names in mmrl.algorithms.KL_ESTIMATORS


class KLControlConfig(_Section):
    """β for the KL reward penalty: fixed, or adapted towards `target_kl` (Ziegler et al. 2019)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0, description="β, or its starting value when adaptive")
    target_kl: float = Field(0.1, gt=0, description="Adaptive only: the KL β steers towards")
    horizon: int = Field(10000, gt=0, description="Adaptive only: samples over which β may change ~e-fold")


class AlgorithmConfig(_Section):
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True
    gamma: float = Field(1.0, ge=0, le=1, description="Discount over response tokens")
    lam: float = Field(1.0, ge=0, le=1, description="GAE λ: 1 is the Monte-Carlo return, 0 one-step TD")
    step_weight: float = Field(
        1.0, ge=0, description="GiGPO's ω: the weight of the step-level advantage beside the episode's"
    )
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop groups whose rewards are all equal and sample more prompts"
    )
    max_num_gen_batches: int = Field(
        4, gt=0, description="Dynamic sampling: prompt batches generated at most per step"
    )
    on_unfilled: Literal["fail", "continue"] = Field(
        "continue", description="Dynamic sampling: after max_num_gen_batches, stop or train a partial batch"
    )
    overlong_buffer_len: int = Field(
        0, ge=0, description="DAPO soft overlong punishment over the last N tokens; 0 disables"
    )
    overlong_penalty_factor: float = Field(1.0, ge=0)
    mask_truncated: bool = Field(False, description="Leave responses cut at max_new_tokens out of the loss")
    use_kl_in_reward: bool = Field(False, description="Charge −β·KL(π_old ‖ π_ref) as a token reward")
    kl_penalty: KLEstimatorName = "k1"
    kl_ctrl: KLControlConfig = KLControlConfig()


LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


class _OptimSection(_Section):
    """AdamW and its schedule: linear warm-up over `warmup_steps` optimizer steps, then constant
    or cosine decay to `min_lr_ratio`·lr."""

    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(1e-2, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear learning-rate warm-up")
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor as a fraction of lr")
    max_grad_norm: float = Field(1.0, gt=0)


class ActorConfig(_OptimSection):
    ppo_epochs: int = Field(1, gt=0)
    mini_batch_size: int = Field(8, gt=0, description="Prompts per optimizer step (each with n responses)")
    micro_batch_size: int = Field(8, gt=0, description="Sequences per forward/backward pass")
    max_tokens_per_micro_batch: int | None = Field(
        None,
        gt=0,
        description="Instead of micro_batch_size: rows packed by length into forwards of at most this many "
        "padded tokens (rows x (longest prompt + longest response)), balanced by tokens across workers; "
        "the gradient is the same. Also the critic's",
    )
    padding_free: bool = Field(
        False,
        description="Actor, reference and critic forwards run each micro-batch's sequences packed into "
        "one, without padding (no compute on pad tokens when response lengths vary); same log-probs. For "
        "GPUs (flash-attention varlen): on CPUs the dense mask costs more than the padding saved",
    )
    policy_loss: str = "ppo_clip"
    rollout_correction: str | None = Field(
        None,
        description="Correct for the engine that sampled not being the trainer's old policy (vLLM's "
        "kernels, precision): each token's advantage is weighted by pi_old/pi_rollout, tis (truncated per "
        "token), seq_tis (per sequence), mis or seq_mis (masked outside [1/C, C]), or path/to/file.py:function. "
        "The engine's log-probs are then always recorded",
    )
    rollout_correction_cap: float = Field(2.0, gt=1.0, description="C of actor.rollout_correction")
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.28, ge=0)
    clip_ratio_c: float = Field(3.0, gt=1.0)
    loss_agg_mode: LossAggMode = "token-mean"
    use_kl_loss: bool = True
    kl_loss_coef: float = Field(0.01, ge=0)
    kl_loss_type: KLEstimatorName = "low_var_kl"
    entropy_coef: float = Field(0.0, ge=0)
    router_aux_loss_coef: float = Field(
        0.0,
        ge=0,
        description="Mixture-of-experts models: weight of the router's load-balancing loss (0: off, "
        "as in EasyR1 and verl; 0.001 is the pre-training value)",
    )
    offload: bool = Field(
        False,
        description="With Ray workers (FSDP2): keep parameters, gradients and AdamW state in CPU memory",
    )


class CriticConfig(_OptimSection):
    """The learned value function of `algorithm.adv_estimator=gae` (PPO): the policy's architecture
    with a scalar value head, trained on the same mini-batches as the actor."""

    model_path: str | None = Field(
        None, description="Where its trunk starts; default: the policy's start (after any format warm-up)"
    )
    lr: float = Field(1e-5, gt=0)
    ppo_epochs: int | None = Field(None, gt=0, description="Default: actor.ppo_epochs")
    cliprange_value: float = Field(0.5, gt=0, description="PPO value clipping: V moves at most this far")
    loss_agg_mode: LossAggMode = "token-mean"
    pretrain_steps: int = Field(
        0, ge=0, description="Critic warm-up: the first N steps train only the critic, the actor waits"
    )


class RewardFunctionConfig(_Section):
    """One reward function; an `async def` one is detected and its calls in a batch run concurrently."""

    name: str = Field(description="A built-in grader's short name, or path/to/file.py:function")
    weight: float = 1.0
    kwargs: dict[str, Any] = {}
    batched: bool | None = Field(
        None,
        description="Called once per batch with list[RewardInput], returning one score per sample; "
        "unset: per sample, except built-in model rewards (reward_model, llm_judge)",
    )


class RewardConfig(_Section):
    functions: list[RewardFunctionConfig] = [RewardFunctionConfig(name="answer_match")]
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
    num_workers: int = Field(2, gt=0)
    max_all_failed_steps: int = Field(
        3,
        ge=0,
        description="Stop the run after this many steps in a row in which one reward function failed on "
        "every sample (0: never), naming the function and its first error",
    )


class WarmupConfig(_Section):
    """Supervised format warm-up: targets are answers shuffled across rows, so the model learns
    the answer *format* and answer vocabulary, never the image-to-answer mapping."""

    steps: int = Field(0, ge=0)
    lr: float = Field(1e-3, gt=0)
    batch_size: int = Field(32, gt=0)
    target_template: str = "<answer>{answer}</answer>"
    turns: list[str] | None = Field(
        None,
        description="Agent runs: the assistant turns of each warm-up trajectory, in order; their tool calls "
        "run for real. {answer} is a shuffled answer, and each {key} of `fill` one of its values at random",
    )
    fill: dict[str, list[str]] = Field({}, description="Values drawn at random for `turns`' {key}s")
    expert_noise: float | None = Field(
        None,
        ge=0,
        description="Games: each turn's {move} is the task's scripted expert's move under this action noise "
        "(`mmrl.envs.experts`), a behaviour-cloning start instead of a format-only one",
    )


class EnvConfig(_Section):
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
    val_episodes: int = Field(50, ge=0, description="Greedy evaluation episodes at each validation")
    val_seed: int = Field(1_000_000, ge=0, description="First evaluation seed; training seeds stay below it")
    media_episodes: int = Field(4, ge=0, description="Evaluation episodes drawn into each validation GIF")


class ToolConfig(_Section):
    """One tool: a built-in (`image_zoom`, `calculator`) or `path/to/file.py:function`."""

    function: str = Field(description="A built-in tool name or path/to/file.py:function")
    name: str | None = Field(None, description="The name the model calls it by; default: the function's")
    description: str | None = Field(None, description="What the model is told it does")
    parameters: dict[str, Any] | None = Field(
        None, description="JSON schema of its arguments (built-ins bring their own)"
    )
    kwargs: dict[str, Any] = Field(
        {}, description="Fixed keyword arguments the model does not see, e.g. image_zoom's frame: norm1000"
    )


class GameConfig(_Section):
    """An `envs/` task played turn by turn (`mmrl.agent.game`): the rows are its first frames with seeds."""

    task: str = Field(description="A registered env that names its moves (gridnav)")
    options: dict[str, Any] = Field({}, description="The env's keyword arguments, as the rows were written")


class AgentConfig(_Section):
    """Multi-turn rollouts (`mmrl.agent`): each prompt's answer may call tools, whose results (text or
    images) come back as the next turn, until an answer or a limit; or, with `game`, each answer is a
    move and the env's next frame is the next turn."""

    tools: list[ToolConfig] = Field([], description="What the model may call (none in a game)")
    game: GameConfig | None = None
    max_turns: int = Field(4, gt=0, description="Assistant turns per trajectory")
    max_tokens: int = Field(4096, gt=0, description="Tokens per trajectory: the prompt and every turn")
    max_images: int = Field(8, gt=0, description="Images per trajectory: the prompt's and the tools'")
    tool_timeout_s: float = Field(
        10.0, gt=0, description="Per call of a tool from a file, before it is killed"
    )
    tool_workers: int = Field(2, gt=0, description="Worker processes for tools from files")


class SftConfig(_OptimSection):
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
    steps: int = Field(300, gt=0, description="Optimizer steps (the schedule's length)")
    lr: float = Field(1e-3, gt=0)
    batch_size: int = Field(64, gt=0)
    max_grad_norm: float | None = Field(
        None, gt=0, description="Clip each step's gradient norm; None: no clipping"
    )


class TrainerConfig(_Section):
    total_steps: int = Field(100, gt=0)
    val_every: int = Field(10, ge=0, description="0 disables periodic validation")
    val_before_train: bool = True
    save_every: int = Field(0, ge=0, description="0 saves only at the end")
    keep_checkpoints: int = Field(2, gt=0)
    max_consecutive_bad_steps: int = Field(
        3,
        gt=0,
        description="Steps in a row whose every update had a non-finite gradient before the run stops "
        "(after saving the last good state)",
    )
    output_dir: str = "runs/{experiment_name}"
    experiment_name: str = "mmrl"
    device: str = "auto"
    seed: int = 1
    loggers: list[Literal["console", "jsonl", "tensorboard", "wandb", "swanlab"]] = [
        "console",
        "jsonl",
        "tensorboard",
    ]
    progress: bool = True
    gallery_samples: int = Field(32, ge=0, description="Validation samples per gallery page; 0 writes none")
    nnodes: int = Field(1, gt=0, description="Nodes of the Ray cluster that run actor workers")
    n_gpus_per_node: int = Field(
        1,
        gt=0,
        description="Actor workers per node, one GPU each; on machines without GPUs each takes "
        "trainer.cpus_per_worker CPU cores. nnodes x n_gpus_per_node > 1 trains with FSDP2 across Ray workers",
    )
    cpus_per_worker: int = Field(1, gt=0)
    ray_address: str | None = Field(
        None,
        description="Join a running Ray cluster ('auto', or the head's host:port from `ray start --head`); "
        "unset starts a local one when workers are used",
    )
    dist_timeout_s: float = Field(600.0, gt=0, description="How long a collective waits for a silent rank")

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


class Config(_Section):
    model: ModelConfig
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    actor: ActorConfig = ActorConfig()
    critic: CriticConfig = CriticConfig()
    reward: RewardConfig = RewardConfig()
    warmup: WarmupConfig = WarmupConfig()
    trainer: TrainerConfig = TrainerConfig()
    env: EnvConfig | None = None
    sft: SftConfig | None = None
    agent: AgentConfig | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        if self.env is None and not self.data.train_files:
            raise ValueError("data.train_files is required: name the training data (or add an env section)")
        if self.agent is not None:
            self._check_agent_supported()
        game = self.agent.game if self.agent is not None else None
        if self.warmup.expert_noise is not None and (game is None or self.warmup.turns is None):
            raise ValueError(
                "warmup.expert_noise plays a game's expert: it needs agent.game and warmup.turns"
            )
        if self.env is not None:
            self._check_env_supported()
        elif self.algorithm.adv_estimator == "gigpo" and game is None:
            raise ValueError(
                "algorithm.adv_estimator=gigpo compares decisions made from the same state across the "
                "episodes of a group, so it needs an env section or a game (agent.game); use grpo for prompts"
            )
        if self.data.train_batch_size % self.actor.mini_batch_size:
            raise ValueError(
                f"data.train_batch_size ({self.data.train_batch_size}) must be a multiple of "
                f"actor.mini_batch_size ({self.actor.mini_batch_size}); change one of them"
            )
        for name, sampling in (("rollout", self.rollout), ("rollout.val", self.rollout.val)):
            if sampling.n > 1 and sampling.temperature == 0:
                raise ValueError(
                    f"{name}.n={sampling.n} with {name}.temperature=0 samples the same greedy answer n times; "
                    f"set {name}.temperature > 0 or {name}.n=1"
                )
        vllm_len = self.rollout.vllm.max_model_len
        if (
            self.rollout.engine != "hf"
            and self.data.max_prompt_length + self.rollout.max_new_tokens > vllm_len
        ):
            raise ValueError(
                f"data.max_prompt_length ({self.data.max_prompt_length}) + rollout.max_new_tokens "
                f"({self.rollout.max_new_tokens}) exceeds rollout.vllm.max_model_len ({vllm_len}): vLLM would "
                "reject the longest prompts mid-run. Raise max_model_len or lower one of the two "
                "(longer prompts are skipped and counted as prompt_too_long)."
            )
        _check_registered("algorithm.adv_estimator", self.algorithm.adv_estimator, "ADVANTAGE_ESTIMATORS")
        _check_registered("actor.policy_loss", self.actor.policy_loss, "POLICY_LOSSES")
        if self.actor.rollout_correction is not None:
            _check_registered(
                "actor.rollout_correction", self.actor.rollout_correction, "ROLLOUT_CORRECTIONS"
            )
        algo = self.algorithm
        if algo.dynamic_sampling and self.rollout.n == 1:
            raise ValueError(
                "algorithm.dynamic_sampling keeps only groups whose rewards differ, and a group of "
                "rollout.n=1 never differs; set rollout.n >= 2 or algorithm.dynamic_sampling=false"
            )
        if algo.overlong_buffer_len > self.rollout.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer_len ({algo.overlong_buffer_len}) must not exceed "
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens}); shorten the buffer"
            )
        if algo.adv_estimator == "gae" and self.critic.pretrain_steps >= self.trainer.total_steps:
            raise ValueError(
                f"critic.pretrain_steps ({self.critic.pretrain_steps}) must be below trainer.total_steps "
                f"({self.trainer.total_steps}), or the actor never trains"
            )
        self._check_tensor_parallel()
        self._check_staleness()
        if self.rollout.n == 1 and self.algorithm.adv_estimator in ("grpo", "drgrpo", "rloo"):
            raise ValueError(
                f"algorithm.adv_estimator={self.algorithm.adv_estimator} compares responses within a "
                "group, so it needs rollout.n >= 2"
            )
        return self

    def _check_env_supported(self) -> None:
        """Episode training grades whole episodes, so settings that grade or warm up on answers are refused."""
        refused = {
            "data.train_files (episodes are the data)": bool(self.data.train_files),
            "warmup.steps > 0 (use `mmrl sft` to start from demos)": self.warmup.steps > 0,
            "algorithm.adv_estimator gae or remax (episodes use group baselines)": self.algorithm.adv_estimator
            in ("gae", "remax"),
            "algorithm.use_kl_in_reward (use actor.use_kl_loss)": self.algorithm.use_kl_in_reward,
            "actor.rollout_correction (episodes keep no sampling log-probs)": self.actor.rollout_correction
            is not None,
        }
        hit = [name for name, bad in refused.items() if bad]
        if hit:
            raise ValueError(f"an env section (VLA episodes) does not combine with {'; '.join(hit)}")

    def _check_agent_supported(self) -> None:
        """Agent trajectories are generated in the trainer's process, turn by turn."""
        assert self.agent is not None
        refused = {
            "an env section": self.env is not None,
            "rollout.max_staleness > 0 (agent rollouts run in the trainer's process)": self.rollout.max_staleness
            > 0,
            "algorithm.adv_estimator remax": self.algorithm.adv_estimator == "remax",
            "algorithm.overlong_buffer_len (it measures one turn's length; agent.max_tokens limits the whole)": self.algorithm.overlong_buffer_len
            > 0,
        }
        hit = [name for name, bad in refused.items() if bad]
        if hit:
            raise ValueError(f"an agent section (multi-turn rollouts) does not combine with {'; '.join(hit)}")
        if bool(self.agent.tools) == (self.agent.game is not None):
            raise ValueError(
                "an agent section needs either agent.tools (tool calls) or agent.game (an env played turn by "
                "turn), not both and not neither"
            )
        vllm_len = self.rollout.vllm.max_model_len
        if self.rollout.engine != "hf" and self.agent.max_tokens > vllm_len:
            raise ValueError(
                f"agent.max_tokens ({self.agent.max_tokens}) exceeds rollout.vllm.max_model_len ({vllm_len}): "
                "vLLM would refuse a trajectory's later turns. Raise max_model_len or lower agent.max_tokens."
            )

    def _check_staleness(self) -> None:
        """Overlapped rollouts sample from an older policy, which only a rollout correction accounts for."""
        k = self.rollout.max_staleness
        if not k:
            return
        if self.env is not None:
            raise ValueError(
                f"rollout.max_staleness={k}: VLA episodes are generated synchronously; set it to 0"
            )
        if self.rollout.vllm.tensor_parallel_size > 1 and self.rollout.engine != "hf":
            raise ValueError(
                f"rollout.max_staleness={k} generates on one rollout worker with one GPU, so its vLLM engine "
                "cannot be split: set rollout.vllm.tensor_parallel_size=1"
            )
        if self.actor.rollout_correction is None:
            raise ValueError(
                f"rollout.max_staleness={k} trains on rollouts sampled up to {k} updates ago: set "
                "actor.rollout_correction (tis is the usual choice) so the loss weights them by pi_old/pi_rollout"
            )

    def _check_tensor_parallel(self) -> None:
        """A vLLM engine over `tp` ranks is built from that many Ray workers on one node (its ranks talk
        every layer), so each node's workers must split into whole engines."""
        tp = self.rollout.vllm.tensor_parallel_size
        per_node = self.trainer.n_gpus_per_node
        if tp > 1 and self.rollout.engine != "hf" and per_node % tp:
            raise ValueError(
                f"rollout.vllm.tensor_parallel_size={tp} splits each vLLM engine over {tp} Ray workers on one "
                f"node, and trainer.n_gpus_per_node={per_node} does not split into groups of {tp}. Set "
                f"trainer.n_gpus_per_node to a multiple of {tp}, or tensor_parallel_size=1."
            )

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.output_dir.format(experiment_name=self.trainer.experiment_name))


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-5` and `3E4` as floats (YAML 1.2; PyYAML's 1.1 rules need a dot),
    so a learning rate or a reward kwarg written the usual way never arrives as a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects


def _read_yaml(path: Path) -> Any:
    """A config file's tree; a syntax error names the file, line and column instead of PyYAML's
    `"<unicode string>", line N`."""
    try:
        return _yaml(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{path}{where}: not valid YAML ({problem}); fix the file and run again") from None


def _check_registered(key: str, name: str, registry: str) -> None:
    """Registered names and `path/to/file.py:function` specs pass; anything else fails at start."""
    from mmrl import algorithms

    known = getattr(algorithms, registry)
    if ":" not in name and name not in known:
        raise ValueError(
            f"{key}={name!r} is not registered; choose one of {', '.join(sorted(known))}, "
            "or name your own as path/to/file.py:function"
        )


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `dotted` in the config tree; a number addresses an item of a list of sections
    (`reward.functions.1.weight=0.5`), counted from 0."""
    node: Any = tree
    *parents, leaf = dotted.split(".")
    for part in parents:
        if isinstance(node, list):
            node = _item(node, part, dotted)
            continue
        child = node.setdefault(part, {})
        if not isinstance(child, dict | list):
            raise ConfigError(f"override {dotted}: {part} is a value, not a section")
        node = child
    if isinstance(node, list):
        raise ConfigError(
            f"override {dotted}: name a field of one item ({dotted}.<field>), or set the whole list"
        )
    node[leaf] = value


def _item(items: list[Any], index: str, dotted: str) -> dict[str, Any]:
    """The list item an override's index names."""
    if not index.isdigit() or int(index) >= len(items) or not isinstance(items[int(index)], dict):
        raise ConfigError(
            f"override {dotted}: {index!r} is not an item of this list; it has {len(items)} items, "
            f"numbered from 0"
        )
    return items[int(index)]


def parse_override(text: str) -> tuple[str, Any]:
    """`actor.lr=1e-5` -> ("actor.lr", 1e-5); values are YAML, so lists and null work."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    try:
        return key.strip(), _yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(
            f"override {text!r}: the value is not valid YAML; quote it ({key}='\"...\"')"
        ) from None


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds, directly or as the items of a list (`reward.functions`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation) or (None,)
        return _section_of(item)
    return None


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key; list items are addressed without their index (`reward.functions.weight`)."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        section = _section_of(field.annotation)
        if section is not None:
            keys += _known_keys(section, prefix + name + ".")
    return keys


def _suggest(where: str, known: list[str]) -> tuple[str, list[str]]:
    """(' Did you mean x.y?' or '', the keys allowed beside `where`) for an unknown dotted key."""
    parts = where.split(".")
    generic = ".".join(p for p in parts if not p.isdigit())  # list indices dropped, as in `known`
    parent, _, leaf = generic.rpartition(".")
    options = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == parent]
    real_parent = where.rpartition(".")[0]
    # The exact key in another section first (`data.mini_batch_size` -> actor.mini_batch_size),
    # then a near-typo of a key allowed here, then a near-typo of any key.
    elsewhere = [k for k in known if k.rpartition(".")[2] == leaf and k != generic]
    if not elsewhere:
        close = difflib.get_close_matches(leaf, options, n=1)
        if close:
            return f" Did you mean {real_parent + '.' if real_parent else ''}{close[0]}?", options
        elsewhere = difflib.get_close_matches(generic, known, n=1)
    return (f" Did you mean {elsewhere[0]}?" if elsewhere else ""), options


def _explain(err: ValidationError) -> str:
    lines = []
    known = _known_keys(Config)
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            hint, options = _suggest(where, known)
            lines.append(f"{where}: unknown key.{hint} Keys allowed here: {', '.join(options)}.")
        elif item["type"] == "missing" and any(isinstance(p, int) for p in item["loc"]):
            lines.append(f"{where}: required (an item is missing from a list or pair).")
        elif item["type"] == "missing":
            lines.append(f"{where}: required, add it to the YAML or pass {where}=... on the command line.")
        else:
            value = item.get("input")
            shown = f" (got {value!r})" if not isinstance(value, dict) else ""
            lines.append(f"{where}: {item['msg']}{shown}.")
    return "invalid config:\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read YAML, apply `a.b=c` overrides, validate; raises ConfigError with a readable message."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        if path.is_dir():
            raise ConfigError(f"{path} is a folder; give the YAML file of a config (configs/quickstart.yaml)")
        tree = _read_yaml(path)
        if not isinstance(tree, dict):
            raise ConfigError(f"{path} must hold a YAML mapping at the top level")
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML, as `mmrl config show` prints it and runs record it."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
