"""The native-fix shape the guard looks for is the upstream series' API, read from it.

``targets.NATIVE_FIX`` names what the guard must find to step aside; the upstream series
(``upstream/out/series/*.patch``, in order) is the reference. Here the series is applied to
the installed vLLM's sources (vLLM 0.33.0, the release it is made for) and every name is
read back from the patched code with ``ast``: the class, the method and its parameters,
or the attribute its constructor sets. ``nox -s upstream`` then checks the live
detection on the patched vLLM (its check d).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import vllm

from vllm_prefix_guard import targets

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "upstream" / "tools"))

import tree  # noqa: E402

pytestmark = pytest.mark.skipif(
    not vllm.__version__.startswith("0.33.0"), reason="the series is made for vLLM 0.33.0"
)


def patched_sources(tmp_path: Path) -> dict[str, ast.Module]:
    """Module name -> the parsed patched source of every ``vllm/`` file the series
    touches, its parts applied in order."""
    assert tree.SERIES, "upstream/out/series holds no patch"
    package = tree.installed_vllm()
    touched: list[str] = []
    for patch in tree.SERIES:
        files = tree.patch_stats(patch)["files"]
        assert isinstance(files, dict)
        for name in files:
            if name.startswith("vllm/") and name not in touched:
                touched.append(name)
    for name in touched:
        destination = tmp_path / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        source = package.parent / name
        if source.exists():
            shutil.copy2(source, destination)
    for index, patch in enumerate(tree.SERIES):
        vllm_only = tmp_path / f"vllm-only-{index}.patch"
        sections = patch.read_text().split("diff --git ")
        vllm_only.write_text(
            "".join("diff --git " + s for s in sections[1:] if s.startswith("a/vllm/"))
        )
        subprocess.run(
            ["patch", "-p1", "--batch", "--quiet", "-i", str(vllm_only)], cwd=tmp_path, check=True
        )
    return {
        name[: -len(".py")].replace("/", "."): ast.parse((tmp_path / name).read_text())
        for name in touched
        if (tmp_path / name).exists()
    }


def classes(modules: dict[str, ast.Module]) -> dict[tuple[str, str], ast.ClassDef]:
    return {
        (module, node.name): node
        for module, tree_ in modules.items()
        for node in ast.walk(tree_)
        if isinstance(node, ast.ClassDef)
    }


def arity(function: ast.FunctionDef) -> int:
    """Required positional parameters besides ``self``."""
    positional = function.args.posonlyargs + function.args.args
    return len(positional) - 1 - len(function.args.defaults)


def constructor_sets(cls: ast.ClassDef, name: str) -> bool:
    init = next(
        (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None
    )
    return init is not None and any(
        isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.ctx, ast.Store)
        for node in ast.walk(init)
    )


def test_native_fix_shape_is_the_patch_api(tmp_path: Path) -> None:
    found = classes(patched_sources(tmp_path))
    for owner, name, expected in targets.NATIVE_FIX:
        module = targets.NATIVE_FIX_MODULES[owner]
        cls = found.get((module, owner))
        assert cls is not None, f"the series defines no {owner} in {module}"
        if expected is None:
            assert constructor_sets(cls, name), f"{owner}.__init__ does not set {name}"
            continue
        methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
        assert name in methods, f"the series' {owner} has no {name}"
        assert arity(methods[name]) == expected, f"{owner}.{name} takes other parameters"


def test_series_adds_none_of_pr43569s_names(tmp_path: Path) -> None:
    """PR #43569's names mean another fix to the guard (it refuses to start beside it)."""
    found = classes(patched_sources(tmp_path))
    for owner, name in targets.OTHER_SHAPES:
        cls = found.get((targets.NATIVE_FIX_MODULES[owner], owner))
        if cls is not None:
            assert name not in {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
