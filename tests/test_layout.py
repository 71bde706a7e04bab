"""The engine's layout and import direction (ARCHITECTURE.md §1), read from the source.

`make lint` runs this file: a plugin that reaches into the engine's internals, or a
config module that imports the services it configures, fails there before review.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine" / "slipstream"
PLUGIN_FOLDERS = ("algorithms", "callbacks", "datasets", "examples")
# What a plugin may import of the engine: the public API, and the dataset plugins' API.
PUBLIC = {"slipstream", "slipstream.data"}


def module_name(path: Path, top: Path = ENGINE) -> str:
    parts = list(path.relative_to(top.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, top: Path = ENGINE, names: bool = False) -> set[str]:
    """Every module ``path`` imports, absolute, at any depth of the file (lazy imports
    inside functions count: they run too). With ``names``, ``from a import b`` gives
    ``a.b`` too (``b`` may be a module)."""
    package = module_name(path, top).split(".") if path.is_relative_to(top) else []
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            if names:
                found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def import_cycles(top: Path = ENGINE) -> list[list[str]]:
    """The import cycles among the modules under ``top`` (each a sorted list of the
    modules that import one another, directly or not). An import anywhere in a module
    counts; a package's ``__init__`` is left out as a target, since importing a name
    from a package (its lazy map of exports) runs only that module."""
    modules = {module_name(p, top): p for p in sorted(top.rglob("*.py"))}
    packages = {m for m, p in modules.items() if p.name == "__init__.py"}
    graph = {
        m: sorted(t for t in imported(p, top, names=True) if t in modules and t not in packages and t != m)
        for m, p in modules.items()
        if m not in packages
    }
    # Tarjan's strongly connected components, iteratively (no recursion limit).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def engine_files(sub: str = "") -> list[Path]:
    return sorted((ENGINE / sub).rglob("*.py"))


def test_the_top_level_holds_at_most_a_dozen_modules_and_names_are_unique() -> None:
    top = [p.name for p in ENGINE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(top) <= 12, sorted(top)
    names: dict[str, list[str]] = {}
    for path in engine_files():
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(str(path.relative_to(ENGINE)))
    assert not {n: p for n, p in names.items() if len(p) > 1}


@pytest.mark.parametrize("path", engine_files("config"), ids=lambda p: p.name)
def test_config_never_imports_the_services_or_the_loop(path: Path) -> None:
    bad = {m for m in imported(path) if m.startswith(("slipstream.services", "slipstream.trainer", "slipstream.cli"))}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: validators belong beside the settings"


@pytest.mark.parametrize(
    "path",
    [p for p in engine_files() if "cli" not in p.relative_to(ENGINE).parts[:1] and p.name != "__main__.py"],
    ids=lambda p: str(p.relative_to(ENGINE)),
)
def test_only_the_command_line_imports_the_command_line(path: Path) -> None:
    allowed = {"run/inference.py"}  # evaluation and export rebuild a run as `train` does
    if str(path.relative_to(ENGINE)) in allowed:
        return
    bad = {m for m in imported(path) if m == "slipstream.cli" or m.startswith("slipstream.cli.")}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def plugin_files() -> list[Path]:
    return sorted(
        p for folder in PLUGIN_FOLDERS for p in (ROOT / folder).glob("*/**/*.py")
        if ".egg-info" not in str(p) and "build" not in p.parts
    )


@pytest.mark.parametrize("path", plugin_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_import_only_the_public_api(path: Path) -> None:
    engine = {m for m in imported(path) if m == "slipstream" or m.startswith("slipstream.")}
    assert engine <= PUBLIC, (
        f"{path.relative_to(ROOT)} imports {sorted(engine - PUBLIC)}: a plugin imports only "
        f"{' and '.join(sorted(PUBLIC))} (export what it needs there)"
    )


def test_the_rules_see_a_violation(tmp_path: Path) -> None:
    """The checks above would catch a plugin reaching into the engine."""
    bad = tmp_path / "slipstream_bad.py"
    bad.write_text("from slipstream.services.flops import meta_copy\nimport slipstream.trainer\n")
    assert imported(bad) - PUBLIC == {"slipstream.services.flops", "slipstream.trainer"}


def test_no_import_cycles_among_the_engine_modules() -> None:
    """Each module's imports, those inside functions included, lead away from it: a
    cycle means two modules that cannot be read, changed or tested apart."""
    cycles = import_cycles()
    assert not cycles, "import cycles: " + " | ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle(tmp_path: Path) -> None:
    """A cycle through an import inside a function is found; a package's __init__
    that re-exports its modules makes none."""
    top = tmp_path / "slipstream"
    (top / "data").mkdir(parents=True)
    (top / "__init__.py").write_text("from slipstream import plain\n")
    (top / "plain.py").write_text("import slipstream\n")
    (top / "data" / "__init__.py").write_text("from .a import A\n")
    (top / "data" / "a.py").write_text("from slipstream.data import b\nA = 1\n")
    (top / "data" / "b.py").write_text("def f():\n    from .a import A\n    return A\n")
    assert import_cycles(top) == [["slipstream.data.a", "slipstream.data.b"]]
    (top / "data" / "b.py").write_text("def f():\n    return 1\n")
    assert import_cycles(top) == []
