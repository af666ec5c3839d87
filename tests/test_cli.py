"""The `mmrl` command line: its utilities write usable outputs and its errors are readable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmrl.cli import main
from mmrl.data import PromptDataset, read_rows
from mmrl.models import load_policy, load_processor
from processors import PixelBudget

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml")


def _one_line(text: str) -> str:
    """Rich wraps long messages at the console width; compare text with whitespace collapsed."""
    return " ".join(text.split())


def test_model_init_tiny_writes_a_loadable_checkpoint(tmp_path, capsys) -> None:
    out = tmp_path / "tiny"
    assert main(["model", "init-tiny", str(out), "--seed", "3"]) == 0
    assert str(out) in _one_line(capsys.readouterr().out)
    model = load_policy(out)
    processor = load_processor(out)
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert json.loads((out / "mmrl_tiny.json").read_text())["seed"] == 3
    ids = processor.tokenizer("What colour is the shape?", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()


def test_model_init_tiny_is_seeded(tmp_path) -> None:
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        assert main(["model", "init-tiny", str(tmp_path / name), "--seed", str(seed)]) == 0
    a, b, c = (load_policy(tmp_path / n).lm_head.weight for n in "abc")
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_data_synth_writes_a_dataset_the_loader_accepts(tmp_path, capsys, tiny_model_dir) -> None:
    out = tmp_path / "data"
    assert main(["data", "synth", str(out), "--n-train", "8", "--n-val", "4"]) == 0
    assert "8 train / 4 val" in _one_line(capsys.readouterr().out)
    train, val = read_rows([str(out / "train.jsonl")]), read_rows([str(out / "val.jsonl")])
    assert (len(train), len(val)) == (8, 4)
    assert json.loads((out / "meta.json").read_text())["task"] == "color"

    processor = load_processor(tiny_model_dir)
    dataset = PromptDataset(
        train + val,
        processor.tokenizer,
        processor.image_processor,
        budget=PixelBudget(56 * 56, 56 * 56),
        max_prompt_length=64,
    )
    samples = dataset.prepare_all()
    assert len(samples) == 12, dict(dataset.skipped)
    assert not dataset.skipped
    assert all(len(s.images) == 1 and s.images[0].size == (56, 56) for s in samples)
    assert {s.ground_truth for s in samples} <= {"red", "green", "blue", "yellow", "purple", "orange"}


def test_data_synth_unknown_task_is_a_usage_error(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["data", "synth", str(tmp_path / "d"), "--task", "nope", "--n-train", "2", "--n-val", "1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "nope" in err and "color" in err  # names the bad task and the choices
    assert not (tmp_path / "d").exists()


def test_data_synth_bad_image_size_returns_2(tmp_path, capsys) -> None:
    args = ["data", "synth", str(tmp_path / "d"), "--image-size", "50", "--n-train", "2", "--n-val", "1"]
    assert main(args) == 2
    assert "multiple of 28" in _one_line(capsys.readouterr().err)


def test_train_with_a_missing_config_returns_2(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", "missing.yaml"]) == 2
    captured = capsys.readouterr()
    err = _one_line(captured.err)
    assert "error:" in err
    assert "config file missing.yaml does not exist" in err
    assert "Traceback" not in captured.err


def test_train_with_a_bad_override_returns_2_before_any_work(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert main(["train", CONFIG, f"trainer.output_dir={run}", "trainer.total_stepz=3"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "trainer.total_stepz: unknown key. Did you mean trainer.total_steps?" in err
    assert not run.exists()


def test_train_with_a_missing_model_returns_2_with_a_clear_message(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "x", "answer": "y"}\n')
    overrides = [f"model.path={tmp_path / 'no-model'}", f"data.train_files={data}", "data.val_files=[]"]
    assert main(["train", CONFIG, *overrides, f"trainer.output_dir={run}"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "no model checkpoint" in err and "no-model" in err
    assert "mmrl model init-tiny" in err
    assert not run.exists()


def test_train_with_a_missing_data_file_returns_2(tmp_path, capsys, tiny_model_dir) -> None:
    run = tmp_path / "run"
    overrides = [f"model.path={tiny_model_dir}", f"data.train_files={tmp_path / 'absent.jsonl'}"]
    assert main(["train", CONFIG, *overrides, "data.val_files=[]", f"trainer.output_dir={run}"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "data.train_files" in err and "absent.jsonl" in err
    assert not run.exists()


def test_unknown_subcommand_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["trian"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
