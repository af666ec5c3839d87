"""The simulator bridge: the env interface, a task registry, MuJoCo tasks, action tokenizers, experts.

``import envs`` stays cheap: the built-in tasks are registered by import path, so MuJoCo (and its
OpenGL backend) loads only when ``make_env`` first builds one.
"""

from envs.actions import ActionStats, ActionTokenizer, InvalidAction
from envs.base import Env, Info, Obs, StepResult
from envs.registry import make_env, register_env, registered_envs

__all__ = [
    "ActionStats",
    "ActionTokenizer",
    "Env",
    "Info",
    "InvalidAction",
    "Obs",
    "StepResult",
    "make_env",
    "register_env",
    "registered_envs",
]

register_env("reach", "envs.reach:ReachEnv")
register_env("push", "envs.push:PushEnv")
register_env("metaworld/", "envs.metaworld:MetaWorldEnv")
register_env("libero/", "envs.libero:LiberoEnv")
register_env("gridnav", "envs.gridnav:GridNavEnv")
