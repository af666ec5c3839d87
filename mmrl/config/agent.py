"""The agent sections: multi-turn rollouts with tools, or a game played turn by turn."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from mmrl.config.base import Section


class ToolConfig(Section):
    """One tool: a built-in (`image_zoom`, `calculator`) or `path/to/file.py:function`."""

    function: str = Field(description="A built-in tool name or path/to/file.py:function")
    name: str | None = Field(None, description="The name the model calls it by; default: the function's")
    description: str | None = Field(None, description="What the model is told it does")
    parameters: dict[str, Any] | None = Field(
        None, description="JSON schema of its arguments (built-ins bring their own)"
    )
    kwargs: dict[str, Any] = Field(
        {}, description="Fixed keyword arguments the model does not see, e.g. image_zoom's frame: norm1000"
    )


class GameConfig(Section):
    """An `envs/` task played turn by turn (`mmrl.agent.game`): the rows are its first frames with seeds."""

    task: str = Field(description="A registered env that names its moves (gridnav)")
    options: dict[str, Any] = Field({}, description="The env's keyword arguments, as the rows were written")


class AgentConfig(Section):
    """Multi-turn rollouts (`mmrl.agent`): each prompt's answer may call tools, whose results (text or
    images) come back as the next turn, until an answer or a limit; or, with `game`, each answer is a
    move and the env's next frame is the next turn."""

    tools: list[ToolConfig] = Field([], description="What the model may call (none in a game)")
    game: GameConfig | None = None
    max_turns: int = Field(4, gt=0, description="Assistant turns per trajectory")
    max_tokens: int = Field(4096, gt=0, description="Tokens per trajectory: the prompt and every turn")
    max_images: int = Field(8, gt=0, description="Images per trajectory: the prompt's and the tools'")
    tool_timeout_s: float = Field(
        10.0, gt=0, description="Per call of a tool from a file, before it is killed"
    )
    tool_workers: int = Field(2, gt=0, description="Worker processes for tools from files")
