"""What operators install: the wheel holds the guard and its diagnostics, nothing else, and
loading the plugin imports none of the diagnostics."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vllm_prefix_guard import __version__

ROOT = Path(__file__).resolve().parents[1]

#: Every module the wheel ships, by job. Anything else (the demo, the e2e harness, the
#: model generator, benchmarks, tests) stays in the repository.
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
    "stats",
    "targets",
    "versions",
}
DIAGNOSTICS = {
    "diagnostics/__init__",
    "diagnostics/connector",
    "diagnostics/factory",
    "diagnostics/kv_events",
    "diagnostics/pool_index",
    "diagnostics/records",
    "diagnostics/selftest",
    "diagnostics/shadow_kv",
    *(
        f"diagnostics/fuzz/{name}"
        for name in (
            "__init__",
            "audit",
            "capabilities",
            "cli",
            "configs",
            "differential",
            "generators",
            "hash_seed",
            "oracle",
            "pr43569",
            "report",
            "runner",
            "shrink",
            "soak",
            "workload",
        )
    ),
    *(
        f"diagnostics/explore/{name}"
        for name in (
            "__init__",
            "cli",
            "digest",
            "mutations",
            "report",
            "scope",
            "search",
            "system",
            "visited",
        )
    ),
}


PIP_WHEEL = (sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [*PIP_WHEEL, "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("vllm_prefix_guard-*.whl")
    return built


def test_the_wheel_holds_the_guard_and_its_diagnostics_only(wheel: Path) -> None:
    assert wheel.name.startswith(f"vllm_prefix_guard-{__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    modules = {
        name.removeprefix("vllm_prefix_guard/").removesuffix(".py")
        for name in names
        if name.startswith("vllm_prefix_guard/") and name.endswith(".py")
    }
    assert modules == GUARD | DIAGNOSTICS
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


def test_the_plugin_and_doctor_import_no_diagnostics() -> None:
    """Loading the plugin (as vLLM does) and then ``doctor`` without ``--self-test`` import
    nothing from ``vllm_prefix_guard.diagnostics``."""
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
        assert not {m for m in modules if m.startswith("vllm_prefix_guard.diagnostics")}
