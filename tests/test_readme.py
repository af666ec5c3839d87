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


def test_the_docs_point_only_at_files_in_the_repository() -> None:
    shipped = [ROOT / "README.md", *ROOT.glob("docs/*.md")]
    for folder in ("mmrl", "processors", "rewards", "envs", "examples", "configs"):
        shipped += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".yaml")]
    for path in shipped:
        for name in re.findall(r"\b[A-Z][A-Z_]+\.md\b", path.read_text()):
            assert (ROOT / name).exists() or (path.parent / name).exists(), f"{path} names {name}"


def test_each_recipe_writes_to_a_folder_named_after_it() -> None:
    from mmrl.config import load_config

    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(path)
        assert cfg.run_dir.parts[:2] == ("runs", cfg.trainer.experiment_name), path.name


def test_the_guide_says_the_vllm_engine_runs_on_workers() -> None:
    """Workers host vLLM since the scale-out work (mmrl/workers/policy.py starts one engine per rank)."""
    guide = " ".join((ROOT / "docs" / "scale_out.md").read_text().split())
    assert "Not yet on workers: the vLLM engine" not in guide
    assert "vLLM" in guide.split("## Scale-out", 1)[1].split("## ", 1)[0]
