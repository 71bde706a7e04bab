"""Finding the bundled recipes (they ship inside the distribution as
``slipstream.bundled_recipes``) and recipe files given by path."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from slipstream.errors import ConfigError, did_you_mean

DEFAULT_RECIPE = "default"


def bundled_dir() -> Path:
    return Path(str(resources.files("slipstream.bundled_recipes")))


def bundled() -> dict[str, Path]:
    """Name -> path of every bundled recipe."""
    return {p.stem: p for p in sorted(bundled_dir().glob("*.yaml"))}


def description(path: Path) -> str:
    """The recipe's first comment line, which says what it is for."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
        if line.strip():
            break
    return ""


def find_recipe(name_or_path: str, relative_to: Path | None = None) -> Path:
    """A path as given (or relative to the recipe that extends it), else a bundled name."""
    candidates = [Path(name_or_path)]
    if relative_to is not None:
        candidates.insert(0, relative_to / name_or_path)
    for candidate in candidates:
        for path in (candidate, candidate.with_suffix(".yaml")):
            if path.is_file():
                return path
    recipes = bundled()
    name = Path(name_or_path).stem if name_or_path.endswith((".yaml", ".yml")) else name_or_path
    if name in recipes:
        return recipes[name]
    raise ConfigError(
        f"no recipe {name_or_path!r}: not a file, and not a bundled recipe"
        f"{did_you_mean(name, recipes)}; bundled recipes: {', '.join(recipes) or 'none'}"
    )
