"""RL algorithm pieces as pure tensor functions: advantages, policy losses, KL, aggregation, response
filters, and the off-policy correction between the sampling engine and the trainer.

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
    gpg,
    grpo,
    opo,
    prime,
    register_advantage_estimator,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
    sppo,
)
from mmrl.algorithms.aggregation import LOSS_AGG_MODES, agg_loss
from mmrl.algorithms.covariance import clip_cov, kl_cov, token_covariance
from mmrl.algorithms.filtering import (
    POLICY_FILTERS,
    best_of_n,
    best_random,
    best_worst,
    get_policy_filter,
    informative_groups,
    register_policy_filter,
)
from mmrl.algorithms.implicit_prm import (
    batch_normalized_process_rewards,
    implicit_prm_loss,
    implicit_process_rewards,
)
from mmrl.algorithms.kl import KL_ESTIMATORS, kl_penalty, register_kl_estimator
from mmrl.algorithms.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    kl_reward_penalty,
)
from mmrl.algorithms.lm_loss import positive_example_nll
from mmrl.algorithms.logits import BLOCKED_LOGIT, block_tokens, entropy_from_logits, logprobs_from_logits
from mmrl.algorithms.masked import masked_mean, masked_sum, masked_whiten
from mmrl.algorithms.policy_loss import (
    POLICY_LOSSES,
    cispo,
    dual_clip,
    get_policy_loss,
    gmpo,
    gspo,
    ppo_clip,
    register_policy_loss,
    sapo,
)
from mmrl.algorithms.policy_loss import gpg as gpg_loss
from mmrl.algorithms.policy_loss import sppo as sppo_loss
from mmrl.algorithms.registry import Needs, load_from_file, needs_of
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
    "POLICY_FILTERS",
    "POLICY_LOSSES",
    "ROLLOUT_CORRECTIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "Needs",
    "agg_loss",
    "batch_normalized_process_rewards",
    "best_of_n",
    "best_random",
    "best_worst",
    "block_tokens",
    "cispo",
    "clip_cov",
    "clipped_value_loss",
    "drgrpo",
    "dual_clip",
    "entropy_from_logits",
    "first_rows",
    "gae",
    "get_advantage_estimator",
    "get_policy_filter",
    "get_policy_loss",
    "get_rollout_correction",
    "gigpo",
    "gmpo",
    "gpg",
    "gpg_loss",
    "grpo",
    "gspo",
    "implicit_prm_loss",
    "implicit_process_rewards",
    "informative_groups",
    "kl_cov",
    "kl_penalty",
    "kl_reward_penalty",
    "load_from_file",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "needs_of",
    "opo",
    "overlong_penalty",
    "positive_example_nll",
    "ppo_clip",
    "prime",
    "register_advantage_estimator",
    "register_kl_estimator",
    "register_policy_filter",
    "register_policy_loss",
    "register_rollout_correction",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "sapo",
    "sppo",
    "sppo_loss",
    "token_covariance",
]
