"""A flow-matching action expert (π0-style) on a VLM backbone, sampled so that RL has a likelihood.

The expert is a small transformer over the chunk's noisy actions that cross-attends to the backbone's
hidden states at the action queries (`mmrl.models.action_head`: each of those states has read the whole
prompt). Cloning teaches it the velocity from noise to the demo chunk (rectified flow): at τ ~ U(0, 1),
x_τ = (1 - τ) ε + τ a and the target is a - ε. Sampling integrates from τ = 0 to 1 in `denoise_steps`
Euler steps.

A deterministic sampler has no tractable density for the chunk it returns, so for RL each Euler step
adds Gaussian noise (πRL's "flow-noise" form): x_{i+1} ~ N(x_i + Δ v(x_i, τ_i), σ² Δ). The whole
denoising chain is then a product of Gaussian transitions whose log-density is exact, and PPO/GRPO
optimise it, the chain standing in for the chunk (the start noise's density does not depend on the
policy, so it cancels in every ratio). Greedy sampling starts from the noise's mean and adds none.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mmrl.models.action_head import HEAD_KINDS, ActionHead, HeadSpec

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


class FlowActionExpert(ActionHead):
    """Velocity v(x_τ, τ | context) over a chunk, and the noisy Euler chain that samples from it."""

    draw_keys = ("actions", "chain")

    def __init__(self, spec: HeadSpec) -> None:
        super().__init__(spec)
        w = spec.width
        self.context = nn.Linear(spec.hidden_size, w)
        self.action_in = nn.Linear(spec.action_dim, w)
        self.time = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, w))
        self.position = nn.Parameter(torch.zeros(spec.chunk, w))
        layer = nn.TransformerDecoderLayer(
            w, spec.heads, 4 * w, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerDecoder(layer, spec.layers)
        self.action_out = nn.Linear(w, spec.action_dim)

    def velocity(self, x: torch.Tensor, tau: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """v at noisy chunks x (N, chunk, D) and times tau (N,), given projected context (N, chunk, W)."""
        h = self.action_in(x) + self.position + self.time(_sinusoid(tau, self.spec.width))[:, None]
        return self.action_out(self.blocks(h, context))

    @property
    def dt(self) -> float:
        return 1.0 / self.spec.denoise_steps

    def _step_mean(self, x: torch.Tensor, i: int, context: torch.Tensor) -> torch.Tensor:
        """Where Euler step i takes x before its noise."""
        tau = torch.full((len(x),), i * self.dt, device=x.device)
        return x + self.dt * self.velocity(x, tau, context)

    def _noise(self, temperature: float) -> torch.Tensor:
        return self.std(temperature) * math.sqrt(self.dt)

    def sample(
        self, hidden: torch.Tensor, temperature: float, greedy: bool
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        context = self.context(hidden.float())
        shape = (len(hidden), self.spec.chunk, self.spec.action_dim)
        x = torch.zeros(shape, device=context.device) if greedy else torch.randn(shape, device=context.device)
        chain, logp = [x], torch.zeros(shape[:2], device=context.device)
        sigma = self._noise(1.0 if greedy else temperature)  # greedy: the density it would have sampled at
        for i in range(self.spec.denoise_steps):
            mean = self._step_mean(x, i, context)
            x = mean if greedy else mean + sigma * torch.randn_like(mean)
            logp = logp + torch.distributions.Normal(mean, sigma).log_prob(x).sum(-1)
            chain.append(x)
        return {"actions": x, "chain": torch.stack(chain, dim=1)}, logp

    def log_prob(
        self, hidden: torch.Tensor, draw: dict[str, torch.Tensor], temperature: float
    ) -> torch.Tensor:
        """The chain's log-density (B, chunk): each chunk step's transitions summed over the Euler steps,
        recomputed step by step exactly as they were sampled."""
        context = self.context(hidden.float())
        chain = draw["chain"].to(context.device).float()
        sigma = self._noise(temperature)
        logp = torch.zeros(chain.shape[0], chain.shape[2], device=context.device)
        for i in range(self.spec.denoise_steps):
            mean = self._step_mean(chain[:, i], i, context)
            logp = logp + torch.distributions.Normal(mean, sigma).log_prob(chain[:, i + 1]).sum(-1)
        return logp

    def entropy(self, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """The transitions' entropy, summed over the chain; it depends on the noise alone."""
        per_step = (0.5 + LOG_SQRT_2PI + torch.log(self._noise(temperature))).sum()
        return (self.spec.denoise_steps * per_step).expand(hidden.shape[:2])

    def imitation_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Flow matching: the squared error of the velocity at a random point between noise and demo."""
        context = self.context(hidden.float())
        actions = targets.to(context)
        noise = torch.randn_like(actions)
        tau = torch.rand(len(actions), device=actions.device)
        x = (1 - tau[:, None, None]) * noise + tau[:, None, None] * actions
        return (self.velocity(x, tau, context) - (actions - noise)).pow(2).mean()


def _sinusoid(tau: torch.Tensor, width: int) -> torch.Tensor:
    """Sinusoidal features of times in [0, 1] (N, width), as diffusion models embed their timestep."""
    half = width // 2
    freqs = torch.exp(-math.log(1000.0) * torch.arange(half, device=tau.device) / max(half - 1, 1))
    angles = tau[:, None].float() * 1000.0 * freqs
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


HEAD_KINDS["flow"] = FlowActionExpert
