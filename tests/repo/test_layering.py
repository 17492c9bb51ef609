"""How the package is put together: imports form no cycle, data flows hook -> guard ->
rules -> pool, the guard never loads the harness, and no module touches another
module's private state.

Read from the source with ``ast``: no vLLM needed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from vllm_prefix_guard import targets

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "vllm_prefix_guard"
#: The guard itself: the package's modules and the rules (the harness is another
#: distribution, ``harness/``).
CORE = sorted([*PACKAGE.glob("*.py"), *PACKAGE.glob("rules/*.py")])
#: vLLM's own private names the guard uses on purpose (each checked at start-up); a
#: wrapper named after one is no private state of the module defining it.
VLLM_INTERNALS = {internal.name for internal in targets.INTERNALS}


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_anywhere(path: Path) -> set[str]:
    """Every module ``path`` imports, function bodies included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def top_level_imports(path: Path) -> set[str]:
    """Project modules ``path`` imports when it is imported (function bodies excluded),
    and those it imports for type checking only: a cycle hidden behind ``TYPE_CHECKING``
    is still two modules that cannot be read apart."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    statements = list(tree.body)
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            statements += node.body
    for node in statements:
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "vllm_prefix_guard":
                found |= {f"vllm_prefix_guard.{alias.name}" for alias in node.names}
            elif node.module.startswith("vllm_prefix_guard"):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("vllm_prefix_guard")}
    return {
        name
        for name in found
        if (PACKAGE.parent / name.replace(".", "/")).exists()
        or (PACKAGE.parent / (name.replace(".", "/") + ".py")).exists()
    }


def test_core_imports_form_no_cycle() -> None:
    graph = {module_name(p): top_level_imports(p) - {module_name(p)} for p in CORE}
    visiting: set[str] = set()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in visiting, " -> ".join([*path, node])
        if node in done or node not in graph:
            return
        visiting.add(node)
        for target in graph[node]:
            visit(target, [*path, node])
        visiting.discard(node)
        done.add(node)

    for node in graph:
        visit(node, [])


def test_data_flows_hook_to_guard_to_rules_to_pool() -> None:
    imports = {module_name(p): top_level_imports(p) for p in CORE}
    package = "vllm_prefix_guard"
    hooks, guard, pool, plugin = (
        f"{package}.{name}" for name in ("hooks", "scheduler_guard", "pool", "plugin")
    )
    rules = sorted(name for name in imports if name.startswith(f"{package}.rules"))
    assert rules and guard in imports and pool in imports
    assert not imports[pool] & {guard, hooks}
    for name in rules:
        assert not imports[name] & {pool, hooks, guard}, name
    assert hooks not in imports[guard]
    assert plugin not in imports[hooks]


def test_the_guard_never_imports_the_harness() -> None:
    for path in CORE:
        harness = ("vllm_prefix_guard_harness", "guard_demo")
        bad = {m for m in imports_anywhere(path) if m.startswith(harness)}
        assert not bad, f"{path.name} imports {bad}"


def _private_names_defined(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and _is_private(node.name):
            names.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and _is_private(node.attr)
        ):
            names.add(node.attr)
    return names


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _foreign_private_reads(tree: ast.AST, names: set[str]) -> Iterator[str]:
    """``obj._name`` where ``_name`` is another module's private and ``obj`` is not ``self``."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in names
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            yield f"line {node.lineno}: .{node.attr}"


def test_no_module_reaches_into_another_modules_private_state() -> None:
    paths = sorted(PACKAGE.rglob("*.py"))
    trees = {path: ast.parse(path.read_text()) for path in paths}
    defined = {path: _private_names_defined(tree) for path, tree in trees.items()}
    for path, tree in trees.items():
        others = set().union(*(names for p, names in defined.items() if p != path))
        foreign = others - defined[path] - VLLM_INTERNALS
        reads = list(_foreign_private_reads(tree, foreign))
        assert not reads, f"{path.relative_to(PACKAGE)}: {reads}"


def test_rules_stay_small() -> None:
    """The rules are what a vLLM maintainer reads in one sitting (issue 42): under 600
    lines, no class over 150, no function over 50."""
    rules = sorted(PACKAGE.glob("rules/*.py"))
    assert sum(len(p.read_text().splitlines()) for p in rules) < 600
    assert_small_definitions(rules)


def test_guard_modules_stay_small() -> None:
    """Every module of the wheel, likewise: no class over 150 lines, no function over 50
    (issue 43)."""
    assert_small_definitions(sorted(PACKAGE.rglob("*.py")))


def assert_small_definitions(paths: list[Path]) -> None:
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                size = node.end_lineno - node.lineno + 1
                limit = 150 if isinstance(node, ast.ClassDef) else 50
                assert size <= limit, f"{path.name}: {node.name} has {size} lines"
