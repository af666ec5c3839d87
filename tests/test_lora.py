"""LoRA through peft: adapters on the language model only by default, the reference is the base model
with the adapter off (no copy), adapters save in peft format, load in plain transformers, resume exactly,
and reach the vLLM engine by merge-and-sync."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmrl.cli import main
from mmrl.config import LoraConfig, load_config
from mmrl.data.synthetic import generate
from mmrl.models import load_policy
from mmrl.rollout.vllm import vllm_available
from mmrl.run import checkpoint as ckpt
from mmrl.run.logger import read_metrics
from mmrl.trainer import Trainer
from mmrl.training.lora import apply_lora, load_with_adapter

SCRAMBLE = "def scramble(sample):\n    return (sum(map(ord, sample.response)) * 7919 % 101) / 100\n"


def test_adapters_go_on_the_language_model_unless_vision_is_asked_for(tiny_model_dir) -> None:
    peft = apply_lora(load_policy(tiny_model_dir), LoraConfig(rank=4))
    trainable = [n for n, p in peft.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert all("language_model" in n for n in trainable)
    adapted = {n.split(".lora_")[0].rpartition(".")[2] for n in trainable}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with_vision = apply_lora(load_policy(tiny_model_dir), LoraConfig(rank=4, include_vision=True))
    assert any("visual" in n and ".lora_" in n for n, p in with_vision.named_parameters() if p.requires_grad)


def _config(model: Path, data: Path, out: Path, steps: int, engine: str) -> list[str]:
    reward = data / "scramble.py"
    reward.write_text(SCRAMBLE)
    return [
        f"model.path={model}",
        "model.lora.rank=8",
        "model.lora.alpha=16",
        f"rollout.engine={engine}",
        "rollout.vllm.max_model_len=512",
        "rollout.vllm.verify_sync_every=1",
        "rollout.vllm.enforce_eager=true",
        f"data.train_files={data / 'train.jsonl'}",
        "data.val_files=[]",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={steps}",
        "trainer.save_every=2",
        "trainer.val_every=0",
        "trainer.progress=false",
        "trainer.loggers=[jsonl]",
        "warmup.steps=2",
        "warmup.batch_size=8",
        "data.train_batch_size=4",
        "actor.mini_batch_size=4",
        "actor.lr=1e-2",
        "actor.lr_schedule=constant",
        "rollout.n=4",
        f"reward.functions=[{{name: '{reward}:scramble'}}]",
    ]


@pytest.mark.slow
def test_the_warm_up_leaves_no_gradient_on_the_frozen_base(tmp_path, tiny_model_dir) -> None:
    """The adapters start on a model that carries no gradient from the format warm-up. A stale one on the
    frozen base weights entered the clipped gradient norm (`clip_grad_norm_` over every parameter): with
    the warm-up run on the policy object itself, LoRA's first updates after it were scaled down about 5x
    (grad norm 5.2 where the adapters' own was 7e-4, 2026-12-01)."""
    data = tmp_path / "data"
    generate(data, task="color", n_train=32, n_val=0, seed=0, image_size=56)
    trainer = Trainer(
        load_config("configs/quickstart.yaml", _config(tiny_model_dir, data, tmp_path / "a", 1, "hf"))
    )
    try:
        stale = [n for n, p in trainer.policy.model.named_parameters() if p.grad is not None]
        assert (tmp_path / "a" / "warmup_model" / "config.json").exists(), "the warm-up should have run"
        assert not stale, f"{len(stale)} parameters carry a gradient before the first update: {stale[:3]}"
    finally:
        trainer.logger.close()
        trainer.source.close()
        trainer.lock.release()


@pytest.mark.slow
def test_lora_run_keeps_the_base_saves_a_peft_adapter_and_resumes_exactly(tmp_path, tiny_model_dir) -> None:
    data = tmp_path / "data"
    generate(data, task="color", n_train=32, n_val=0, seed=0, image_size=56)
    engine = "hf"  # vLLM's CPU backend samples without per-request seeds, so only HF resumes bit-exactly
    straight = Trainer(
        load_config("configs/quickstart.yaml", _config(tiny_model_dir, data, tmp_path / "a", 4, engine))
    )
    straight.fit()

    # The reference is the policy object itself, read with the adapter off: no second copy.
    assert straight.policy.ref is None and straight.policy.peft is not None  # no second copy
    base = load_policy(tmp_path / "a" / "warmup_model")
    batch = straight.engine.generate(
        straight.source.train_set.prepare_all(limit=4), straight.source.sampling(straight.engine)
    )
    reference = straight.policy.ref_logprobs(batch)
    expected = straight.policy.actor.logprobs(batch, base)
    torch.testing.assert_close(reference, expected, rtol=0, atol=1e-5)
    assert not torch.allclose(straight.policy.actor.logprobs(batch), expected, atol=1e-3)

    # Base weights untouched; the adapters moved.
    merged_names = {
        n.replace(".base_layer.", "."): p
        for n, p in straight.policy.model.state_dict().items()
        if ".lora_" not in n
    }
    for name, value in base.state_dict().items():
        torch.testing.assert_close(merged_names[name], value, rtol=0, atol=0)
    lora_b = [p for n, p in straight.policy.model.named_parameters() if "lora_B" in n]
    assert any(p.abs().max() > 0 for p in lora_b)

    # The checkpoint holds the adapter in peft's format, and plain transformers loads it.
    model_dir = ckpt.latest_checkpoint(tmp_path / "a" / "checkpoints") / "model"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in model_dir.iterdir()}
    assert all(".lora_" in k for k in load_file(model_dir / "adapter_model.safetensors"))
    plain = load_with_adapter(model_dir).eval()
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        straight.policy.model.eval()
        torch.testing.assert_close(
            plain(input_ids=ids).logits, straight.policy.model(input_ids=ids).logits, rtol=0, atol=1e-5
        )

    # `mmrl export` merges the adapter: a plain checkpoint with the same outputs and no peft files.
    assert main(["export", str(tmp_path / "a"), str(tmp_path / "exported")]) == 0
    assert not (tmp_path / "exported" / "adapter_config.json").exists()
    exported = load_policy(tmp_path / "exported").eval()
    with torch.no_grad():
        torch.testing.assert_close(
            exported(input_ids=ids).logits, straight.policy.model(input_ids=ids).logits, rtol=0, atol=1e-5
        )

    # Stopped at step 2 and resumed: the same adapter as the uninterrupted run.
    assert Trainer(
        load_config("configs/quickstart.yaml", _config(tiny_model_dir, data, tmp_path / "b", 2, engine))
    ).fit()
    resumed = Trainer(
        load_config("configs/quickstart.yaml", _config(tiny_model_dir, data, tmp_path / "b", 4, engine)),
        resume=True,
    )
    resumed.fit()
    a = load_file(
        ckpt.latest_checkpoint(tmp_path / "a" / "checkpoints") / "model" / "adapter_model.safetensors"
    )
    b = load_file(
        ckpt.latest_checkpoint(tmp_path / "b" / "checkpoints") / "model" / "adapter_model.safetensors"
    )
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-6, worst


@pytest.mark.slow
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (install requirements-test.lock)")
def test_lora_reaches_vllm_by_merge_and_sync_without_touching_the_base(tmp_path, tiny_model_dir) -> None:
    data = tmp_path / "data"
    generate(data, task="color", n_train=16, n_val=0, seed=0, image_size=56)
    trainer = Trainer(
        load_config("configs/quickstart.yaml", _config(tiny_model_dir, data, tmp_path / "v", 3, "vllm"))
    )
    trainer.fit()  # verify_sync_every=1: every sync is checked against the trainer's log-probs
    records = [r for r in read_metrics(tmp_path / "v" / "metrics.jsonl") if r["step"] > 0]
    assert all(r["actor/rollout_logprob_diff"] < 1e-3 for r in records)
    base = load_policy(tmp_path / "v" / "warmup_model").state_dict()
    ours = {
        n.replace(".base_layer.", "."): p
        for n, p in trainer.policy.model.state_dict().items()
        if ".lora_" not in n
    }
    assert all(
        torch.equal(ours[name], value) for name, value in base.items()
    )  # bit-exact: nothing merged in place
