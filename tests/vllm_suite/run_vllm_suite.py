#!/usr/bin/env python3
"""Run vLLM's own unit tests stock and guarded; fail on any test the guard breaks.

The regression net of issue 9 (2b). Given vLLM's ``tests/`` unpacked from the sdist of
the installed version (scripts/fetch_vllm_tests.py), it runs the files of one selection
of ``selection.toml`` (``full``, or ``ci``: the fast representative) twice, one pytest
process at a time:

- *stock*: ``VLLM_PREFIX_GUARD=0``;
- *guard*: ``VLLM_PREFIX_GUARD=1``, the guard applied by vLLM's ``load_general_plugins()``
  as in a user's process (prefix_guard_pytest.py, loaded with ``-p``, in both runs);

offline, against a Hub cache that holds only the ``config.json`` of the models the
tests name (hub_cache.py). It then compares per-test outcomes and exits non-zero unless
every test that passes on stock passes guarded, and every test that fails or errors
guarded also failed or errored on stock, or is listed for this version in
``expected_differences.toml`` (a deliberate difference, with its reason and the project
test that shows the hazard).

After each test, vLLM's own teardown (``cleanup_dist_env_and_memory()``: model-parallel
groups, distributed environment, env cache) runs without its ``gc.collect()``, which is
most of these unit tests' run time; ``--global-cleanup`` keeps the collection too.

Usage (in a venv with the vLLM under test, this project, pytest, pytest-timeout and
vLLM's test deps; run from anywhere):
    python tests/vllm_suite/run_vllm_suite.py --vllm-tests DEST [--selection ci]
        [--files F ...] [--out DIR] [--mode both]

Exit status: 0 no unexpected difference; 1 unexpected differences; 2 a run broke
(pytest crashed, collected nothing, or the guard's state did not match the mode).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli before Python 3.11
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from hub_cache import write_hub_cache  # noqa: E402

sys.path.insert(0, str(HERE.parent.parent / "compat"))
from environment import TEST_ENV  # noqa: E402

FAILED = ("failed", "error")
ENV = {
    **TEST_ENV,
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    # vLLM's own CPU CI runs these tests on its accelerator wheel this way: the CPU
    # platform, explicitly (the 0.33 CUDA wheel cannot infer a device on a GPU-less host).
    "VLLM_TARGET_DEVICE": "cpu",
}


def installed_vllm_version() -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().split("+")[0]


def load_selection(name: str, version: str, checked_only: bool = True) -> dict:
    """Selection ``name`` of selection.toml; refuses a vLLM it was not run on."""
    data = tomllib.loads((HERE / "selection.toml").read_text())
    if name not in data:
        raise SystemExit(f"selection.toml has no selection {name!r}: {sorted(data)}")
    selection = data[name]
    if checked_only and version not in selection["versions"]:
        raise SystemExit(
            f"selection {name!r} was not run on vLLM {version} (only {selection['versions']}):"
            " run it with --version, look at the outcome, then add the version"
        )
    return selection


def load_expected(version: str) -> list[dict]:
    data = tomllib.loads((HERE / "expected_differences.toml").read_text())
    return [d for d in data.get("difference", []) if version in d["versions"]]


def is_expected(nodeid: str, expected: list[dict]) -> dict | None:
    """The entry whose ``test`` matches ``nodeid``: exact, all parametrizations of a
    test (``path::name`` matches ``path::name[...]``), or an fnmatch pattern."""
    for entry in expected:
        pattern = entry["test"]
        if nodeid == pattern or nodeid.split("[", 1)[0] == pattern:
            return entry
        if any(c in pattern for c in "*?") and fnmatch.fnmatchcase(nodeid, pattern):
            return entry
    return None


def run_pytest(
    mode: str,
    vllm_tests: Path,
    selection: dict,
    out: Path,
    env: dict,
    timeout: int,
    extra: tuple[str, ...] = (),
) -> tuple[dict, float, int]:
    """Run the selected files in one pytest process; return (report, wall seconds, rc)."""
    report_path = out / f"{mode}.json"
    report_path.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "prefix_guard_pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfE",
        f"--timeout={selection.get('per_test_timeout', 300)}",
        f"--junitxml={out / f'{mode}.xml'}",
        f"--prefix-guard-report={report_path}",
        *[f"--deselect={d['test']}" for d in selection.get("deselect", [])],
        *extra,
        *selection["files"],
    ]
    run_env = {**env, "VLLM_PREFIX_GUARD": "1" if mode == "guard" else "0"}
    print(f"== {mode}: {' '.join(cmd[3:])}", flush=True)
    start = time.monotonic()
    with open(out / f"{mode}.log", "w") as log:
        try:
            proc = subprocess.run(
                cmd,
                cwd=vllm_tests,
                env=run_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = -1
    wall = time.monotonic() - start
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    return report, wall, rc


def summarize(outcomes: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


def regressed(before: str, after: str) -> bool:
    """A guarded outcome worse than stock's: it fails or errors where stock did not, or a
    test that passed on stock did not pass (skipped, xfailed, or did not run at all)."""
    return (after in FAILED and before not in FAILED) or (before == "passed" and after != "passed")


def compare(stock: dict[str, str], guard: dict[str, str], expected: list[dict]) -> dict:
    """Guarded outcomes against stock's, test by test (``missing``: not run in that mode)."""
    unexpected, justified, fixed = [], [], []
    for nodeid in sorted(set(stock) | set(guard)):
        before, after = stock.get(nodeid, "missing"), guard.get(nodeid, "missing")
        if regressed(before, after):
            entry = is_expected(nodeid, expected)
            (justified if entry else unexpected).append((nodeid, before, after, entry))
        elif before in FAILED and after == "passed":
            fixed.append(nodeid)
    hit = {id(e) for *_, e in justified}
    stale = [e for e in expected if id(e) not in hit]
    only_stock = sorted(set(stock) - set(guard))
    return {
        "unexpected": unexpected,
        "justified": justified,
        "fixed": fixed,
        "stale": stale,
        "only_stock": only_stock,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-tests", type=Path, required=True, help="fetch_vllm_tests DEST")
    parser.add_argument("--out", type=Path, help="logs, junit XML and reports (default: temp)")
    parser.add_argument("--mode", choices=("both", "stock", "guard"), default="both")
    parser.add_argument("--selection", default="full", help="a table of selection.toml")
    parser.add_argument(
        "--files", nargs="+", help="run these files or node ids instead (sdist-relative)"
    )
    parser.add_argument(
        "--global-cleanup",
        action="store_true",
        help="keep the gc.collect() of vLLM's teardown after every test (slow)",
    )
    parser.add_argument(
        "--version", help="vLLM version of the tests (default: the installed vLLM's)"
    )
    parser.add_argument("--timeout", type=int, default=1800, help="per pytest run, seconds")
    parser.add_argument(
        "--compare-only",
        action="store_true",
        help="run nothing: compare the reports an earlier run left in --out",
    )
    args = parser.parse_args(argv)

    version = args.version or installed_vllm_version()
    selection = dict(load_selection(args.selection, version, checked_only=not args.version))
    if args.files:
        selection["files"] = args.files
    expected = load_expected(version)
    if args.compare_only and not args.out:
        parser.error("--compare-only needs --out")
    out = (args.out or Path(tempfile.mkdtemp(prefix="vllm-suite-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    vllm_tests = args.vllm_tests.resolve()
    if not (vllm_tests / "tests" / "__init__.py").exists():
        raise SystemExit(f"{vllm_tests} holds no vLLM tests/ (run scripts/fetch_vllm_tests.py)")
    absent = [f for f in selection["files"] if not (vllm_tests / f.split("::")[0]).is_file()]
    for name in absent:
        print(f"   note: not in vLLM {version}'s tests, skipped: {name}")
    selection["files"] = [f for f in selection["files"] if f not in absent]
    extra = () if args.global_cleanup else ("--cleanup-without-gc",)

    hf_home = Path(tempfile.mkdtemp(prefix="vllm-suite-hf-"))
    hub = write_hub_cache(hf_home)
    env = {
        **os.environ,
        **ENV,
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hub),
        "VLLM_CACHE_ROOT": os.environ.get(
            "VLLM_CACHE_ROOT", str(Path(tempfile.gettempdir()) / f"vllm-suite-cache-{version}")
        ),
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    env.pop("VLLM_PLUGINS", None)  # every installed general plugin loads, as for a user

    modes = ("stock", "guard") if args.mode == "both" else (args.mode,)
    results, broken = {}, False
    walls: dict[str, float] = {}
    exercised: dict[str, int] = {}
    for mode in modes:
        if args.compare_only:
            report = json.loads((out / f"{mode}.json").read_text())
            wall, rc = 0.0, 0
        else:
            report, wall, rc = run_pytest(
                mode, vllm_tests, selection, out, env, args.timeout, extra
            )
        outcomes = report.get("outcomes", {})
        print(f"   {mode}: {wall:.0f} s, rc={rc}, {summarize(outcomes) or 'no results'}")
        if not outcomes or rc not in (0, 1) or report.get("guard_state_ok") is False:
            print(f"   {mode} run BROKE (rc={rc}); see {out / f'{mode}.log'}")
            broken = True
        results[mode] = outcomes
        walls[mode] = round(wall, 1)
        exercised[mode] = len(report.get("exercised", []))
    print(f"   logs, junit XML and reports in {out}")
    if broken:
        return 2
    if args.mode != "both":
        return 0

    diff = compare(results["stock"], results["guard"], expected)
    print(f"\n== vLLM {version}: {len(results['guard'])} tests, guard vs stock")
    for nodeid, before, after, entry in diff["justified"]:
        print(f"   EXPECTED  {nodeid}: {before} -> {after} ({entry['reason'].splitlines()[0]})")
    for nodeid, before, after, _ in diff["unexpected"]:
        print(f"   REGRESSED {nodeid}: {before} -> {after}")
    for nodeid in diff["fixed"]:
        print(f"   fixed     {nodeid}: failed on stock, passes guarded")
    for entry in diff["stale"]:
        print(f"   note: expected difference did not occur: {entry['test']}")
    for nodeid in diff["only_stock"]:
        print(f"   note: ran on stock only: {nodeid} ({results['stock'][nodeid]})")
    print(
        f"   {len(diff['unexpected'])} unexpected, {len(diff['justified'])} expected "
        f"differences, {len(diff['fixed'])} fixed; the guard was exercised (a guard "
        f"attached to a scheduler and its pool) in {exercised['guard']} tests"
    )
    summary = {
        "vllm": version,
        "selection": args.selection,
        "files": selection["files"],
        "wall_s": walls,
        "counts": {mode: summarize(results[mode]) for mode in modes},
        "exercised_by_guard": exercised["guard"],
        "unexpected": [d[0] for d in diff["unexpected"]],
        "expected": [d[0] for d in diff["justified"]],
        "fixed": diff["fixed"],
    }
    if not args.compare_only:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 1 if diff["unexpected"] else 0


if __name__ == "__main__":
    sys.exit(main())
