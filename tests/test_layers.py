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


def test_an_upward_import_breaks_the_contract_and_is_named(tmp_path: Path) -> None:
    """The contract is not vacuous: one import from the data layer up to the trainer fails it."""
    shutil.copytree(
        ROOT / "mmrl", tmp_path / "mmrl", symlinks=False, ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    batch = tmp_path / "mmrl" / "data" / "batch.py"
    batch.write_text(batch.read_text() + "\nfrom mmrl.trainer import Trainer  # noqa: E402\n")
    done = _lint(tmp_path)
    assert done.returncode != 0
    assert "mmrl.data.batch -> mmrl.trainer" in done.stdout, done.stdout


def test_a_cycle_inside_a_package_breaks_the_contract(tmp_path: Path) -> None:
    shutil.copytree(
        ROOT / "mmrl", tmp_path / "mmrl", symlinks=False, ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    scripts = tmp_path / "mmrl" / "agent" / "scripts.py"
    scripts.write_text(scripts.read_text() + "\nfrom mmrl.agent.warmup import agent_warmup  # noqa: E402\n")
    done = _lint(tmp_path)
    assert done.returncode != 0
    assert "No cycles are allowed in mmrl.agent." in done.stdout, done.stdout
