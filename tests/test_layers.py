"""The import-linter contract in pyproject.toml holds: mmrl's layers import only downwards, and no
package has an import cycle. A broken contract names the offending import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120, check=False
    )


def test_the_layer_contract_is_kept() -> None:
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def _lint_with(root: Path, module: str, line: str) -> subprocess.CompletedProcess[str]:
    """`lint-imports` over a copy of the package in `root` whose `module` (a path under mmrl/) ends with `line`."""
    shutil.copytree(ROOT / "mmrl", root / "mmrl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root)
    target = root / "mmrl" / module
    target.write_text(target.read_text() + f"\n{line}  # noqa: E402\n")
    return _lint(root)


def test_an_upward_import_breaks_the_contract_and_is_named(tmp_path: Path) -> None:
    """The contract is not vacuous: one import from the data layer up to the trainer fails it."""
    done = _lint_with(tmp_path, "data/batch.py", "from mmrl.trainer import Trainer")
    assert done.returncode != 0
    assert "mmrl.data.batch -> mmrl.trainer" in done.stdout, done.stdout


def test_a_cycle_inside_a_package_breaks_the_contract(tmp_path: Path) -> None:
    done = _lint_with(tmp_path, "agent/scripts.py", "from mmrl.agent.warmup import agent_warmup")
    assert done.returncode != 0
    assert "No cycles are allowed in mmrl.agent." in done.stdout, done.stdout
