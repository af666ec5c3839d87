"""The run's rollout source, chosen by the config's sections."""

from __future__ import annotations

from typing import Any

from mmrl.config import Config
from mmrl.sources.base import RolloutSource


def source_from_config(cfg: Config, processor: Any, model_config: Any) -> RolloutSource:
    """The run's source: simulator episodes with an `env` section, agent trajectories with an `agent`
    section, else prompts from the data files."""
    if cfg.env is not None:
        from mmrl.sources.episodes import EpisodeSource  # imports the simulators only for runs that use them

        return EpisodeSource(cfg, processor, model_config)
    if cfg.agent is not None:
        from mmrl.sources.agents import AgentSource

        return AgentSource(cfg, processor, model_config)
    from mmrl.sources.prompts import PromptSource

    return PromptSource(cfg, processor, model_config)
