"""The package's layout holds: no import cycle, llama_cpp behind one package, the packages on
floors with no import running back up, no two packages importing each other, the CLI on top,
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


# specli's packages and top-level modules, bottom floor first. Each imports only from floors
# below its own (and from itself); those on one floor import nothing from each other.
FLOORS = (
    ("specli", "specli.errors", "specli.modes"),  # nothing of specli's: the version, errors, drafting modes
    ("specli.files",),  # on errors: reading and writing files safely
    ("specli.gguf",),  # the GGUF header reader (opens model files through specli.files)
    ("specli.llama", "specli.models"),  # llama.cpp; the registry, hub and fit: side by side
    ("specli.constraints",),  # grammars and schemas on a model's vocabulary (llguidance); decoding sees only Request.constraint
    ("specli.decoding",),
    ("specli.session",),
    ("specli.server",),
    ("specli.cli",),
    ("specli.__main__",),
)


def child(name: str, package: str) -> str | None:
    """The module or subpackage of `package` that holds module `name` (None: not inside it,
    or package's own __init__)."""
    if not name.startswith(package + "."):
        return None
    return f"{package}.{name[len(package) + 1 :].split('.')[0]}"


def top(name: str) -> str:
    """The package or module of specli's own that holds `name` ("specli" for its __init__)."""
    return child(name, "specli") or "specli"


def floor(name: str) -> int:
    return next(i for i, names in enumerate(FLOORS) if top(name) in names)


def arrows_up(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) across specli's packages where the imported one is not on a lower floor."""
    return sorted((a, b) for a, targets in graph.items() for b in targets if top(a) != top(b) and floor(b) >= floor(a))


def two_way_ties(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs of siblings (modules or subpackages of one package, at any depth, each with all
    its modules) that import each other."""
    packages = {name.rsplit(".", n)[0] for name in graph for n in range(1, name.count(".") + 1)}
    arrows = set()
    for a, targets in graph.items():
        for b in targets:
            for package in packages:
                ca, cb = child(a, package), child(b, package)
                if ca and cb and ca != cb:
                    arrows.add((ca, cb))
    return sorted((a, b) for a, b in arrows if a < b and (b, a) in arrows)


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


# The pure parts: the policy, verification, sampling, a generation's bookkeeping, stopping, token
# trees, stats and text, tested on simulated numbers, without llama.cpp.
PURE = {m for m in MODULES if m.startswith("specli.decoding.policy")} | {
    f"specli.decoding.{name}" for name in ("verifier", "sampling", "generation", "stopping", "branches", "stats", "text")}


@pytest.mark.parametrize("name", sorted(PURE))
def test_the_pure_parts_import_nothing_but_each_other(name):
    assert GRAPH[name] <= PURE | {"specli.errors"}, GRAPH[name] - PURE


def trees() -> dict[str, ast.AST]:
    return {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}


TREES = trees()
VERIFIER = "specli.decoding.verifier"


def calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, (node.func.id if isinstance(node.func, ast.Name) else node.func.attr if isinstance(node.func, ast.Attribute) else "")


def test_acceptance_is_decided_in_one_module():
    # Only the verifier makes a Verdict or defines a verify function: a constraint's mask, or
    # any other rule for accepting a draft, has one place to go.
    for name, tree in TREES.items():
        if name == VERIFIER:
            continue
        made = [node.lineno for node, called in calls(tree) if called == "Verdict"]
        defined = [node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.lower().startswith("verif")]
        assert not made and not defined, (name, made, defined)


def test_nothing_above_decoding_builds_a_step_loop_by_hand():
    # The front ends start, prefill, step and release sequences through StepLoop (or generate());
    # none plans or commits a step itself, or makes a SequenceStep or a StepLoop but by its
    # factories.
    for name, tree in TREES.items():
        if name.startswith("specli.decoding"):
            continue
        stepping = [(node.lineno, called) for node, called in calls(tree)
                    if called in ("SequenceStep", "StepLoop") and isinstance(node.func, ast.Name)
                    or called in ("plan", "plan_steps", "commit") and isinstance(node.func, ast.Attribute) and "seq" in ast.unparse(node.func.value)]
        assert not stepping, (name, stepping)


def test_no_drafter_is_probed_for_what_it_can_do():
    # The drafter's protocol is declared (drafters.Drafter, with a default for every optional
    # capability): nothing asks getattr or hasattr of a drafter or a cache.
    for name, tree in TREES.items():
        for node, called in calls(tree):
            if called in ("getattr", "hasattr") and node.args:
                probed = ast.unparse(node.args[0])
                assert not any(word in probed for word in ("drafter", "draft", "cache", "item")), (name, node.lineno, probed)


def test_every_drafter_follows_the_declared_protocol():
    import inspect

    import specli.decoding.drafters as drafters
    import specli.decoding.memory_drafter as memory_drafter
    import specli.decoding.recycling as recycling
    import specli.decoding.replay as replay

    found = [cls for module in (drafters, memory_drafter, recycling, replay) for _, cls in inspect.getmembers(module, inspect.isclass)
             if cls.__module__ == module.__name__ and cls is not drafters.Drafter and (cls.__name__.endswith("Drafter") or cls.__name__ == "ReplayHybrid")]
    assert len(found) >= 7, found
    for cls in found:
        assert issubclass(cls, drafters.Drafter), cls
        assert cls.propose is not drafters.Drafter.propose, cls  # (the one method without a default)


def test_every_package_of_specli_stands_on_a_floor():
    placed = {name for names in FLOORS for name in names}
    assert {top(name) for name in MODULES} == placed


def test_no_import_runs_back_up_a_floor():
    assert arrows_up(GRAPH) == []


def test_the_llama_package_imports_nothing_above_it():
    above = ("specli.models", "specli.decoding", "specli.session", "specli.server", "specli.cli")
    for name in MODULES:
        if name.startswith("specli.llama"):
            assert not [m for m in GRAPH[name] if top(m) in above], name


def test_no_two_packages_import_each_other():
    assert two_way_ties(GRAPH) == []


def test_the_floor_and_tie_checks_find_the_old_bug():
    # The edges these rules were written for (issue 31): the header reader inside models/,
    # llama/model.py reading it, fit asking llama/ for the devices and the compat numbers.
    old = {name: set(targets) for name, targets in GRAPH.items()}
    old["specli.models.header"] = {"specli.errors"}
    old["specli.llama.model"] |= {"specli.models.header"}
    old["specli.models.fit"] |= {"specli.models.header", "specli.llama.devices", "specli.llama.compat"}
    assert ("specli.llama.model", "specli.models.header") in arrows_up(old)
    assert ("specli.models.fit", "specli.llama.devices") in arrows_up(old)  # (one floor: no arrow either way)
    assert two_way_ties(old) == [("specli.llama", "specli.models")]
    assert find_cycle(old) is None  # which the cycle test alone did not see
    assert two_way_ties({"p.a.x": {"p.b"}, "p.b": {"p.a.y"}, "p.a.y": set()}) == [("p.a", "p.b")]
