"""What the package installs: `mmrl` as its only top-level import name, with the leaf packages
(processors, rewards, envs, which sit at the repository root) inside it."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import os

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
