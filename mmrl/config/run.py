"""The whole run's config: every section in one model, whose cross-field checks run on each validation."""

from __future__ import annotations

from pathlib import Path

from pydantic import PrivateAttr, model_validator

from mmrl.config import checks
from mmrl.config.agent import AgentConfig
from mmrl.config.base import Section
from mmrl.config.data import DataConfig
from mmrl.config.model import ModelConfig
from mmrl.config.reward import RewardConfig
from mmrl.config.rollout import RolloutConfig
from mmrl.config.trainer import TrainerConfig
from mmrl.config.training import ActorConfig, AlgorithmConfig, CriticConfig, PRMConfig, WarmupConfig
from mmrl.config.vla import EnvConfig, SftConfig


class Config(Section):
    model: ModelConfig
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    actor: ActorConfig = ActorConfig()
    critic: CriticConfig = CriticConfig()
    prm: PRMConfig = PRMConfig()
    reward: RewardConfig = RewardConfig()
    warmup: WarmupConfig = WarmupConfig()
    trainer: TrainerConfig = TrainerConfig()
    env: EnvConfig | None = None
    sft: SftConfig | None = None
    agent: AgentConfig | None = None
    # What `load_config` filled in from the chosen methods' papers (`loading.paper_defaults`).
    _paper_defaults: list[str] = PrivateAttr(default_factory=list)

    @property
    def paper_defaults(self) -> list[str]:
        """`key=value (method)` for each key the chosen methods' paper values filled in."""
        return self._paper_defaults

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        """The cross-field checks (mmrl.config.checks), in the order a config's first problem is reported."""
        game = self.agent.game if self.agent is not None else None
        checks.check_training_data(self.data, self.env)
        if self.agent is not None:
            checks.check_agent_supported(self.agent, self.env, self.rollout, self.algorithm)
        checks.check_expert_noise(self.warmup, game)
        if self.env is not None:
            checks.check_env_supported(self.data, self.warmup, self.algorithm, self.actor)
        checks.check_gigpo_states(self.algorithm, self.env, game)
        checks.check_mini_batches(self.data, self.actor)
        checks.check_sampling(self.rollout)
        checks.check_lengths(self.data, self.rollout)
        checks.check_registered_names(self.algorithm, self.actor)
        checks.check_dapo(self.algorithm, self.rollout)
        checks.check_critic_warmup(self.algorithm, self.critic, self.trainer)
        checks.check_tensor_parallel(self.rollout, self.trainer)
        checks.check_staleness(self.rollout, self.env, self.actor)
        checks.check_group_size(self.algorithm, self.rollout)
        checks.check_critic_options(self.algorithm)
        checks.check_prm(self.algorithm, self.env, self.agent)
        checks.check_policy_filtration(self.algorithm, self.rollout)
        checks.check_exact_on_policy(self.algorithm, self.actor, self.data, self.rollout)
        checks.check_pairings(self.algorithm, self.actor)
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.output_dir.format(experiment_name=self.trainer.experiment_name))
