"""What the package installs: `mmrl` as its only top-level import name, with the leaf packages
(processors, rewards, envs, which sit at the repository root) inside it."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hatchling.build import build_wheel

    out = tmp_path_factory.mktemp("wheel")
    here = Path.cwd()
    os.chdir(ROOT)  # hatchling reads pyproject.toml from the working directory
    try:
        return out / build_wheel(str(out))
    finally:
        os.chdir(here)


def test_the_wheel_installs_mmrl_as_its_only_top_level_name(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"mmrl"}, tops
    for leaf in ("processors", "rewards", "envs"):
        assert f"mmrl/{leaf}/__init__.py" in names, f"mmrl.{leaf} is missing from the wheel"
    assert "mmrl/rewards/types.py" in names and "mmrl/configs/quickstart.yaml" in names


def test_the_leaves_import_only_under_mmrl() -> None:
    import mmrl.rewards
    from mmrl.rewards import RewardInput

    assert RewardInput.__module__ == "mmrl.rewards.types"
    assert Path(mmrl.rewards.__file__).resolve() == (ROOT / "rewards" / "__init__.py").resolve()


def test_the_installed_quickstart_finds_its_recipes_inside_the_package(wheel: Path, tmp_path: Path) -> None:
    """Unpacked as pip installs it, the wheel's `mmrl quickstart` reads the recipes it carries, not a
    `configs/` folder beside site-packages."""
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    probe = (
        "from pathlib import Path; import mmrl, mmrl.quickstart as q; "
        "inside = [q.recipe_of(t).is_file() and q.recipe_of(t).is_relative_to(Path(mmrl.__file__).parent) "
        "for t in q.TASKS]; assert all(inside), [q.recipe_of(t) for t in q.TASKS]; print(mmrl.__file__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(tmp_path / "site")), done.stdout
