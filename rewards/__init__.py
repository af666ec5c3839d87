"""Reward layer: built-in graders, user reward functions loaded from files, and a fault-isolating manager
that combines them into one score per sample."""

from mmrl.rewards import geometry, grounding  # noqa: F401  (importing them registers their graders)
from mmrl.rewards.graders import GRADERS, extract_answer, register_grader
from mmrl.rewards.loader import load_reward_function
from mmrl.rewards.manager import RewardManager
from mmrl.rewards.types import ImageSize, RewardInput, RewardResult

__all__ = [
    "GRADERS",
    "ImageSize",
    "RewardInput",
    "RewardManager",
    "RewardResult",
    "extract_answer",
    "load_reward_function",
    "register_grader",
]
