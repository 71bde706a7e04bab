"""README.md and docs/: every relative link resolves, every command shown parses, and
the configuration page names every key of the schema."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from slipstream.cli import main as cli
from slipstream.config.schema import SECTIONS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def _links() -> list[tuple[Path, str]]:
    return [(page, t) for page in PAGES for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]


def _commands() -> list[tuple[Path, list[str]]]:
    """``slipstream ...`` and ``make ...`` lines of code blocks, continuations joined,
    comments dropped, as argument lists."""
    found = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text()):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = re.sub(r"^(\.venv/bin/|\$ )", "", line.strip())
                if re.match(r"(slipstream|make)( |$)", line):
                    found.append((page, shlex.split(line, comments=True)))
    return found


def _linked_from(index: Path) -> set[Path]:
    return {(index.parent / t).resolve() for t in LINK.findall(index.read_text()) if not re.match(r"[a-z]+:", t)}


@pytest.mark.parametrize("index, pages", [("README.md", "docs/*.md"), ("docs/results/README.md", "docs/results/*.md")])
def test_every_page_is_linked_from_its_index(index: str, pages: str) -> None:
    linked = _linked_from(ROOT / index) | {(ROOT / index).resolve()}
    unlinked = [p.relative_to(ROOT).as_posix() for p in sorted(ROOT.glob(pages)) if p.resolve() not in linked]
    assert not unlinked, f"{index} links to none of {unlinked}"


def test_the_readme_is_at_most_250_lines() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page, target", _links(), ids=lambda v: str(v)[-40:] if isinstance(v, Path) else v)
def test_relative_links_resolve(page: Path, target: str) -> None:
    resolved = (page.parent / target).resolve()
    assert resolved.exists(), f"{page.relative_to(ROOT)}: broken link {target}"


def _subparsers() -> dict[str, object]:
    parser = cli._parser()
    (action,) = [a for a in parser._actions if a.dest == "command"]
    return action.choices


def test_every_command_shown_parses(capsys: pytest.CaptureFixture[str]) -> None:
    commands = _commands()
    subparsers = _subparsers()
    makefile = (ROOT / "Makefile").read_text()
    shown = set()
    for page, argv in commands:
        where = f"{page.relative_to(ROOT)}: {' '.join(argv)}"
        if argv[0] == "make":
            target = next((a for a in argv[1:] if "=" not in a), None)
            assert target is None or re.search(rf"^{re.escape(target)}:", makefile, re.M), where
            continue
        assert len(argv) > 1 and argv[1] in subparsers, where
        sub = subparsers[argv[1]]
        nested = [a for a in sub._actions if getattr(a, "choices", None) and hasattr(a, "_name_parser_map")]
        if nested and len(argv) > 2 and argv[2] in nested[0].choices:  # `slipstream data convert ...`
            sub = nested[0].choices[argv[2]]
        known = {s for a in sub._actions for s in a.option_strings}
        for flag in (a.split("=")[0] for a in argv[2:] if a.startswith("--")):
            assert flag in known, f"{where}: {flag} is not an option of 'slipstream {argv[1]}'"
        shown.add(argv[1])
    for name in sorted(shown):
        with pytest.raises(SystemExit) as exit_:
            cli.main([name, "--help"])
        assert exit_.value.code == 0, name
    capsys.readouterr()
    assert {"train", "sweep", "compare"} <= shown  # the pages do show commands


def _keys(cls: type, prefix: str) -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += _keys(type(default), f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def test_configuration_page_names_every_key() -> None:
    page = (ROOT / "docs/configuration.md").read_text()
    keys = [k for section, cls in SECTIONS.items() for k in _keys(cls, f"{section}.")]
    assert len(keys) > 40
    assert [k for k in keys if f"`{k}`" not in page] == []


def test_the_trainer_defaults_on_the_configuration_page_are_the_code_s() -> None:
    import yaml

    from slipstream.config.schema import build_config
    from slipstream.run.tracking import flatten

    page = (ROOT / "docs/configuration.md").read_text()
    documented = dict(re.findall(r"^\| `(trainer\.[\w.]+)` \| `([^`]*)` \|", page, re.M))
    defaults = flatten({"trainer": OmegaConf.to_container(build_config(None, None, []).trainer)})
    assert set(documented) == set(defaults)
    wrong = {k: (v, defaults[k]) for k, v in documented.items() if yaml.safe_load(v) != defaults[k]}
    assert wrong == {}
