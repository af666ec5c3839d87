"""RL algorithm pieces as pure tensor functions: advantages, policy losses, KL, aggregation, and the
off-policy correction between the sampling engine and the trainer.

Algorithms are looked up by name in registries, so a config selects them by string and
users add their own with the `register_*` decorators.
"""

from mmrl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    drgrpo,
    first_rows,
    gae,
    get_advantage_estimator,
    gigpo,
    grpo,
    register_advantage_estimator,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)
from mmrl.algorithms.aggregation import LOSS_AGG_MODES, agg_loss
from mmrl.algorithms.filtering import informative_groups
from mmrl.algorithms.kl import KL_ESTIMATORS, kl_penalty, register_kl_estimator
from mmrl.algorithms.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    kl_reward_penalty,
)
from mmrl.algorithms.logits import BLOCKED_LOGIT, block_tokens, entropy_from_logits, logprobs_from_logits
from mmrl.algorithms.masked import masked_mean, masked_sum, masked_whiten
from mmrl.algorithms.policy_loss import (
    POLICY_LOSSES,
    dual_clip,
    get_policy_loss,
    gspo,
    ppo_clip,
    register_policy_loss,
)
from mmrl.algorithms.registry import load_from_file
from mmrl.algorithms.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    get_rollout_correction,
    register_rollout_correction,
)
from mmrl.algorithms.shaping import overlong_penalty
from mmrl.algorithms.value_loss import clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "BLOCKED_LOGIT",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "ROLLOUT_CORRECTIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "agg_loss",
    "block_tokens",
    "clipped_value_loss",
    "drgrpo",
    "dual_clip",
    "entropy_from_logits",
    "first_rows",
    "gae",
    "get_advantage_estimator",
    "get_policy_loss",
    "get_rollout_correction",
    "gigpo",
    "grpo",
    "gspo",
    "informative_groups",
    "kl_penalty",
    "kl_reward_penalty",
    "load_from_file",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "overlong_penalty",
    "ppo_clip",
    "register_advantage_estimator",
    "register_kl_estimator",
    "register_policy_loss",
    "register_rollout_correction",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
]
