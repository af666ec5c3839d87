"""The simulator bridge: the env interface, a task registry, MuJoCo tasks, action tokenizers, experts.

``import envs`` stays cheap: the built-in tasks are registered by import path, so MuJoCo (and its
OpenGL backend) loads only when ``make_env`` first builds one.
"""

from mmrl.envs.actions import ActionStats, ActionTokenizer, InvalidAction
from mmrl.envs.base import Env, Info, Obs, StepResult
from mmrl.envs.registry import make_env, register_env, registered_envs

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

register_env("reach", "mmrl.envs.reach:ReachEnv")
register_env("push", "mmrl.envs.push:PushEnv")
register_env("metaworld/", "mmrl.envs.metaworld:MetaWorldEnv")
register_env("libero/", "mmrl.envs.libero:LiberoEnv")
register_env("gridnav", "mmrl.envs.gridnav:GridNavEnv")
