"""What every model family must do: load from a folder or a hub id, refuse an unknown family
clearly, and export to a folder plain transformers loads (LoRA merged). Per-family numerics
(log-prob parity, positions, vLLM) are in `test_family_*.py`."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from mmrl.cli import main
from mmrl.config import LoraConfig
from mmrl.models import (
    FAMILIES,
    UnsupportedModelError,
    family_of,
    load_config,
    load_policy,
    load_processor,
    model_folder,
    resolve_dtype,
)
from mmrl.training.lora import apply_lora

FAMILY_NAMES = sorted({f.name for f in FAMILIES.values()})
REPO = Path(__file__).resolve().parents[1]


def _plain_load(folder: Path) -> torch.nn.Module:
    """How a user without mmrl loads a model: the Auto class for its kind."""
    config = AutoConfig.from_pretrained(folder)
    auto = AutoModelForImageTextToText if family_of(config).takes_images else AutoModelForCausalLM
    return auto.from_pretrained(folder, dtype=torch.float32)


def test_an_unknown_model_type_stops_with_the_supported_list(tmp_path, tiny_model_dir) -> None:
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["model_type"] = "llava"
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as err:
        family_of(AutoConfig.from_pretrained(tmp_path / "m"))
    assert "'llava'" in str(err.value) and "docs/adding_a_model.md" in str(err.value)
    assert all(name in str(err.value) for name in FAMILY_NAMES)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_each_family_exports_plain_and_lora_merged_to_folders_transformers_loads(
    family, tmp_path, tiny_family_dir
) -> None:
    source = tiny_family_dir(family)
    assert main(["export", str(source), str(tmp_path / "plain")]) == 0
    original, exported = load_policy(source), _plain_load(tmp_path / "plain")
    for name, tensor in original.state_dict().items():
        assert torch.equal(tensor, exported.state_dict()[name]), name
    load_processor(tmp_path / "plain")  # the processor came along

    # A trained LoRA adapter, saved in peft's format, merges into the base on export.
    model = load_policy(source)
    peft = apply_lora(model, LoraConfig(rank=4, alpha=8, include_vision=family_of(model).takes_images))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    peft.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(source)
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    shutil.copy(source / "tokenizer_config.json", tmp_path / "adapter")
    for extra in ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json"):
        if (source / extra).exists():
            shutil.copy(source / extra, tmp_path / "adapter")
    shutil.copy(source / "tokenizer.json", tmp_path / "adapter")
    assert main(["export", str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 0
    merged = _plain_load(tmp_path / "merged").eval()
    ids = torch.tensor([[5, 9, 17, 30, 41]])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5
        )
        changed = (merged(input_ids=ids).logits - original(input_ids=ids).logits).abs().max()
    assert changed > 1e-3, "the adapter did not reach the export"


def _cache_as_hub_id(model_dir: Path, cache: Path, repo_id: str) -> None:
    """Lay `model_dir` out in a Hugging Face cache as the snapshot of `repo_id` at main."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_a_hub_id_resolves_through_the_offline_cache(tmp_path, tiny_model_dir, monkeypatch) -> None:
    from huggingface_hub import constants

    _cache_as_hub_id(tiny_model_dir, tmp_path / "hub", "mmrl-test/tiny-vl")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local folder of that name
    folder = model_folder("mmrl-test/tiny-vl")
    assert folder.is_relative_to(tmp_path / "hub")
    model = load_policy("mmrl-test/tiny-vl")
    assert torch.equal(model.lm_head.weight, load_policy(tiny_model_dir).lm_head.weight)
    assert load_processor("mmrl-test/tiny-vl").tokenizer.eos_token == "<|im_end|>"

    with pytest.raises(FileNotFoundError) as err:
        model_folder("mmrl-test/not-downloaded")
    message = str(err.value)
    assert "huggingface-cli download mmrl-test/not-downloaded" in message and "HF_HUB_OFFLINE" in message


def test_a_missing_local_folder_is_named_as_such(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no model checkpoint at .*absent.*mmrl model init-tiny"):
        load_config(tmp_path / "absent")


def test_no_module_outside_its_adapter_names_a_model_class() -> None:
    """The rest of mmrl talks to the family adapter: a model class named elsewhere is a seam broken."""
    found = subprocess.run(
        [
            "grep",
            "-rln",
            "-e",
            "Qwen2_5",
            "-e",
            "Qwen3VL",
            "-e",
            "Qwen2VL",
            "-e",
            "Qwen3_5",
            "mmrl",
            "processors",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert all(path.startswith("mmrl/models/") for path in found), found


def test_a_transformers_that_would_drop_encoded_media_is_refused(tiny_model_dir, monkeypatch) -> None:
    """transformers < 5.18 swallows `mm_encoder_outputs` in **kwargs: the policy would train blind."""
    from mmrl.models import family as families

    family = family_of(AutoConfig.from_pretrained(tiny_model_dir))
    monkeypatch.setattr(families.transformers, "__version__", "5.17.0")
    families._takes_encoded_media.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"transformers>=5\.18,<5\.20"):
            family.hidden_states(
                None, torch.zeros(1, 4, dtype=torch.long), None, torch.zeros(1, 4), {"image": ()}
            )
    finally:
        families._takes_encoded_media.cache_clear()


@pytest.mark.parametrize(
    ("capability", "bf16", "expected"),
    [("AVX512", True, torch.bfloat16), ("AVX2", True, torch.float32), ("AVX512", False, torch.float32)],
)
def test_auto_dtype_is_bf16_on_a_cpu_that_runs_it_natively(monkeypatch, capability, bf16, expected) -> None:
    """`model.dtype: auto` on a CPU: bf16 where it has bf16 instructions and ATen may use them, fp32 where
    bf16 would be emulated or ATen is pinned below AVX-512 (as this suite pins it, so its runs stay fp32)."""
    assert resolve_dtype("auto", "cpu") == torch.float32  # the suite's AVX2 pin (conftest.py)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert resolve_dtype("auto", "cpu") == expected
    assert (
        resolve_dtype("float32", "cpu") == torch.float32
        and resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    )
