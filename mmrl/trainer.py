"""The RL loop: generate, score, log-probs, advantages, update, sync, log, save."""

from __future__ import annotations

import logging
import random
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from transformers import AutoConfig

from mmrl.config import Config, dump_config
from mmrl.data.batch import response_metrics, token_count
from mmrl.errors import CheckpointError, NumericalError, RewardError, RolloutError, WorkerError
from mmrl.models import load_processor, tokenizer_of
from mmrl.run import checkpoint as ckpt
from mmrl.run.lock import RunLock
from mmrl.run.logger import MetricsLogger, plot_reward_curve
from mmrl.run.progress import TrainingProgress
from mmrl.run.resume import (
    CONFIG,
    check_resume,
    record_config,
    refuse_to_overwrite,
    resumable_checkpoint,
    truncate_metrics,
)
from mmrl.run.signals import RunInterrupted, StopSignals
from mmrl.run.targets import StopTargets
from mmrl.run.timing import HeapRelease, PhaseTimer
from mmrl.sources.base import RolloutSource, StepContext
from mmrl.sources.build import source_from_config
from mmrl.training.actor import update_actor
from mmrl.training.critic import critic_plan, update_critic
from mmrl.training.prm import train_and_score
from mmrl.workers.placement import Policy, place_policy

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
        self.policy: Policy | None = None
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
        resume_from, notes = resumable_checkpoint(self.run_dir) if resume else (None, [])
        start, changes = check_resume(self.run_dir, cfg, resume_from)
        for note in [*notes, changes] if changes else notes:
            self.console.print(note, markup=False, highlight=False, soft_wrap=True)
        seed_everything(cfg.trainer.seed)
        self.processor = load_processor(cfg.model.path)
        self.source = source or source_from_config(
            cfg, self.processor, AutoConfig.from_pretrained(cfg.model.path)
        )
        self.policy = place_policy(
            cfg, self.processor, self.run_dir, resume_from is not None, self._warmup, self.console
        )
        self.engine = self.policy.engine
        self.critic = self.policy.critic
        self.prm = self.policy.prm
        self.logger = MetricsLogger(
            self.run_dir,
            cfg.trainer.loggers,
            self.console,
            name=cfg.trainer.experiment_name,
            config=cfg.model_dump(mode="json"),
        )
        self.step = 0
        self.heap = HeapRelease()  # freed heap pages back to the OS when they pile up
        self.resumed_from: Path | None = None
        self.targets = StopTargets(cfg.trainer, self.logger.jsonl, self.console)
        # A run of steps whose every update was skipped (non-finite gradients): how many, and the
        # state before the first of them, which `_check_numerics` saves if the run must stop.
        self.bad_steps = 0
        self.last_good: dict[str, Any] | None = None
        self.save_deferred = False
        if resume:
            self._resume(resume_from)
        record_config(self.run_dir, cfg, start)  # once the run is built: a refused resume changes no record

    # ---------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        try:
            return self._fit()
        finally:
            self._stop_workers()
            self.lock.release()

    def _stop_workers(self) -> None:
        """Stop the run's Ray actors (the policy group's, an overlapped run's rollout worker). A failure to
        is logged, not raised: it must not hide why the run ended."""
        if self.policy is not None:
            try:
                self.policy.shutdown()
            except Exception as err:
                log.warning("could not stop %s: %r", type(self.policy).__name__, err)

    def _fit(self) -> dict[str, Any]:
        cfg = self.cfg.trainer
        self.engine.sync_weights()  # the engine starts from the weights RL starts from (warm-up, resume)
        # A resumed run's step-0 record is already in the log (a checkpoint of step 0 is written when
        # the very first steps all fail numerically).
        progress = TrainingProgress(self.console, cfg.total_steps, self.step, cfg.progress)
        if cfg.val_before_train and self.step == 0 and self.resumed_from is None and self.source.validates:
            with self._worker_errors():
                baseline = self.source.validate(self._context(PhaseTimer()))
                self.logger.log(0, baseline)
                self.targets.baseline = baseline
                self.targets.reached(0, baseline)  # a target this validation lacks fails before any training
            progress.validated(0, baseline)
        with progress, StopSignals() as stop:
            reached = False
            while self.step < cfg.total_steps and not reached:
                before = self._small_state()
                self.step += 1
                with self._worker_errors():
                    metrics = self.train_step()
                    if cfg.val_every and (self.step % cfg.val_every == 0 or self.step == cfg.total_steps):
                        metrics.update(self.source.validate(self._context(PhaseTimer())))
                        reached = self.targets.reached(self.step, metrics)
                    self.logger.log(self.step, metrics)
                    self._check_numerics(metrics, before)
                    self._save_if_due(final=reached)
                progress.update(self.step, metrics)
                if stop.received and self.step < cfg.total_steps and not reached:
                    self._stop_on(stop.received)
        plot_reward_curve(
            self.logger.jsonl, self.run_dir / "reward_curve.png", self.cfg.trainer.experiment_name
        )
        self.logger.close()
        self.source.close()
        return {"run_dir": str(self.run_dir), "steps": self.step}

    def _save_if_due(self, final: bool = False) -> None:
        """Periodic and final checkpoints (`final`: a stop_at target was met, so this step is the last);
        during a run of numerically bad steps the save waits, so the last good state stays the newest
        checkpoint a stop would leave."""
        cfg = self.cfg.trainer
        final = final or self.step == cfg.total_steps
        due = (cfg.save_every and self.step % cfg.save_every == 0) or final
        if self.last_good is not None and not final:
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
        plan = self.source.update_plan(batch)
        if algo.use_kl_in_reward or plan.steps(len(batch)) > 1:
            with timer("old_logprobs"):
                batch.set(old_logprobs=self.policy.logprobs(batch))
        if self.policy.has_reference:
            with timer("ref"):
                batch.set(ref_logprobs=self.policy.ref_logprobs(batch))
        if self.critic is not None:
            with timer("values"):
                batch.set(values=self.critic.values(batch))
        if self.prm is not None:  # PRIME: the PRM learns this step's outcomes, then rewards every token
            with timer("prm"):
                metrics.update(train_and_score(self.prm, self.cfg, batch))
        with timer("advantage"):
            advantages, returns = self.source.advantages(batch, metrics, ctx)
            batch.set(advantages=advantages, returns=returns)
        metrics.update(response_metrics(batch))
        if algo.mask_truncated:  # after the advantages, so a truncated response still counts in its group
            batch.set(response_mask=batch["response_mask"] * ~batch["truncated"][:, None])
        if self.critic is not None:
            with timer("critic"):
                metrics.update(update_critic(self.critic, critic_plan(self.cfg, batch, plan), batch))
        if self.step > self.cfg.critic.pretrain_steps or self.critic is None:
            with timer("update"):
                metrics.update(update_actor(self.policy, batch, plan.minibatches(batch), self.step))
            with timer("sync"):
                self.engine.sync_weights()
        metrics.update(timer.metrics(tokens=token_count(batch), heap=self.heap))
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
        state = {**small, **self.policy.state_dict()}
        root = self.run_dir / "checkpoints"
        try:
            return ckpt.save_checkpoint(
                root, small["step"], self._write_model, state, self.cfg.trainer.keep_checkpoints
            )
        except OSError as err:
            raise CheckpointError(ckpt.save_failure(root, small["step"], err)) from err

    def _write_model(self, folder: Path) -> None:
        """The weights into a checkpoint folder (the policy's layout: an HF folder, or each worker's
        shards), then what the source's policy needs beside them (`RolloutSource.save_files`)."""
        self.policy.save(folder)
        self.source.save_files(Path(folder) / "model")
        (Path(folder) / CONFIG).write_text(dump_config(self.cfg))  # what a resume from it compares with

    def _context(self, timer: PhaseTimer) -> StepContext:
        """What the source is handed for a call: the engine, this step, its timer, the error guard."""
        return StepContext(self.engine, self.step, timer, self._engine_errors)

    def _check_numerics(self, metrics: dict[str, Any], before: dict[str, Any]) -> None:
        """Stop after `trainer.max_consecutive_bad_steps` steps in a row whose every actor update was
        skipped for a non-finite gradient, first saving the state from before the first of them.

        A skipped update touches no weights, optimizer moments or schedule (see `minibatch_updates`),
        so that state is today's model and optimizer with `before` (loader, RNG, counters) from the
        streak's start: a resumed run replays the same data exactly. A critic's or PRM's own finite
        updates during the streak are kept. Steps that update nothing (empty batch, critic warm-up) are neutral."""
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

    def _resume(self, folder: Path | None) -> None:
        if folder is None:
            truncate_metrics(self.logger.jsonl, None)
            self.console.print(
                f"[yellow]--resume: no complete checkpoint in {self.run_dir / 'checkpoints'}; starting fresh"
            )
            return
        state = ckpt.load_trainer_state(folder)
        self.policy.load(folder, state)
        self.source.load_state(state)
        ckpt.set_rng_state(state["rng"])
        self.step = state["step"]
        self.resumed_from = folder
        redone = truncate_metrics(self.logger.jsonl, self.step)
        self.logger.resume_at(self.step)
        note = f"; {redone} metrics records logged after it were dropped, to be redone" if redone else ""
        self.console.print(f"resumed from {folder} at step {self.step}{note}")

    def _warmup(self, model: Any) -> list[float]:
        """The format warm-up on the source's own prompts (`place_policy` saves its result)."""
        return self.source.warmup(model, tokenizer_of(self.processor), self.cfg.trainer.seed)

    @contextmanager
    def _worker_errors(self) -> Iterator[None]:
        """A dead or failing Ray worker stops the run with the step it happened in and what to do."""
        try:
            yield
        except WorkerError as err:
            raise WorkerError(
                f"step {self.step}: {err}. The other workers were stopped. {self._kept()}"
            ) from err
        except RewardError as err:
            raise RewardError(f"{err}. {self._kept()}") from err

    def _kept(self) -> str:
        return ckpt.what_is_kept(self.run_dir / "checkpoints", self.cfg.trainer.save_every)

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
                f"step {self.step}: the {type(self.engine).__name__} failed during {what}: {err!r}. {self._kept()}"
            ) from err
