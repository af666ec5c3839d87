"""Reward layer: built-in graders, user reward functions loaded from files, and a fault-isolating manager
that combines them into one score per sample."""

import rewards.geometry  # registers the geometry grader; binds the same name as the next line
import rewards.grounding  # noqa: F401  (registers the grounding graders)
from rewards.graders import GRADERS, extract_answer, register_grader
from rewards.loader import load_reward_function
from rewards.manager import RewardManager
from rewards.types import ImageSize, RewardInput, RewardResult

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
