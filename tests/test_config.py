"""The run config: the shipped YAML loads, overrides are typed, and every mistake names its key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mmrl.cli import main
from mmrl.config import Config, load_config
from mmrl.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
CONFIGS = sorted((ROOT / "configs").glob("*.y*ml"))


def _error(overrides: list[str], path: Path | None = QUICKSTART) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def _write(tmp_path: Path, tree: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _quickstart_tree() -> dict:
    return yaml.safe_load(QUICKSTART.read_text())


def test_quickstart_yaml_loads_with_its_values() -> None:
    cfg = load_config(QUICKSTART)
    assert isinstance(cfg, Config)
    assert cfg.model.dtype == "float32"
    assert cfg.data.train_files == ["runs/quickstart/data/train.jsonl"]  # a single string becomes a list
    assert cfg.data.min_pixels == cfg.data.max_pixels == 112 * 112
    assert cfg.actor.lr_schedule == "cosine"
    assert cfg.rollout.n == 8
    assert cfg.actor.lr == pytest.approx(1.0e-3)
    assert [(f.name, f.weight) for f in cfg.reward.functions] == [
        ("answer_match", 0.9),
        ("format_answer", 0.1),
    ]
    assert cfg.warmup.steps == 40
    assert cfg.run_dir == Path("runs/quickstart/run")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.data.train_batch_size % cfg.actor.mini_batch_size == 0
    assert cfg.data.min_pixels <= cfg.data.max_pixels
    # What `config show` prints must load again to the same config.
    again = Config.model_validate(yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json"))))
    assert again == cfg


def test_configs_folder_is_not_empty() -> None:
    assert QUICKSTART in CONFIGS


def test_overrides_are_typed_as_yaml() -> None:
    cfg = load_config(
        QUICKSTART,
        [
            "trainer.total_steps=7",
            "actor.lr=0.25",
            "warmup.lr=1e-5",  # exponent without a dot: YAML 1.1 would read a string
            "data.val_files=[a.jsonl, b.jsonl]",
            "data.max_val_samples=12",
            "data.system_prompt=null",
            "trainer.val_before_train=false",
            "trainer.loggers=[jsonl]",
            "actor.betas=[0.8, 0.95]",
        ],
    )
    assert cfg.trainer.total_steps == 7 and type(cfg.trainer.total_steps) is int
    assert cfg.actor.lr == 0.25
    assert cfg.warmup.lr == pytest.approx(1e-5)
    assert cfg.data.val_files == ["a.jsonl", "b.jsonl"]
    assert cfg.data.max_val_samples == 12
    assert cfg.data.system_prompt is None
    assert cfg.trainer.val_before_train is False
    assert cfg.trainer.loggers == ["jsonl"]
    assert cfg.actor.betas == (0.8, 0.95)
    # Untouched values keep the file's.
    assert cfg.rollout.n == 8


def test_null_override_clears_a_value_from_the_file(tmp_path: Path) -> None:
    tree = _quickstart_tree()
    tree["data"]["max_val_samples"] = 5
    path = _write(tmp_path, tree)
    assert load_config(path).data.max_val_samples == 5
    assert load_config(path, ["data.max_val_samples=null"]).data.max_val_samples is None


def test_override_creates_a_missing_section() -> None:
    cfg = load_config(QUICKSTART, ["algorithm.gamma=0.5"])
    assert cfg.algorithm.gamma == 0.5


def test_float_without_dot_reaches_untyped_fields_as_a_number() -> None:
    cfg = load_config(QUICKSTART, ["reward.functions=[{name: answer_match, kwargs: {tol: 1e-3, n: 2}}]"])
    kwargs = cfg.reward.functions[0].kwargs
    assert kwargs == {"tol": 1e-3, "n": 2}
    assert isinstance(kwargs["tol"], float)


def test_later_override_wins() -> None:
    assert load_config(QUICKSTART, ["rollout.n=3", "rollout.n=4"]).rollout.n == 4


@pytest.mark.parametrize(
    ("override", "key", "suggestion"),
    [
        ("actor.lrr=1", "actor.lrr", "actor.lr"),
        ("trainer.seeed=1", "trainer.seeed", "trainer.seed"),
        ("trainr.seed=1", "trainr", "trainer"),
        ("rollout.val.temperatur=0.5", "rollout.val.temperatur", "rollout.val.temperature"),
        ("data.mini_batch_size=2", "data.mini_batch_size", "actor.mini_batch_size"),
    ],
)
def test_unknown_override_key_names_it_and_suggests(override: str, key: str, suggestion: str) -> None:
    message = _error([override])
    assert f"{key}: unknown key" in message
    assert f"Did you mean {suggestion}?" in message


def test_unknown_key_inside_a_list_of_sections() -> None:
    message = _error(["reward.functions=[{name: answer_match, wieght: 1}]"])
    assert "reward.functions.0.wieght: unknown key" in message
    assert "Did you mean reward.functions.0.weight?" in message
    assert "name, weight, kwargs" in message


def test_unknown_keys_in_the_yaml_file_top_level_and_nested(tmp_path: Path) -> None:
    tree = _quickstart_tree()
    tree["trainr"] = {"seed": 3}
    tree["actor"]["kl_loss_cof"] = 0.1
    message = _error([], _write(tmp_path, tree))
    assert "trainr: unknown key. Did you mean trainer?" in message
    assert "actor.kl_loss_cof: unknown key. Did you mean actor.kl_loss_coef?" in message


def test_unknown_key_without_a_close_match_lists_the_allowed_keys() -> None:
    message = _error(["actor.frobnicate=1"])
    assert "actor.frobnicate: unknown key" in message
    assert "Did you mean" not in message
    assert "Keys allowed here:" in message and "mini_batch_size" in message


@pytest.mark.parametrize(
    ("override", "key", "got"),
    [
        ("rollout.n=abc", "rollout.n", "'abc'"),
        ("actor.lr=fast", "actor.lr", "'fast'"),
        ("model.dtype=float64", "model.dtype", "'float64'"),
        ("trainer.loggers=[mlflow]", "trainer.loggers.0", "'mlflow'"),
        ("data.train_batch_size=0", "data.train_batch_size", "0"),
        ("actor.lr=-1", "actor.lr", "-1"),
    ],
)
def test_wrong_type_or_range_names_the_key(override: str, key: str, got: str) -> None:
    message = _error([override])
    assert f"{key}:" in message
    assert f"(got {got})" in message


def test_override_into_a_value_is_refused() -> None:
    assert "actor.lr.x" in _error(["actor.lr.x=1"])


def test_override_sets_a_field_of_one_list_item() -> None:
    cfg = load_config(QUICKSTART, ["reward.functions.1.weight=0.5"])
    assert [(f.name, f.weight) for f in cfg.reward.functions] == [
        ("answer_match", 0.9),
        ("format_answer", 0.5),
    ]


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("reward.functions.2.weight=1", "'2' is not an item of this list; it has 2 items"),
        ("reward.functions.x.weight=1", "'x' is not an item of this list"),
        ("reward.functions.0=1", "name a field of one item"),
    ],
)
def test_override_into_a_list_names_what_it_holds(override: str, says: str) -> None:
    assert says in _error([override])


def test_malformed_override_is_refused() -> None:
    assert "key.sub=value" in _error(["actor.lr"])


def test_missing_required_section_is_reported(tmp_path: Path) -> None:
    tree = _quickstart_tree()
    del tree["model"]
    message = _error([], _write(tmp_path, tree))
    assert "model: required" in message


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    assert "does not exist" in _error([], tmp_path / "nope.yaml")


def test_train_batch_not_a_multiple_of_mini_batch_fails() -> None:
    message = _error(["data.train_batch_size=12", "actor.mini_batch_size=8"])
    assert "data.train_batch_size (12)" in message and "actor.mini_batch_size (8)" in message
    # ...and the same sizes in a valid combination load.
    assert load_config(QUICKSTART, ["data.train_batch_size=16", "actor.mini_batch_size=8"])


def test_grpo_needs_a_group() -> None:
    message = _error(["rollout.n=1"])
    assert "rollout.n >= 2" in message
    assert load_config(QUICKSTART, ["rollout.n=2"]).rollout.n == 2


def test_gigpo_needs_episodes() -> None:
    assert "needs an env section or a game" in _error(["algorithm.adv_estimator=gigpo"])
    reach = load_config(QUICKSTART.parent / "vla_mujoco_reach.yaml", ["algorithm.adv_estimator=gigpo"])
    assert reach.algorithm.adv_estimator == "gigpo" and reach.algorithm.step_weight == 1.0


def test_min_pixels_above_max_pixels_fails() -> None:
    message = _error(["data.min_pixels=6272", "data.max_pixels=3136"])
    assert "data.min_pixels must not exceed data.max_pixels" in message
    assert load_config(QUICKSTART, ["data.min_pixels=3136", "data.max_pixels=6272"]).data.max_pixels == 6272


def test_cli_config_show_prints_resolved_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", str(QUICKSTART), "actor.lr=0.5", "rollout.n=3"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.5" in out
    shown = yaml.safe_load(out)
    assert shown["actor"]["lr"] == 0.5
    assert shown["rollout"]["n"] == 3
    assert Config.model_validate(shown).actor.lr == 0.5


def test_cli_config_show_unknown_key_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", str(QUICKSTART), "actor.lrr=1"]) == 2
    captured = capsys.readouterr()
    assert "actor.lrr" in captured.err
    assert "actor.lr" in captured.err.replace("actor.lrr", "")
    assert captured.out == ""


def test_greedy_sampling_with_several_responses_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.val\.n=4"):
        load_config(QUICKSTART, ["rollout.val.n=4"])
    with pytest.raises(ConfigError, match=r"rollout\.temperature"):
        load_config(QUICKSTART, ["rollout.temperature=0"])


def test_unregistered_algorithm_names_fail_at_start_but_file_specs_pass() -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimator='grpoo'.*grpo"):
        load_config(QUICKSTART, ["algorithm.adv_estimator=grpoo"])
    with pytest.raises(ConfigError, match=r"actor\.policy_loss"):
        load_config(QUICKSTART, ["actor.policy_loss=nope"])
    assert load_config(QUICKSTART, ["algorithm.adv_estimator=my.py:fn"]).algorithm.adv_estimator == "my.py:fn"


def test_vllm_length_budget_is_checked_at_start() -> None:
    with pytest.raises(ConfigError, match=r"exceeds rollout\.vllm\.max_model_len"):
        load_config(
            QUICKSTART,
            ["rollout.engine=vllm", "data.max_prompt_length=1024", "rollout.vllm.max_model_len=1024"],
        )
    assert load_config(
        QUICKSTART, ["rollout.engine=hf", "data.max_prompt_length=1024", "rollout.vllm.max_model_len=1024"]
    )


def test_a_tensor_parallel_engine_must_be_whole_ray_workers_on_one_node() -> None:
    vllm_tp = ["rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=2"]
    for per_node in (1, 3):  # one process has no group to split; three workers leave one rank over
        message = _error([*vllm_tp, f"trainer.n_gpus_per_node={per_node}"])
        assert f"trainer.n_gpus_per_node={per_node} does not split into groups of 2" in message
    assert (
        load_config(QUICKSTART, [*vllm_tp, "trainer.n_gpus_per_node=4"]).rollout.vllm.tensor_parallel_size
        == 2
    )
    assert load_config(QUICKSTART, ["rollout.engine=hf", "rollout.vllm.tensor_parallel_size=2"])  # HF: unused


def test_an_override_that_is_not_yaml_names_the_override() -> None:
    assert "override 'actor.lr=[1': the value is not valid YAML" in _error(["actor.lr=[1"])


def test_an_agent_section_refuses_what_it_cannot_combine_with() -> None:
    agent = "agent={tools: [{function: image_zoom}]}"
    cfg = load_config(QUICKSTART, [agent])
    assert cfg.agent is not None and cfg.agent.tools[0].function == "image_zoom"
    for extra, message in (
        (["rollout.max_staleness=1", "actor.rollout_correction=tis"], "max_staleness"),
        (["algorithm.adv_estimator=remax"], "remax"),
        (["rollout.engine=vllm", "rollout.vllm.max_model_len=2048"], "agent.max_tokens"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(QUICKSTART, [agent, *extra])
    with pytest.raises(ConfigError, match="tools"):
        load_config(QUICKSTART, ["agent={tools: []}"])
