"""What a first GPU run would hit, shown on the CPU (no GPU here: where a test needs CUDA's answers it says
which it stands in for). The mixed-media FSDP hang is shown for real in `test_distributed.py`.

- vLLM's tensor-parallel engine on Ray workers: its custom all-reduce maps each rank through
  CUDA_VISIBLE_DEVICES, which shows a Ray worker one GPU, so it is switched off.
- A GPU process group carries gloo for CPU tensors too (`actor.offload`'s shards and gradients).
- Each worker computes on the GPU Ray assigned it, also where every GPU stays visible.
- A LoRA base (any frozen weight) is held in the compute dtype, not fp32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from family_cases import vllm_only
from helpers import mixed_prompts
from transformers import AutoConfig

from mmrl.config import VLLMConfig, load_config
from mmrl.data.batch import Batch
from mmrl.errors import ConfigError
from mmrl.models import family_of, load_policy, load_processor, resolve_dtype
from mmrl.rollout import HFEngine, SamplingParams, weights_device
from mmrl.rollout.vllm import _refuse_what_cannot_run
from mmrl.training.actor import build_actor
from mmrl.training.optim import plan_minibatches
from mmrl.training.setup import add_adapters
from mmrl.workers import device as worker_devices
from mmrl.workers.fsdp import process_group_backend


class _Built(Exception):
    """Raised by the stand-in for `vllm.LLM` once it has the engine's arguments."""


@vllm_only
def test_the_vllm_engine_is_built_without_custom_all_reduce(monkeypatch, tiny_model_dir) -> None:
    """The arguments mmrl hands `vllm.LLM` (a stand-in records them: on a CPU vLLM disables the custom
    all-reduce by itself, so a real engine would pass either way), and that vLLM 0.32 takes the flag."""
    import inspect

    import vllm

    from mmrl.rollout.vllm import VLLMEngine

    assert "disable_custom_all_reduce" in inspect.signature(vllm.LLM.__init__).parameters
    seen = {}

    def llm(**kwargs):
        seen.update(kwargs)
        raise _Built

    monkeypatch.setattr(vllm, "LLM", llm)
    model = load_policy(tiny_model_dir)
    with pytest.raises(_Built):
        VLLMEngine(
            model, load_processor(tiny_model_dir), tiny_model_dir, torch.float32, VLLMConfig(), 784, 12544
        )
    assert seen["disable_custom_all_reduce"] is True


def test_a_gpu_process_group_runs_gloo_for_cpu_tensors() -> None:
    """On a GPU the group is NCCL for CUDA tensors and gloo for CPU ones, as torch parses the string."""
    backend = process_group_backend(torch.device("cuda", 0))
    assert backend == "cpu:gloo,cuda:nccl" and process_group_backend(torch.device("cpu")) == "gloo"
    by_device = dist.distributed_c10d.BackendConfig(dist.Backend(backend)).get_device_backend_map()
    assert by_device == {"cpu": "gloo", "cuda": "nccl"}


@pytest.mark.parametrize(
    ("ids", "visible", "index"),
    [
        ([3], "3", 0),  # Ray's default: the worker sees its GPU alone
        ([3], None, 3),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1, nothing set: physical ids
        ([5], "4,5,6,7", 1),  # every GPU of a node shown, this worker's second among them
        ([], None, 0),  # no GPU assigned (a CPU worker)
    ],
)
def test_a_worker_computes_on_the_gpu_ray_assigned_it(ids, visible, index) -> None:
    assert worker_devices.visible_index(ids, visible) == index


def test_a_gpu_hidden_from_the_worker_is_refused_in_one_line() -> None:
    with pytest.raises(
        RuntimeError, match="Ray assigned GPU 2, which CUDA_VISIBLE_DEVICES=0,1 does not show"
    ):
        worker_devices.visible_index([2], "0,1")


def test_the_worker_becomes_the_current_device_of_its_process(monkeypatch) -> None:
    """What the worker does on a GPU (CUDA's answers stood in for): the assigned GPU's index becomes the
    current device, which NCCL, FSDP2 and vLLM's `LOCAL_RANK` follow."""
    import ray

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [6])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert worker_devices.worker_device() == torch.device("cuda", 2) and chosen == [torch.device("cuda", 2)]


def test_a_single_process_vllm_engine_off_gpu_0_is_refused_at_start(monkeypatch, tiny_model_dir) -> None:
    """vLLM 0.32's single-process executor always takes GPU 0: a worker on another visible GPU would put
    its engine on a neighbour's (the current device stood in for)."""
    family = family_of(AutoConfig.from_pretrained(tiny_model_dir))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    with pytest.raises(ConfigError, match="RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") as refused:
        _refuse_what_cannot_run(family, torch.bfloat16, tensor_parallel=1, on_cpu=False)
    assert "\n" not in str(refused.value)
    _refuse_what_cannot_run(family, torch.bfloat16, tensor_parallel=2, on_cpu=False)  # LOCAL_RANK places it


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_lora_base_is_held_in_the_compute_dtype(tiny_model_dir, dtype) -> None:
    """The frozen base in bf16 (2 bytes a parameter, not fp32's 4 plus autocast's bf16 copies), the adapters
    in fp32; in fp32 nothing changes. A LoRA update then runs and moves the adapters alone."""
    cfg = load_config(
        "configs/quickstart_lora.yaml", [f"model.path={tiny_model_dir}", f"model.dtype={dtype}"]
    )
    compute = resolve_dtype(cfg.model.dtype, "cpu")
    model, processor = load_policy(tiny_model_dir), load_processor(tiny_model_dir)
    add_adapters(model, cfg, tiny_model_dir, compute)
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {compute}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    torch.manual_seed(0)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, logprobs=True)
    batch = HFEngine(model, processor, compute).generate(mixed_prompts(processor)[:2], params)
    batch.set(
        advantages=torch.tensor([[1.0], [-1.0], [1.0], [-1.0]]).expand_as(batch["response_mask"]).clone()
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    actor = build_actor(cfg, model, processor.tokenizer.pad_token_id, compute)
    stats = actor.update(batch, plan_minibatches(batch, len(batch), epochs=1, horizon=4))
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert stats.steps == 1 and stats.skipped_steps == 0
    assert moved and all(".lora_" in n for n in moved), sorted(moved)[:4]


@pytest.mark.parametrize(
    ("kind", "device", "held"), [("vllm", "cuda", "cpu"), ("hf", "cuda", "cuda"), ("hf", "cpu", "cpu")]
)
def test_a_model_vllm_only_takes_weights_from_stays_in_host_memory(kind, device, held) -> None:
    """`mmrl eval` and a rollout worker of its own hold an HF copy beside their engine: on the GPU in fp32 it
    would take 31-35 GiB for an 8-9 B model before vLLM sizes its cache by what is left."""
    assert weights_device(kind, device) == held


@pytest.mark.parametrize("padding_free", [False, True])
def test_padding_tower_passes_leave_values_and_gradients_exactly_as_they_were(
    monkeypatch, tiny_model_dir, padding_free
) -> None:
    """What a rank short of its group's tower passes adds (`mmrl.training.media`), in one process: two
    passes on the blank image, joined at weight zero. The log-probs and every gradient are bit for bit
    those without them, and the tower's parameters still receive their gradient through the padding."""
    from mmrl.data.dataset import image_budget
    from mmrl.training import media
    from mmrl.training.forward import forward_logprobs

    model, processor = load_policy(tiny_model_dir), load_processor(tiny_model_dir)
    cfg = load_config("configs/quickstart.yaml", [f"model.path={tiny_model_dir}"])
    media.keep_blank_image(model, processor, image_budget(cfg.data, model.config))
    torch.manual_seed(0)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, logprobs=True)
    batch = HFEngine(model, processor).generate(mixed_prompts(processor)[:2], params)

    def run(extra: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        monkeypatch.setattr(media, "_most_passes", lambda model, passes: passes + extra)
        model.zero_grad(set_to_none=True)
        logp, _ = forward_logprobs(model, batch, processor.tokenizer.pad_token_id, padding_free=padding_free)
        logp.sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, plain_grads = run(0)
    padded, padded_grads = run(2)
    assert torch.equal(padded, plain)
    assert set(padded_grads) == set(plain_grads) and any(n.startswith("model.visual.") for n in plain_grads)
    assert all(torch.equal(padded_grads[n], plain_grads[n]) for n in plain_grads)
    # a text-only micro-batch padded: the tower's parameters get (zero) gradients, so backward reaches them
    text_only = batch.select(torch.nonzero(batch["prompt_index"] == 1).flatten())
    assert not text_only.prompts[int(text_only["prompt_index"][0])].images
    monkeypatch.setattr(media, "_most_passes", lambda model, passes: passes + 1)
    model.zero_grad(set_to_none=True)
    logp, _ = forward_logprobs(model, text_only, processor.tokenizer.pad_token_id, padding_free=padding_free)
    logp.sum().backward()
    tower = [p.grad for n, p in model.named_parameters() if n.startswith("model.visual.blocks.")]
    assert tower and all(g is not None and not g.any() for g in tower)


def _logprobs_and_grads(model, batch, pad_id, with_entropy) -> tuple[torch.Tensor, torch.Tensor, dict]:
    from mmrl.training.forward import forward_logprobs

    model.zero_grad(set_to_none=True)
    logp, entropy = forward_logprobs(model, batch, pad_id, temperature=0.7, with_entropy=with_entropy)
    (logp.sum() + (entropy.sum() if with_entropy == "grad" else 0)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy.detach(), grads


def _chunked_logits(monkeypatch) -> list[int]:
    """The output layer over 3 tokens at a time; returns a list that counts the checkpointed chunks."""
    from torch.utils import checkpoint

    from mmrl.training import forward

    monkeypatch.setattr(forward, "LOGIT_CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(forward, "LOGIT_CHUNK_MIN_TOKENS", 3)
    calls: list[int] = []
    wrapped = checkpoint.checkpoint
    monkeypatch.setattr(checkpoint, "checkpoint", lambda fn, *a, **k: calls.append(1) or wrapped(fn, *a, **k))
    return calls


def _sampled(model_dir: Path) -> tuple[Any, Batch, int]:
    """The tiny policy, two mixed prompts' responses (n=2, 8 tokens) and its pad id."""
    model, processor = load_policy(model_dir), load_processor(model_dir)
    torch.manual_seed(0)
    batch = HFEngine(model, processor).generate(
        mixed_prompts(processor)[:2], SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    )
    return model, batch, processor.tokenizer.pad_token_id


@pytest.mark.parametrize("with_entropy", [True, "grad"])
def test_the_output_layer_in_chunks_gives_the_same_logprobs_and_gradients(
    monkeypatch, tiny_model_dir, with_entropy
) -> None:
    """Item 7: about six fp32 (N, V) copies of the logits live at the update's peak (30 GB at 4 x 2,048
    tokens over a 152 k vocabulary); beyond `logit_chunk` tokens they are made chunk by chunk under
    checkpointing. Values and entropies are those of the whole (N, V) at once, and every gradient to fp32
    rounding (its tokens are summed in another order): within 1e-5 of the tensor's largest entry."""
    model, batch, pad_id = _sampled(tiny_model_dir)
    whole = _logprobs_and_grads(model, batch, pad_id, with_entropy)
    chunks = _chunked_logits(monkeypatch)
    chunked = _logprobs_and_grads(model, batch, pad_id, with_entropy)
    assert len(chunks) == -(-int(batch["response_mask"].sum()) // 3)
    assert torch.allclose(chunked[0], whole[0], atol=1e-6) and torch.allclose(chunked[1], whole[1], atol=1e-6)
    assert chunked[2].keys() == whole[2].keys()
    worst = max(
        (chunked[2][n] - whole[2][n]).abs().max() / whole[2][n].abs().max().clamp_min(1e-12) for n in whole[2]
    )
    assert worst < 1e-5, worst


def test_the_output_layer_in_chunks_under_fsdp2(monkeypatch, tiny_model_dir) -> None:
    """The same on a policy sharded with FSDP2 (one gloo rank in this process): the chunks run inside
    the registered method that gathers the root's output layer, and are recomputed in its backward."""
    from mmrl.workers.fsdp import shard_policy

    model, batch, pad_id = _sampled(tiny_model_dir)
    whole = _logprobs_and_grads(model, batch, pad_id, True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = shard_policy(load_policy(tiny_model_dir), torch.float32, offload=False)
        chunks = _chunked_logits(monkeypatch)
        logp, entropy, grads = _logprobs_and_grads(sharded, batch, pad_id, True)
        grads = {n: g.full_tensor() for n, g in grads.items()}
    finally:
        dist.destroy_process_group()
    assert chunks
    assert torch.allclose(logp, whole[0], atol=1e-5) and torch.allclose(entropy, whole[1], atol=1e-5)
    assert grads.keys() == whole[2].keys()
    assert all(torch.allclose(grads[n], whole[2][n], atol=1e-5) for n in whole[2])


def test_the_packed_attention_mask_is_a_lower_right_causal_bias() -> None:
    """Item 10: a segment that continues a shared prompt attends the whole context and itself causally.
    As a boolean mask that left CUDA only the math kernel (flash refuses masks; memory-efficient refuses
    them with grouped-query attention); as PyTorch's lower-right `CausalBias` both kernels take it. On a
    CPU PyTorch materialises the same mask as before."""
    from torch.nn.attention.bias import CausalBias

    from mmrl.training.segments import _Run

    run = _Run(start=5, count=2, width=3, context=(range(0, 4),), device="cpu")
    assert isinstance(run.mask, CausalBias)
    dense = torch.cat([torch.ones(3, 4, dtype=torch.bool), torch.ones(3, 3, dtype=torch.bool).tril()], 1)
    assert torch.equal(run.mask._materialize("cpu"), dense)
    assert _Run(start=0, count=1, width=4, context=(), device="cpu").mask is None  # plain causal
