"""Bundled recipes: the YAML files of the repository's `configs/`, named on the command line by file name.

A wheel carries them inside the package (`pyproject.toml` copies `configs/` to `mmrl/configs/`); a
clone or an editable install reads the repository's own folder, so there is one copy to edit.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from mmrl.errors import ConfigError

PACKAGED = Path(__file__).resolve().parent.parent / "configs"  # mmrl/configs
# Folders a recipe may be written under when the path does not exist here: the repository's folder, and
# the spelling `config/` that the first description of mmrl used.
RECIPE_FOLDERS = (".", "config", "configs")


def recipe_dir() -> Path:
    """Where the bundled recipes are: inside an installed package, else the repository's `configs/`."""
    return PACKAGED if PACKAGED.is_dir() else PACKAGED.parent.parent / "configs"  # the repository root


def recipe_names() -> list[str]:
    return sorted(p.stem for p in recipe_dir().glob("*.yaml"))


def resolve_config(given: str) -> tuple[Path, str | None]:
    """The config file a command-line argument means, and a note when it is a bundled recipe.

    An existing path always wins. A missing path resolves to a bundled recipe only when it is a bare
    name (`qwen25vl_geo`) or sits directly under `config/` or `configs/`, so a typo in a folder of the
    user's own is reported rather than silently replaced by a recipe of the same name.
    """
    path = Path(given)
    if path.exists():
        return path, None
    stem = path.stem if path.suffix in (".yaml", ".yml") else path.name
    recipe = recipe_dir() / f"{stem}.yaml"
    if str(path.parent) in RECIPE_FOLDERS and recipe.is_file():
        return recipe, f"using the bundled recipe {recipe} (there is no file {given} here)"
    raise ConfigError(f"config file {given} does not exist.{_suggestion(stem)}")


def _suggestion(stem: str) -> str:
    close = difflib.get_close_matches(stem, recipe_names(), n=1)
    if close:
        return f" Did you mean {close[0]}? (a bundled recipe: mmrl train {close[0]})"
    return f" Bundled recipes, usable by name: {', '.join(recipe_names())}."
