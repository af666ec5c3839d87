"""The README's two commands are what CI and new users actually run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commands() -> list[str]:
    section = (ROOT / "README.md").read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section, flags=re.S)


def test_readme_has_exactly_a_quickstart_and_a_test_command() -> None:
    quickstart, tests = _commands()
    assert quickstart.endswith("mmrl quickstart") and "requirements.lock" in quickstart
    assert "-m pytest -q" in tests and "requirements-test.lock" in tests


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    _, tests = _commands()
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_lockfiles_pin_the_tested_torch_pair() -> None:
    for name in ("requirements.lock", "requirements-test.lock"):
        text = (ROOT / name).read_text()
        assert re.search(r"^torch==2\.13\.0 ", text, flags=re.M), name
        assert re.search(r"^torchvision==0\.28\.0 ", text, flags=re.M), name
        assert "--hash=sha256:" in text
