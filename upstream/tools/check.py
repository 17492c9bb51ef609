#!/usr/bin/env python3
"""Prove the upstream series (``nox -s upstream``): each prefix of it applies to vLLM 0.33.0
and does what its part claims, vLLM's own tests still pass, and the guard steps aside for
the whole series and refuses to run beside part of it.

Builds one vLLM tree per prefix of ``upstream/out/series/`` (``tree.py``: no part, part 1,
parts 1-2, ...), each with every part's vLLM-style tests added where vLLM keeps them, then:

a. each part's tests fail on the tree before it and pass on every tree with it;
b. judged by the shadow-KV oracle, with ``VLLM_PREFIX_GUARD=0``: on the whole series the
   project's regression tests pass, the explorer finds no bad read in any sequence of
   events within each scope's bounds, the fuzzer reads no bad KV in any configuration,
   with hit tokens, preemptions, computed tokens and steps equal to the guard's on
   unpatched vLLM (same seeds), and a consumer replayed from its KV events matches the
   prefix cache after every step; each prefix reads no bad KV in every configuration
   whose parts it has (failed KV loads need part 2), and what it leaves elsewhere is
   measured (as are the event inconsistencies of prefixes without part 3);
c. vLLM's own unit tests (``tests/vllm_suite``, one selection) pass on every prefix
   wherever they pass unpatched; the one test part 2 changes passes in its new form, and
   fails in its old form against the patched vLLM;
d. with ``VLLM_PREFIX_GUARD=1``: on the whole series the guard recognises the fix by its
   shape, logs once that it steps aside, patches nothing, and (b)'s fuzz figures do not
   change; on part 1 alone it refuses to start, naming what part 2 adds;
e. (``nox -s upstream-bench``) instructions per scheduler step, patched and not.

Writes ``--out`` (JSON: every figure and verdict) and exits 1 if any check failed. Run with
the Python of the vLLM 0.33.0 venv, from anywhere.

Usage:
    python upstream/tools/check.py --vllm-tests DIR --work DIR --out upstream/out/results.json
        [--seeds 3] [--selection ci] [--only a,b,c,d] [--suite-on-series-only]
        [--explore-scope NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent  # upstream/tools
UPSTREAM = HERE.parent
INPUTS = UPSTREAM / "inputs"  # written by hand: call sites, PR templates, vLLM-style tests
OUT = UPSTREAM / "out"  # written by the tools: patches, PR texts, results
ROOT = UPSTREAM.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(INPUTS))
sys.path.insert(0, str(ROOT / "tests" / "vllm_suite"))

import tree  # noqa: E402
from hub_cache import write_hub_cache  # noqa: E402
from run_vllm_suite import FAILED, compare  # noqa: E402

from vllm_prefix_guard_harness.explore.scope import DEFAULT_SCOPES  # noqa: E402

#: The project's regression tests of the rollback rules: each shows bad KV on stock and
#: none guarded; on the whole series they run once, as ``native`` (tests/native_fix.py).
REGRESSION_TESTS = (
    "tests/regression/test_preemption.py",
    "tests/regression/test_kv_load_failure.py",
    "tests/regression/test_hybrid_kv_load_failure.py",
    "tests/regression/test_sharing.py",
    "tests/harness/fuzz/test_soak_regressions.py",
)
#: The test of vLLM's that asserts the hazard; part 2 changes it.
CHANGED_VLLM_TEST = (
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py"
    "::test_sync_load_failure_with_shared_blocks"
)
#: The fuzz figures that must match the guard's exactly.
EQUAL_FIGURES = ("hit_tokens", "preemptions", "computed_tokens", "steps")
STEPS_ASIDE = "already ships its own fix"
#: The checks, by name ("c:<selection>" holds vLLM's own tests of another selection).
CHECKS = ("a", "b", "c", "d", "e")
#: The trees, by how many parts of the series they carry.
UNPATCHED, PART_1, SERIES = "unpatched", "part 1", "series"


def tree_names() -> dict[str, int]:
    """Tree name -> number of parts applied."""
    names = {UNPATCHED: 0}
    for count in range(1, len(tree.SERIES) + 1):
        names[SERIES if count == len(tree.SERIES) else f"part {count}"] = count
    return names


def part_tests(part: Path) -> list[str]:
    """The vLLM-style test files a part adds, by their path in vLLM's tree."""
    directory = INPUTS / "parts" / part.stem
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("test_*.py"))


class Env:
    """Environments of the runs: offline, a Hub cache with the configs vLLM's tests
    name, the CPU platform, a fixed hash seed."""

    def __init__(self, hf_home: Path) -> None:
        hub = write_hub_cache(hf_home)
        self.base = {
            **os.environ,
            "HF_HOME": str(hf_home),
            "HF_HUB_CACHE": str(hub),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
            "PYTHONHASHSEED": "0",
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.base.pop("PYTHONPATH", None)
        self.base.pop("VLLM_PLUGINS", None)

    def __call__(
        self, vllm_tree: Path | None, guard: bool = False, vllm_tests: bool = False
    ) -> dict[str, str]:
        env = {**self.base, "VLLM_PREFIX_GUARD": "1" if guard else "0"}
        if vllm_tree is not None:
            env["PYTHONPATH"] = str(vllm_tree)
        if vllm_tests:
            # vLLM's CPU CI runs its unit tests on the accelerator wheel this way: the
            # CPU platform, explicitly (the wheel cannot infer a device without a GPU).
            # The project's own runs keep the wheel's platform, as its CI does.
            env["VLLM_TARGET_DEVICE"] = "cpu"
        return env


def run(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> int:
    """Run ``cmd``, its output to ``log``; return the exit status."""
    with open(log, "w") as out:
        return subprocess.run(
            cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT
        ).returncode


def junit_outcomes(path: Path) -> dict[str, str]:
    """Test id -> passed / failed / error / skipped, with the failure's first line."""
    outcomes: dict[str, str] = {}
    if not path.exists():
        return outcomes
    for case in ElementTree.parse(path).iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                message = (element.get("message") or "").splitlines()
                outcome = kind.replace("failure", "failed") + (
                    f": {message[0][:120]}" if message and kind != "skipped" else ""
                )
        outcomes[name] = outcome
    return outcomes


def pytest(tree_dir: Path | None, cwd: Path, args: list[str], env: dict, work: Path, name: str):
    xml = work / f"{name}.xml"
    xml.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={xml}"]
    rc = run(cmd + args, env, cwd, work / f"{name}.log")
    return rc, junit_outcomes(xml)


def in_parallel(jobs: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run independent jobs (each mostly one subprocess) two at a time: the machine's
    two cores; returns each job's result by name."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def check_a(trees: dict[str, Path], env: Env, work: Path) -> dict[str, Any]:
    """Each part's tests fail on the tree before it and pass on every tree with it."""
    files = [test for patch in tree.SERIES for test in part_tests(patch)]

    def run_on(name: str) -> dict[str, str]:
        label = f"a-on-{name.replace(' ', '-')}"
        environment = env(trees[name], vllm_tests=True)
        return pytest(trees[name], trees[name], files, environment, work, label)[1]

    outcomes = in_parallel({name: partial(run_on, name) for name in trees})
    by_count = {count: name for name, count in tree_names().items()}
    parts: dict[str, Any] = {}
    for number, patch in enumerate(tree.SERIES, start=1):
        own = {f"{Path(test).stem}::" for test in part_tests(patch)}

        def of_part(results: dict[str, str], own: set[str] = own) -> dict[str, str]:
            return {k: o for k, o in results.items() if any(k.startswith(p) for p in own)}

        before = of_part(outcomes[by_count[number - 1]])
        with_part = {
            by_count[count]: of_part(outcomes[by_count[count]])
            for count in range(number, len(tree.SERIES) + 1)
        }
        parts[patch.stem] = {
            "before": before,
            "with": with_part,
            "ok": bool(before)
            and all(o.startswith(("failed", "error")) for o in before.values())
            and all(
                set(results) == set(before) and all(o == "passed" for o in results.values())
                for results in with_part.values()
            ),
        }
    lint = vllm_ruff(trees[SERIES], work)
    return {
        "parts": parts,
        "vllm_ruff": lint,
        "ok": all(part["ok"] for part in parts.values()) and lint["ok"],
    }


def vllm_ruff(tree_dir: Path, work: Path) -> dict[str, Any]:
    """vLLM's own ruff settings (the tree's pyproject.toml) on every file the series
    touches: lint and format, as vLLM's pre-commit runs them."""
    touched = sorted({name for patch in tree.SERIES for name in tree.patch_stats(patch)["files"]})
    results = {}
    for name, args in (("check", ["check"]), ("format", ["format", "--check"])):
        log = work / f"a-ruff-{name}.log"
        command = [sys.executable, "-m", "ruff", *args, *touched]
        results[name] = run(command, dict(os.environ), tree_dir, log)
    return {"files": touched, **results, "ok": not any(results.values())}


def fuzz(tree_dir: Path | None, modes: str, seeds: int, env: dict, work: Path, name: str):
    out = work / f"{name}.json"
    command = Path(sys.executable).parent / "vllm-prefix-guard-harness"
    cmd = [str(command), "fuzz", "--seeds", str(seeds)]
    cmd += ["--modes", modes, "--json", "--shrink-seconds", "0"]
    log = work / f"{name}.log"
    with open(out, "w") as stdout, open(log, "w") as stderr:
        rc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=stdout, stderr=stderr).returncode
    if not out.stat().st_size:
        raise RuntimeError(f"the fuzzer wrote no report (exit {rc}): {log}")
    document = json.loads(out.read_text())
    return {c["name"]: c for c in document["configs"]}


def explore(
    tree_dir: Path, scopes: list[str], env: dict, work: Path, name: str
) -> list[dict[str, Any]]:
    """``vllm-prefix-guard-harness explore`` on a patched tree, its stock lane being the
    patch (guard off): each scope's figures, every sequence of events within its bounds."""
    out = work / f"{name}.json"
    out.unlink(missing_ok=True)
    command = Path(sys.executable).parent / "vllm-prefix-guard-harness"
    cmd = [str(command), "explore", "--modes", "stock", "--json", str(out)]
    for scope in scopes:
        cmd += ["--scope", scope]
    with open(work / f"{name}.log", "w") as log:
        subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=log)
    return json.loads(out.read_text())["scopes"] if out.exists() else []


def figures(config: dict, mode: str) -> dict[str, int]:
    run_ = config["modes"][mode]
    keys = ("violations", "hit_tokens", "invalid_hit_tokens", "preemptions", "computed_tokens")
    events = (
        "kv_event_keys_missing",
        "kv_event_keys_extra",
        "kv_event_counted_keys_missing",
        "kv_event_counted_keys_extra",
    )
    return {k: run_[k] for k in (*keys, "steps", *events)}


def parts_needed(config: Any) -> int:
    """How many parts of the series a fuzz configuration needs to read no bad KV: part 2
    rolls back failed KV loads."""
    return 2 if config.fails_kv_loads else 1


def check_b(
    trees: dict[str, Path], env: Env, work: Path, seeds: int, explore_scopes: list[str]
) -> dict[str, Any]:
    """Each prefix alone, judged by the oracle, against the guard's figures; the whole
    series explored within the explorer's bounds."""
    from vllm_prefix_guard_harness.fuzz.configs import CONFIGS

    whole = trees[SERIES]
    prefixes = {name: count for name, count in tree_names().items() if count}
    jobs: dict[str, Callable[[], Any]] = {
        "regression": partial(
            pytest, whole, ROOT, list(REGRESSION_TESTS), env(whole), work, "b-regression"
        ),
        "explore": partial(explore, whole, explore_scopes, env(whole), work, "b-explore"),
        UNPATCHED: partial(
            fuzz, None, "stock,guard,pr43569", seeds, env(None), work, "b-fuzz-unpatched"
        ),
    }
    for name, count in prefixes.items():
        jobs[name] = partial(
            fuzz, trees[name], "stock", seeds, env(trees[name]), work, f"b-fuzz-{count}"
        )
    done = in_parallel(jobs)
    rc, outcomes = done.pop("regression")
    explored = done.pop("explore")
    explore_ok = len(explored) == len(explore_scopes) and all(
        scope["complete"] and scope["violations"]["stock"] == 0 for scope in explored
    )
    regression_ok = rc == 0 and any(o == "passed" for o in outcomes.values())
    skipped = sorted(k for k, o in outcomes.items() if o.startswith("skipped"))
    reference = done.pop(UNPATCHED)
    patched = done
    configs = {}
    for name, config in reference.items():
        row: dict[str, Any] = {m: figures(config, m) for m in ("stock", "guard", "pr43569")}
        row["targeted"] = config["targeted"]
        row["failed_loads"] = CONFIGS[name].fails_kv_loads
        row["parts_needed"] = parts_needed(CONFIGS[name])
        for tree_name in prefixes:
            row[tree_name] = figures(patched[tree_name][name], "stock")
        # A prefix without the part a configuration needs: what it leaves is measured.
        covered = [t for t, count in prefixes.items() if count >= row["parts_needed"]]
        row["ok"] = all(
            row[t]["violations"] == 0 and all(row[t][k] == row["guard"][k] for k in EQUAL_FIGURES)
            for t in covered
        ) and not any(row[SERIES][k] for k in row[SERIES] if k.startswith("kv_event_"))
        configs[name] = row
    return {
        "seeds": seeds,
        "regression": {
            "passed": sum(o == "passed" for o in outcomes.values()),
            "skipped": skipped,
            "failed": sorted(k for k, o in outcomes.items() if o.startswith(("failed", "error"))),
        },
        "fuzz": configs,
        "explore": {"scopes": explored, "ok": explore_ok},
        "ok": regression_ok and explore_ok and all(c["ok"] for c in configs.values()),
    }


def suite_outcomes(
    tests_tree: Path, vllm_tree: Path | None, selection: str, env: Env, work: Path, name: str
):
    """vLLM's own tests of one selection, guard off, from ``tests_tree``."""
    out = work / f"c-suite-{name.replace(' ', '-')}"
    cmd = [sys.executable, str(ROOT / "tests" / "vllm_suite" / "run_vllm_suite.py")]
    cmd += ["--vllm-tests", str(tests_tree), "--selection", selection, "--mode", "stock"]
    cmd += ["--out", str(out)]
    started = time.monotonic()
    rc = run(cmd, env(vllm_tree, vllm_tests=True), ROOT, work / f"{out.name}.log")
    report = json.loads((out / "stock.json").read_text()) if (out / "stock.json").exists() else {}
    return rc, report.get("outcomes", {}), round(time.monotonic() - started)


def reusable_stock_run(directory: Path | None, selection: str) -> Any:
    """The unpatched outcomes of ``nox -s vllm-suite-ci``'s stock run in ``directory``,
    when it ran this selection on this vLLM (the same run check c makes unpatched)."""
    if directory is None:
        return None
    summary, stock = directory / "summary.json", directory / "stock.json"
    if not (summary.exists() and stock.exists()):
        return None
    facts = json.loads(summary.read_text())
    if facts.get("selection") != selection or facts.get("vllm") != tree.installed_version():
        return None
    outcomes = json.loads(stock.read_text()).get("outcomes", {})
    return (0, outcomes, 0) if outcomes else None


def check_c(
    trees: dict[str, Path],
    env: Env,
    work: Path,
    selection: str,
    reuse: Path | None = None,
    whole_series_only: bool = False,
) -> dict[str, Any]:
    """vLLM's own tests: nothing that passes unpatched fails on any prefix (with
    ``whole_series_only``, on the whole series alone)."""
    reused = reusable_stock_run(reuse, selection)
    jobs = {
        name: partial(
            suite_outcomes, trees[name], trees[name] if count else None, selection, env, work, name
        )
        for name, count in tree_names().items()
        if (count or reused is None) and not (whole_series_only and 0 < count < len(tree.SERIES))
    }
    done = in_parallel(jobs)
    rc_u, unpatched, wall_u = done.pop(UNPATCHED) if reused is None else reused
    prefixes: dict[str, Any] = {}
    ok = rc_u in (0, 1) and bool(unpatched)
    for name, (rc, outcomes, wall) in done.items():
        diff = compare(unpatched, outcomes, expected=[])
        prefixes[name] = {
            "outcomes": summarize(outcomes),
            "regressed": [f"{n}: {b} -> {a}" for n, b, a, _ in diff["unexpected"]],
            "fixed": diff["fixed"],
            "seconds": wall,
        }
        ok = ok and rc in (0, 1) and bool(outcomes) and not diff["unexpected"]
    # The test part 2 changes, in its old form, against the whole series: it fails.
    whole = trees[SERIES]
    changed_file, function = CHANGED_VLLM_TEST.split("::")
    old_file = Path(changed_file).with_name(f"{Path(changed_file).stem}_before_series.py")
    (whole / old_file).write_text((trees[UNPATCHED] / changed_file).read_text())
    environment = env(whole, vllm_tests=True)
    _, old_form = pytest(
        whole, whole, [f"{old_file}::{function}"], environment, work, "c-old-form-on-series"
    )
    _, new_form = pytest(whole, whole, [CHANGED_VLLM_TEST], environment, work, "c-new-form")
    return {
        "selection": selection,
        "unpatched_from": "vllm-suite-ci's stock run" if reused is not None else "this check",
        "unpatched": summarize(unpatched),
        "unpatched_seconds": wall_u,
        "prefixes": prefixes,
        "changed_test_new_form": new_form,
        "changed_test_old_form": old_form,
        "ok": ok
        and bool(new_form)
        and all(o == "passed" for o in new_form.values())
        and bool(old_form)
        and all(o.startswith("failed") for o in old_form.values()),
    }


def summarize(outcomes: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        key = "failed" if outcome in FAILED else outcome
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


#: What the guard does on the patched tree, as a vLLM process would run it.
PROBE = (
    f"STEPS_ASIDE = {STEPS_ASIDE!r}\n"
    + """
import json, logging
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
import vllm.logger  # vLLM's logging set-up first, then the guard's logger is read at INFO
from vllm_prefix_guard.log import LOGGER_NAME
logging.getLogger(LOGGER_NAME).addHandler(handler)
logging.getLogger(LOGGER_NAME).setLevel(logging.INFO)
from vllm.plugins import load_general_plugins
load_general_plugins()
load_general_plugins()
from vllm.v1.core.sched.scheduler import Scheduler
from vllm_prefix_guard import plugin, targets
from vllm_prefix_guard_harness.factory import make_scheduler
scheduler = make_scheduler(async_scheduling=True)
pool = type(scheduler.kv_cache_manager.block_pool)
print(json.dumps({
    "native_fix": targets.native_fix().describe() if targets.native_fix().complete else None,
    "applied": plugin.is_applied(),
    "patched_targets": plugin.applied_targets(),
    "schedule_is_vllms": Scheduler.schedule.__module__ == "vllm.v1.core.sched.scheduler"
        and not hasattr(Scheduler.schedule, "__wrapped__"),
    "project_classes_in_pool_mro": [c.__qualname__ for c in pool.__mro__
        if c.__module__.startswith("vllm_prefix_guard")],
    "steps_aside_lines": sum(STEPS_ASIDE in r for r in records),
}))
"""
)


#: What the guard does on a tree with only part of the series.
REFUSAL_PROBE = """
import json
from vllm_prefix_guard import plugin
try:
    plugin.apply()
    print(json.dumps({"refused": None, "applied": plugin.is_applied()}))
except BaseException as exc:
    print(json.dumps({"refused": str(exc), "applied": plugin.is_applied()}))
"""


def probe(code: str, environment: dict[str, str]) -> dict[str, Any]:
    """Run ``code`` in a fresh Python; the last JSON line it prints."""
    done = subprocess.run(
        [sys.executable, "-c", code], env=environment, cwd=ROOT, capture_output=True, text=True
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": done.stderr[-2000:]}


def check_d(trees: dict[str, Path], env: Env, work: Path, seeds: int, b: dict | None):
    """The guard on the whole series steps aside and changes nothing; on part of it, it
    refuses to start, naming what is missing."""
    from vllm_prefix_guard import targets

    whole = trees[SERIES]
    seen = probe(PROBE, env(whole, guard=True))
    guarded = fuzz(whole, "guard", seeds, env(whole, guard=True), work, "d-fuzz-guard-on")
    if b is not None:
        before = {name: row[SERIES] for name, row in b["fuzz"].items()}
    else:  # run alone: (b)'s figures on the series, measured here
        guard_off = fuzz(whole, "stock", seeds, env(whole), work, "d-fuzz-guard-off")
        before = {name: figures(config, "stock") for name, config in guard_off.items()}
    unchanged = {
        name: before.get(name) == figures(config, "guard") for name, config in guarded.items()
    }
    partial: dict[str, Any] = {}
    for name, count in tree_names().items():
        if 0 < count < len(tree.SERIES):
            refusal = probe(REFUSAL_PROBE, env(trees[name], guard=True))
            missing = [
                f"{owner}.{member}"
                for owner, member, _ in targets.NATIVE_FIX
                if f"{owner}.{member}" in (refusal.get("refused") or "")
            ]
            partial[name] = {**refusal, "names_missing": missing}
    ok = (
        seen.get("native_fix") is not None
        and seen.get("applied") is False
        and seen.get("patched_targets") == []
        and seen.get("schedule_is_vllms") is True
        and seen.get("project_classes_in_pool_mro") == []
        and seen.get("steps_aside_lines") == 1
        and all(unchanged.values())
        and all(
            p.get("refused") and p.get("applied") is False and p["names_missing"]
            for p in partial.values()
        )
    )
    return {
        "guard_on_series": seen,
        "fuzz_unchanged": unchanged,
        "guard_on_part_of_series": partial,
        "ok": ok,
    }


#: The step-cost cell: 256 running requests, synchronous FCFS (every column follows one
#: trajectory, so instruction counts compare step for step).
BENCH_CELL = "256-fcfs-nopressure-sync"


def check_e(trees: dict[str, Path], env: Env, work: Path) -> dict[str, Any]:
    """Instructions per scheduler step under callgrind: the patched vLLM (guard off)
    against unpatched stock, the guard, and PR #43569's scope."""
    script = ROOT / "benchmarks" / "instructions.py"
    columns: dict[str, Any] = {}
    for name, vllm_tree, wanted in (
        (UNPATCHED, None, "stock,guard,pr43569"),
        (SERIES, trees[SERIES], "stock"),
    ):
        out = work / f"e-instructions-{name}.json"
        cmd = [sys.executable, str(script), "measure", "--cells", BENCH_CELL]
        cmd += ["--columns", wanted, "--out", str(out)]
        run(cmd, env(vllm_tree), ROOT, work / f"e-instructions-{name}.log")
        [cell] = json.loads(out.read_text())["cells"]
        for column in wanted.split(","):
            label = "series (guard off)" if name == SERIES else column
            columns[label] = dict(cell[column])
    reference = columns["stock"]["instructions_per_step"]
    for figures_ in columns.values():
        figures_["ratio"] = round(figures_["instructions_per_step"] / reference, 4)
    trajectories = {f["trajectory"] for f in columns.values()}
    return {
        "cell": BENCH_CELL,
        "vllm": tree.installed_version(),
        "columns": columns,
        "ok": len(trajectories) == 1,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-tests", type=Path, required=True, help="fetch_vllm_tests DEST")
    parser.add_argument("--work", type=Path, required=True, help="trees, logs, reports")
    parser.add_argument("--out", type=Path, required=True, help="the results JSON")
    parser.add_argument("--seeds", type=int, default=3, help="fuzz seeds per configuration")
    parser.add_argument("--selection", default="ci", help="tests/vllm_suite selection")
    parser.add_argument(
        "--explore-scope",
        action="append",
        help="scope the series is explored on (repeatable; default: the explorer's default set)",
    )
    parser.add_argument(
        "--reuse-unpatched-suite",
        type=Path,
        help="a run_vllm_suite.py --out directory whose stock run check c may reuse",
    )
    parser.add_argument(
        "--only", default="a,b,c,d", help="comma-separated checks to run (e: the step cost)"
    )
    parser.add_argument(
        "--suite-on-series-only",
        action="store_true",
        help="check c runs vLLM's tests on the whole series, not on each prefix (CI)",
    )
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    trees = {
        name: tree.build(args.vllm_tests, work / name.replace(" ", "-"), tree.SERIES[:count])
        for name, count in tree_names().items()
    }
    # Every part's tests in every tree, where vLLM keeps them (a checks each both ways).
    for patch in tree.SERIES:
        for test in part_tests(patch):
            for tree_dir in trees.values():
                (tree_dir / test).write_text((INPUTS / "parts" / patch.stem / test).read_text())
    env = Env(work / "hf-home")
    # Checks not run this time keep their last results (the step cost is measured apart).
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    results.update(
        vllm=tree.installed_version(),
        series=[
            {"file": f"upstream/out/series/{patch.name}", **tree.patch_stats(patch)}
            for patch in tree.SERIES
        ],
    )
    results.pop("patch", None)
    timings: dict[str, int] = {}
    for name, check in (
        ("a", lambda: check_a(trees, env, work)),
        ("b", lambda: check_b(trees, env, work, args.seeds, args.explore_scope or DEFAULT_SCOPES)),
        # vLLM's own tests: "c" is the selection CI runs, "c:<name>" any other.
        (
            "c" if args.selection == "ci" else f"c:{args.selection}",
            lambda: check_c(
                trees,
                env,
                work,
                args.selection,
                args.reuse_unpatched_suite,
                args.suite_on_series_only,
            ),
        ),
        ("d", lambda: check_d(trees, env, work, args.seeds, results.get("b"))),
        ("e", lambda: check_e(trees, env, work)),
    ):
        if name.split(":")[0] not in only:
            continue
        begun = time.monotonic()
        results[name] = check()
        timings[name] = round(time.monotonic() - begun)
        verdict = "ok" if results[name]["ok"] else "FAILED"
        print(f"upstream check {name}: {verdict} ({timings[name]} s)", flush=True)
    results["seconds"] = {**results.get("seconds", {}), **timings}
    results["ok"] = all(
        check["ok"] for name, check in results.items() if name.split(":")[0] in CHECKS
    )
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"upstream: {'every check passed' if results['ok'] else 'a check FAILED'}; {args.out}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
