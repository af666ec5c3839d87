"""Setup mistakes end in one line and exit 2 before any work (mmrl/sources/startup.py), and requests the
Ray cluster can never hold fail at start: each case through `mmrl.cli.main`, as a user meets it."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from mmrl.cli import main

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PROMPTS, VLA, AGENT, GAME = (
    str(CONFIGS / f"{name}.yaml")
    for name in ("quickstart", "vla_mujoco_reach", "quickstart_agent", "quickstart_game")
)


def _one_line(text: str) -> str:
    """Rich wraps long messages at the console width; compare text with whitespace collapsed."""
    return " ".join(text.split())


def _prompt_run(tmp: Path, model: Path, *overrides: str, config: str = PROMPTS) -> list[str]:
    data = tmp / "train.jsonl"
    data.write_text('{"problem": "x", "answer": "y"}\n')
    paths = [f"model.path={model}", f"data.train_files={data}", "data.val_files=[]"]
    return ["train", config, *paths, f"trainer.output_dir={tmp / 'run'}", *overrides]


def _vla_run(tmp: Path, model: Path, *overrides: str) -> list[str]:
    paths = [f"model.path={model}", f"sft.base_model={model}", f"trainer.output_dir={tmp / 'run'}"]
    return ["train", VLA, *paths, *overrides]


def _model_of_type(tmp: Path, model: Path) -> Path:
    folder = tmp / "model"
    folder.mkdir()
    config = json.loads((model / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "qwen2_5_vll"}))
    return folder


def _truncated_model(tmp: Path, model: Path) -> Path:
    folder = tmp / "model"
    shutil.copytree(model, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return folder


def _model_missing_a_shard(tmp: Path, model: Path) -> Path:
    folder = tmp / "model"
    shutil.copytree(model, folder)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {
        "a.weight": "model-00001-of-00002.safetensors",
        "b.weight": "model-00002-of-00002.safetensors",
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def _parquet(tmp: Path, content: bytes) -> Path:
    path = tmp / "train.parquet"
    path.write_bytes(content)
    return path


def _tool_file(tmp: Path, first_line: str = "") -> str:
    (tmp / "tools.py").write_text(f"{first_line}\ndef lookup(query):\n    return query\n")
    return f"{tmp / 'tools.py'}:lookup"


def _read_only(tmp: Path) -> Path:
    """A folder nothing can be written in, for root too (which permission bits do not stop)."""
    if os.geteuid() == 0:
        return Path("/sys/mmrl-run")
    folder = tmp / "read-only"
    folder.mkdir(mode=0o555)
    return folder / "run"


Case = Callable[[Path, Path], list[str]]
CASES: dict[str, tuple[Case, list[str]]] = {
    "unknown_family": (
        lambda tmp, model: ["model", "init-tiny", str(tmp / "run"), "--family", "qwen25_vl"],
        ["--family 'qwen25_vl'", "did you mean 'qwen2_5_vl'?", "qwen3_vl"],
    ),
    "unknown_model_type": (
        lambda tmp, model: _prompt_run(tmp, _model_of_type(tmp, model)),
        ["model.path", "model_type 'qwen2_5_vll'", "did you mean 'qwen2_5_vl'?"],
    ),
    "truncated_safetensors": (
        lambda tmp, model: _prompt_run(tmp, _truncated_model(tmp, model)),
        ["model.path", "model.safetensors is", "cut short", "download it again"],
    ),
    "missing_weight_shard": (
        lambda tmp, model: _prompt_run(tmp, _model_missing_a_shard(tmp, model)),
        ["model.path", "lacks weight files its index names: model-00002-of-00002.safetensors"],
    ),
    "unknown_env": (
        lambda tmp, model: _vla_run(tmp, model, "env.task=reahc"),
        ["env.task='reahc' is not a registered env", "did you mean 'reach'?"],
    ),
    "unknown_metaworld_task": (
        lambda tmp, model: _vla_run(tmp, model, "env.task=metaworld/reech-v3"),
        ["metaworld/ has no task 'reech-v3'", "did you mean 'reach-v3'?"],
    ),
    "unknown_libero_suite": (
        lambda tmp, model: _vla_run(tmp, model, "env.task=libero/spacial/0"),
        ["libero/ has no task 'spacial/0'", "did you mean 'spatial/0'?"],
    ),
    "unknown_env_option": (
        lambda tmp, model: _vla_run(tmp, model, "env.options.image_sise=56"),
        ["env.options: env 'reach' takes no option 'image_sise'", "did you mean 'image_size'?"],
    ),
    "sft_unknown_env": (
        lambda tmp, model: [
            "sft",
            VLA,
            "env.task=reahc",
            f"sft.base_model={model}",
            f"model.path={tmp / 'run'}",
        ],
        ["env.task='reahc'", "did you mean 'reach'?"],
    ),
    "env_option_out_of_range": (
        lambda tmp, model: [
            "sft",
            VLA,
            "env.options.max_steps=0",
            f"sft.base_model={model}",
            f"model.path={tmp / 'run'}",
        ],
        ["env 'reach' cannot be built with", "max_steps=0", "max_steps must be a positive integer, got 0"],
    ),
    "flow_width_the_heads_do_not_divide": (
        lambda tmp, model: _vla_run(tmp, model, "sft.policy=flow", "sft.flow_width=30"),
        ["sft.flow_width", "4 attention heads split its width evenly", "such as 28"],
    ),
    "critic_of_another_family": (
        lambda tmp, model: _prompt_run(
            tmp, model, "algorithm.adv_estimator=gae", f"critic.model_path={_other_family(tmp)}"
        ),
        ["critic.model_path", "is a llava_onevision model, but the policy (model.path) is qwen2_5_vl"],
    ),
    "missing_prm_model": (
        lambda tmp, model: _prompt_run(
            tmp, model, "algorithm.adv_estimator=prime", f"prm.model_path={tmp / 'no-prm'}"
        ),
        ["prm.model_path", "no-prm"],
    ),
    "policy_of_another_action_size": (
        lambda tmp, model: _vla_run(tmp, _policy_of_dim(tmp, model, 3)),
        ["policy was taught 3-D actions, but env reach takes 2-D", "mmrl sft"],
    ),
    "unknown_game": (
        lambda tmp, model: _prompt_run(tmp, model, "agent.game.task=gridnow", config=GAME),
        ["agent.game.task='gridnow'", "did you mean 'gridnav'?"],
    ),
    "game_without_moves": (
        lambda tmp, model: _prompt_run(tmp, model, "agent.game.task=reach", config=GAME),
        ["agent.game.task='reach' names no moves", "gridnav"],
    ),
    "unknown_builtin_tool": (
        lambda tmp, model: _prompt_run(tmp, model, "agent.tools=[{function: image_zom}]", config=AGENT),
        ["agent.tools[0].function='image_zom'", "did you mean 'image_zoom'?"],
    ),
    "tool_file_that_exits_at_import": (
        lambda tmp, model: _prompt_run(
            tmp,
            model,
            f"agent.tools=[{{function: {_tool_file(tmp, 'import os; os._exit(3)')}, parameters: {{type: object}}}}]",
            config=AGENT,
        ),
        ["agent.tools[0]", "tools.py failed: it calls os._exit(3) at import"],
    ),
    "reward_file_that_exits_at_import": (
        lambda tmp, model: _prompt_run(
            tmp, model, f"reward.functions=[{{name: '{_tool_file(tmp, 'import sys; sys.exit(4)')}'}}]"
        ),
        ["tools.py failed: it calls sys.exit(4) at import"],
    ),
    "tool_without_parameters": (
        lambda tmp, model: _prompt_run(
            tmp, model, f"agent.tools=[{{function: {_tool_file(tmp)}}}]", config=AGENT
        ),
        ["agent.tools[0]", "has no `parameters`", "JSON schema"],
    ),
    "empty_parquet": (
        lambda tmp, model: _prompt_run(tmp, model, f"data.train_files={_parquet(tmp, b'')}"),
        ["data.train_files", "train.parquet is empty (0 bytes)"],
    ),
    "garbage_parquet": (
        lambda tmp, model: _prompt_run(tmp, model, f"data.train_files={_parquet(tmp, b'not parquet' * 9)}"),
        ["data.train_files", "train.parquet is not a parquet file"],
    ),
    "read_only_output": (
        lambda tmp, model: _prompt_run(tmp, model, f"trainer.output_dir={_read_only(tmp)}"),
        ["trainer.output_dir=", "nothing can be written in", "give a folder you can write in"],
    ),
    "output_under_a_file": (
        lambda tmp, model: _prompt_run(tmp, model, f"trainer.output_dir={_parquet(tmp, b'x')}/run"),
        ["trainer.output_dir=", "train.parquet is a file"],
    ),
    "estimator_file_without_the_function": (
        lambda tmp, model: _prompt_run(tmp, model, f"algorithm.adv_estimator={_algorithm_file(tmp)}:missing"),
        ["algorithm.adv_estimator=", "defines no 'missing'", "callables there: ['other']"],
    ),
    "loss_file_that_fails_to_import": (
        lambda tmp, model: _prompt_run(tmp, model, f"actor.policy_loss={_algorithm_file(tmp, '1/0')}:other"),
        ["actor.policy_loss=", "ZeroDivisionError"],
    ),
    "device_gpu": (
        lambda tmp, model: _prompt_run(tmp, model, "trainer.device=gpu"),
        ["trainer.device", "'gpu' is no device", "auto, cpu, cuda or cuda:N"],
    ),
    "output_dir_placeholder": (
        lambda tmp, model: _prompt_run(tmp, model, f"trainer.output_dir={tmp / 'run'}/{{name}}"),
        ["trainer.output_dir", "only {experiment_name} is filled in", "KeyError: 'name'"],
    ),
    "truncated_dataset_dict": (
        lambda tmp, model: _prompt_run(tmp, model, f"data.train_files={_truncated_dataset(tmp)}@train"),
        ["data.train_files", "dataset_dict.json cannot be read", "JSONDecodeError", "save the dataset again"],
    ),
    "truncated_action_tokenizer": (
        lambda tmp, model: _vla_run(
            tmp, _with_side_file(tmp, model, "action_tokenizer.json", '{"action_dim": 2, "st')
        ),
        ["action_tokenizer.json cannot be read", "JSONDecodeError", "copy it again"],
    ),
    "action_head_of_an_unknown_field": (
        lambda tmp, model: _vla_run(
            tmp, _with_side_file(tmp, model, "action_head.json", '{"kind": "gaussian", "widht": 3}')
        ),
        ["action_head.json cannot be read", "TypeError", "widht"],
    ),
    "env_prompt_without_image": (
        lambda tmp, model: _vla_run(tmp, model, "env.prompt='reach {instruction} now'"),
        ["env.prompt", "exactly one <image> marker"],
    ),
}


def _policy_of_dim(tmp: Path, model: Path, action_dim: int) -> Path:
    """A copy of the tiny model as if `mmrl sft` had taught it `action_dim`-D action tokens."""
    from mmrl.envs.actions import ActionTokenizer

    vocab = json.loads((model / "config.json").read_text())["text_config"]["vocab_size"]
    tokens = ActionTokenizer.for_vocab(vocab, action_dim, n_bins=256)
    return _with_side_file(tmp, model, "action_tokenizer.json", json.dumps(tokens.to_dict()))


def _other_family(tmp: Path) -> Path:
    from mmrl.models import build_tiny

    return build_tiny(tmp / "llava", family="llava_onevision")


def _truncated_dataset(tmp: Path) -> Path:
    folder = tmp / "geo"
    (folder / "train").mkdir(parents=True)
    (folder / "dataset_dict.json").write_text('{"splits": ["train", "te')
    return folder


def _with_side_file(tmp: Path, model: Path, name: str, text: str) -> Path:
    folder = tmp / "policy"
    shutil.copytree(model, folder)
    (folder / name).write_text(text)
    return folder


def _algorithm_file(tmp: Path, body: str = "pass") -> Path:
    path = tmp / "algo.py"
    path.write_text(f"{body}\n\n\ndef other(*args, **kwargs):\n    return None\n")
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_a_setup_mistake_is_one_line_and_exit_2_before_any_work(
    case, tmp_path, capsys, tiny_model_dir
) -> None:
    build, expected = CASES[case]
    argv = build(tmp_path, tiny_model_dir)
    capsys.readouterr()  # what building the case printed (a tiny model's progress bar) is not the command's
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error:")
    line = _one_line(err)
    for part in expected:
        assert part in line, f"{part!r} not in {line!r}"
    assert not (tmp_path / "run").exists()


def test_eval_of_a_policy_taught_another_action_size_is_one_line(tmp_path, capsys, tiny_model_dir) -> None:
    """`mmrl eval` checks the policy's action size against the env's as training does (it skipped the check
    and failed deep in its first episode); the weights load first, so their progress bar precedes the line."""
    policy = _policy_of_dim(tmp_path, tiny_model_dir, 3)
    capsys.readouterr()
    argv = ["eval", VLA, f"model.path={policy}", "--checkpoint", str(policy), "--episodes", "1"]
    assert main([*argv, "--out", str(tmp_path / "eval.json")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "error: " + f"{policy} was taught 3-D actions, but env reach takes 2-D" in _one_line(err)
    assert not (tmp_path / "eval.json").exists()


@pytest.fixture
def two_cpu_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray looks joined to a cluster of one node with two CPUs; no Ray process starts (nor auto-starts)."""
    import ray
    from ray._private import auto_init_hook

    node = {"Alive": True, "NodeManagerAddress": "10.0.0.7", "Resources": {"CPU": 2.0}}
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: [node])
    monkeypatch.setattr(auto_init_hook, "enable_auto_connect", False)


@pytest.mark.parametrize(
    "overrides, asked",
    [
        (["env.num_workers=64"], "env.num_workers=64 (64)"),
        (
            ["rollout.max_staleness=1", "actor.rollout_correction=tis", "rollout.worker_cpus=8"],
            "rollout.worker_cpus=8",
        ),
    ],
    ids=["env_workers", "rollout_worker_cpus"],
)
def test_a_request_the_cluster_can_never_hold_fails_at_start(
    overrides, asked, tmp_path, capsys, tiny_model_dir, two_cpu_cluster
) -> None:
    if overrides[0].startswith("env."):
        argv = _vla_run(tmp_path, tiny_model_dir, "data.train_batch_size=8", *overrides)
    else:
        argv = _prompt_run(tmp_path, tiny_model_dir, *overrides)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = _one_line(err)
    assert asked in line and "2 CPU(s)" in line, line
    assert not (tmp_path / "run").exists()
