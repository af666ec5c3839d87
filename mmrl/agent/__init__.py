"""Multi-turn agents: tool calls in the model's own format, tools that return images, and the loop that
runs them in lockstep over any rollout engine (`mmrl.agent.loop`)."""

from mmrl.agent.builtin import BUILTIN_TOOLS, SeenImage, ToolError, calculator, image_zoom
from mmrl.agent.calls import CallError, ToolCall, parse_tool_calls
from mmrl.agent.loop import AgentEngine, AgentLimits, Responder, ToolResponder, Trajectory, Turn
from mmrl.agent.tools import Observation, ToolBox, ToolSpec, check_arguments

__all__ = [
    "BUILTIN_TOOLS",
    "AgentEngine",
    "AgentLimits",
    "CallError",
    "Observation",
    "Responder",
    "SeenImage",
    "ToolBox",
    "ToolCall",
    "ToolError",
    "ToolResponder",
    "ToolSpec",
    "Trajectory",
    "Turn",
    "calculator",
    "check_arguments",
    "image_zoom",
    "parse_tool_calls",
]
