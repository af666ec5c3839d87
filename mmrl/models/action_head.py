"""A continuous action head on a VLM backbone: the OpenVLA-OFT-style policy that decodes a whole action
chunk in one forward instead of one action token at a time (and the base that the flow-matching expert,
`mmrl.models.flow_expert`, shares).

The prompt is followed by `chunk` action-query tokens (the vocabulary's last `chunk` ids; learned
embeddings under full fine-tuning). The hidden state that predicts query j is read by a small MLP into
step j's action, normalised to (-1, 1) per dimension. For RL the head is a Gaussian policy around that
mean with a state-independent standard deviation (a learned parameter, or fixed), so a sampled chunk's
log-density is exact: the sum of each dimension's normal log-density.

The head lives on the model as `model.action_head`, so the optimizer, the reference copy and a
checkpoint's resume carry it with the backbone. On disk it sits beside the backbone as two files
(`action_head.json`, `action_head.safetensors`): the backbone folder stays one that transformers and
vLLM load as it is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mmrl.envs.actions import ActionStats, ContinuousActions
from mmrl.errors import read_json

T = TypeVar("T")

HEAD_CONFIG = "action_head.json"
HEAD_WEIGHTS = "action_head.safetensors"
ATTRIBUTE = "action_head"


@dataclass(frozen=True)
class HeadSpec:
    """What a head is built from, saved as `action_head.json`: the actions it emits (dimension, chunk,
    the demos' statistics that map them back to env units), its query ids and its noise."""

    action_dim: int
    chunk: int
    query_start: int  # the first of `chunk` consecutive action-query token ids
    hidden_size: int
    std_init: float = 0.2  # in normalised units: (-1, 1) spans the demos' 1st to 99th percentile
    learn_std: bool = True
    std_min: float = 1e-3
    stats: dict[str, list[float]] | None = None
    kind: str = "gaussian"  # or "flow" (`mmrl.models.flow_expert`)
    # A flow expert's size and sampler: its width, layers and heads, and the denoising steps per chunk.
    width: int = 64
    layers: int = 2
    heads: int = 4
    denoise_steps: int = 4

    @property
    def actions(self) -> ContinuousActions:
        stats = None if self.stats is None else ActionStats.from_dict(self.stats)
        return ContinuousActions(self.action_dim, self.chunk, stats)

    @property
    def query_ids(self) -> list[int]:
        return list(range(self.query_start, self.query_start + self.chunk))


class ActionHead(nn.Module):
    """What the engine, the trainer and cloning ask of a head, given the hidden states (B, chunk, H) that
    predict the action queries: a draw with its log-probability, the log-probability of a recorded draw,
    an entropy, and the loss that clones demo chunks. A draw is `actions` (B, chunk, action_dim) plus
    whatever else its log-probability needs (`draw_keys`), all kept in the rollout batch."""

    draw_keys: tuple[str, ...] = ("actions",)

    def __init__(self, spec: HeadSpec) -> None:
        super().__init__()
        self.spec = spec
        self.log_std = nn.Parameter(
            torch.full((spec.action_dim,), math.log(spec.std_init)), requires_grad=spec.learn_std
        )

    def std(self, temperature: float = 1.0) -> torch.Tensor:
        """Per-dimension standard deviation; the acting temperature scales it, as it scales logits."""
        return self.log_std.clamp(min=math.log(self.spec.std_min)).exp() * temperature

    def sample(
        self, hidden: torch.Tensor, temperature: float, greedy: bool
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """A draw for each row (greedy: the noise-free action) and its log-probability (B, chunk)."""
        raise NotImplementedError

    def log_prob(
        self, hidden: torch.Tensor, draw: dict[str, torch.Tensor], temperature: float
    ) -> torch.Tensor:
        """log-probability (B, chunk) of a recorded draw, differentiable in the head and `hidden`."""
        raise NotImplementedError

    def entropy(self, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Entropy (B, chunk) of what `sample` draws at each chunk step."""
        raise NotImplementedError

    def imitation_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The cloning loss against demo chunks (B, chunk, action_dim), normalised."""
        raise NotImplementedError


class GaussianActionHead(ActionHead):
    """Hidden states (..., H) to a diagonal Gaussian over normalised actions (..., action_dim)."""

    def __init__(self, spec: HeadSpec) -> None:
        super().__init__(spec)
        h = spec.hidden_size
        self.net = nn.Sequential(nn.Linear(h, h), nn.GELU(), nn.Linear(h, spec.action_dim))

    def mean(self, hidden: torch.Tensor) -> torch.Tensor:
        """The action the head would take greedily, in (-1, 1); computed in fp32 whatever the backbone's."""
        return torch.tanh(self.net(hidden.float()))

    def distribution(self, hidden: torch.Tensor, temperature: float = 1.0) -> torch.distributions.Normal:
        return torch.distributions.Normal(self.mean(hidden), self.std(temperature))

    def sample(
        self, hidden: torch.Tensor, temperature: float, greedy: bool
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        dist = self.distribution(hidden, 1.0 if greedy else temperature)
        actions = dist.mean if greedy else dist.sample()
        return {"actions": actions}, dist.log_prob(actions).sum(-1)

    def log_prob(
        self, hidden: torch.Tensor, draw: dict[str, torch.Tensor], temperature: float
    ) -> torch.Tensor:
        """log π(a | s) of each chunk step: the sum over its dimensions. Actions are the sampled, unclipped
        ones; the env clips them, which changes what happens but not what was drawn."""
        return self.distribution(hidden, temperature).log_prob(draw["actions"].float()).sum(-1)

    def entropy(self, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        return self.distribution(hidden, temperature).entropy().sum(-1)

    def imitation_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """L1 between the mean chunk and the demo's: OpenVLA-OFT's loss, robust to noisy demos' outliers."""
        mean = self.mean(hidden)
        return (mean - targets.to(mean)).abs().mean()


# Head classes by `HeadSpec.kind`; `mmrl.models.flow_expert` adds "flow" on import.
HEAD_KINDS: dict[str, type[ActionHead]] = {"gaussian": GaussianActionHead}


def action_head_of(model: Any) -> ActionHead | None:
    """The continuous head on `model`, or None for a policy that emits tokens."""
    return getattr(model, ATTRIBUTE, None)


def attach_action_head(model: Any, spec: HeadSpec) -> ActionHead:
    """A freshly initialised head of `spec.kind` on `model`'s device, in fp32 (heads stay fp32; autocast
    runs the rest)."""
    head = HEAD_KINDS[spec.kind](spec).to(next(model.parameters()).device)
    setattr(model, ATTRIBUTE, head)
    return head


def save_action_head(head: ActionHead, folder: str | Path) -> None:
    folder = Path(folder)
    (folder / HEAD_CONFIG).write_text(json.dumps(asdict(head.spec), indent=1))
    save_file({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}, folder / HEAD_WEIGHTS)


def read_policy_file(path: Path, build: Callable[[Any], T]) -> T:
    """A policy's side file (`action_head.json`, `action_tokenizer.json`) parsed by `build`. A damaged,
    truncated or foreign one is one line naming the file and what is wrong, before any work."""
    fix = (
        "it is damaged or not mmrl's: copy it again from the checkpoint or model folder it came with, or "
        "write it again with `mmrl sft`"
    )
    return read_json(path, build, fix)


def head_spec(folder: str | Path) -> HeadSpec | None:
    """The spec saved in a model folder, or None where the policy has no continuous head."""
    path = Path(folder) / HEAD_CONFIG
    return read_policy_file(path, lambda data: HeadSpec(**data)) if path.exists() else None


def load_action_head(model: Any, folder: str | Path) -> ActionHead | None:
    """Attach the head saved in `folder` to `model` with its weights; None where the folder has none."""
    spec = head_spec(folder)
    if spec is None:
        return None
    head = attach_action_head(model, spec)
    load_head_weights(head, folder)
    return head


def load_head_weights(head: ActionHead, folder: str | Path) -> None:
    """The saved weights into `head` in place (a resume keeps the optimizer's parameters)."""
    path = Path(folder) / HEAD_WEIGHTS
    if not path.exists():
        raise FileNotFoundError(
            f"{folder} has {HEAD_CONFIG} but no {HEAD_WEIGHTS}: the head was not saved whole"
        )
    device = head.log_std.device
    head.load_state_dict({k: v.to(device) for k, v in load_file(path).items()})


@contextmanager
def without_action_head(model: Any) -> Iterator[ActionHead | None]:
    """`model` with its head taken off for the duration, so `save_pretrained` writes the plain backbone."""
    head = action_head_of(model)
    if head is not None:
        delattr(model, ATTRIBUTE)
    try:
        yield head
    finally:
        if head is not None:
            setattr(model, ATTRIBUTE, head)
