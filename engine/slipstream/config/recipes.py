"""Finding the bundled recipes (they ship inside the distribution as
``slipstream.bundled_recipes``) and recipe files given by path."""

from __future__ import annotations

import os
import warnings
from importlib import resources
from pathlib import Path

from slipstream.errors import ConfigError, ConfigWarning, did_you_mean

DEFAULT_RECIPE = "default"


def bundled_dir() -> Path:
    return Path(str(resources.files("slipstream.bundled_recipes")))


def bundled() -> dict[str, Path]:
    """Name -> path of every bundled recipe."""
    return {p.stem: p for p in sorted(bundled_dir().glob("*.yaml"))}


def description(path: Path) -> str:
    """The first sentence of the recipe's leading comment, which says what it is for."""
    words: list[str] = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            if line.strip() or words:
                break
            continue
        words.extend(line.lstrip("# ").split())
        text = " ".join(words)
        end = text.find(". ")
        if end >= 0:
            return text[: end + 1]
    return " ".join(words)


def find_recipe(name_or_path: str, relative_to: Path | None = None) -> Path:
    """A bundled recipe's name (a bare name, as docs/configuration.md says), else a path
    as given (or relative to the recipe that extends it), ``.yaml`` optional."""
    recipes = bundled()
    candidates = [Path(name_or_path)]
    if relative_to is not None:
        candidates.insert(0, relative_to / name_or_path)
    files = [p for c in candidates for p in (c, c.with_suffix(".yaml")) if p.is_file()]
    bare = "/" not in name_or_path and os.sep not in name_or_path and not name_or_path.endswith((".yaml", ".yml"))
    if bare and name_or_path in recipes:
        files = [p for p in files if p.resolve() != recipes[name_or_path].resolve()]
        if files:
            warnings.warn(
                f"recipe {name_or_path!r} is the bundled one, not the file {files[0]}; give the file's "
                f"path (./{files[0].name}) to use it",
                ConfigWarning,
                stacklevel=2,
            )
        return recipes[name_or_path]
    if files:
        return files[0]
    name = Path(name_or_path).stem if name_or_path.endswith((".yaml", ".yml")) else name_or_path
    if name in recipes:
        return recipes[name]
    raise ConfigError(
        f"no recipe {name_or_path!r}: not a file, and not a bundled recipe"
        f"{did_you_mean(name, recipes)}; bundled recipes: {', '.join(recipes) or 'none'}"
    )
