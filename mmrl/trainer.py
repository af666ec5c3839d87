"""The RL loop: generate, score, log-probs, advantages, update, sync, log, save."""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import random
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from rich.console import Console
from safetensors.torch import load_file
from transformers import AutoConfig

from mmrl.config import Config
from mmrl.data.batch import Batch
from mmrl.errors import CheckpointError, ConfigError, NumericalError, RolloutError, WorkerError
from mmrl.models import family_of, load_policy, load_processor, resolve_dtype, save_model, tokenizer_of
from mmrl.rollout import engine_from_config
from mmrl.run import checkpoint as ckpt
from mmrl.run.lock import RunLock
from mmrl.run.logger import MetricsLogger, plot_reward_curve
from mmrl.run.progress import TrainingProgress
from mmrl.run.resume import check_resume, record_config
from mmrl.run.signals import RunInterrupted, StopSignals
from mmrl.run.timing import PhaseTimer
from mmrl.sources.base import RolloutSource, StepContext
from mmrl.sources.build import source_from_config
from mmrl.training.actor import Actor, build_actor, needs_reference
from mmrl.training.critic import Critic, build_critic, critic_plan, needs_critic, value_model
from mmrl.training.lora import apply_lora, merged_weights
from mmrl.training.optim import apply_settings
from mmrl.workers.remote import RemoteRollout

if TYPE_CHECKING:
    from mmrl.workers.group import CriticRole, PolicyGroup

log = logging.getLogger("mmrl.trainer")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Builds every part from the config, then runs `fit`; `resume=True` continues the newest checkpoint."""

    def __init__(
        self,
        cfg: Config,
        resume: bool = False,
        console: Console | None = None,
        source: RolloutSource | None = None,
    ) -> None:
        """`source`: where the steps' rollouts come from; by default the config's (`source_from_config`)."""
        self.lock = RunLock(cfg.run_dir)  # held until `fit` ends: a second run in the folder stops at once
        self.workers: PolicyGroup | None = None
        self.engine: Any = None
        try:
            self._build(cfg, resume, console, source)
        except BaseException:
            self._stop_workers()
            self.lock.release()
            raise

    def _build(
        self, cfg: Config, resume: bool, console: Console | None, source: RolloutSource | None
    ) -> None:
        self.cfg = cfg
        self.console = console or Console()
        self.run_dir = cfg.run_dir
        if not resume:
            refuse_to_overwrite(self.run_dir)
        start, changes = check_resume(self.run_dir, cfg) if resume else (0, "")
        if changes:
            self.console.print(changes, markup=False, highlight=False, soft_wrap=True)
        record_config(self.run_dir, cfg, start)
        seed_everything(cfg.trainer.seed)
        device = cfg.trainer.torch_device()
        # Trained weights stay fp32; `model.dtype` sets the compute precision (autocast).
        self.compute_dtype = resolve_dtype(cfg.model.dtype, device)
        self.processor = load_processor(cfg.model.path)
        self.pad_id = tokenizer_of(self.processor).pad_token_id
        # With Ray workers the policy lives in them (FSDP2 shards); the controller holds no weights.
        self.model: Any = None
        if not cfg.trainer.uses_workers:
            self.model = load_policy(cfg.model.path, torch.float32, device)
            if cfg.model.freeze_vision_tower:
                family_of(self.model).freeze_vision(self.model)
            if cfg.model.gradient_checkpointing:
                self.model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
        self.source = source or source_from_config(
            cfg, self.processor, AutoConfig.from_pretrained(cfg.model.path)
        )
        self.peft: Any = None  # the PeftModel wrapper once LoRA adapters are in
        self.actor: Any
        if self.model is not None and cfg.rollout.max_staleness and device == "cuda":
            raise ConfigError(
                "rollout.max_staleness on a GPU: the trainer in this process would share its GPU with the rollout "
                "worker. Run the trainer in a Ray worker too, so each has a GPU of its own: add "
                "trainer.ray_address=local (or auto on a cluster started with `ray start`)"
            )
        if self.model is not None:
            self.engine = (
                RemoteRollout(cfg, partial(merged_weights, self.model))  # generates ahead while this trains
                if cfg.rollout.max_staleness
                else engine_from_config(cfg, self.model, self.processor, self.compute_dtype, cfg.model.path)
            )
            self.actor = self._make_actor()
        self.critic: Critic | CriticRole | None = self._make_critic(cfg.critic.model_path or cfg.model.path)
        self.ref: Any = None
        self.logger = MetricsLogger(
            self.run_dir,
            cfg.trainer.loggers,
            self.console,
            name=cfg.trainer.experiment_name,
            config=cfg.model_dump(mode="json"),
        )
        self.step = 0
        self.resumed_from: Path | None = None
        # A run of steps whose every update was skipped (non-finite gradients): how many, and the
        # state before the first of them, which `_check_numerics` saves if the run must stop.
        self.bad_steps = 0
        self.last_good: dict[str, Any] | None = None
        self.save_deferred = False
        if cfg.trainer.uses_workers:
            self._start_workers(resume)
        if resume:
            self._resume()

    # ---------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        try:
            return self._fit()
        finally:
            self._stop_workers()
            self.lock.release()

    def _stop_workers(self) -> None:
        """Kill the Ray actors of this run: the policy group's, an overlapped run's rollout worker. A
        failure to is logged, not raised: it must not hide why the run ended."""
        for role in {id(r): r for r in (self.engine, self.workers) if r is not None}.values():
            if (stop := getattr(role, "shutdown", None)) is not None:
                try:
                    stop()
                except Exception as err:
                    log.warning("could not stop %s: %r", type(role).__name__, err)

    def _fit(self) -> dict[str, Any]:
        cfg = self.cfg.trainer
        if self.resumed_from is None and self.cfg.warmup.steps and self.workers is None:
            self._warmup(self.model)
        if self.cfg.model.lora.rank and self.peft is None and self.workers is None:
            self._apply_lora()  # after the warm-up: adapters start on the model RL starts from
        self.ref = self._reference()
        self.engine.sync_weights()  # the engine starts from the weights RL starts from (warm-up, resume)
        # A resumed run's step-0 record is already in the log (a checkpoint of step 0 is written when
        # the very first steps all fail numerically).
        progress = TrainingProgress(self.console, cfg.total_steps, self.step, cfg.progress)
        if cfg.val_before_train and self.step == 0 and self.resumed_from is None and self.source.validates:
            with self._worker_errors():
                baseline = self.source.validate(self._context(PhaseTimer()))
                self.logger.log(0, baseline)
            progress.validated(0, baseline)
        with progress, StopSignals() as stop:
            while self.step < cfg.total_steps:
                before = self._small_state()
                self.step += 1
                with self._worker_errors():
                    metrics = self.train_step()
                    if cfg.val_every and (self.step % cfg.val_every == 0 or self.step == cfg.total_steps):
                        metrics.update(self.source.validate(self._context(PhaseTimer())))
                    self.logger.log(self.step, metrics)
                    self._check_numerics(metrics, before)
                    self._save_if_due()
                progress.update(self.step, metrics)
                if stop.received and self.step < cfg.total_steps:
                    self._stop_on(stop.received)
        plot_reward_curve(
            self.logger.jsonl, self.run_dir / "reward_curve.png", self.cfg.trainer.experiment_name
        )
        self.logger.close()
        self.source.close()
        return {"run_dir": str(self.run_dir), "steps": self.step}

    def _save_if_due(self) -> None:
        """Periodic and final checkpoints; during a run of numerically bad steps the save waits, so
        the last good state stays the newest checkpoint a stop would leave."""
        cfg = self.cfg.trainer
        due = (cfg.save_every and self.step % cfg.save_every == 0) or self.step == cfg.total_steps
        if self.last_good is not None and self.step < cfg.total_steps:
            self.save_deferred = self.save_deferred or bool(due)
        elif due or self.save_deferred:
            self.save()
            self.save_deferred = False

    def _stop_on(self, signum: int) -> None:
        """End the run after a pre-emption signal with the newest state worth resuming saved: this
        step's, or during a run of numerically bad steps the last good one."""
        small = self.last_good or self._small_state()
        folder = self.run_dir / "checkpoints" / f"step_{small['step']:08d}"
        if not ckpt.is_complete(folder):
            folder = self.save(small)
        raise RunInterrupted(
            f"{signal.Signals(signum).name}: stopped after step {self.step} of "
            f"{self.cfg.trainer.total_steps}; the checkpoint of step {small['step']} is in {folder}.",
            signum,
        )

    def train_step(self) -> dict[str, Any]:
        timer = PhaseTimer()
        ctx = self._context(timer)
        batch, metrics = self.source.rollouts(ctx)
        with timer("rollout"), self._engine_errors("rollout"):
            self.engine.sleep()  # after every generation round: waking from level 2 reloads the weights
        metrics.update(self.source.metrics(batch))
        if not len(batch):  # dynamic sampling kept no group and on_unfilled=continue: nothing to learn
            return metrics
        algo = self.cfg.algorithm
        if algo.use_kl_in_reward or self.source.needs_old_logprobs(batch):
            with timer("old_logprobs"):
                batch.set(old_logprobs=self.actor.logprobs(batch))
        if self.ref is not None:
            with timer("ref"):
                batch.set(ref_logprobs=self._ref_logprobs(batch))
        if self.critic is not None:
            with timer("values"):
                batch.set(values=self.critic.values(batch))
        with timer("advantage"):
            advantages, returns = self.source.advantages(batch, metrics, ctx)
            batch.set(advantages=advantages, returns=returns)
        metrics.update(_response_metrics(batch))
        if algo.mask_truncated:  # after the advantages, so a truncated response still counts in its group
            batch.set(response_mask=batch["response_mask"] * ~batch["truncated"][:, None])
        if self.critic is not None:
            with timer("critic"):
                metrics.update(self._update_critic(batch))
        if self.step > self.cfg.critic.pretrain_steps or self.critic is None:
            with timer("update"):
                stats = self.actor.update(batch, self.source.update_plan(batch))
            with timer("sync"):
                self.engine.sync_weights()
            metrics.update(stats.metrics)
            metrics["actor/updates"] = stats.steps
            metrics["actor/skipped_updates"] = stats.skipped_steps
            if stats.skipped_steps:
                log.warning(
                    "step %d: %d of %d actor updates skipped for a non-finite gradient norm (NaN/inf); "
                    "they changed no weights and no optimizer state",
                    self.step,
                    stats.skipped_steps,
                    stats.steps,
                )
        metrics.update(timer.metrics(tokens=_token_count(batch)))
        return metrics

    def _small_state(self) -> dict[str, Any]:
        """The trainer state besides weights and optimizer: small enough to copy before every step,
        so the state before a run of skipped updates can still be saved once it is known to be bad."""
        return {
            "step": self.step,
            **self.source.state(),
            "rng": ckpt.rng_state(),
        }

    def save(self, small_state: dict[str, Any] | None = None) -> Path:
        """Checkpoint the model, optimizer and `small_state` (default: as they are now)."""
        small = small_state or self._small_state()
        state = dict(small)
        write_model = self._model_writer()
        if self.workers is None:
            state["optimizer"] = self.actor.optimizer.state_dict()
            state["scheduler"] = self.actor.scheduler.state_dict()
        if self.critic is not None and self.workers is None:  # workers save their critic shards themselves
            state["critic"] = self.critic.state_dict()
        root = self.run_dir / "checkpoints"
        try:
            return ckpt.save_checkpoint(
                root, small["step"], write_model, state, self.cfg.trainer.keep_checkpoints
            )
        except OSError as err:
            raise CheckpointError(_save_failure(root, small["step"], err)) from err

    def _model_writer(self) -> Callable[[Path], None]:
        """What writes the weights into a checkpoint folder: each worker its own shards of weights and
        AdamW state, or this process the model (under LoRA the adapter alone, in peft's format); then the
        source adds what its policy needs beside them (`RolloutSource.save_files`)."""
        weights = (
            self.workers.save
            if self.workers is not None
            else ckpt.hf_writer(self.peft or self.model, self.processor)
        )

        def write(folder: Path) -> None:
            weights(folder)
            self.source.save_files(Path(folder) / "model")

        return write

    def _context(self, timer: PhaseTimer) -> StepContext:
        """What the source is handed for a call: the engine, this step, its timer, the error guard."""
        return StepContext(self.engine, self.step, timer, self._engine_errors)

    def _check_numerics(self, metrics: dict[str, Any], before: dict[str, Any]) -> None:
        """Stop after `trainer.max_consecutive_bad_steps` steps in a row whose every actor update was
        skipped for a non-finite gradient, first saving the state from before the first of them.

        A skipped update touches no weights, optimizer moments or schedule (see `minibatch_updates`),
        so that state is today's model and optimizer with `before` (loader, RNG, counters) from the
        streak's start: a resumed run replays the same data exactly. A critic's own finite updates
        during the streak are kept. Steps that update nothing (empty batch, critic warm-up) are neutral."""
        updates = metrics.get("actor/updates", 0)
        if not updates:
            return
        if metrics["actor/skipped_updates"] < updates:
            self.bad_steps, self.last_good = 0, None
            return
        self.bad_steps += 1
        self.last_good = self.last_good or before
        limit = self.cfg.trainer.max_consecutive_bad_steps
        if self.bad_steps < limit:
            return
        good_step = self.last_good["step"]
        folder = self.run_dir / "checkpoints" / f"step_{good_step:08d}"
        if not ckpt.is_complete(folder):  # a periodic save may already hold exactly this state
            folder = self.save(self.last_good)
        raise NumericalError(
            f"steps {good_step + 1}-{self.step}: every actor update had a non-finite gradient (NaN/inf), "
            f"{limit} steps in a row (trainer.max_consecutive_bad_steps), so the run stopped. The last good "
            f"state, after step {good_step}, is saved in {folder}. Look for the cause in metrics.jsonl "
            "(actor/pg_loss, reward/*, a custom actor.policy_loss or reward); a lower actor.lr or "
            "actor.max_grad_norm may help. Then run again with --resume."
        )

    def _resume(self) -> None:
        ckpt.remove_torn_writes(self.run_dir / "checkpoints")
        folder = ckpt.latest_checkpoint(self.run_dir / "checkpoints")
        if folder is None:
            truncate_metrics(self.logger.jsonl, None)
            self.console.print(
                f"[yellow]--resume: no complete checkpoint in {self.run_dir / 'checkpoints'}; starting fresh"
            )
            return
        state = ckpt.load_trainer_state(folder)
        if self.workers is not None:
            self.workers.load(folder)
        else:
            if self.cfg.model.lora.rank:
                self._load_lora(folder)
            else:
                ckpt.load_model_weights(self.model, folder)
            self.actor.optimizer.load_state_dict(state["optimizer"])
            self.actor.scheduler.load_state_dict(state["scheduler"])
            # The config's lr over the checkpoint's: a resume may change it.
            apply_settings(self.actor.optimizer, self.actor.scheduler, self.cfg.actor)
        self.source.load_state(state)
        ckpt.set_rng_state(state["rng"])
        if self.critic is not None and self.workers is None:  # `workers.load` restored theirs
            self.critic.load_state_dict(state["critic"])
        self.step = state["step"]
        self.resumed_from = folder
        redone = truncate_metrics(self.logger.jsonl, self.step)
        self.logger.resume_at(self.step)
        note = f"; {redone} metrics records logged after it were dropped, to be redone" if redone else ""
        self.console.print(f"resumed from {folder} at step {self.step}{note}")

    def _warmup(self, model: Any) -> None:
        losses = self.source.warmup(model, tokenizer_of(self.processor), self.cfg.trainer.seed)
        # The RL starting point and the KL reference: a complete model folder, for the workers too.
        save_model(model, self.processor, self.run_dir / "warmup_model")
        self.console.print(f"format warm-up: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        if self.critic is not None and not self.cfg.critic.model_path:
            self.critic = self._make_critic(self.run_dir / "warmup_model")  # the critic starts where RL does

    def _start_workers(self, resume: bool) -> None:
        """Start the Ray actor group on the weights RL starts from: the configured model, or the format
        warm-up's output, which the controller makes first (in-process, once) when a fresh run has one."""
        start = self._lora_base()
        if self.cfg.warmup.steps and not (start / "config.json").exists():
            if resume and ckpt.latest_checkpoint(self.run_dir / "checkpoints") is not None:
                raise FileNotFoundError(
                    f"{start} is missing: the checkpoints of this run were trained from it"
                )
            with torch.random.fork_rng(devices=ckpt.rng_devices()):
                self._warmup(load_policy(self.cfg.model.path))
        from mmrl.workers.group import PolicyGroup  # Ray is imported only by runs that use it

        cfg = self.cfg.model_copy(deep=True)
        cfg.model.path = str(start)
        self.workers = PolicyGroup(cfg)
        self.actor = self.workers
        # Overlapped: a rollout worker of its own, fed the whole weights gathered from the shards.
        self.engine = (
            RemoteRollout(cfg, self.workers.merged_weights) if cfg.rollout.max_staleness else self.workers
        )
        self.critic = self.workers.critic
        roles = "actor and critic" if self.critic is not None else "actor"
        self.console.print(
            f"{self.workers.world} {roles} workers (FSDP2) on {len(set(self.workers.nodes))} node(s)"
        )

    @contextmanager
    def _worker_errors(self) -> Iterator[None]:
        """A dead or failing Ray worker stops the run with the step it happened in and what to do."""
        try:
            yield
        except WorkerError as err:
            raise WorkerError(
                f"step {self.step}: {err}. The other workers were stopped; checkpoints up to the last save are "
                f"intact in {self.run_dir / 'checkpoints'}. Fix the cause and run again with --resume."
            ) from err

    @contextmanager
    def _engine_errors(self, what: str) -> Iterator[None]:
        """An engine crash (vLLM out of memory, a dead engine process) stops the run with an error that
        names the step, instead of a bare traceback from deep inside the engine."""
        try:
            yield
        except WorkerError:
            raise  # the worker group names its own failures
        except Exception as err:
            raise RolloutError(
                f"step {self.step}: the {type(self.engine).__name__} failed during {what}: {err!r}. Checkpoints "
                f"up to the last save are intact in {self.run_dir / 'checkpoints'}; fix the cause and run "
                "again with --resume."
            ) from err

    def _make_critic(self, start: str | Path) -> Critic | None:
        """The in-process GAE critic, its trunk initialised from the policy weights at `start`; None
        without GAE, or with Ray workers, which hold their own shards of it (`_start_workers`)."""
        if not needs_critic(self.cfg) or self.cfg.trainer.uses_workers:
            return None
        device = str(next(self.model.parameters()).device)
        with torch.random.fork_rng(devices=ckpt.rng_devices()):  # building it must not shift the training RNG
            model = value_model(self.cfg, start, device)
        return build_critic(self.cfg, model, self.pad_id, self.compute_dtype)

    def _update_critic(self, batch: Batch) -> dict[str, Any]:
        """One critic update on the actor's mini-batches; returns its metrics."""
        assert self.critic is not None
        stats = self.critic.update(batch, critic_plan(self.cfg, batch))
        mask = batch["response_mask"].bool()
        metrics = dict(stats.metrics)
        metrics["critic/returns_mean"] = float(batch["returns"][mask].mean()) if mask.any() else 0.0
        metrics["critic/values_mean"] = float(batch["values"][mask].mean()) if mask.any() else 0.0
        metrics["critic/skipped_updates"] = stats.skipped_steps
        return metrics

    def _reference(self) -> Any:
        """The frozen KL reference: the policy as RL started (after any warm-up). None when KL is off;
        under LoRA the policy itself, read with its adapter switched off (no second copy)."""
        if not needs_reference(self.cfg):
            return None
        if self.workers is not None:  # each worker holds its shard of the reference
            return self.workers
        if self.peft is not None:
            return self.model
        if self.resumed_from is None:
            return copy.deepcopy(self.model).to(self.compute_dtype).eval().requires_grad_(False)
        start = self.run_dir / "warmup_model" if self.cfg.warmup.steps else Path(self.cfg.model.path)
        device = next(self.model.parameters()).device
        with torch.random.fork_rng(devices=ckpt.rng_devices()):  # loading must not shift the training RNG
            return load_policy(start, self.compute_dtype, str(device)).eval().requires_grad_(False)

    def _ref_logprobs(self, batch: Batch) -> torch.Tensor:
        if self.workers is not None:
            return self.workers.ref_logprobs(batch)
        if self.ref is self.model:  # LoRA: the base model is the policy without its adapter
            with self.peft.disable_adapter():
                return self.actor.logprobs(batch)
        return self.actor.logprobs(batch, self.ref)

    def _make_actor(self) -> Actor:
        return build_actor(self.cfg, self.model, self.pad_id, self.compute_dtype)

    def _lora_base(self) -> Path:
        """The weights the adapters sit on: the warm-up's output, or the configured model."""
        return self.run_dir / "warmup_model" if self.cfg.warmup.steps else Path(self.cfg.model.path)

    def _apply_lora(self) -> None:
        """Freeze the model, add adapters, and give the actor an optimizer over the adapters only."""
        # peft records this as the adapter's base, so `mmrl eval` and plain transformers find it.
        base = str(self._lora_base().resolve())
        self.model.name_or_path = self.model.config._name_or_path = base
        self.peft = apply_lora(self.model, self.cfg.model.lora)
        self.actor = self._make_actor()

    def _load_lora(self, folder: Path) -> None:
        """Resume under LoRA: the base weights, then the checkpoint's adapter on top."""
        from peft import set_peft_model_state_dict

        with torch.random.fork_rng(devices=ckpt.rng_devices()):
            base = load_policy(self._lora_base(), torch.float32)
        self.model.load_state_dict(base.state_dict())
        self._apply_lora()
        adapter = folder / "model" / "adapter_model.safetensors"
        if not adapter.exists():
            raise FileNotFoundError(
                f"{folder} holds no LoRA adapter ({adapter.name}); was it saved with model.lora?"
            )
        set_peft_model_state_dict(self.peft, load_file(adapter))


def refuse_to_overwrite(run_dir: Path) -> None:
    """A fresh run must not mix its metrics and checkpoints with an earlier run's."""
    leftovers = [p for p in (run_dir / "metrics.jsonl", run_dir / "checkpoints") if p.exists()]
    if leftovers:
        raise FileExistsError(
            f"{run_dir} already holds an earlier run ({', '.join(p.name for p in leftovers)}). "
            "Pass --resume to continue it, or set trainer.output_dir / trainer.experiment_name to a new folder."
        )


def truncate_metrics(path: Path, last_step: int | None) -> int:
    """Drop metrics.jsonl records after `last_step` (every record for None); returns how many.

    A run killed after its last checkpoint has logged steps that the resumed run does again;
    kept, they would appear twice. A line torn by the kill goes too. The file is replaced
    atomically, so dying here loses nothing."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            step = None
        if step is not None and last_step is not None and step <= last_step:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("w", encoding="utf-8") as fh:
            fh.writelines(kept)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    return dropped


def _save_failure(root: Path, step: int, err: OSError) -> str:
    """What went wrong writing a checkpoint, what is still safe, and what to do."""
    cause = "no space left on the device" if err.errno == errno.ENOSPC else (err.strerror or str(err))
    newest = ckpt.latest_checkpoint(root)
    intact = f"the newest complete one, {newest.name}, is intact" if newest else "there is no earlier one"
    return (
        f"step {step}: could not write a checkpoint to {root}: {cause} ({err.filename or err}). "
        f"The partial write was removed; {intact}. Saving needs room for one checkpoint more than "
        "trainer.keep_checkpoints; free space there, then run again with --resume."
    )


def _token_count(batch: Batch) -> int:
    prompt_tokens = sum(len(batch.prompts[i].prompt_ids) for i in batch["prompt_index"].tolist())
    return prompt_tokens + int(batch.attention.sum())  # tool responses between turns are computed too


def _response_metrics(batch: Batch) -> dict[str, float]:
    lengths = batch["response_mask"].sum(dim=1).float()
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_frac": float(batch["truncated"].float().mean()),
        "prompt_length/mean": float(np.mean([len(p.prompt_ids) for p in batch.prompts])),
    }
