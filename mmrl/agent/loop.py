"""The agent loop: multi-turn rollouts in which replies, images included, come back as turns.

`AgentEngine` wraps a rollout engine (HF or vLLM) and is one itself: `generate` runs every prompt's n
trajectories in lockstep. Each round, one batched call of the inner engine extends every live
trajectory by an assistant turn, and a `Responder` answers it: `ToolResponder` runs the turn's tool
calls (`mmrl.agent.tools.ToolBox`) and a turn without one is the answer; `GameResponder`
(`mmrl.agent.game`) steps an env with the turn's move and shows the next frame. The reply is appended
as the next turn, images sized by the family's pixel budget, and the next round goes on from there.

A trajectory is built from token ids, never re-tokenised text, so the trainer scores exactly the tokens
the engine sampled, at the positions it sampled them. Its row in the batch is the first prompt, then
every later token as the "response": `response_attention` marks the tokens that exist, `response_mask`
only those the policy generated (the loss trains on them alone), and `rollout_logprobs` holds each
policy token's sampling log-prob. The row's prompt sample carries all of its images, so the trainer
encodes them in one forward with the rest. Limits end a trajectory, marked truncated and counted:
`max_turns` assistant turns, `max_tokens` in all, `max_images` in all, and a turn cut off by the
per-turn `max_new_tokens`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from PIL import Image

from mmrl.agent.builtin import SeenImage
from mmrl.agent.calls import parse_tool_calls
from mmrl.agent.tools import ToolBox
from mmrl.data.batch import Batch, right_pad
from mmrl.data.sample import PromptSample
from mmrl.processors import PixelBudget, fit_image, num_image_tokens, pixel_inputs
from mmrl.processors.chat import expand_pads, tool_response_text
from mmrl.rewards import ImageSize
from mmrl.rollout.base import GeneratesAtOnce, RolloutEngine, SamplingParams

log = logging.getLogger("mmrl.agent")

# How a trajectory ended: its answer, a game's episode ending ("done"), or a limit (truncated).
ENDINGS = ("answer", "done", "env_steps", "max_turns", "max_tokens", "max_images", "turn_length")
FINISHED = ("answer", "done")


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 4  # assistant turns
    max_tokens: int = 4096  # prompt and every turn
    max_images: int = 8  # the prompt's and the tools'


@dataclass
class Turn:
    """One turn as the gallery shows it: the model's text, or a tool response (text and images)."""

    role: str  # "assistant" or "tool"
    text: str
    images: list[Image.Image] = field(default_factory=list)


@dataclass
class Trajectory:
    """One prompt's conversation so far: the tokens after its prompt, which of them the policy sampled
    (with their log-probs), and every image shown (sized for the model, and as the tools see them)."""

    prompt: PromptSample
    ids: list[int] = field(default_factory=list)
    policy: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    images: list[Image.Image] = field(default_factory=list)
    seen: list[SeenImage] = field(default_factory=list)
    pixels: list[torch.Tensor] = field(default_factory=list)
    grids: list[torch.Tensor] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    tool_calls: int = 0  # every <tool_call> block, malformed ones too
    tool_calls_ok: int = 0  # those that returned a result
    outcome: dict[str, Any] = field(default_factory=dict)  # the responder's, for rewards (`extra`)
    ending: str | None = None

    @classmethod
    def start(cls, prompt: PromptSample) -> Trajectory:
        originals = prompt.originals or prompt.images
        seen = [SeenImage(o, f.size) for o, f in zip(originals, prompt.images, strict=True)]
        grids = list(prompt.image_grid_thw) if prompt.image_grid_thw is not None else []
        pixels = _split_patches(prompt.pixel_values, grids) if grids else []
        return cls(
            prompt, images=list(prompt.images), seen=seen, pixels=pixels, grids=[g[None] for g in grids]
        )

    @property
    def length(self) -> int:
        return len(self.prompt.prompt_ids) + len(self.ids)

    def sample(self, prompt_ids: list[int]) -> PromptSample:
        """The prompt sample with `prompt_ids` and every image so far."""
        return replace(
            self.prompt,
            prompt_ids=prompt_ids,
            images=list(self.images),
            image_sizes=[*self.prompt.image_sizes, *(_size(s) for s in self.seen[len(self.prompt.images) :])],
            pixel_values=torch.cat(self.pixels) if self.pixels else None,
            image_grid_thw=torch.cat(self.grids) if self.grids else None,
        )

    def context(self) -> PromptSample:
        """What the next turn is generated from: the prompt and everything since."""
        return self.sample(self.prompt.prompt_ids + self.ids)

    def answer(self) -> str:
        """The last assistant turn's text: what reward functions grade."""
        return next((t.text for t in reversed(self.turns) if t.role == "assistant"), "")


# A responder's reply to one assistant turn: the results to show the model as the next turn (each a list
# of text and images), or the ending that closes the trajectory instead.
Reply = list[list[str | Image.Image]] | str


class Responder(Protocol):
    """What answers the policy's turns: tools, or a game's environment."""

    role: str  # the reply turns' role, as the gallery names them

    def begin(self, trajectories: list[Trajectory]) -> None:
        """Called once with every trajectory of a `generate` call, before its first turn."""

    def respond(self, trajectories: list[Trajectory], last: bool) -> list[Reply]:
        """One reply to each trajectory's latest assistant turn (`turns[-1].text`); in the `last` round no
        turn would follow, so a reply is an ending."""

    def turn_text(self, parts: list[str | None]) -> str:
        """The chat text of a reply turn, up to the next assistant header; None stands for an image."""


class ToolResponder:
    """Tool calls in the turn are run (`mmrl.agent.tools.ToolBox`) and their results are the reply; a
    turn without one is the answer."""

    role = "tool"

    def __init__(self, tools: ToolBox) -> None:
        self.tools = tools

    def begin(self, trajectories: list[Trajectory]) -> None:
        """Tools keep no state per trajectory."""

    def respond(self, trajectories: list[Trajectory], last: bool) -> list[Reply]:
        parsed = [parse_tool_calls(t.turns[-1].text) for t in trajectories]
        calling = [i for i, calls in enumerate(parsed) if calls and not last]
        for i in calling:
            trajectories[i].tool_calls += len(parsed[i])
        flat = [call for i in calling for call in parsed[i]]
        images = [trajectories[i].seen for i in calling for _ in parsed[i]]
        observations = iter(self.tools.run(flat, images) if flat else [])
        replies: list[Reply] = ["max_turns" if calls else "answer" for calls in parsed]
        for i in calling:
            answered = [next(observations) for _ in parsed[i]]
            trajectories[i].tool_calls_ok += sum(o.failure is None for o in answered)
            replies[i] = [o.parts for o in answered]
        return replies

    def turn_text(self, parts: list[str | None]) -> str:
        return tool_response_text(parts)


def _split_patches(pixel_values: torch.Tensor, grids: list[torch.Tensor]) -> list[torch.Tensor]:
    sizes = [int(g.prod()) for g in grids]
    return list(pixel_values.split(sizes))


def _size(seen: SeenImage) -> ImageSize:
    return ImageSize(original=seen.original.size, model_input=seen.model_size)


class AgentEngine(GeneratesAtOnce):
    """A rollout engine whose responses are multi-turn trajectories, each turn answered by `responder`
    (tool calls or a game; see the module)."""

    def __init__(
        self,
        engine: RolloutEngine,
        responder: Responder,
        tokenizer: Any,
        image_processor: Any,
        budget: PixelBudget | None,
        limits: AgentLimits,
    ) -> None:
        self.engine = engine
        self.responder = responder
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.budget = budget
        self.limits = limits
        self.logprobs_are_free = engine.logprobs_are_free

    def generate(self, prompts: list[PromptSample], params: SamplingParams) -> Batch:
        trajectories = [Trajectory.start(p) for p in prompts for _ in range(params.n)]
        self.responder.begin(trajectories)
        turn = replace(params, n=1)
        for round_ in range(self.limits.max_turns):
            for t in trajectories:
                if t.ending is None and t.length >= self.limits.max_tokens:
                    t.ending = "max_tokens"
            live = [t for t in trajectories if t.ending is None]
            if not live:
                break
            width = min(params.max_new_tokens, max(self.limits.max_tokens - t.length for t in live))
            out = self.engine.generate([t.context() for t in live], replace(turn, max_new_tokens=width))
            self._extend(live, out, params, last=round_ == self.limits.max_turns - 1)
        for t in trajectories:
            t.ending = t.ending or "max_turns"
        return self._batch(prompts, trajectories, params)

    def _extend(self, live: list[Trajectory], out: Batch, params: SamplingParams, last: bool) -> None:
        """Append each trajectory's new turn, then the responder's reply to it; in the `last` round a
        turn that would be answered ends the trajectory instead (no turn would read the reply)."""
        answered: list[Trajectory] = []
        for row, t in enumerate(live):
            mask = out["response_mask"][row].bool()
            ids = out["response_ids"][row][mask].tolist()
            if t.length + len(ids) > self.limits.max_tokens:  # the engine stops at the widest row's room
                ids = ids[: self.limits.max_tokens - t.length]
                t.ending = "max_tokens"
            t.ids += ids
            t.policy += [1] * len(ids)
            sampled = out["rollout_logprobs"][row][mask].tolist() if params.logprobs else [0.0] * len(ids)
            t.logprobs += sampled[: len(ids)]
            t.turns.append(Turn("assistant", out["response_text"][row]))
            if t.ending is None and bool(out["truncated"][row]):
                t.ending = "turn_length"
            if t.ending is None:
                answered.append(t)
        for t, reply in zip(answered, self.responder.respond(answered, last), strict=True):
            if isinstance(reply, str):
                t.ending = reply
            else:
                self._observe(t, reply)

    def _observe(self, t: Trajectory, results: list[list[str | Image.Image]]) -> None:
        """Append one turn holding every part of the reply (text and images), if it fits."""
        parts: list[str | None] = []
        fitted: list[tuple[Image.Image, Image.Image]] = []
        for result in results:
            for item in result:
                if isinstance(item, Image.Image):
                    if self.budget is None:
                        parts.append("Error: this model cannot see images")
                        continue
                    rgb = item.convert("RGB")
                    fitted.append((rgb, fit_image(rgb, self.budget)))
                    parts.append(None)
                else:  # spelled-out control tokens stay text: "<|im_end|>" in a result must not end a turn
                    parts.append(item.replace("<|", "< |"))
        if len(t.images) + len(fitted) > self.limits.max_images:
            t.ending = "max_images"
            return
        counts = [num_image_tokens(f.height, f.width, self.budget) for _, f in fitted] if fitted else []
        ids = expand_pads(self.tokenizer, self.responder.turn_text(parts), counts)
        if t.length + len(ids) >= self.limits.max_tokens:  # and no room left for an answer after it
            t.ending = "max_tokens"
            return
        t.ids += ids
        t.policy += [0] * len(ids)
        t.logprobs += [0.0] * len(ids)
        for original, image in fitted:
            inputs = pixel_inputs([image], self.image_processor)
            t.images.append(image)
            t.seen.append(SeenImage(original, image.size))
            t.pixels.append(inputs["pixel_values"])
            t.grids.append(inputs["image_grid_thw"])
        shown = [p if p is not None else "<image>" for p in parts]
        t.turns.append(Turn(self.responder.role, "\n".join(shown), [f for _, f in fitted]))

    def _batch(
        self, prompts: list[PromptSample], trajectories: list[Trajectory], params: SamplingParams
    ) -> Batch:
        """One row per trajectory, each with its own prompt sample (all of its images), grouped by the
        prompt it started from (`group_index`)."""
        ids, attention = right_pad([t.ids for t in trajectories], self.tokenizer.pad_token_id)
        policy, _ = right_pad([t.policy for t in trajectories])
        logprobs, _ = right_pad([t.logprobs for t in trajectories], 0.0, torch.float32)
        samples = []
        for t in trajectories:
            sample = t.sample(t.prompt.prompt_ids)
            sample.extra = {
                **t.prompt.extra,
                "agent_turns": [vars(turn) for turn in t.turns],  # plain data: reward workers unpickle it
                "agent_tool_calls": t.tool_calls,
                "agent_tool_calls_ok": t.tool_calls_ok,
                "agent_ending": t.ending,
                **t.outcome,
            }
            samples.append(sample)
        tensors = {
            "prompt_index": torch.arange(len(trajectories)),
            "group_index": torch.arange(len(prompts)).repeat_interleave(params.n),
            "response_ids": ids,
            "response_mask": policy,
            "response_attention": attention,
            "truncated": torch.tensor([t.ending not in FINISHED for t in trajectories]),
            "turns": torch.tensor([sum(x.role == "assistant" for x in t.turns) for t in trajectories]),
            "tool_calls": torch.tensor([t.tool_calls for t in trajectories]),
            "tool_calls_ok": torch.tensor([t.tool_calls_ok for t in trajectories]),
        }
        if params.logprobs:
            tensors["rollout_logprobs"] = logprobs
        batch = Batch(tensors=tensors, prompts=samples)
        batch.set(response_text=[t.answer() for t in trajectories])
        return batch

    def sync_weights(self) -> None:
        self.engine.sync_weights()

    def sleep(self) -> None:
        self.engine.sleep()
