"""`mmrl sft`: behaviour-clone a VLM on a scripted expert's noisy demos, the usual start of VLA RL.

The expert is deliberately imperfect (`mmrl.envs.experts`), so the cloned policy succeeds sometimes and RL
has room to improve it. The output folder is a plain model folder plus `action_tokenizer.json`,
the bins and q01/q99 statistics the policy was taught with; `mmrl train` and `mmrl eval` read it. With
`sft.policy: gaussian` or `flow` it is the backbone plus a continuous action head or flow-matching expert
(`mmrl.models.action_head`), whose files hold the statistics instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import AutoConfig

from mmrl.config import Config, SftConfig
from mmrl.data.dataset import image_budget
from mmrl.envs.actions import ActionStats, ActionTokenizer
from mmrl.errors import ConfigError
from mmrl.models import (
    ACTION_TOKENIZER_FILE,
    ACTION_TOKENS,
    HeadSpec,
    action_head_of,
    attach_action_head,
    head_spec,
    load_policy,
    load_processor,
    read_policy_file,
    save_model,
)
from mmrl.training.optim import make_optimizer
from mmrl.training.supervised import regression_step, supervised_step
from mmrl.vla.episodes import Actions
from mmrl.vla.observations import ObservationPrompts, frame_history

if TYPE_CHECKING:  # the experts import MuJoCo, which only `mmrl sft` needs
    from mmrl.envs.experts import Demo

TOKENIZER_FILE = ACTION_TOKENIZER_FILE


def save_action_tokenizer(tokenizer: ActionTokenizer, folder: Path) -> None:
    (Path(folder) / TOKENIZER_FILE).write_text(json.dumps(tokenizer.to_dict(), indent=1))


def load_action_tokenizer(folder: str | Path) -> ActionTokenizer | None:
    """The tokenizer saved beside a policy, or None for a model that was never taught actions."""
    path = Path(folder) / TOKENIZER_FILE
    return read_policy_file(path, ActionTokenizer.from_dict) if path.exists() else None


def policy_actions(folder: str | Path) -> Actions | None:
    """How the policy saved in `folder` acts: its continuous head's chunks, its action tokens' bins, or
    None for a model that was never taught actions."""
    spec = head_spec(folder)
    return spec.actions if spec is not None else load_action_tokenizer(folder)


def acting_on(actions: Actions, folder: str | Path, task: str, action_dim: int) -> Actions:
    """`actions`, the way the policy in `folder` acts, if they move as many dimensions as env `task` takes;
    a policy cloned on a task of another action size cannot act in this one, so it is refused in one line."""
    if actions.action_dim != action_dim:
        raise ConfigError(
            f"{folder} was taught {actions.action_dim}-D actions, but env {task} takes {action_dim}-D: train "
            f"or evaluate it on the task it was cloned on, or clone one for {task} (`mmrl sft` with this config)"
        )
    return actions


def demo_labels(demo: Demo, labels: str = "executed") -> np.ndarray:
    """The actions a demo teaches: those it executed, or the expert's noise-free ones (`sft.labels`)."""
    return demo.expert_actions if labels == "expert" else demo.actions


def demo_steps(
    demos: list[Demo], tokenizer: Actions, labels: str = "executed"
) -> list[tuple[Demo, int, Any]]:
    """(demo, t, target) for every decision: the chunk of actions starting at step t, the last action
    repeated where the episode ends inside a chunk, as target ids or a continuous head's normalised chunk."""
    steps = []
    for demo in demos:
        actions = demo_labels(demo, labels)
        for t in range(0, len(actions), tokenizer.chunk):
            rows = np.minimum(np.arange(t, t + tokenizer.chunk), len(actions) - 1)
            steps.append((demo, t, tokenizer.encode(actions[rows])))
    return steps


def behaviour_clone(
    model: torch.nn.Module,
    prompts: ObservationPrompts,
    steps: list[tuple[Demo, int, Any]],
    *,
    sft: SftConfig,
    seed: int,
    pad_id: int,
    progress: Progress | None = None,
) -> list[float]:
    """`sft.steps` AdamW steps (on `sft`'s schedule) on random mini-batches of demo decisions, the losses:
    cross-entropy on action tokens, or L1 on a continuous head's chunks (`regression_step`)."""
    regress = action_head_of(model) is not None
    rng = np.random.default_rng([seed, 2])
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer, schedule = make_optimizer(trained, sft, sft.steps)
    task = progress.add_task("behaviour cloning", total=sft.steps) if progress is not None else None
    losses = []
    for _ in range(sft.steps):
        picked = [
            steps[i] for i in rng.choice(len(steps), size=min(sft.batch_size, len(steps)), replace=False)
        ]
        samples = prompts(
            [
                {"image": d.frames[t], "instruction": d.instruction, "state": d.states[t]}
                for d, t, _ in picked
            ],
            frames=[frame_history(d.frames, t, prompts.history) for d, t, _ in picked],
        )
        targets = [target for *_, target in picked]
        step = regression_step if regress else supervised_step
        losses.append(
            step(
                model,
                optimizer,
                samples,
                list(range(len(picked))),
                torch.tensor(np.stack(targets), dtype=torch.float32) if regress else targets,
                pad_id,
                sft.max_grad_norm,
            )
        )
        schedule.step()
        if progress is not None and task is not None:
            progress.update(task, advance=1)
    return losses


def run_sft(cfg: Config, console: Console | None = None) -> Path:
    """Collect demos, fit the action statistics, clone, and write the policy to `model.path`."""
    from mmrl.envs.experts import collect_demos

    console = console or Console()
    if cfg.env is None or cfg.sft is None:
        raise ValueError(
            "`mmrl sft` needs a config with env and sft sections (see configs/vla_mujoco_reach.yaml)"
        )
    env, sft = cfg.env, cfg.sft
    out = Path(cfg.model.path)
    torch.manual_seed(cfg.trainer.seed)
    with _progress(console) as progress:
        task = progress.add_task("expert demos", total=sft.demos)
        demos = collect_demos(
            env.task,
            sft.demos,
            seed=sft.demo_seed,
            noise=sft.noise,
            workers=sft.demo_workers,
            progress=lambda: progress.advance(task),
            **env.options,
        )
        rate = float(np.mean([d.success for d in demos]))
        used = [d for d in demos if d.success] if sft.success_only else demos
        if not used:
            raise ValueError("sft.success_only: no demo succeeded; lower sft.noise or add demos")
        model_config = AutoConfig.from_pretrained(sft.base_model)
        stats = ActionStats.from_demos([demo_labels(d, sft.labels) for d in used])
        processor = load_processor(sft.base_model)
        model = load_policy(sft.base_model, torch.float32, cfg.trainer.torch_device())
        tokenizer = policy_head(
            model, model_config, sft, env.n_bins, env.chunk, used[0].actions.shape[1], stats
        )
        steps = demo_steps(used, tokenizer, sft.labels)
        losses = behaviour_clone(
            model,
            ObservationPrompts(processor, image_budget(cfg.data, model_config), env.prompt, env.history),
            steps,
            sft=sft,
            seed=cfg.trainer.seed,
            pad_id=processor.tokenizer.pad_token_id,
            progress=progress,
        )
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, processor, out)  # with a continuous head, its files too
    # The loss of a clone that ignores its observations; a flow expert's loss has no such simple bound.
    prior = None
    if isinstance(tokenizer, ActionTokenizer):
        save_action_tokenizer(tokenizer, out)
        prior = label_prior_loss([ids for *_, ids in steps])
    elif sft.policy == "gaussian":
        prior = median_l1([chunk for *_, chunk in steps])
    report = {
        "demos": len(demos),
        "demo_success": rate,
        "cloned_demos": len(used),
        "loss": [losses[0], losses[-1]],
        "loss_curve": loss_curve(losses),
        "label_prior_loss": prior,
    }
    (out / "sft_report.json").write_text(json.dumps(report, indent=1))
    console.print(
        f"cloned {len(used)} of {len(demos)} expert demos (expert success {rate:.0%}); "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        + (f" (label prior {prior:.3f})" if prior is not None else "")
        + f"; policy written to {out}"
    )
    if prior is not None and losses[-1] > 0.95 * prior:
        console.print(
            "[yellow]the clone predicts actions hardly better than their overall frequencies: it has "
            "not yet learned to read its observations. Clone longer (sft.steps), or give the model "
            "more visual tokens (data.max_pixels).[/yellow]"
        )
    return out


def policy_head(
    model: Any,
    model_config: Any,
    sft: SftConfig,
    n_bins: int,
    chunk: int,
    action_dim: int,
    stats: ActionStats,
) -> Actions:
    """What `model` will emit, set up on it: action bins on the vocabulary's last ids, which then become
    the only ids it may emit (`never_generated_ids`), or a fresh continuous head or flow expert (`sft.policy`)."""
    vocab = model_config.get_text_config().vocab_size
    if sft.policy != "tokens":
        spec = HeadSpec(
            kind=sft.policy,
            width=sft.flow_width,
            denoise_steps=sft.flow_steps,
            action_dim=action_dim,
            chunk=chunk,
            query_start=vocab - chunk,
            hidden_size=model_config.get_text_config().hidden_size,
            std_init=sft.action_std,
            learn_std=sft.learn_std,
            stats=stats.to_dict(),
        )
        return attach_action_head(model, spec).spec.actions
    tokenizer = ActionTokenizer.for_vocab(vocab, action_dim, n_bins=n_bins, chunk=chunk, stats=stats)
    setattr(model.config, ACTION_TOKENS, [tokenizer.start_id, tokenizer.start_id + tokenizer.n_bins])
    return tokenizer


def median_l1(targets: list[np.ndarray]) -> float:
    """The L1 loss of a head that ignores its observations and always emits each dimension's median:
    the continuous counterpart of `label_prior_loss`."""
    chunks = np.stack(targets)
    return float(np.abs(chunks - np.median(chunks, axis=0)).mean())


def loss_curve(losses: list[float], points: int = 20) -> list[float]:
    """Mean loss over `points` equal spans of the run: whether cloning still improves, stalled or diverged."""
    spans = np.array_split(np.asarray(losses), min(points, len(losses)))
    return [round(float(span.mean()), 4) for span in spans]


def label_prior_loss(targets: list[list[int]]) -> float:
    """The loss of a policy that ignores its observations: the entropy of each action-token position's
    label frequencies, averaged over positions. A clone's loss near it has learned nothing from frames."""
    ids = np.asarray(targets)
    entropies = []
    for column in ids.T:
        p = np.unique(column, return_counts=True)[1] / len(column)
        entropies.append(float(-(p * np.log(p)).sum()))
    return float(np.mean(entropies))


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
