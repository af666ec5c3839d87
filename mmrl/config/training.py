"""The training sections: the advantage estimator, the actor's and critic's losses and optimizers, and
the format warm-up before RL."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from mmrl.config.base import Section

KLEstimatorName = Literal[
    "k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"
]  # the names in mmrl.algorithms.KL_ESTIMATORS


class KLControlConfig(Section):
    """β for the KL reward penalty: fixed, or adapted towards `target_kl` (Ziegler et al. 2019)."""

    type: Literal["fixed", "adaptive"] = Field("fixed", description="fixed β, or adapted towards target_kl")
    kl_coef: float = Field(0.001, ge=0, description="β, or its starting value when adaptive")
    target_kl: float = Field(0.1, gt=0, description="Adaptive only: the KL β steers towards")
    horizon: int = Field(10000, gt=0, description="Adaptive only: samples over which β may change ~e-fold")


class AlgorithmConfig(Section):
    adv_estimator: str = Field(
        "grpo", description="An advantage estimator's name (the algorithms page), or path/to/file.py:function"
    )
    norm_adv_by_std: bool = Field(
        True, description="Divide group-relative advantages by the group's std (false: Dr. GRPO)"
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount over response tokens")
    lam: float = Field(
        1.0,
        ge=0,
        le=1,
        description="GAE λ: 1 is the Monte-Carlo return, 0 one-step TD. The policy's and, unless "
        "algorithm.critic_lam is set, the critic's",
    )
    critic_lam: float | None = Field(
        None,
        ge=0,
        le=1,
        description="VAPO's decoupled GAE: λ of the critic's returns (VAPO: 1.0); default algorithm.lam",
    )
    length_adaptive_alpha: float | None = Field(
        None,
        gt=0,
        description="VAPO's length-adaptive GAE: the policy's λ = 1 − 1/(α·l) per response of l tokens, "
        "in place of algorithm.lam (VAPO: α = 0.05); null: off",
    )
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
    overlong_penalty_factor: float = Field(
        1.0, ge=0, description="The overlong punishment's largest penalty, reached at max_new_tokens"
    )
    mask_truncated: bool = Field(False, description="Leave responses cut at max_new_tokens out of the loss")
    use_kl_in_reward: bool = Field(False, description="Charge −β·KL(π_old ‖ π_ref) as a token reward")
    kl_penalty: KLEstimatorName = Field("k1", description="KL estimator of use_kl_in_reward")
    kl_ctrl: KLControlConfig = KLControlConfig()
    policy_filtration: str | None = Field(
        None,
        description="PF-PPO: train only on some of each prompt's responses, chosen by reward before the "
        "advantages: best_worst, best_random or best_of_n (mmrl.algorithms.POLICY_FILTERS)",
    )
    sppo_eta: float = Field(
        1.0, gt=0, description="SPPO's η: adv_estimator=sppo's target for the log-ratio is η(P̂ − ½)"
    )
    prime_outcome_coef: float = Field(
        1.0, ge=0, description="PRIME: the weight of the outcome reward's RLOO advantage (the paper: 1)"
    )
    prime_process_coef: float = Field(
        1.0,
        ge=0,
        description="PRIME: the weight of the implicit process rewards' RLOO return (the paper: 1)",
    )

    def estimator_options(self) -> dict[str, Any]:
        """The keyword arguments every advantage estimator is called with; each takes what it uses."""
        return {
            "norm_adv_by_std": self.norm_adv_by_std,
            "gamma": self.gamma,
            "lam": self.lam,
            "critic_lam": self.critic_lam,
            "length_adaptive_alpha": self.length_adaptive_alpha,
            "eta": self.sppo_eta,
            "outcome_coef": self.prime_outcome_coef,
            "process_coef": self.prime_process_coef,
        }


LossAggMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-turn-mean"
]


class OptimSection(Section):
    """AdamW and its schedule: linear warm-up over `warmup_steps` optimizer steps, then constant
    or cosine decay to `min_lr_ratio`·lr."""

    lr: float = Field(1e-6, gt=0, description="Peak learning rate")
    weight_decay: float = Field(1e-2, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear learning-rate warm-up")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="After warm-up: constant, or cosine decay"
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor as a fraction of lr")
    max_grad_norm: float = Field(1.0, gt=0, description="Clip each step's gradient norm to this")


class ActorConfig(OptimSection):
    ppo_epochs: int = Field(1, gt=0, description="Passes over each rollout batch")
    mini_batch_size: int = Field(8, gt=0, description="Prompts per optimizer step (each with n responses)")
    micro_batch_size: int = Field(8, gt=0, description="Sequences per forward/backward pass")
    max_tokens_per_micro_batch: int | None = Field(
        None,
        gt=0,
        description="Instead of micro_batch_size: rows packed by length into forwards of at most this many "
        "padded tokens (rows x (longest prompt + longest response)), balanced by tokens across workers; "
        "the gradient is the same. Also the critic's",
    )
    padding_free: bool | Literal["auto"] = Field(
        "auto",
        description="Actor, reference, critic and PRM forwards run each micro-batch's sequences packed into "
        "one, without padding, each group's prompt once before its responses, attention kept within each "
        "sequence without an (N, N) mask; same log-probs. Pays where compute decides a forward's time (the "
        "update's forward 1.96x as fast at a 108.6M-parameter shape); on tiny models per-call overhead makes "
        "it slower. auto, resolved for each model: packed where its family packs, its language model is at "
        "least 256 wide and gradient checkpointing is off (its re-run forward would need transformers' dense "
        "mask); true refuses a family that cannot pack",
    )
    policy_loss: str = Field(
        "ppo_clip", description="A policy loss's name (the algorithms page), or path/to/file.py:function"
    )
    rollout_correction: str | None = Field(
        None,
        description="Correct for the engine that sampled not being the trainer's old policy (vLLM's "
        "kernels, precision): each token's advantage is weighted by pi_old/pi_rollout, tis (truncated per "
        "token), seq_tis (per sequence), mis or seq_mis (masked outside [1/C, C]), or path/to/file.py:function. "
        "The engine's log-probs are then always recorded",
    )
    rollout_correction_cap: float = Field(2.0, gt=1.0, description="C of actor.rollout_correction")
    clip_ratio_low: float = Field(
        0.2, ge=0, description="ε_low of ppo_clip, dual_clip, gspo, clip_cov and cispo; in log space for gmpo"
    )
    clip_ratio_high: float = Field(
        0.28, ge=0, description="ε_high, as clip_ratio_low (gmpo's paper: 0.4 both)"
    )
    clip_ratio_c: float = Field(
        3.0, gt=1.0, description="dual_clip: the lower bound on negative-advantage ratios"
    )
    tau_pos: float = Field(1.0, gt=0, description="sapo: the gate's temperature for positive advantages")
    tau_neg: float = Field(
        1.05, gt=0, description="sapo: the temperature for the others (the paper fades them faster: 1.05)"
    )
    kl_cov_ratio: float = Field(
        2e-4, gt=0, le=1, description="kl_cov: the share of valid tokens, by covariance, given the KL penalty"
    )
    kl_cov_coef: float = Field(1.0, ge=0, description="kl_cov: β of the KL penalty on those tokens")
    clip_cov_ratio: float = Field(
        2e-4, gt=0, le=1, description="clip_cov: the share of valid tokens whose gradient is cut"
    )
    clip_cov_lb: float = Field(1.0, description="clip_cov: tokens are drawn from covariances above this")
    clip_cov_ub: float = Field(5.0, description="clip_cov: and below this")
    positive_lm_coef: float = Field(
        0.0,
        ge=0,
        description="VAPO's μ: weight of the language-model loss (NLL) on responses with a positive "
        "score, added to the policy loss (VAPO: 0.1); 0: off",
    )
    loss_agg_mode: LossAggMode = Field("token-mean", description="How token losses are averaged into one")
    use_kl_loss: bool = Field(True, description="Add β·KL(π ‖ π_ref) to the loss")
    kl_loss_coef: float = Field(0.01, ge=0, description="β of the KL loss")
    kl_loss_type: KLEstimatorName = Field("low_var_kl", description="KL estimator of the KL loss")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight; 0: off")
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

    @model_validator(mode="after")
    def _covariance_band(self) -> ActorConfig:
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(
                f"actor.clip_cov_lb ({self.clip_cov_lb}) must be below actor.clip_cov_ub ({self.clip_cov_ub}): "
                "clip_cov draws tokens from the covariances between them (the paper's band: 1 to 5)"
            )
        return self

    def policy_loss_options(self) -> dict[str, Any]:
        """The settings every policy loss is called with; each takes what it uses."""
        return self.model_dump(
            include={
                "clip_ratio_low",
                "clip_ratio_high",
                "clip_ratio_c",
                "tau_pos",
                "tau_neg",
                "kl_cov_ratio",
                "kl_cov_coef",
                "clip_cov_ratio",
                "clip_cov_lb",
                "clip_cov_ub",
            }
        )


class CriticConfig(OptimSection):
    """The learned value function of `algorithm.adv_estimator=gae` (PPO): the policy's architecture
    with a scalar value head, trained on the same mini-batches as the actor.

    VAPO's value pretraining is ``pretrain_steps`` with ``algorithm.critic_lam=1``: for those steps the
    actor waits, so the responses come from the fixed starting policy, and the critic regresses on their
    Monte-Carlo returns. The paper trains until the value loss and explained variance settle; here the
    number of steps is fixed (watch ``critic/vf_loss``)."""

    model_path: str | None = Field(
        None, description="Where its trunk starts; default: the policy's start (after any format warm-up)"
    )
    lr: float = Field(1e-5, gt=0, description="The critic's learning rate")
    ppo_epochs: int | None = Field(None, gt=0, description="Default: actor.ppo_epochs")
    cliprange_value: float = Field(0.5, gt=0, description="PPO value clipping: V moves at most this far")
    loss_agg_mode: LossAggMode = Field("token-mean", description="How token value losses are averaged")
    pretrain_steps: int = Field(
        0,
        ge=0,
        description="Critic warm-up (VAPO's value pretraining): the first N steps train only the critic "
        "on responses of the fixed starting policy, the actor waits",
    )


class PRMConfig(OptimSection):
    """PRIME's implicit process reward model (`algorithm.adv_estimator=prime`; Cui et al. 2025, arXiv
    2502.01456): a copy of the policy's language model, π_φ, whose token log-ratio to the frozen
    reference, β·log π_φ/π_ref, is each token's process reward. Every step it first takes one pass of
    cross-entropy updates on the step's responses labelled by their outcome reward (in [0, 1]), on the
    actor's mini-batches, and then scores them (the paper's "double forward"), so the advantages use
    the PRM that has seen this step's outcomes."""

    model_path: str | None = Field(
        None, description="Where π_φ starts; default: the policy's start (after any format warm-up)"
    )
    lr: float = Field(1e-6, gt=0, description="The PRM's learning rate (the paper: 1e-6)")
    beta: float = Field(
        0.05, gt=0, description="β of the implicit reward β·log π_φ/π_ref, in its loss too (the paper: 0.05)"
    )
    process_norm: Literal["batch", "none"] = Field(
        "batch",
        description="batch: the process rewards divided by the batch's largest |return-to-go|, so none "
        "outweighs the outcome's ±1 (the PRIME authors' code); none: β·log π_φ/π_ref as it is",
    )


class WarmupConfig(Section):
    """Supervised format warm-up: targets are answers shuffled across rows, so the model learns
    the answer *format* and answer vocabulary, never the image-to-answer mapping."""

    steps: int = Field(0, ge=0, description="Supervised steps before RL; 0: no warm-up")
    lr: float = Field(1e-3, gt=0, description="The warm-up's learning rate")
    batch_size: int = Field(32, gt=0, description="Rows per warm-up step")
    target_template: str = Field(
        "<answer>{answer}</answer>", description="Each target's text; {answer} is a shuffled answer"
    )
    turns: list[str] | None = Field(
        None,
        description="Agent runs: the assistant turns of each warm-up trajectory, in order; their tool calls "
        "run for real. {answer} is a shuffled answer, and each {key} of `fill` one of its values at random",
    )
    fill: dict[str, list[str]] = Field({}, description="Values drawn at random for `turns`' {key}s")
    cache_dir: str | None = Field(
        None,
        description="Keep the warm-up's output in this folder and reuse it in any later run whose warm-up "
        "would be the same (the model, training files, data, agent and warm-up settings and seed): other "
        "algorithms or learning rates on one recipe skip it (`mmrl.run.warmup_cache`)",
    )
    expert_noise: float | None = Field(
        None,
        ge=0,
        description="Games: each turn's {move} is the task's scripted expert's move under this action noise "
        "(`mmrl.envs.experts`), a behaviour-cloning start instead of a format-only one",
    )
