"""The RL loop (DESIGN.md): generate, score, log-probs, advantages, update, sync, log, save."""

from __future__ import annotations

import copy
import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from mmrl import checkpoint as ckpt
from mmrl import reward_models  # noqa: F401  (registers the reward_model and llm_judge rewards)
from mmrl.actor import Actor
from mmrl.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    get_advantage_estimator,
    informative_groups,
    kl_reward_penalty,
    overlong_penalty,
)
from mmrl.batch import Batch, concat
from mmrl.config import Config, ConfigError, dump_config
from mmrl.critic import Critic, ValueModel
from mmrl.data import PromptDataset, PromptLoader, PromptSample
from mmrl.errors import RolloutError
from mmrl.gallery import GalleryItem, write_gallery
from mmrl.logger import MetricsLogger, peak_rss_gb, plot_reward_curve
from mmrl.models import load_policy, load_processor, resolve_dtype
from mmrl.rollout import SamplingParams, engine_from_config
from mmrl.scoring import generate_and_score, reward_inputs, reward_label, reward_metrics
from mmrl.warmup import format_warmup
from processors import PixelBudget
from rewards import RewardManager

log = logging.getLogger("mmrl.trainer")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class UnfilledBatchError(ConfigError):
    """Dynamic sampling ran out of generation rounds with `algorithm.on_unfilled=fail`."""


class Trainer:
    """Builds every part from the config, then runs `fit`; `resume=True` continues the newest checkpoint."""

    def __init__(self, cfg: Config, resume: bool = False, console: Console | None = None) -> None:
        self.cfg = cfg
        self.console = console or Console()
        self.run_dir = cfg.run_dir
        if not resume:
            refuse_to_overwrite(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        seed_everything(cfg.trainer.seed)
        device = (
            cfg.trainer.device
            if cfg.trainer.device != "auto"
            else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        # Trained weights stay fp32; `model.dtype` sets the compute precision (autocast).
        self.compute_dtype = resolve_dtype(cfg.model.dtype, device)
        self.model = load_policy(cfg.model.path, torch.float32, device)
        self.processor = load_processor(cfg.model.path)
        if cfg.model.freeze_vision_tower:
            self.model.model.visual.requires_grad_(False)
        self.pad_id = self.processor.tokenizer.pad_token_id
        self.train_set, self.val_samples = build_datasets(cfg, self.processor, self.model.config)
        self.loader = PromptLoader(
            self.train_set, cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle
        )
        self.engine = engine_from_config(cfg, self.model, self.processor, self.compute_dtype, cfg.model.path)
        self.rewards = RewardManager(
            [f.model_dump() for f in cfg.reward.functions],
            timeout_s=cfg.reward.timeout_s,
            isolation=cfg.reward.isolation,
            num_workers=cfg.reward.num_workers,
        )
        self.accuracy_key = reward_label(cfg.reward.functions[0].name)
        self.actor = Actor(
            self.model,
            cfg.actor,
            self.pad_id,
            cfg.rollout.temperature or 1.0,
            cfg.rollout.max_new_tokens,
            total_updates=self._optimizer_steps(cfg.actor.ppo_epochs),
            compute_dtype=self.compute_dtype,
        )
        self.critic = self._make_critic(cfg.critic.model_path or cfg.model.path)
        self.ref: Any = None
        self.advantage = get_advantage_estimator(cfg.algorithm.adv_estimator)
        self.kl_ctrl = make_kl_controller(cfg)
        self.logger = MetricsLogger(self.run_dir, cfg.trainer.loggers, self.console)
        self.step = 0
        self.resumed_from: Path | None = None
        if resume:
            self._resume()

    # ---------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        cfg = self.cfg.trainer
        if self.resumed_from is None and self.cfg.warmup.steps:
            self._warmup()
        self.ref = self._reference()
        self.engine.sync_weights()  # the engine starts from the weights RL starts from (warm-up, resume)
        if cfg.val_before_train and self.step == 0 and self.val_samples:
            self.logger.log(0, self.validate())
        with self._progress() as bar:
            task = bar.add_task("training", total=cfg.total_steps, completed=self.step, info="")
            while self.step < cfg.total_steps:
                self.step += 1
                metrics = self.train_step()
                if cfg.val_every and (self.step % cfg.val_every == 0 or self.step == cfg.total_steps):
                    metrics.update(self.validate())
                self.logger.log(self.step, metrics)
                if (cfg.save_every and self.step % cfg.save_every == 0) or self.step == cfg.total_steps:
                    self.save()
                bar.update(task, completed=self.step, info=_progress_info(metrics))
        plot_reward_curve(
            self.logger.jsonl, self.run_dir / "reward_curve.png", self.cfg.trainer.experiment_name
        )
        self.logger.close()
        self.rewards.close()
        return {"run_dir": str(self.run_dir), "steps": self.step}

    def train_step(self) -> dict[str, Any]:
        timer = _Timer()
        batch, metrics = self.rollouts(timer)
        metrics.update(_data_metrics(batch, self.train_set.skipped, self.loader.epoch))
        if not len(batch):  # dynamic sampling kept no group and on_unfilled=continue: nothing to learn
            return metrics
        algo = self.cfg.algorithm
        if algo.use_kl_in_reward or self.actor.needs_old_logprobs(len(batch), self.cfg.rollout.n):
            with timer("old_logprobs"):
                batch.set(old_logprobs=self.actor.logprobs(self.model, batch))
        if self.ref is not None:
            with timer("ref"):
                batch.set(ref_logprobs=self.actor.logprobs(self.ref, batch))
        if self.critic is not None:
            with timer("values"):
                batch.set(values=self.critic.values(batch))
        with timer("advantage"):
            advantages, returns = self.advantages(batch, metrics)
            batch.set(advantages=advantages, returns=returns)
        metrics.update(_response_metrics(batch))
        if algo.mask_truncated:  # after the advantages, so a truncated response still counts in its group
            batch.set(response_mask=batch["response_mask"] * ~batch["truncated"][:, None])
        if self.critic is not None:
            with timer("critic"):
                metrics.update(self._update_critic(batch))
        if self.step > self.cfg.critic.pretrain_steps or self.critic is None:
            with timer("update"):
                stats = self.actor.update(batch, self.cfg.rollout.n)
            with timer("sync"):
                self.engine.sync_weights()
            metrics.update(stats.metrics)
            metrics["actor/skipped_updates"] = stats.skipped_steps
        metrics.update(timer.metrics(tokens=_token_count(batch)))
        return metrics

    def rollouts(self, timer: _Timer) -> tuple[Batch, dict[str, Any]]:
        """One scored prompt batch; with DAPO dynamic sampling, only groups whose rewards differ,
        refilled from the loader until `train_batch_size` groups or `max_num_gen_batches` rounds.

        Reward metrics describe the first round: an unbiased sample of the policy, comparable
        with runs without dynamic sampling."""
        algo, want = self.cfg.algorithm, self.cfg.data.train_batch_size
        metrics: dict[str, Any] = {}
        kept, filtered, groups = [], 0, 0
        for _ in range(algo.max_num_gen_batches):
            batch, round_metrics = self._scored_rollouts(timer)
            metrics = metrics or round_metrics
            if not algo.dynamic_sampling:
                return batch, metrics
            informative = informative_groups(batch["scores"], batch["prompt_index"])
            kept.append(batch.select(informative.nonzero().squeeze(1)))
            filtered += len(batch["prompt_index"][~informative].unique())
            groups += len(kept[-1]["prompt_index"].unique())
            if groups >= want:
                break
        if groups < want and algo.on_unfilled == "fail":
            raise UnfilledBatchError(
                f"step {self.step}: dynamic sampling found {groups} of data.train_batch_size={want} groups "
                f"with differing rewards in algorithm.max_num_gen_batches={len(kept)} generation rounds. "
                "Raise algorithm.max_num_gen_batches, set algorithm.on_unfilled=continue to train on a "
                "partial batch, or use a reward that separates responses more finely."
            )
        merged = concat(kept)
        chosen = merged["prompt_index"].unique()[:want]  # surplus groups of the last round are dropped
        merged = merged.select(torch.isin(merged["prompt_index"], chosen).nonzero().squeeze(1))
        metrics["dynamic_sampling/filtered_groups"] = filtered
        metrics["dynamic_sampling/gen_rounds"] = len(kept)
        metrics["dynamic_sampling/kept_groups"] = len(chosen)
        metrics["dynamic_sampling/kept_rows"] = [merged.prompts[i].row_id for i in chosen.tolist()]
        return merged, metrics

    def _scored_rollouts(self, timer: _Timer) -> tuple[Batch, dict[str, Any]]:
        """Generate for the loader's next prompts and score them, overlong shaping included."""
        with timer("rollout"), self._engine_errors("rollout"):
            batch = self.engine.generate(self.loader.next_batch(), self.train_sampling)
            self.engine.sleep()
        with timer("reward"):
            scores, metrics = self.score(batch, prefix="reward")
        algo = self.cfg.algorithm
        if algo.overlong_buffer_len:
            penalty = overlong_penalty(
                batch["response_mask"].sum(dim=1),
                self.cfg.rollout.max_new_tokens,
                algo.overlong_buffer_len,
                algo.overlong_penalty_factor,
            )
            scores = scores + penalty
            metrics["reward/overlong_penalty"] = float(penalty.mean())
        batch.set(scores=scores)
        return batch, metrics

    # ---------------------------------------------------------------- pieces
    @property
    def train_sampling(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            logprobs=self.engine.logprobs_are_free,
        )

    def score(self, batch: Batch, prefix: str) -> tuple[torch.Tensor, dict[str, Any]]:
        result = self.rewards.score(reward_inputs(batch))
        return torch.tensor(result.overall, dtype=torch.float32), reward_metrics(result, prefix)

    def advantages(self, batch: Batch, metrics: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token rewards (the score on the final token, minus β·KL if charged) to advantages and
        returns (the critic's regression targets under GAE)."""
        mask = batch["response_mask"].float()
        scores = batch["scores"]
        last = (mask.sum(dim=1).long() - 1).clamp(min=0)
        token_rewards = torch.zeros_like(mask)
        token_rewards[torch.arange(len(scores)), last] = scores  # outcome reward on the final token
        if self.cfg.algorithm.use_kl_in_reward:
            kl_reward, kl = kl_reward_penalty(
                batch["old_logprobs"],
                batch["ref_logprobs"],
                mask,
                self.cfg.algorithm.kl_penalty,
                self.kl_ctrl.value,
            )
            token_rewards = token_rewards + kl_reward
            metrics.update({"kl_reward/kl": kl, "kl_reward/coef": self.kl_ctrl.value})
            self.kl_ctrl.update(kl, n_steps=len(scores))
        extra: dict[str, Any] = {"values": batch["values"]} if "values" in batch else {}
        if self.cfg.algorithm.adv_estimator == "remax":  # ReMax: the greedy response's reward is the baseline
            with self._engine_errors("ReMax baseline rollout"):
                greedy = self.engine.generate(
                    batch.prompts, replace(self.train_sampling, n=1, temperature=0.0)
                )
            baseline, _ = self.score(greedy, prefix="remax")
            extra["baseline_scores"] = baseline[batch["prompt_index"]]
        return self.advantage(
            token_rewards,
            mask,
            batch["prompt_index"],
            norm_adv_by_std=self.cfg.algorithm.norm_adv_by_std,
            gamma=self.cfg.algorithm.gamma,
            lam=self.cfg.algorithm.lam,
            **extra,
        )

    def validate(self) -> dict[str, Any]:
        """Greedy answers on the held-out prompts; touches no RNG the training run depends on."""
        v = self.cfg.rollout.val
        params = SamplingParams(
            n=v.n,
            temperature=v.temperature,
            top_p=v.top_p,
            top_k=v.top_k,
            max_new_tokens=self.cfg.rollout.max_new_tokens,
        )
        if not self.val_samples:
            return {}
        with self._engine_errors("validation"):
            inputs, result = generate_and_score(
                self.engine, self.rewards, self.val_samples, params, self.cfg.data.val_batch_size
            )
        metrics = reward_metrics(result, prefix="val")
        key = f"val/{self.accuracy_key}"
        metrics["val/accuracy"] = metrics[key] if key in metrics else metrics["val/mean"]
        if self.cfg.trainer.gallery_samples:
            shown = range(min(len(inputs), self.cfg.trainer.gallery_samples))
            items = [
                GalleryItem(
                    images=inputs[i].images,
                    prompt=inputs[i].prompt,
                    response=inputs[i].response,
                    ground_truth=inputs[i].ground_truth,
                    reward=result.overall[i],
                    components={k: v[i] for k, v in result.components.items()},
                )
                for i in shown
            ]
            write_gallery(self.run_dir, self.step, items, metrics)
        return metrics

    def save(self) -> Path:
        state = {
            "step": self.step,
            "optimizer": self.actor.optimizer.state_dict(),
            "scheduler": self.actor.scheduler.state_dict(),
            "loader": self.loader.state_dict(),
            "bad_rows": dict(self.train_set.bad_rows),
            "rng": ckpt.rng_state(),
            "kl_coef": self.kl_ctrl.value,
        }
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        return ckpt.save_checkpoint(
            self.run_dir / "checkpoints",
            self.step,
            self.model,
            self.processor,
            state,
            self.cfg.trainer.keep_checkpoints,
        )

    def _resume(self) -> None:
        folder = ckpt.latest_checkpoint(self.run_dir / "checkpoints")
        if folder is None:
            self.console.print(
                f"[yellow]--resume: no complete checkpoint in {self.run_dir / 'checkpoints'}; starting fresh"
            )
            return
        ckpt.load_model_weights(self.model, folder)
        state = ckpt.load_trainer_state(folder)
        self.actor.optimizer.load_state_dict(state["optimizer"])
        self.actor.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])
        self.train_set.bad_rows = dict(state["bad_rows"])
        ckpt.set_rng_state(state["rng"])
        self.kl_ctrl.value = state.get("kl_coef", self.kl_ctrl.value)  # absent in older checkpoints
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
        self.step = state["step"]
        self.resumed_from = folder
        self.console.print(f"resumed from {folder} at step {self.step}")

    def _warmup(self) -> None:
        samples = self.train_set.prepare_all(limit=512)
        losses = format_warmup(
            self.model, self.processor.tokenizer, samples, self.cfg.warmup, self.cfg.trainer.seed
        )
        self.model.save_pretrained(
            self.run_dir / "warmup_model"
        )  # the RL starting point, and the KL reference
        self.console.print(f"format warm-up: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        if self.critic is not None and not self.cfg.critic.model_path:
            self.critic = self._make_critic(self.run_dir / "warmup_model")  # the critic starts where RL does

    @contextmanager
    def _engine_errors(self, what: str) -> Iterator[None]:
        """An engine crash (vLLM out of memory, a dead engine process) stops the run with an error that
        names the step, instead of a bare traceback from deep inside the engine."""
        try:
            yield
        except Exception as err:
            raise RolloutError(
                f"step {self.step}: the {type(self.engine).__name__} failed during {what}: {err!r}. Checkpoints "
                f"up to the last save are intact in {self.run_dir / 'checkpoints'}; fix the cause and run "
                "again with --resume."
            ) from err

    def _optimizer_steps(self, epochs: int) -> int:
        """Optimizer steps over the whole run, the length of the learning-rate schedule."""
        cfg = self.cfg
        return cfg.trainer.total_steps * epochs * (cfg.data.train_batch_size // cfg.actor.mini_batch_size)

    def _make_critic(self, start: str | Path) -> Critic | None:
        """The GAE critic, its trunk initialised from the policy weights at `start`; None without GAE."""
        if self.cfg.algorithm.adv_estimator != "gae":
            return None
        cfg = self.cfg
        device = str(next(self.model.parameters()).device)
        with torch.random.fork_rng(devices=_rng_devices()):  # building it must not shift the training RNG
            model = ValueModel.from_policy_weights(start, device)
        if cfg.model.freeze_vision_tower:
            model.model.visual.requires_grad_(False)
        return Critic(
            model,
            cfg.critic,
            self.pad_id,
            cfg.rollout.max_new_tokens,
            total_updates=self._optimizer_steps(cfg.critic.ppo_epochs or cfg.actor.ppo_epochs),
            micro_batch_size=cfg.actor.micro_batch_size,
            compute_dtype=self.compute_dtype,
        )

    def _update_critic(self, batch: Batch) -> dict[str, Any]:
        """One critic update on the actor's mini-batches; returns its metrics."""
        cfg = self.cfg
        assert self.critic is not None
        stats = self.critic.update(
            batch,
            rows_per_step=cfg.actor.mini_batch_size * cfg.rollout.n,
            epochs=cfg.critic.ppo_epochs or cfg.actor.ppo_epochs,
        )
        mask = batch["response_mask"].bool()
        metrics = dict(stats.metrics)
        metrics["critic/returns_mean"] = float(batch["returns"][mask].mean()) if mask.any() else 0.0
        metrics["critic/values_mean"] = float(batch["values"][mask].mean()) if mask.any() else 0.0
        metrics["critic/skipped_updates"] = stats.skipped_steps
        return metrics

    def _reference(self) -> Any:
        """The frozen KL reference: the policy as RL started (after any warm-up). None when KL is off."""
        kl_loss = self.cfg.actor.use_kl_loss and self.cfg.actor.kl_loss_coef > 0
        if not (kl_loss or self.cfg.algorithm.use_kl_in_reward):
            return None
        if self.resumed_from is None:
            return copy.deepcopy(self.model).to(self.compute_dtype).eval().requires_grad_(False)
        start = self.run_dir / "warmup_model" if self.cfg.warmup.steps else Path(self.cfg.model.path)
        device = next(self.model.parameters()).device
        with torch.random.fork_rng(devices=_rng_devices()):  # loading must not shift the training RNG
            return load_policy(start, self.compute_dtype, str(device)).eval().requires_grad_(False)

    def _progress(self) -> Progress:
        return Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.cfg.trainer.progress,
        )


def build_datasets(
    cfg: Config, processor: Any, model_config: Any
) -> tuple[PromptDataset, list[PromptSample]]:
    """The training set (prepared lazily, row by row) and the prepared validation samples."""
    d = cfg.data
    vcfg = model_config.vision_config
    budget = PixelBudget(d.min_pixels, d.max_pixels, vcfg.patch_size, vcfg.spatial_merge_size)
    tok, images = processor.tokenizer, processor.image_processor
    train = PromptDataset.from_config(d.train_files, d, tok, images, budget)
    val: list[PromptSample] = []
    if d.val_files:
        val_set = PromptDataset.from_config(d.val_files, d, tok, images, budget)
        val = val_set.prepare_all(d.max_val_samples)
        if val_set.skipped:
            log.warning("validation rows skipped: %s", dict(val_set.skipped))
    return train, val


def refuse_to_overwrite(run_dir: Path) -> None:
    """A fresh run must not mix its metrics and checkpoints with an earlier run's."""
    leftovers = [p for p in (run_dir / "metrics.jsonl", run_dir / "checkpoints") if p.exists()]
    if leftovers:
        raise FileExistsError(
            f"{run_dir} already holds an earlier run ({', '.join(p.name for p in leftovers)}). "
            "Pass --resume to continue it, or set trainer.output_dir / trainer.experiment_name to a new folder."
        )


def make_kl_controller(cfg: Config) -> KLController:
    """β for the KL reward penalty; warns when KL is also a loss term, as both then pull to π_ref."""
    kl = cfg.algorithm.kl_ctrl
    if cfg.algorithm.use_kl_in_reward and cfg.actor.use_kl_loss and cfg.actor.kl_loss_coef > 0:
        log.warning(
            "algorithm.use_kl_in_reward and actor.use_kl_loss are both on: KL to the reference is "
            "penalised twice (in the reward and in the loss); set actor.use_kl_loss=false unless intended"
        )
    if kl.type == "adaptive":
        return AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon)
    return FixedKLController(kl.kl_coef)


def _rng_devices() -> list[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_available() else []


class _Timer:
    """Wall time per phase, reported as timing/<phase> seconds plus throughput."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        yield
        self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - t0

    def metrics(self, tokens: int) -> dict[str, float]:
        total = time.perf_counter() - self.start
        out = {f"timing/{k}": v for k, v in self.phases.items()}
        out["timing/step"] = total
        out["throughput/tokens_per_s"] = tokens / total
        out["memory/peak_rss_gb"] = peak_rss_gb()
        return out


def _token_count(batch: Batch) -> int:
    prompt_tokens = sum(len(batch.prompts[i].prompt_ids) for i in batch["prompt_index"].tolist())
    return prompt_tokens + int(batch["response_mask"].sum())


def _response_metrics(batch: Batch) -> dict[str, float]:
    lengths = batch["response_mask"].sum(dim=1).float()
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_frac": float(batch["truncated"].float().mean()),
        "prompt_length/mean": float(np.mean([len(p.prompt_ids) for p in batch.prompts])),
    }


def _data_metrics(batch: Batch, skipped: dict[str, int], epoch: int) -> dict[str, Any]:
    """Where the loader stands; `data/rows` lists every prompt drawn this step, filtered or not."""
    metrics: dict[str, Any] = {f"data/skipped/{k}": v for k, v in skipped.items()}
    metrics["data/epoch"] = epoch
    metrics["data/rows"] = [p.row_id for p in batch.prompts]
    return metrics


def _progress_info(metrics: dict[str, Any]) -> str:
    text = f"reward {metrics.get('reward/mean', float('nan')):.3f}"
    if "val/accuracy" in metrics:
        text += f"  val acc {metrics['val/accuracy']:.3f}"
    return text
