"""The plugin, the upstream series and the pull requests run one copy of the rules.

``upstream/tools/series.py`` writes ``src/vllm_prefix_guard/rules`` into vLLM: whole modules
become new vLLM files, classes lend their methods to vLLM's classes, the entry types go
before ``BlockHashToBlockMap``. Here the committed series is read back, without vLLM:
each new file, once every part is applied, is the rules module line for line, and each
method and name stands in its part's patch as the rules have it. Only the license
header and the import lines may differ. The pull requests against vLLM 0.34.0
(``upstream/tools/prs.py``) are read back the same way. (``nox -s upstream`` and ``nox -s
upstream-prs`` also regenerate the patches from vLLM and fail if a committed one is
stale.)
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "upstream" / "tools"))

import prs  # noqa: E402
import series  # noqa: E402

#: Every patch made of the rules: the series' parts and the pull requests.
PATCHES = (*series.PARTS, *prs.PULL_REQUESTS)


def without_imports(text: str) -> list[str]:
    """``text``'s docstring and code, less the license header and the import section
    (its imports, the ``if TYPE_CHECKING:`` imports and the blank lines between)."""
    lines = text.splitlines()
    tree = ast.parse(text)
    docstring = tree.body[0]
    code = next(
        node
        for node in tree.body[1:]
        if not isinstance(node, (ast.Import, ast.ImportFrom))
        and not (
            isinstance(node, ast.If)
            and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in node.body)
        )
    )
    start = code.lineno - 1
    while start > 0 and lines[start - 1].startswith("#"):
        start -= 1
    return lines[docstring.lineno - 1 : docstring.end_lineno] + lines[start:]


def added_blocks(patch: str, path: str) -> str:
    """The lines ``patch`` adds to ``path``, hunk by hunk, as text."""
    section = patch.split(f"diff --git a/{path} b/{path}\n", 1)[1].split("\ndiff --git ")[0]
    return "\n".join(
        line[1:]
        for line in section.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    )


def files_after_series(tmp_path: Path) -> Path:
    """Every file the series creates, with all parts applied (``patch -p1``)."""
    for part in series.PARTS:
        patch = part.patch_file.read_text()
        sections = patch.split("diff --git ")[1:]
        created_or_grown = [
            s for s in sections if any(s.startswith(f"a/{p} ") for p in created_paths())
        ]
        subset = tmp_path / f"{part.name}.patch"
        subset.write_text("".join("diff --git " + s for s in created_or_grown))
        subprocess.run(
            ["patch", "-p1", "--batch", "--quiet", "-i", str(subset)], cwd=tmp_path, check=True
        )
    return tmp_path


def created_paths() -> set[str]:
    return {
        item.path
        for part in series.PARTS
        for item in part.generated
        if isinstance(item, series.NewModule)
    }


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the patch command")
def test_every_new_vllm_file_is_its_rules_module(tmp_path: Path) -> None:
    tree = files_after_series(tmp_path)
    modules = {
        item.path: item.rules_module
        for part in series.PARTS
        for item in part.generated
        if isinstance(item, series.NewModule)
    }
    assert modules, "the series creates no module"
    for path, module in modules.items():
        in_vllm = (tree / path).read_text()
        assert without_imports(in_vllm) == without_imports(series.rules_source(module)), path


def test_every_method_and_name_stands_in_its_part_as_the_rules_have_it() -> None:
    checked = 0
    for part in PATCHES:
        patch = part.patch_file.read_text()
        for item in part.generated:
            if isinstance(item, series.Methods):
                expected = series.class_methods_text(
                    item.rules_module, item.rules_class, item.names
                )
            elif isinstance(item, series.Names):
                expected = series.names_text(item.rules_module, item.names)
            else:
                continue
            assert expected.rstrip("\n") in added_blocks(patch, item.path), (part, item)
            checked += 1
    assert checked >= 4


def test_part_one_creates_the_whole_uncommitted_module() -> None:
    """Part 2 builds on part 1 without changing its module: the rollback of failed
    loads imports the record, never the other way round."""
    [part_one, *_] = series.PARTS
    [uncommitted] = [i for i in part_one.generated if isinstance(i, series.NewModule)]
    created = added_blocks(part_one.patch_file.read_text(), uncommitted.path)
    assert created == series.vllm_module_text("uncommitted").rstrip("\n")


def test_the_patches_never_name_this_project() -> None:
    for part in PATCHES:
        text = part.patch_file.read_text().lower()
        body = text.split("\n---\n", 1)[1]
        assert "prefix-guard" not in body and "prefix_guard" not in body, part.patch_file
