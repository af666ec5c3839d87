"""Agent runs as a rollout source: prompt rows answered by multi-turn trajectories with tool calls.

Everything about the data is the prompt source's (`mmrl.sources.prompts.PromptSource`): the loader and
its checkpointed cursor, the reward functions (they grade the final answer and may read the turns in
`extra["agent_turns"]`), dynamic sampling, validation and its gallery. What differs is generation:
the loop's engine is wrapped in an `AgentEngine`, so every response is a trajectory.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from mmrl.agent.credit import turn_advantages
from mmrl.agent.game import GAME_OUTCOMES, GameResponder
from mmrl.agent.loop import ENDINGS, AgentEngine, AgentLimits, Responder, ToolResponder
from mmrl.agent.tools import ToolBox, ToolSpec
from mmrl.agent.warmup import agent_warmup
from mmrl.config import Config
from mmrl.data.batch import Batch
from mmrl.data.dataset import image_budget
from mmrl.models import family_of, tokenizer_of
from mmrl.rollout.base import RolloutEngine
from mmrl.sources.base import StepContext
from mmrl.sources.prompts import WARMUP_ROWS, PromptSource


class AgentLoops:
    """Makes the run's agent loop (`agent` section: tools or a game, limits) over a given engine:
    training's, `mmrl eval`'s, or the warm-up's script. Owns the tools; `close` stops their workers."""

    def __init__(self, cfg: Config, processor: Any, model_config: Any) -> None:
        a = cfg.agent
        assert a is not None
        self.tools = ToolBox(
            [ToolSpec.from_config(t.model_dump()) for t in a.tools], a.tool_timeout_s, a.tool_workers
        )
        self.responder: Responder = (
            GameResponder(a.game.task, a.game.options) if a.game is not None else ToolResponder(self.tools)
        )
        self.limits = AgentLimits(a.max_turns, a.max_tokens, a.max_images)
        self.tokenizer = tokenizer_of(processor)
        takes_images = family_of(model_config).takes_images
        self.image_processor = processor.image_processor if takes_images else None
        self.budget = image_budget(cfg.data, model_config) if takes_images else None

    def __call__(self, engine: Any) -> AgentEngine:
        return AgentEngine(
            engine, self.responder, self.tokenizer, self.image_processor, self.budget, self.limits
        )

    def close(self) -> None:
        self.tools.close()
        if isinstance(self.responder, GameResponder):
            self.responder.close()


class AgentSource(PromptSource):
    """A prompt source whose answers are agent trajectories (see the module)."""

    def __init__(self, cfg: Config, processor: Any, model_config: Any) -> None:
        super().__init__(cfg, processor, model_config)
        self.agent_loop = AgentLoops(cfg, processor, model_config)
        self.tools = self.agent_loop.tools
        self._agents: dict[int, AgentEngine] = {}

    def agent(self, engine: RolloutEngine) -> AgentEngine:
        """The agent loop over `engine`, made once per engine."""
        if id(engine) not in self._agents:
            self._agents[id(engine)] = self.agent_loop(engine)
        return self._agents[id(engine)]

    def rollouts(self, ctx: StepContext) -> tuple[Batch, dict[str, Any]]:
        batch, metrics = super().rollouts(replace(ctx, engine=self.agent(ctx.engine)))
        metrics["agent/turns"] = float(batch["turns"].float().mean())
        metrics["agent/tool_calls"] = float(batch["tool_calls"].float().mean())
        metrics["agent/tool_calls_ok"] = float(batch["tool_calls_ok"].float().mean())
        extras = [batch.prompts[i].extra for i in batch["prompt_index"].tolist()]
        endings = [extra["agent_ending"] for extra in extras]
        metrics.update({f"agent/ending/{e}": endings.count(e) / len(endings) for e in ENDINGS})
        for key in GAME_OUTCOMES if self.cfg.agent.game is not None else ():
            metrics[f"game/{key.removeprefix('env_')}"] = sum(float(e[key]) for e in extras) / len(extras)
        return batch, metrics

    def metrics(self, batch: Batch) -> dict[str, Any]:
        """The prompt source's, and every tool failure so far by tool and kind."""
        metrics = super().metrics(batch)
        metrics.update({f"agent/tool_failures/{k}": v for k, v in self.tools.failures.items()})
        return metrics

    def advantages(
        self, batch: Batch, metrics: dict[str, Any], ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt source's, except GiGPO on a game: credit per move (`mmrl.agent.credit`)."""
        a = self.cfg.algorithm
        if a.adv_estimator != "gigpo":
            return super().advantages(batch, metrics, ctx)
        return turn_advantages(
            self.estimator, batch, gamma=a.gamma, step_weight=a.step_weight, norm_adv_by_std=a.norm_adv_by_std
        )

    def validate(self, ctx: StepContext) -> dict[str, Any]:
        return super().validate(replace(ctx, engine=self.agent(ctx.engine)))

    def warmup(self, model: Any, tokenizer: Any, seed: int) -> list[float]:
        """Scripted trajectories with `warmup.turns` (`mmrl.agent.warmup`), else the answer-format warm-up."""
        if self.cfg.warmup.turns is None:
            return super().warmup(model, tokenizer, seed)
        samples = self.train_set.prepare_all(limit=WARMUP_ROWS)
        return agent_warmup(model, self.agent_loop, samples, self.cfg.warmup, seed, tokenizer)

    def close(self) -> None:
        self.agent_loop.close()
        super().close()
