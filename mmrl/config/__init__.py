"""The run configuration: one YAML file, typed and validated before any work starts.

Every section forbids unknown keys, so a typo fails at start with the key's dotted name,
a close match if there is one, and what to do. `key.sub=value` overrides from the command
line are parsed as YAML scalars and checked the same way.

Where each part lives:
- the sections, by the part of mmrl that reads them: `model`, `data`, `rollout`, `training` (algorithm,
  actor, critic, warm-up), `reward`, `agent`, `vla` (env, sft) and `trainer`, all on `base.Section`;
- `run`: the top-level `Config` that holds them, and `checks`: the cross-field checks it runs;
- `loading`: YAML files, overrides, and validation errors explained; `recipes`: the bundled configs.
"""

from mmrl.config.agent import AgentConfig, GameConfig, ToolConfig
from mmrl.config.data import DataConfig
from mmrl.config.loading import dump_config, load_config, parse_override
from mmrl.config.model import LoraConfig, ModelConfig
from mmrl.config.reward import RewardConfig, RewardFunctionConfig
from mmrl.config.rollout import RolloutConfig, SamplingConfig, ValSamplingConfig, VLLMConfig
from mmrl.config.run import Config
from mmrl.config.trainer import TrainerConfig
from mmrl.config.training import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    KLControlConfig,
    KLEstimatorName,
    LossAggMode,
    PRMConfig,
    WarmupConfig,
)
from mmrl.config.vla import EnvConfig, SftConfig

__all__ = [
    "ActorConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "Config",
    "CriticConfig",
    "DataConfig",
    "EnvConfig",
    "GameConfig",
    "KLControlConfig",
    "KLEstimatorName",
    "LoraConfig",
    "LossAggMode",
    "ModelConfig",
    "PRMConfig",
    "RewardConfig",
    "RewardFunctionConfig",
    "RolloutConfig",
    "SamplingConfig",
    "SftConfig",
    "ToolConfig",
    "TrainerConfig",
    "VLLMConfig",
    "ValSamplingConfig",
    "WarmupConfig",
    "dump_config",
    "load_config",
    "parse_override",
]
