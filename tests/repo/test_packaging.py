"""What operators install: the wheel holds the guard and its self-test, nothing else; the
harness (oracle, fuzzer, explorer, demo) is a second distribution, ``harness/``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vllm_prefix_guard import __version__

ROOT = Path(__file__).resolve().parents[2]

#: Every module the wheel ships. Anything else (the oracle, fuzzer and explorer, the demo,
#: the e2e harness, the model generator, benchmarks, tests) stays in the repository.
GUARD = {
    "__init__",
    "cli",
    "doctor",
    "errors",
    "hooks",
    "kvcached_support",
    "log",
    "metrics",
    "patches",
    "patching",
    "plugin",
    "pool",
    "rules/__init__",
    "rules/block_pool",
    "rules/failed_kv_loads",
    "rules/kv_cache_manager",
    "rules/uncommitted",
    "scheduler_guard",
    "selftest",
    "stats",
    "targets",
    "versions",
}


PIP_WHEEL = (sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q")


def build_from_tracked(source: Path, out: Path, package: str, *paths: str) -> None:
    """Build the wheel of ``package`` (a folder of the repository) into ``out`` from the
    files git tracks under ``paths``, copied into ``source``: setuptools builds in the
    tree's ``build/``, where a module removed since an earlier build would still be."""
    tracked = subprocess.run(
        ["git", "ls-files", *paths], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [*PIP_WHEEL, "-w", str(out), str(source / package)], check=True, capture_output=True
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    build_from_tracked(source, out, ".", "pyproject.toml", "README.md", "LICENSE", "src")
    (built,) = out.glob("vllm_prefix_guard-*.whl")
    return built


def test_the_wheel_holds_the_guard_only(wheel: Path) -> None:
    assert wheel.name.startswith(f"vllm_prefix_guard-{__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    modules = {
        name.removeprefix("vllm_prefix_guard/").removesuffix(".py")
        for name in names
        if name.startswith("vllm_prefix_guard/") and name.endswith(".py")
    }
    assert modules == GUARD
    assert "vllm_prefix_guard/py.typed" in names
    assert not [
        n for n in names if n.split("/")[0] not in ("vllm_prefix_guard",) and ".dist-info/" not in n
    ]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "prefix_guard = vllm_prefix_guard.plugin:register" in text
    assert "vllm-prefix-guard = vllm_prefix_guard.cli:main" in text


#: The guard's modules a process has loaded, printed after each stage (one interpreter:
#: importing vLLM is most of the cost).
_STAGES = """
import contextlib, io, sys
def loaded(stage):
    print(stage, *sorted(m for m in sys.modules if m.startswith("vllm_prefix_guard")))
import vllm.plugins
vllm.plugins.load_general_plugins()
from vllm_prefix_guard import plugin
assert plugin.is_applied()
loaded("plugin")
from vllm_prefix_guard.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    main(["doctor"])
loaded("doctor")
"""


def test_the_plugin_and_doctor_import_no_harness() -> None:
    """Loading the plugin (as vLLM does) and then ``doctor`` import nothing from the
    harness, nor the self-test (imported only by ``--self-test``)."""
    result = subprocess.run(
        [sys.executable, "-c", _STAGES],
        env={**os.environ, "VLLM_PREFIX_GUARD": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    stages = {
        line.split()[0]: set(line.split()[1:])
        for line in result.stdout.splitlines()
        if line.startswith(("plugin ", "doctor "))
    }
    assert "vllm_prefix_guard.plugin" in stages["plugin"]
    assert "vllm_prefix_guard.doctor" in stages["doctor"]
    for modules in stages.values():
        assert not {m for m in modules if m.startswith("vllm_prefix_guard_harness")}
        assert "vllm_prefix_guard.selftest" not in modules


def wheel_size(wheel: Path) -> tuple[int, int, int]:
    """(Modules, lines, lines of code) of the wheel's Python: code being what is not blank,
    a comment or a docstring."""
    import ast

    modules = lines = code = 0
    archive = zipfile.ZipFile(wheel)
    for name in archive.namelist():
        if not name.endswith(".py"):
            continue
        text = archive.read(name).decode()
        docstrings = set()
        for node in ast.walk(ast.parse(text)):
            body = getattr(node, "body", None)
            if (
                isinstance(body, list)
                and body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
        rows = text.splitlines()
        modules += 1
        lines += len(rows)
        code += sum(
            1
            for number, row in enumerate(rows, 1)
            if row.strip() and not row.lstrip().startswith("#") and number not in docstrings
        )
    return modules, lines, code


def test_the_readme_gives_the_wheels_size(wheel: Path) -> None:
    modules, lines, code = wheel_size(wheel)
    readme = (ROOT / "README.md").read_text()
    assert f"{modules} modules, {lines:,} lines ({code:,} of code" in readme, (modules, lines, code)


def test_the_harness_is_a_distribution_of_its_own(tmp_path: Path) -> None:
    build_from_tracked(tmp_path / "source", tmp_path, "harness", "harness")
    (built,) = tmp_path.glob("vllm_prefix_guard_harness-*.whl")
    packages = {name.split("/")[0] for name in zipfile.ZipFile(built).namelist()}
    assert {"vllm_prefix_guard_harness", "guard_demo"} <= packages
    assert "vllm_prefix_guard" not in packages
