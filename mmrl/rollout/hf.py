"""The HF transformers engine: always available, and sharing the policy's weights in memory."""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig

from mmrl.algorithms import block_tokens, logprobs_from_logits
from mmrl.data.batch import Batch, concat, left_pad
from mmrl.data.sample import PromptSample, vision_inputs
from mmrl.models import autocast_for, family_of, fp32_attention_on_cpu, never_generated_ids, tokenizer_of
from mmrl.rollout.base import GeneratesAtOnce, SamplingParams
from mmrl.rollout.decode import sample_groups


def _expands_media_per_item(model: Any, prompts: list[PromptSample]) -> bool:
    """Whether `generate` can copy these prompts for `num_return_sequences` itself. transformers 5.19
    declares some multimodal classes text-only (Qwen3.5's `input_modalities == "text"`) and then copies
    `pixel_values` patch by patch instead of image by image: every copy of a multi-image or video row
    sees scrambled pixels. Such prompts are repeated before `generate` instead."""
    has_media = any(p.pixel_values is not None or p.pixel_values_videos is not None for p in prompts)
    return not has_media or "image" in getattr(type(model), "input_modalities", ("image",))


class HFEngine(GeneratesAtOnce):
    """`model.generate` over left-padded prompts; placeholders can never be sampled."""

    logprobs_are_free = False  # they cost a (B, V) logits tensor per step

    def __init__(
        self,
        model: Any,
        processor: Any,
        compute_dtype: torch.dtype = torch.float32,
        synced_gpus: bool = False,
        max_seqs: int | None = None,
    ) -> None:
        """`synced_gpus` keeps every rank of an FSDP group stepping until all ranks' sequences are done:
        each step gathers the shards, so a rank that stopped early would leave the others waiting.
        `max_seqs` caps the sequences decoded at once (`rollout.hf_max_seqs`): their KV cache is what
        generation holds, and a step's whole batch at real lengths does not fit a GPU."""
        self.model = model
        self.max_seqs = max_seqs
        self.compute_dtype = compute_dtype
        self.synced_gpus = synced_gpus
        self.tokenizer = tokenizer_of(processor)
        cfg = model.config
        self.blocked = never_generated_ids(cfg)
        eos = model.generation_config.eos_token_id
        self.eos_ids = sorted(
            {*(eos if isinstance(eos, list) else [eos]), self.tokenizer.eos_token_id} - {None}
        )

    @torch.no_grad()
    def generate(self, prompts: list[PromptSample], params: SamplingParams) -> Batch:
        per_pass = max(1, (self.max_seqs or 0) // params.n)
        if self.max_seqs and len(prompts) > per_pass:  # whole groups per pass, in order
            return concat(
                [self.generate(prompts[i : i + per_pass], params) for i in range(0, len(prompts), per_pass)]
            )
        stop = sorted({*self.eos_ids, *params.stop_token_ids})
        was_training = self.model.training
        self.model.eval()
        family = family_of(self.model)
        with (
            autocast_for(self.model, self.compute_dtype),
            fp32_attention_on_cpu(self.model, self.compute_dtype),
        ):
            # An FSDP group must step together (`synced_gpus`), and a recurrent family's state is not
            # keys and values: both keep transformers' own loop.
            if family.prefix_cache and not self.synced_gpus:
                response, logps = sample_groups(
                    self.model, prompts, params, stop, self.blocked, self.tokenizer.pad_token_id
                )
            else:
                response, logps = self._generate(prompts, params, stop)
        self.model.train(was_training)
        is_stop = torch.isin(response, torch.tensor(stop, device=response.device))
        # Valid tokens run up to and including the first stop token.
        response_mask = ((is_stop.cumsum(dim=1) - is_stop.long()) == 0).long()
        tensors = {
            "prompt_index": torch.arange(len(prompts)).repeat_interleave(params.n),
            "response_ids": response.masked_fill(response_mask == 0, self.tokenizer.pad_token_id).cpu(),
            "response_mask": response_mask.cpu(),
            "truncated": (~is_stop.any(dim=1)).cpu(),
        }
        if logps is not None:
            tensors["rollout_logprobs"] = (logps * response_mask).cpu()
        texts = self.tokenizer.batch_decode(
            [
                r[m.bool()].tolist()
                for r, m in zip(tensors["response_ids"], tensors["response_mask"], strict=True)
            ],
            skip_special_tokens=True,
        )
        batch = Batch(tensors=tensors, prompts=prompts)
        batch.set(response_text=texts)
        return batch

    def _generate(
        self, prompts: list[PromptSample], params: SamplingParams, stop: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`model.generate` with `num_return_sequences`: the response ids and, with `params.logprobs`,
        the sampled tokens' log-probs, as `sample_groups` returns them."""
        device = next(self.model.parameters()).device
        sources, copies = prompts, params.n
        if params.n > 1 and not _expands_media_per_item(self.model, prompts):
            sources, copies = [p for p in prompts for _ in range(params.n)], 1
        ids, mask = left_pad([p.prompt_ids for p in sources], self.tokenizer.pad_token_id)
        extra = family_of(self.model).generate_inputs(ids, vision_inputs(sources))
        extra = {k: v.to(device) for k, v in extra.items()}
        out = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            **extra,
            generation_config=self._generation_config(params, stop, copies),
            synced_gpus=self.synced_gpus,
        )
        response = out.sequences[:, ids.shape[1] :]
        if not params.logprobs:
            return response, None
        scale = 1.0 if params.greedy else params.temperature
        steps = [
            logprobs_from_logits(
                block_tokens(step.float().unsqueeze(1), self.blocked) / scale, response[:, t : t + 1]
            )
            for t, step in enumerate(out.logits)
        ]
        return response, torch.cat(steps, dim=1)

    def _generation_config(self, params: SamplingParams, stop: list[int], copies: int) -> GenerationConfig:
        """Built from scratch, so no checkpoint default (repetition penalty, min length, ...) bends
        the sampling distribution away from the softmax(logits / T) that training assumes."""
        sampling: dict[str, Any] = {"do_sample": False}
        if not params.greedy:
            top_k = params.top_k if params.top_k > 0 else 0
            sampling = {
                "do_sample": True,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": top_k,
            }
        return GenerationConfig(
            **sampling,
            max_new_tokens=params.max_new_tokens,
            num_return_sequences=copies,
            suppress_tokens=self.blocked,
            eos_token_id=stop,
            pad_token_id=self.tokenizer.pad_token_id,
            output_logits=params.logprobs,
            return_dict_in_generate=True,
        )

    def sync_weights(self) -> None:
        """Nothing to copy: this engine generates with the training model object itself."""

    def sleep(self) -> None:
        """Nothing to free: `generate` keeps no cache between calls."""
