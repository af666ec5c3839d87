"""vLLM's sleep mode on a GPU (`rollout.vllm.sleep_level`). A module of its own: vLLM's sleep allocator is one
per process, so an engine built by another test would sleep with this one."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import mixed_prompts, vllm_engine

from mmrl.config import VLLMConfig
from mmrl.models import load_policy, load_processor
from mmrl.rollout import SamplingParams
from mmrl.rollout.vllm import vllm_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (install requirements-test.lock)"),
]


def test_level_2_sleep_gives_the_gpu_memory_back_and_wakes_with_the_weights(tiny_model_dir) -> None:
    """What the engine took comes back while it sleeps (weights and KV cache), and after waking its
    log-probs match the trainer's (the first reload after a level-2 sleep is always verified)."""
    free = lambda: torch.cuda.mem_get_info()[0]  # noqa: E731
    model = load_policy(tiny_model_dir).cuda().eval()
    before = free()
    settings = VLLMConfig(max_model_len=512, gpu_memory_utilization=0.3, sleep_level=2, verify_sync_every=0)
    engine = vllm_engine(model, tiny_model_dir, torch.bfloat16, settings)
    if not engine.can_sleep:
        pytest.skip("this vLLM build has no sleep mode here (a CPU build of vLLM picks the CPU platform)")
    held = before - free()
    engine.sleep()
    asleep = before - free()
    assert asleep < 0.1 * held, (
        f"asleep, the engine still holds {asleep / 2**30:.2f} of {held / 2**30:.2f} GiB"
    )
    engine.sync_weights()  # wakes: weights, then the KV cache; verified against the trainer
    assert engine._verified_level_2
    engine.generate(mixed_prompts(load_processor(tiny_model_dir)), SamplingParams(n=2, max_new_tokens=4))
    del engine
    gc.collect()
