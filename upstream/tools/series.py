#!/usr/bin/env python3
"""Write the upstream series, ``upstream/out/series/000N-*.patch``, against vLLM 0.33.0.

Each part is made of three things, and only the first is written by hand for vLLM:

- the call sites (``call_sites.py``): where vLLM's scheduler and pool call the rules;
- the rules, copied from the plugin's own ``src/vllm_prefix_guard/rules``: whole modules
  become new files of vLLM, classes named below lend their methods to vLLM's classes,
  and module-level names (the entry types) go before a vLLM class. Only the import
  lines change (``vllm_prefix_guard.rules.X`` becomes vLLM's module of X);
- vLLM-style tests (``upstream/inputs/parts/<part>/``, laid out as in vLLM's tree).

A part's patch is the diff between the tree the earlier parts left and the tree with the
part applied, so the series applies in order with ``patch -p1`` and no offset or fuzz.
``--check`` regenerates into memory and fails if a committed patch differs (CI runs it
in ``nox -s upstream``); ``tests/repo/test_rules_are_upstream.py`` checks, without vLLM,
that the patches hold the rules exactly as ``src/`` has them.

Usage (the Python of a venv with vLLM 0.33.0; ``DIR`` from scripts/fetch_vllm_tests.py):
    python upstream/tools/series.py --vllm-tests DIR [--check]
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent  # upstream/tools
UPSTREAM = HERE.parent
INPUTS = UPSTREAM / "inputs"  # written by hand: call sites, PR templates, vLLM-style tests
OUT = UPSTREAM / "out"  # written by the tools: patches, PR texts, results
ROOT = UPSTREAM.parent
RULES = ROOT / "src" / "vllm_prefix_guard" / "rules"
PARTS_DIR = INPUTS / "parts"
SERIES_DIR = OUT / "series"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(INPUTS))

from call_sites import COMMIT_FENCE, FAILED_KV_LOADS, FINISH_ALL, KV_EVENTS, Edit  # noqa: E402

#: Where each rules module lives in vLLM (its import lines are rewritten to these).
VLLM_MODULES = {
    "vllm_prefix_guard.rules.block_pool": "vllm.v1.core.block_pool",
    "vllm_prefix_guard.rules.kv_cache_manager": "vllm.v1.core.kv_cache_manager",
    "vllm_prefix_guard.rules.uncommitted": "vllm.v1.core.sched.uncommitted",
    "vllm_prefix_guard.rules.failed_kv_loads": "vllm.v1.core.sched.failed_kv_loads",
}


def vllm_path(module: str) -> str:
    return module.replace(".", "/") + ".py"


@dataclass(frozen=True)
class NewModule:
    """A rules module that becomes a new vLLM file."""

    rules_module: str

    @property
    def path(self) -> str:
        return vllm_path(VLLM_MODULES[f"vllm_prefix_guard.rules.{self.rules_module}"])


@dataclass(frozen=True)
class Methods:
    """Methods of a rules class, added to a vLLM class after one of its methods."""

    rules_module: str
    rules_class: str
    names: tuple[str, ...]
    vllm_class: str
    after: str

    @property
    def path(self) -> str:
        return vllm_path(VLLM_MODULES[f"vllm_prefix_guard.rules.{self.rules_module}"])


@dataclass(frozen=True)
class Names:
    """Module-level assignments of a rules module (with the comments above each),
    added to the vLLM module before one of its top-level statements."""

    rules_module: str
    names: tuple[str, ...]
    before: str

    @property
    def path(self) -> str:
        return vllm_path(VLLM_MODULES[f"vllm_prefix_guard.rules.{self.rules_module}"])


@dataclass(frozen=True)
class Part:
    number: int
    slug: str
    subject: str
    edits: tuple[Edit, ...]
    generated: tuple[NewModule | Methods | Names, ...]
    tests: tuple[str, ...] = field(default=())

    @property
    def name(self) -> str:
        return f"{self.number:04d}-{self.slug}"

    @property
    def patch_file(self) -> Path:
        return SERIES_DIR / f"{self.name}.patch"

    @property
    def tests_dir(self) -> Path:
        return PARTS_DIR / self.name


PARTS: tuple[Part, ...] = (
    Part(
        1,
        "commit-prefix-cache-entries-once-written",
        "[Core][Bugfix] Commit prefix-cache entries only once their KV is written",
        (*COMMIT_FENCE, *FINISH_ALL),
        (
            Names("block_pool", ("UncommittedEntry", "StepCacheEntries"), "BlockHashToBlockMap"),
            Methods(
                "block_pool",
                "BlockPoolAdditions",
                ("remove_uncommitted_entry",),
                "BlockPool",
                "_insert_block_hash",
            ),
            NewModule("uncommitted"),
        ),
        tests=("tests/v1/core/test_uncommitted_prefix_cache.py",),
    ),
    Part(
        2,
        "roll-back-failed-kv-loads",
        "[Core][KVConnector][Bugfix] Roll back the prefix-cache entries of failed KV loads",
        FAILED_KV_LOADS,
        (
            NewModule("failed_kv_loads"),
            Methods(
                "block_pool",
                "BlockPoolAdditions",
                ("cache_around_kept_blocks",),
                "BlockPool",
                "cache_full_blocks",
            ),
            Methods(
                "kv_cache_manager",
                "CachedBlockRewind",
                ("rewind_num_cached_blocks",),
                "KVCacheManager",
                "cache_blocks",
            ),
        ),
        tests=("tests/v1/kv_connector/unit/test_failed_kv_load_rollback.py",),
    ),
    Part(
        3,
        "emit-block-removed-for-the-last-copy",
        "[Core][KV Events] Emit BlockRemoved only once no block caches the hash",
        KV_EVENTS,
        (
            Methods(
                "block_pool",
                "BlockPoolAdditions",
                ("uncached_block_hashes", "first_copy_events"),
                "BlockPool",
                "_emit_block_removed_events",
            ),
        ),
        tests=("tests/v1/core/test_kv_events_duplicate_blocks.py",),
    ),
)


# -- the rules, as vLLM's code ----------------------------------------------------------


def rules_source(module: str) -> str:
    return (RULES / f"{module}.py").read_text()


def _segment(lines: list[str], node: ast.AST) -> tuple[int, int]:
    """0-based [start, end) of a statement, its decorators and the comments right
    above it."""
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))]) - 1
    while start > 0 and lines[start - 1].lstrip().startswith("#"):
        start -= 1
    end = node.end_lineno
    assert end is not None
    return start, end


def _rewrite_imports(lines: list[str], tree: ast.Module) -> list[str]:
    """The module's import lines in vLLM: rules modules named by their vLLM module, and
    the first-party group (vLLM's) sorted as one."""
    out = list(lines)
    imports = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in VLLM_MODULES
    ]
    for node in imports:
        start, end = node.lineno - 1, node.end_lineno
        assert end is not None
        text = "".join(out[start:end]).replace(
            f"from {node.module} import", f"from {VLLM_MODULES[node.module]} import"
        )
        out[start:end] = [text] + [""] * (end - start - 1)
    # One element per line again (a rewritten import spans several).
    out = "".join(out).splitlines(keepends=True)
    # One first-party block: the top-level `from vllm...` lines, sorted by module.
    top = [
        node
        for node in ast.parse("".join(out)).body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm")
    ]
    if top:
        first, last = top[0].lineno - 1, top[-1].end_lineno
        assert last is not None
        statements = sorted(
            ("".join(out[n.lineno - 1 : n.end_lineno]) for n in top),
            key=lambda text: text.split()[1],
        )
        out[first:last] = statements
    return out


def vllm_module_text(module: str) -> str:
    """A rules module as the vLLM file it becomes."""
    source = rules_source(module)
    lines = source.splitlines(keepends=True)
    return "".join(_rewrite_imports(lines, ast.parse(source)))


def class_methods_text(module: str, cls_name: str, names: Iterable[str]) -> str:
    """Methods of a rules class, in ``names`` order, as they go into a vLLM class body."""
    source = rules_source(module)
    lines = source.splitlines(keepends=True)
    [cls] = [
        n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls_name
    ]
    by_name = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    methods = [by_name[name] for name in names]
    return "\n".join("".join(lines[slice(*_segment(lines, m))]) for m in methods)


def names_text(module: str, names: Iterable[str]) -> str:
    """Module-level assignments of a rules module, each with its comments."""
    source = rules_source(module)
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    chunks = []
    for name in names:
        [node] = [
            n
            for n in tree.body
            if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == name for t in n.targets)
        ]
        chunks.append("".join(lines[slice(*_segment(lines, node))]))
    return "\n".join(chunks)


# -- applying a part to vLLM's files ----------------------------------------------------


def _insert_methods(text: str, vllm_class: str, after: str, methods: str) -> str:
    tree = ast.parse(text)
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == vllm_class]
    [anchor] = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == after]
    lines = text.splitlines(keepends=True)
    end = anchor.end_lineno
    assert end is not None
    return "".join(lines[:end]) + "\n" + methods + "".join(lines[end:])


def _insert_names(text: str, before: str, names: str) -> str:
    tree = ast.parse(text)
    [node] = [n for n in tree.body if getattr(n, "name", None) == before]
    lines = text.splitlines(keepends=True)
    start = node.lineno - 1
    return "".join(lines[:start]) + names + "\n\n" + "".join(lines[start:])


def _edit(text: str, edit: Edit) -> str:
    count = text.count(edit.old)
    if count != 1:
        raise SystemExit(f"{edit.path}: the piece to replace occurs {count} times:\n{edit.old}")
    return text.replace(edit.old, edit.new)


def apply_part(part: Part, files: dict[str, str]) -> dict[str, str]:
    """The files after ``part`` (``files``: every file the series touches, as the
    earlier parts left it; absent or ``""`` for a file not created yet)."""
    out = dict(files)
    for edit in part.edits:
        out[edit.path] = _edit(out[edit.path], edit)
    for item in part.generated:
        if isinstance(item, NewModule):
            out[item.path] = vllm_module_text(item.rules_module)
        elif isinstance(item, Methods):
            methods = class_methods_text(item.rules_module, item.rules_class, item.names)
            out[item.path] = _insert_methods(out[item.path], item.vllm_class, item.after, methods)
        else:
            names = names_text(item.rules_module, item.names)
            out[item.path] = _insert_names(out[item.path], item.before, names)
    for test in part.tests:
        out[test] = (part.tests_dir / test).read_text()
    return out


def touched_paths(parts: Iterable[Part] = PARTS) -> list[str]:
    paths: set[str] = set()
    for part in parts:
        paths.update(edit.path for edit in part.edits)
        paths.update(item.path for item in part.generated)
        paths.update(part.tests)
    return sorted(paths)


def pristine_files(vllm_tests: Path, parts: Iterable[Part] = PARTS) -> dict[str, str]:
    """The installed vLLM's own text of every file ``parts`` touch (its package for
    ``vllm/``, the sdist's ``tests/``); ``""`` for files they create."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("vllm is not installed in this Python")
    package = Path(spec.origin).parent.parent
    files = {}
    for path in touched_paths(parts):
        source = (package if path.startswith("vllm/") else vllm_tests) / path
        files[path] = source.read_text() if source.exists() else ""
    return files


def unified_diff(before: dict[str, str], after: dict[str, str]) -> str:
    chunks = []
    for path in sorted(after):
        old, new = before.get(path, ""), after[path]
        if old == new:
            continue
        diff = difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            "/dev/null" if not old else f"a/{path}",
            f"b/{path}",
            n=3,
        )
        header = f"diff --git a/{path} b/{path}\n"
        if not old:
            header += "new file mode 100644\n"
        chunks.append(header + "".join(diff))
    return "".join(chunks)


def series(vllm_tests: Path) -> dict[Path, str]:
    """Every part's patch, from vLLM's pristine files."""
    files = pristine_files(vllm_tests)
    out = {}
    for part in PARTS:
        after = apply_part(part, files)
        out[part.patch_file] = (
            f"Subject: [PATCH {part.number}/{len(PARTS)}] {part.subject}\n\n"
            "Generated by upstream/tools/series.py; its description: "
            f"upstream/out/series/{part.name}.md\n"
            "---\n" + unified_diff(files, after)
        )
        files = after
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-tests", type=Path, required=True, help="fetch_vllm_tests DEST")
    parser.add_argument("--check", action="store_true", help="fail if a patch is stale")
    args = parser.parse_args(argv)
    SERIES_DIR.mkdir(exist_ok=True)
    return write_patches(series(args.vllm_tests), args.check, "upstream/tools/series.py")


def write_patches(patches: dict[Path, str], check: bool, tool: str) -> int:
    """Write ``patches``; with ``check``, write nothing and fail if one is stale."""
    stale = [p for p, text in patches.items() if not p.exists() or p.read_text() != text]
    if check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run {tool}", file=sys.stderr)
        return 1 if stale else 0
    for path, text in patches.items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
