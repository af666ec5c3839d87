"""The `mmrl` command line: its utilities write usable outputs and its errors are readable."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mmrl.cli import main
from mmrl.config import DataConfig
from mmrl.data.dataset import PromptDataset, PromptInputs, read_rows
from mmrl.models import load_policy, load_processor
from mmrl.processors import PixelBudget

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
        read_rows([str(out / "train.jsonl"), str(out / "val.jsonl")]),
        DataConfig(max_prompt_length=64),
        PromptInputs(processor.tokenizer, processor.image_processor, PixelBudget(56 * 56, 56 * 56)),
    )
    samples = dataset.prepare_all()
    assert len(samples) == 12, dict(dataset.skipped)
    assert not dataset.skipped
    assert all(len(s.images) == 1 and s.images[0].size == (56, 56) for s in samples)
    assert {s.ground_truth for s in samples} <= {"red", "green", "blue", "yellow", "purple", "orange"}


def test_writers_refuse_a_folder_that_holds_files_unless_forced(tmp_path, capsys, tiny_model_dir) -> None:
    """A mistyped path must not replace a model's weights or a labelled data set: `model init-tiny`,
    `data synth` and `sft` refuse a folder that is not empty in one line naming it and --force."""
    model, data, policy = tmp_path / "model", tmp_path / "data", tmp_path / "policy"
    for folder, name in ((model, "config.json"), (data, "train.jsonl"), (policy, "model.safetensors")):
        folder.mkdir()
        (folder / name).write_text("mine")
    vla = str(Path(CONFIG).with_name("vla_mujoco_reach.yaml"))
    commands = {
        model: ["model", "init-tiny", str(model)],
        data: ["data", "synth", str(data), "--n-train", "2", "--n-val", "1"],
        policy: ["sft", vla, f"model.path={policy}", f"sft.base_model={tiny_model_dir}"],
    }
    for folder, args in commands.items():
        assert main(args) == 2, args
        captured = capsys.readouterr()
        assert _one_line(captured.err).startswith(f"error: {folder} is not empty"), captured.err
        assert "--force" in captured.err and "Traceback" not in captured.err
        assert [p.read_text() for p in folder.iterdir()] == ["mine"]
    assert main([*commands[data], "--force"]) == 0
    assert len(read_rows([str(data / "train.jsonl")])) == 2


@pytest.mark.parametrize("flag", ["--n", "--episodes", "--k"])
def test_eval_counts_below_1_are_a_usage_error(flag, tiny_model_dir, capsys) -> None:
    # `--n 0` was a ZeroDivisionError traceback after the model and data had loaded
    with pytest.raises(SystemExit) as info:
        main(["eval", "configs/quickstart.yaml", "--checkpoint", str(tiny_model_dir), flag, "0"])
    assert info.value.code == 2
    assert f"argument {flag}: 0 is not a count of at least 1" in capsys.readouterr().err


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


def test_a_model_folder_without_a_tokenizer_returns_2_naming_the_missing_files(
    tmp_path, capsys, tiny_model_dir
) -> None:
    """transformers loads an empty tokenizer from such a folder, which failed only at step 1 in the engine."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*"))
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "x", "answer": "y"}\n')
    overrides = [f"model.path={model}", f"data.train_files={data}", "data.val_files=[]"]
    assert main(["train", CONFIG, *overrides, f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    captured = capsys.readouterr()
    err = _one_line(captured.err)
    assert f"error: {model} holds no tokenizer (none of tokenizer.json, tokenizer.model, vocab.json)" in err
    assert "Traceback" not in captured.err


def test_unknown_subcommand_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["trian"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_a_bundled_recipe_resolves_by_name_from_any_directory(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)  # no configs/ folder here
    bundled = Path(CONFIG).parent / "qwen25vl_geo.yaml"
    for given in ("qwen25vl_geo", "config/qwen25vl_geo.yaml", "configs/qwen25vl_geo.yaml"):
        assert main(["config", "show", given]) == 0, given
        captured = capsys.readouterr()
        assert "experiment_name: qwen25vl_geo" in captured.out
        note = [line for line in captured.err.splitlines() if line.strip()]
        assert len(note) == 1 and str(bundled) in _one_line(captured.err), captured.err


def test_a_path_in_a_folder_of_its_own_is_not_taken_for_a_recipe(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["config", "show", "experiments/qwen25vl_geo.yaml"]) == 2
    assert main(["config", "show", "qwen25vl_gep"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "config file experiments/qwen25vl_geo.yaml does not exist" in err
    assert "Did you mean qwen25vl_geo?" in err


def test_the_recipes_are_installed_with_the_package() -> None:
    """The wheel copies configs/ to where the resolver looks when it runs from an installed package."""
    import tomllib

    from mmrl.config import recipes

    root = Path(CONFIG).parent.parent
    build = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    installed_at = build["force-include"]["configs"]
    assert root / installed_at == recipes.PACKAGED
    assert installed_at.split("/")[0] in build["packages"]
    assert recipes.recipe_dir() == root / "configs"  # this checkout: the repository's own folder


def test_resume_may_stand_anywhere_among_the_overrides(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    args = ["train", CONFIG, "trainer.total_stepz=3", "--resume", "actor.lrr=1", f"trainer.output_dir={run}"]
    assert main(args) == 2
    err = _one_line(capsys.readouterr().err)
    assert "trainer.total_stepz: unknown key" in err and "actor.lrr: unknown key" in err


def test_train_without_a_config_asks_for_the_config_only(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "config" in err and "overrides" not in err.splitlines()[-1]


def test_eval_on_a_run_with_no_checkpoint_yet_says_so(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    assert main(["eval", CONFIG, "--checkpoint", str(run)]) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"{run} is a run with no checkpoint yet" in err


def test_export_errors_name_its_own_arguments(tmp_path, capsys, tiny_model_dir) -> None:
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    file = tmp_path / "model.bin"
    file.write_text("x")
    assert main(["export", str(tiny_model_dir), str(file)]) == 2
    captured = capsys.readouterr()
    err = _one_line(captured.err)
    assert "--checkpoint" not in err and "Traceback" not in captured.err
    assert f"{file} is a file" in err
    assert file.read_text() == "x"


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: x\n bad: [\n")
    assert main(["config", "show", str(bad)]) == 2
    captured = capsys.readouterr()
    err = _one_line(captured.err)
    assert f"{bad}, line 3" in err and "<unicode string>" not in err
    assert "Traceback" not in captured.err


def test_a_key_written_twice_names_the_key_and_both_lines(tmp_path, capsys) -> None:
    """YAML itself keeps the last of two equal keys without a word (a second `actor:` replacing the first)."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("actor:\n  lr: 1.0e-5\nmodel: {path: m}\nactor:\n  lr: 1.0e-3\n")
    assert main(["config", "show", str(twice)]) == 2
    captured = capsys.readouterr()
    err = _one_line(captured.err)
    assert f"{twice}, line 4, column 1" in err and "key 'actor' appears twice" in err and "line 1" in err
    assert "Traceback" not in captured.err
    merged = tmp_path / "merged.yaml"  # a merge key's values may be overridden: that is what it is for
    merged.write_text(
        "model: {path: m}\ndata: {train_files: [t.jsonl]}\nactor: &actor {lr: 1.0e-5}\ncritic:\n  <<: *actor\n  lr: 2.0e-5\n"
    )
    assert main(["config", "show", str(merged)]) == 0
    assert "lr: 2.0e-05" in capsys.readouterr().out


def test_a_folder_given_as_the_config_returns_2(tmp_path, capsys) -> None:
    assert main(["train", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert f"{tmp_path} is a folder" in _one_line(captured.err) and "Traceback" not in captured.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where no GPU is visible")
def test_train_on_cuda_without_a_gpu_returns_2_before_any_work(tmp_path, capsys, tiny_model_dir) -> None:
    run = tmp_path / "run"
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "x", "answer": "y"}\n')
    overrides = [f"model.path={tiny_model_dir}", f"data.train_files={data}", "data.val_files=[]"]
    assert main(["train", CONFIG, *overrides, "trainer.device=cuda", f"trainer.output_dir={run}"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "trainer.device=cuda" in err and "no CUDA GPU" in err and "trainer.device=auto" in err
    assert not run.exists()
