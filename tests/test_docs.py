"""The user's guide: the site builds in strict mode and offline, every page is in its nav, the config
reference is complete and current, and the algorithms page lists every registry entry."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import yaml

from mmrl.config import reference

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _nav_pages(entries: list) -> list[str]:
    pages = []
    for entry in entries:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_nav() -> None:
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.glob("*.md"))
    assert sorted(nav) == pages, "add the page to mkdocs.yml's nav, or remove it from the nav"


def test_the_site_builds_in_strict_mode_without_the_network(tmp_path: Path, monkeypatch) -> None:
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    def refuse(*args, **kwargs):
        raise AssertionError(f"the docs build opened a connection: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
    build(config)
    home = (tmp_path / "site" / "index.html").read_text()
    assert "mmrl" in home
    for page in (tmp_path / "site").rglob("*.html"):
        loads = re.search(
            r"<(script|img|iframe)[^>]*\ssrc=\"https?://|<link[^>]*\shref=\"https?://", page.read_text()
        )
        assert not loads, f"{page} loads from the web: {loads.group(0)}"
    assert "RewardInput" in (tmp_path / "site" / "api" / "index.html").read_text()


def test_every_config_key_has_a_doc() -> None:
    missing = [k.name for k in reference.config_keys() if not k.doc]
    assert not missing, f"give these fields a description= in mmrl/config/: {missing}"


def test_the_config_reference_is_current() -> None:
    assert reference.PAGE.read_text() == reference.render(), (
        f"docs/configuration.md is stale: regenerate it with `{reference.REGENERATE}`"
    )


def test_config_show_doc_prints_one_key(capsys) -> None:
    from mmrl.cli import main

    assert main(["config", "show", "--doc", "actor.lr"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("actor.lr: ") and "default: 1e-06" in out and "> 0" in out
    assert main(["config", "show", "--doc", "actor.lrr"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'actor.lr'" in " ".join(err.split())


def test_the_algorithms_page_has_a_row_per_registry_entry() -> None:
    from mmrl.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from mmrl.algorithms.filtering import POLICY_FILTERS
    from mmrl.algorithms.kl import KL_ESTIMATORS
    from mmrl.algorithms.policy_loss import POLICY_LOSSES
    from mmrl.algorithms.rollout_correction import ROLLOUT_CORRECTIONS

    rows = [line for line in (DOCS / "algorithms.md").read_text().splitlines() if line.startswith("| ")]
    registries = [ADVANTAGE_ESTIMATORS, POLICY_LOSSES, POLICY_FILTERS, KL_ESTIMATORS, ROLLOUT_CORRECTIONS]
    missing = [name for reg in registries for name in reg if not any(f"`{name}`" in row for row in rows)]
    assert not missing, f"docs/algorithms.md has no row for {missing}"
    page = (DOCS / "algorithms.md").read_text()
    unrendered = [
        name
        for reg in registries
        for name, fn in reg.items()
        if f"::: {fn.__module__}.{fn.__qualname__}\n" not in page
    ]
    assert not unrendered, f"docs/algorithms.md renders no docstring (its formula) for {unrendered}"


def test_the_readme_is_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "the README is a front page: move the detail into docs/"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", readme), "dated measurements belong in docs/benchmarks.md"


def test_the_guide_shows_the_readmes_own_commands() -> None:
    from tests.test_readme import _commands

    quickstart, tests = _commands()
    assert quickstart in (DOCS / "index.md").read_text()
    started = (DOCS / "getting_started.md").read_text()
    assert quickstart in started and tests in started, (
        "docs/getting_started.md: copy the README's two commands"
    )
