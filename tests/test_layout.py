"""The package's layout holds: no import cycle, llama_cpp behind one package, the CLI on top,
the pure parts free of the rest. Read from the source with ast (every import counts, those
inside functions too); nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "specli"


def module_name(path: Path) -> str:
    parts = ["specli", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> set[str]:
    """The modules `name` imports: specli's own resolved to module names, others by their top name."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in MODULES else base)
    return {_owner(m) for m in out}


def _owner(name: str) -> str:
    """A specli name that is not a module (an attribute reached by `import a.b.c`) as the
    module that holds it; other names as they are."""
    while name.startswith("specli.") and name not in MODULES:
        name = name.rsplit(".", 1)[0]
    return name


GRAPH = {name: {m for m in imports(name) if m in MODULES and m != name} for name in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_inside_the_package():
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH))


def test_only_the_llama_package_imports_llama_cpp():
    users = {name for name in MODULES if any(m.split(".")[0] == "llama_cpp" for m in imports(name))}
    assert users and all(name.startswith("specli.llama.") for name in users), users


def test_nothing_below_the_cli_imports_it():
    for name in MODULES:
        if not name.startswith("specli.cli") and name != "specli.__main__":
            assert not any(m.startswith("specli.cli") for m in GRAPH[name]), name


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith("specli.decoding.policy")] + [
    "specli.decoding.verify", "specli.decoding.stats", "specli.decoding.text"])
def test_the_pure_parts_import_nothing_but_each_other(name):
    # The policy, verification, stats and text are pure: tested on simulated numbers.
    pure = {m for m in MODULES if m.startswith("specli.decoding.policy")} | {"specli.decoding.policy"}
    assert GRAPH[name] <= pure | {"specli.decoding.verify"}, GRAPH[name]
