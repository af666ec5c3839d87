"""Every attention path mmrl runs in bf16 on a CPU, each at 64 or more queries and keys: the size at which
PyTorch's CPU flash attention packs bf16 for AMX, and on an AMX CPU with ATen pinned below AVX-512 would
raise (`mmrl.models.reduced_attention`). `tests/test_reduced_attention.py` runs it under the suite's ISA pin
and, in a fresh interpreter, under the machine's own kernels (`python tests/bf16_paths.py MODEL_DIR`).

Each path is scored against the same computation in fp32: the largest |Δ log-prob| over the response
tokens (every position for the whole-row forward), the largest query and key counts among its attention
calls (so a path that no longer reaches the packing size shows), and the dtypes its calls computed in."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from helpers import BUDGET
from PIL import Image
from torch.nn import functional as F
from torch.nn.attention.bias import CausalBias

from mmrl.data.sample import PromptSample
from mmrl.models import load_policy, load_processor
from mmrl.processors import build_messages, encode_prompt, fit_image, num_image_tokens, pixel_inputs
from mmrl.rollout import HFEngine, SamplingParams
from mmrl.training.forward import forward_logprobs

# 112 px images: 64 patches in each of the vision tower's full-attention calls; the question makes every
# prompt over 64 tokens, so the language model's prefill and the packed segments reach the size too.
QUESTION = "<image>" + "Look at the picture carefully and say which colour the shape has. " * 8


def long_prompts(processor: Any) -> list[PromptSample]:
    """Two image prompts, each over 64 tokens, with 112 px images."""
    samples = []
    for i, colour in enumerate([(220, 20, 20), (20, 20, 220)]):
        image = fit_image(Image.new("RGB", (112, 112), colour), BUDGET)
        count = num_image_tokens(image.height, image.width, BUDGET)
        ids = encode_prompt(processor.tokenizer, build_messages(QUESTION, 1), [count])
        inputs = pixel_inputs([image], processor.image_processor)
        samples.append(
            PromptSample(i, ids, "q", "red", [image], [], inputs["pixel_values"], inputs["image_grid_thw"])
        )
    return samples


@contextmanager
def attention_calls() -> Iterator[list[tuple[int, int, str]]]:
    """Inside the block, (queries, keys, the dtype it computes in) of every SDPA call, appended to the
    yielded list; the dtype is autocast's where autocast is on, as SDPA then casts its inputs."""
    seen: list[tuple[int, int, str]] = []
    real = F.scaled_dot_product_attention

    def spy(query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
        seen.append((query.shape[-2], key.shape[-2], str(dtype).removeprefix("torch.")))
        if isinstance(kwargs.get("attn_mask"), CausalBias):  # it dispatches only under SDPA's own name
            kwargs["attn_mask"] = kwargs["attn_mask"]._materialize(query.device)
        return real(query, key, *args, **kwargs)

    with mock.patch.object(F, "scaled_dot_product_attention", spy):
        yield seen


def _measured(
    seen: list[tuple[int, int, str]], got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor
) -> dict:
    return {
        "max_diff": float((got.float() - want)[mask].abs().max()),
        "finite": bool(torch.isfinite(got[mask]).all()),
        "queries": max(q for q, _, _ in seen),
        "keys": max(k for _, k, _ in seen),
        "dtypes": sorted({d for _, _, d in seen}),
    }


def run(model_dir: Path) -> dict[str, dict[str, Any]]:
    """Each path's largest |Δ log-prob| against fp32, and the most queries and keys of one of its calls."""
    torch.manual_seed(0)
    model, processor = load_policy(model_dir), load_processor(model_dir)
    pad = processor.tokenizer.pad_token_id
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, logprobs=True)
    with attention_calls() as seen:  # the vision tower's stacked attention, the prefill and each decode step
        batch = HFEngine(model, processor, torch.bfloat16).generate(long_prompts(processor), params)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        reference, _ = forward_logprobs(model, batch, pad)
    results = {"hf_engine": _measured(seen, batch["rollout_logprobs"], reference, mask)}
    for padding_free in (False, True):  # the shared-prompt forward, then packed segments; with backward
        with torch.no_grad():
            reference, _ = forward_logprobs(model, batch, pad, padding_free=padding_free)
        with attention_calls() as seen:
            logp, _ = forward_logprobs(
                model, batch, pad, compute_dtype=torch.bfloat16, padding_free=padding_free
            )
            logp.sum().backward()
        results[f"train_{'packed' if padding_free else 'padded'}"] = _measured(
            seen, logp.detach(), reference, mask
        )
    prompt = batch.prompts[0]  # transformers' own forward (its `sdpa` attention), on one whole row
    inputs = {"input_ids": torch.tensor([prompt.prompt_ids]), "pixel_values": prompt.pixel_values}
    inputs["image_grid_thw"] = prompt.image_grid_thw
    with torch.no_grad():
        reference = model(**inputs).logits.log_softmax(-1)
        with attention_calls() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
            logp = model(**inputs).logits.float().log_softmax(-1)
    results["model_forward"] = _measured(seen, logp, reference, torch.ones(logp.shape[:-1], dtype=torch.bool))
    return results


if __name__ == "__main__":
    print(json.dumps(run(Path(sys.argv[1]))))
