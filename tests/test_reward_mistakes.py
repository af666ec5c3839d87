"""Reward mistakes in a config end `mmrl train` at start, before any model loads, with one line on stderr
that says what is wrong and what to do, and exit code 2: never a traceback from the reward layer."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from mmrl.cli import main
from mmrl.data.synthetic import generate

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml")

REWARDS = """
    def two_arguments(response, answer):
        return 1.0

    def good(sample):
        return 1.0
"""

# (the reward file's text or None, the reward entry, other overrides, what the one line must say)
MISTAKES = {
    "missing_function": (REWARDS, "{file}:missing_function", [], ["no function 'missing_function'", "good"]),
    "syntax_error": ("def good(sample:\n    return 1.0\n", "{file}:good", [], ["line 1", "syntax"]),
    "import_error": ("import no_such_module_anywhere\n", "{file}:good", [], ["no_such_module_anywhere"]),
    "wrong_signature": (REWARDS, "{file}:two_arguments", [], ["def two_arguments(sample: RewardInput"]),
    "misspelled_grader": (None, "answer_mach", [], ["Did you mean 'answer_match'?"]),
    "unenforceable_timeout": (
        REWARDS,
        "{file}:good",
        ["reward.isolation=inline", "reward.timeout_s=5"],
        ["reward.timeout_s", "isolation"],
    ),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reward_mistakes")
    generate(root, task="color", n_train=8, n_val=4, seed=0)
    return root


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_reward_mistake_is_one_line_and_exit_2_before_the_run_starts(
    mistake: str, tmp_path: Path, data: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, entry, overrides, expected = MISTAKES[mistake]
    file = tmp_path / "my_rewards.py"
    if text is not None:
        file.write_text(textwrap.dedent(text))
    code = main(
        [
            "train",
            CONFIG,
            f"model.path={tiny_model_dir}",
            f"data.train_files={data / 'train.jsonl'}",
            f"data.val_files={data / 'val.jsonl'}",
            f"trainer.output_dir={tmp_path / 'run'}",
            f"reward.functions=[{{name: '{entry.format(file=file)}'}}]",
            *overrides,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    line = " ".join(err.split())
    assert line.startswith("error: reward"), line
    for words in expected:
        assert words in line, line
    assert not (tmp_path / "run").exists(), "nothing is written before the config is known to be usable"
