"""Single-turn prompts as a rollout source: rows from the data files, answers graded by reward functions.

Each step draws `data.train_batch_size` prompts from the loader, samples `rollout.n` answers to each,
scores them and, with DAPO's dynamic sampling, keeps only groups whose rewards differ. Advantages
come from the outcome reward on each answer's last token (minus β·KL when the KL is charged in the
reward), through the configured estimator.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace
from typing import Any

import torch

from mmrl.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    get_advantage_estimator,
    get_policy_filter,
    informative_groups,
    kl_reward_penalty,
    overlong_penalty,
)
from mmrl.config import Config
from mmrl.data.batch import Batch, concat
from mmrl.data.dataset import PreparedRows, PromptDataset, PromptInputs, image_budget
from mmrl.data.loaders import make_loader
from mmrl.data.prefetch import PrefetchLoader
from mmrl.errors import ConfigError
from mmrl.models import family_of, tokenizer_of
from mmrl.processors import VideoBudget
from mmrl.rewards import RewardInput, RewardManager
from mmrl.rollout import resolve_engine
from mmrl.rollout.base import SamplingParams, draw_seed, generate_seeded
from mmrl.run.gallery import GalleryItem, frame_strip, write_gallery
from mmrl.sources import reward_models  # noqa: F401  (registers the reward_model and llm_judge rewards)
from mmrl.sources.base import RolloutSource, StepContext
from mmrl.sources.scoring import (
    FailingRewards,
    generate_and_score,
    reward_inputs,
    reward_label,
    reward_metrics,
)
from mmrl.sources.stream import GroupStream
from mmrl.training.actor import update_plan
from mmrl.training.optim import UpdatePlan
from mmrl.training.warmup import format_warmup

log = logging.getLogger("mmrl.sources.prompts")


WARMUP_ROWS = 512  # prompts the format warm-up draws from


class UnfilledBatchError(ConfigError):
    """Dynamic sampling ran out of generation rounds with `algorithm.on_unfilled=fail`."""


class PromptSource(RolloutSource):
    """Prompt rows, their loader, the reward functions that grade the answers, and the KL controller
    of a KL charged in the reward (its coefficient is part of the source's checkpointed state)."""

    def __init__(self, cfg: Config, processor: Any, model_config: Any) -> None:
        self.cfg = cfg
        self.train_set, self.val_samples = build_datasets(cfg, processor, model_config)
        self.loader = PrefetchLoader(
            make_loader(self.train_set, cfg.data, cfg.trainer.seed), cfg.data.prefetch
        )
        self.rewards = RewardManager(
            [f.model_dump() for f in cfg.reward.functions],
            timeout_s=cfg.reward.timeout_s,
            isolation=cfg.reward.isolation,
            num_workers=cfg.reward.num_workers,
        )
        self.failing_rewards = FailingRewards(cfg.reward.max_all_failed_steps)
        self.accuracy_key = reward_label(cfg.reward.functions[0].name)
        self.estimator = get_advantage_estimator(cfg.algorithm.adv_estimator)
        filtration = cfg.algorithm.policy_filtration
        self.policy_filter = get_policy_filter(filtration) if filtration else None
        self.kl_ctrl = make_kl_controller(cfg)
        self.validates = bool(self.val_samples)
        # Rollout workers of their own (`rollout.workers`, `rollout.max_staleness`): groups streamed.
        r = cfg.rollout
        self.stream = (
            GroupStream(self.loader, cfg.data.train_batch_size, r.max_staleness, r.stale)
            if r.remote
            else None
        )
        self.drawn_state = self.loader.source_state()  # the loader after the batch last trained on

    # ---------------------------------------------------------------- rollouts
    def sampling(self, engine: Any) -> SamplingParams:
        """Training sampling; the engine's log-probs are kept where they cost nothing or are needed."""
        r = self.cfg.rollout
        return SamplingParams(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            logprobs=engine.logprobs_are_free or self.cfg.actor.rollout_correction is not None,
        )

    def rollouts(self, ctx: StepContext) -> tuple[Batch, dict[str, Any]]:
        """One scored prompt batch; with DAPO dynamic sampling, only groups whose rewards differ,
        refilled from the loader until `train_batch_size` groups or `max_num_gen_batches` rounds.

        Reward metrics describe the first round: an unbiased sample of the policy, comparable
        with runs without dynamic sampling. Streamed from rollout workers, each round asks for the groups
        still missing."""
        if self.stream is None:
            return self._rollouts(ctx)
        self.stream.begin_step()
        batch, metrics = self._rollouts(ctx)
        metrics.update(self.stream.step_metrics())
        self.drawn_state = self.stream.trained_state
        return batch, metrics

    def _rollouts(self, ctx: StepContext) -> tuple[Batch, dict[str, Any]]:
        algo, want = self.cfg.algorithm, self.cfg.data.train_batch_size
        metrics: dict[str, Any] = {}
        kept, filtered, groups, shift = [], 0, 0, 0
        for _ in range(algo.max_num_gen_batches):
            batch, round_metrics = self._scored_rollouts(ctx, want - groups)
            metrics = metrics or round_metrics
            if not algo.dynamic_sampling:
                return self._filtered(batch, metrics, ctx.step), metrics
            if "group_index" in batch:  # each round numbers its groups from 0: after the last round's
                batch.set(group_index=batch["group_index"] + shift)
                shift = int(batch["group_index"].max()) + 1
            informative = informative_groups(batch["scores"], groups_of(batch))
            kept.append(batch.select(informative.nonzero().squeeze(1)))
            filtered += len(groups_of(batch)[~informative].unique())
            groups += len(groups_of(kept[-1]).unique())
            if groups >= want:
                break
        if groups < want and algo.on_unfilled == "fail":
            raise UnfilledBatchError(
                f"step {ctx.step}: dynamic sampling found {groups} of data.train_batch_size={want} groups "
                f"with differing rewards in algorithm.max_num_gen_batches={len(kept)} generation rounds. "
                "Raise algorithm.max_num_gen_batches, set algorithm.on_unfilled=continue to train on a "
                "partial batch, or use a reward that separates responses more finely."
            )
        merged = concat(kept)
        chosen = groups_of(merged).unique()[:want]  # surplus groups of the last round are dropped
        merged = merged.select(torch.isin(groups_of(merged), chosen).nonzero().squeeze(1))
        metrics["dynamic_sampling/filtered_groups"] = filtered
        metrics["dynamic_sampling/gen_rounds"] = len(kept)
        metrics["dynamic_sampling/kept_groups"] = len(chosen)
        metrics["dynamic_sampling/kept_rows"] = row_ids(merged)
        return self._filtered(merged, metrics, ctx.step), metrics

    def _filtered(self, batch: Batch, metrics: dict[str, Any], step: int) -> Batch:
        """PF-PPO's policy filtration (`algorithm.policy_filtration`): only the responses its filter keeps
        of each group, chosen by score; random choices are drawn from the run's seed and the step, so a
        resumed run draws the same."""
        if self.policy_filter is None:
            return batch
        draws = torch.Generator().manual_seed(self.cfg.trainer.seed * 1_000_003 + step)
        keep = self.policy_filter(batch["scores"], groups_of(batch), draws)
        metrics["policy_filtration/kept_rows"] = int(keep.sum())
        if keep.any():  # the mean score of what trains, beside reward/mean of everything sampled
            metrics["policy_filtration/kept_reward_mean"] = float(batch["scores"][keep].mean())
        return batch.select(keep.nonzero().squeeze(1))

    def _scored_rollouts(self, ctx: StepContext, groups: int) -> tuple[Batch, dict[str, Any]]:
        """The next generated batch (of `groups` groups when streamed), scored, overlong shaping included."""
        batch, metrics = self._next_generated(ctx, groups)
        with ctx.timer("reward"):
            scores, reward = self.score(batch, "reward", ctx.step)
        metrics.update(reward)
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

    def _next_generated(self, ctx: StepContext, groups: int) -> tuple[Batch, dict[str, Any]]:
        """The loader's next batch, generated; streamed from rollout workers, the first `groups` groups to
        finish (`mmrl.sources.stream`), each row with the policy version that sampled it."""
        params = self.sampling(ctx.engine)
        if self.stream is not None:
            with ctx.timer("rollout"), ctx.guard("rollout"):
                return self.stream.take(ctx.engine, params, groups)
        with ctx.timer("data"):  # waiting for the batch: near 0 while the prefetcher keeps up
            prompts = self.loader.next_batch()  # data without a usable row is no engine failure
        self.drawn_state = self.loader.source_state()
        with ctx.timer("rollout"), ctx.guard("rollout"):
            if self.cfg.rollout.group_seeds:  # as rollout workers sample: each group alone, seeded
                parts = [generate_seeded(ctx.engine, [p], params, draw_seed()) for p in prompts]
                batch = concat(parts)
            else:
                batch = ctx.engine.generate(prompts, params)
        return batch, ctx.engine.rollout_metrics(batch)

    def score(self, batch: Batch, prefix: str, step: int) -> tuple[torch.Tensor, dict[str, Any]]:
        result = self.rewards.score(reward_inputs(batch))
        if prefix == "reward":  # the training rollouts; a ReMax baseline's greedy answers do not count
            self.failing_rewards.observe(step, result)
        return torch.tensor(result.overall, dtype=torch.float32), reward_metrics(result, prefix)

    def metrics(self, batch: Batch) -> dict[str, Any]:
        """Where the loader stood after the batch trained on (not the batches in flight behind it);
        `data/rows` lists every prompt of the step, filtered or not."""
        state = self.drawn_state
        metrics: dict[str, Any] = {
            f"data/skipped/{k}": v for k, v in Counter(state["bad_rows"].values()).items()
        }
        metrics["data/epoch"] = state["loader"]["epoch"]
        metrics["data/rows"] = (
            [p.row_id for p in batch.prompts] if "group_index" not in batch else row_ids(batch)
        )
        if huge := sum(state["huge_rows"].values()):
            metrics["data/huge_images"] = huge
        return metrics

    # ---------------------------------------------------------------- learning
    def update_plan(self, batch: Batch) -> UpdatePlan:
        return update_plan(self.cfg)

    def advantages(
        self, batch: Batch, metrics: dict[str, Any], ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token rewards (the score on the final token, minus β·KL if charged) to advantages and
        returns (the critic's regression targets under GAE); PRIME's estimator also takes the PRM's
        `process_rewards`."""
        mask = batch["response_mask"].float()
        scores = batch["scores"]
        last = last_token(mask)
        token_rewards = torch.zeros_like(mask)
        token_rewards[torch.arange(len(scores)), last] = scores  # outcome reward on the final token
        algo = self.cfg.algorithm
        if algo.use_kl_in_reward:
            kl_reward, kl = kl_reward_penalty(
                batch["old_logprobs"], batch["ref_logprobs"], mask, algo.kl_penalty, self.kl_ctrl.value
            )
            token_rewards = token_rewards + kl_reward
            metrics.update({"kl_reward/kl": kl, "kl_reward/coef": self.kl_ctrl.value})
            self.kl_ctrl.update(kl, n_steps=len(scores))
        extra: dict[str, Any] = {key: batch[key] for key in ("values", "process_rewards") if key in batch}
        if algo.adv_estimator == "remax":  # ReMax: the greedy response's reward is the baseline
            with ctx.guard("ReMax baseline rollout"):
                greedy = ctx.engine.generate(
                    batch.prompts, replace(self.sampling(ctx.engine), n=1, temperature=0.0)
                )
            baseline, _ = self.score(greedy, "remax", ctx.step)
            extra["baseline_scores"] = baseline[batch["prompt_index"]]
        return self.estimator(token_rewards, mask, groups_of(batch), **algo.estimator_options(), **extra)

    # ---------------------------------------------------------------- validation
    def validate(self, ctx: StepContext) -> dict[str, Any]:
        """Answers on the held-out prompts, scored, with a gallery; touches no RNG the training run
        depends on."""
        if not self.val_samples:
            return {}
        v = self.cfg.rollout.val
        params = SamplingParams(
            n=v.n,
            temperature=v.temperature,
            top_p=v.top_p,
            top_k=v.top_k,
            max_new_tokens=self.cfg.rollout.max_new_tokens,
        )
        with ctx.guard("validation"):
            inputs, result = generate_and_score(
                ctx.engine, self.rewards, self.val_samples, params, self.cfg.data.val_batch_size
            )
        metrics = reward_metrics(result, prefix="val")
        metrics.update({f"val/skipped/{reason}": n for reason, n in self.val_samples.skipped.items()})
        key = f"val/{self.accuracy_key}"
        metrics["val/accuracy"] = metrics[key] if key in metrics else metrics["val/mean"]
        if self.cfg.trainer.gallery_samples:
            shown = range(min(len(inputs), self.cfg.trainer.gallery_samples))
            items = [
                GalleryItem(
                    images=[*_prompt_images(inputs[i]), *map(frame_strip, inputs[i].videos)],
                    prompt=inputs[i].prompt,
                    response=inputs[i].response,
                    ground_truth=inputs[i].ground_truth,
                    reward=result.overall[i],
                    components={k: v[i] for k, v in result.components.items()},
                    turns=inputs[i].extra.get("agent_turns", []),
                )
                for i in shown
            ]
            write_gallery(self.cfg.run_dir, ctx.step, items, metrics)
        return metrics

    # ---------------------------------------------------------------- state
    def warmup(self, model: Any, tokenizer: Any, seed: int) -> list[float]:
        samples = self.train_set.prepare_all(limit=WARMUP_ROWS)
        return format_warmup(model, tokenizer, samples, self.cfg.warmup, seed)

    def state(self) -> dict[str, Any]:
        """The data cursor after the last batch trained on; streamed, also which prompts drawn after it
        were taken, so those in flight are drawn and dispatched again on resume and no others."""
        cursor = self.stream.state() if self.stream is not None else self.drawn_state
        return {**cursor, "kl_coef": float(self.kl_ctrl.value)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.loader.load_source_state(state)
        if self.stream is not None:
            self.stream.load_state(state)
        self.drawn_state = self.loader.source_state()
        self.kl_ctrl.value = state.get("kl_coef", self.kl_ctrl.value)  # absent in older checkpoints

    def close(self) -> None:
        self.loader.close()
        self.rewards.close()


def _prompt_images(sample: RewardInput) -> list[Any]:
    """The images of the prompt itself; a trajectory's later ones are shown with their turns."""
    later = sum(len(t["images"]) for t in sample.extra.get("agent_turns", []))
    return sample.images[: len(sample.images) - later]


def groups_of(batch: Batch) -> torch.Tensor:
    """Each row's group, the rows compared with each other: the n responses of one prompt, or the n
    trajectories of one prompt in agent runs (where every trajectory has a prompt sample of its own)."""
    return batch["group_index"] if "group_index" in batch else batch["prompt_index"]


def row_ids(batch: Batch) -> list[int]:
    """The data rows of the batch's groups, in order."""
    return list(dict.fromkeys(batch.prompts[i].row_id for i in batch["prompt_index"].tolist()))


def last_token(mask: torch.Tensor) -> torch.Tensor:
    """Each row's last trained token (the first column for an empty row): where the outcome reward goes,
    also when tool responses lie between the policy's turns."""
    columns = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return ((mask > 0) * columns).amax(dim=1).sub(1).clamp(min=0)


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


def build_datasets(cfg: Config, processor: Any, model_config: Any) -> tuple[PromptDataset, PreparedRows]:
    """The training set (prepared lazily, row by row) and the prepared validation samples.

    A text-only model's processor is its tokenizer: its datasets have no pixel budgets, and rows
    with images or videos are refused here, before any training, rather than skipped one by one."""
    d = cfg.data
    family = family_of(model_config)
    tok = tokenizer_of(processor)
    agent = agent_prompting(cfg)
    if not family.takes_images:
        inputs = PromptInputs(tok, **agent)
        train = PromptDataset.from_config(d, inputs)
        val_set = PromptDataset.from_config(d, inputs, key="val_files") if d.val_files else None
        for name, files, dataset in (("train", d.train_files, train), ("val", d.val_files, val_set)):
            media = dataset.media_rows() if dataset is not None else 0
            if media:
                raise ConfigError(
                    f"data.{name}_files ({', '.join(map(str, files))}): {media} of {len(dataset)} rows have "
                    f"images or videos, but model.path {cfg.model.path} is a text-only model "
                    f"({model_config.model_type}, family {family.name}) that cannot see them. Remove those "
                    "rows (or their image/video columns), or train a vision-language model."
                )
        return train, _prepared_val(val_set, d.max_val_samples)
    grid = family.grid()
    budget = image_budget(d, model_config)
    try:
        video_budget = VideoBudget(
            fps=d.video_fps,
            max_frames=d.video_max_frames,
            min_pixels=d.video_min_pixels,
            max_pixels=d.video_max_pixels,
            max_total_pixels=d.video_max_total_pixels,
            patch_size=grid.patch,
            merge_size=grid.merge,
            temporal_patch_size=grid.temporal,
            rule=family.video_size_rule,
        )
    except ValueError as err:
        raise ConfigError(f"data.video_*: {err}") from None
    inputs = PromptInputs(
        tok,
        processor.image_processor,
        budget,
        video_budget,
        getattr(processor, "video_processor", None),
        family.video_placeholder,
        family.media_pads,
        family.image_placeholder,
        **agent,
    )
    train = PromptDataset.from_config(d, inputs)
    val_set = PromptDataset.from_config(d, inputs, key="val_files") if d.val_files else None
    for name, files, dataset in (("train", d.train_files, train), ("val", d.val_files, val_set)):
        if dataset is not None:
            _check_media_kinds(cfg, family, f"data.{name}_files ({', '.join(map(str, files))})", dataset)
    return train, _prepared_val(val_set, d.max_val_samples)


def _check_media_kinds(cfg: Config, family: Any, files: str, dataset: PromptDataset) -> None:
    """Refuse at start what the family cannot show: videos where it takes none, and images beside videos
    where its own forward takes one kind at a time and the run samples through `generate` (the HF engine
    on FSDP workers, whose shards must step together)."""
    # The HF engine on the policy's own FSDP workers (a rollout worker of its own samples on one process).
    engine, workers = cfg.rollout.engine, cfg.trainer.world_size > 1 and not cfg.rollout.remote
    generates = workers and engine != "vllm" and resolve_engine(engine) == "hf"
    if family.takes_video and (family.generate_mixes_media or not generates):
        return  # nothing to refuse: skip reading every row
    rows = dataset.rows_by_media()
    if rows["video"] and not family.takes_video:
        raise ConfigError(
            f"{files}: {rows['video']} of {len(dataset)} rows have videos, but model.path {cfg.model.path} is "
            f"a {family.name} model, which mmrl cannot show videos yet. Remove those rows (or their video "
            "column), or train a Qwen-VL or GLM model."
        )
    if rows["video"] and rows["image"] and generates and not family.generate_mixes_media:
        raise ConfigError(
            f"{files}: {rows['image']} rows have images and {rows['video']} videos, and on FSDP workers the "
            f"HF engine samples with transformers' `generate`, whose {family.name} forward takes images or "
            "videos, not both in one batch. Set rollout.engine=vllm, train on one process, or split the "
            "image and video rows into separate runs."
        )


def agent_prompting(cfg: Config) -> dict[str, Any]:
    """What an agent run's prompts need: its tools described, and full-size images kept for image tools."""
    if cfg.agent is None:
        return {}
    from mmrl.agent.tools import ToolSpec

    tools = [ToolSpec.from_config(t.model_dump()) for t in cfg.agent.tools]
    return {"tools": [t.schema() for t in tools], "keep_originals": True}


def _prepared_val(val_set: PromptDataset | None, limit: int | None) -> PreparedRows:
    """The validation samples; a validation set with no usable row is refused rather than
    silently turning validation off."""
    if val_set is None:
        return PreparedRows([], Counter())
    val = val_set.prepare_all(limit)
    if not val:
        raise val_set.unusable()
    if val_set.skipped:
        log.warning("validation rows skipped: %s", dict(val_set.skipped))
    return val
