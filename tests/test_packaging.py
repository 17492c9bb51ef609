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
    "diagnostics/records",
    "diagnostics/selftest",
    "diagnostics/shadow_kv",
    *(
        f"diagnostics/fuzz/{name}"
        for name in (
            "__init__",
            "audit",
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


def _modules_after(code: str, **env: str) -> set[str]:
    probe = code + "\nimport sys\nprint('\\n'.join(sorted(sys.modules)))\n"
    result = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return {m for m in result.stdout.split() if m.startswith("vllm_prefix_guard")}


def test_loading_the_plugin_imports_no_diagnostics() -> None:
    loaded = _modules_after(
        "import vllm.plugins\nvllm.plugins.load_general_plugins()\n"
        "from vllm_prefix_guard import plugin\nassert plugin.is_applied()",
        VLLM_PREFIX_GUARD="1",
    )
    assert "vllm_prefix_guard.plugin" in loaded
    assert not {m for m in loaded if m.startswith("vllm_prefix_guard.diagnostics")}


def test_doctor_without_self_test_imports_no_diagnostics() -> None:
    loaded = _modules_after(
        "import contextlib, io\nfrom vllm_prefix_guard.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n    main(['doctor'])"
    )
    assert "vllm_prefix_guard.doctor" in loaded
    assert not {m for m in loaded if m.startswith("vllm_prefix_guard.diagnostics")}
