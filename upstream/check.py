#!/usr/bin/env python3
"""Prove the upstream patch (``nox -s upstream``): it applies to vLLM 0.33.0 and fixes the
bug by itself, vLLM's own tests still pass, and the guard steps aside for it.

Builds two vLLM trees from the installed vLLM and its sdist's tests (``tree.py``), one
patched, one not, each with ``upstream/tests/`` added as vLLM's PR adds them, then:

a. ``upstream/tests/`` pass on the patched tree, and each of them fails on the unpatched one;
b. with the patched tree first on ``PYTHONPATH`` and ``VLLM_PREFIX_GUARD=0``, the project's
   regression tests pass (the shadow-KV oracle judging vLLM's own fix) and the fuzzer reads
   no bad KV in any configuration, with hit tokens, preemptions and computed tokens equal to
   the guard's on unpatched vLLM (same seeds);
c. vLLM's own unit tests (``tests/vllm_suite``, one selection) pass on the patched tree
   wherever they pass unpatched; the one test the patch changes passes in its new form,
   and fails in its old form against the patched vLLM;
d. with ``VLLM_PREFIX_GUARD=1`` on the patched tree, the guard recognises the fix by its
   shape, logs once that it steps aside, patches nothing, and (b)'s fuzz figures do not
   change.

Writes ``--out`` (JSON: every figure and verdict) and exits 1 if any check failed. Run with
the Python of the vLLM 0.33.0 venv, from anywhere.

Usage:
    python upstream/check.py --vllm-tests DIR --work DIR --out upstream/results.json
        [--seeds 3] [--selection ci] [--only a,b,c,d]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "vllm_suite"))

import tree  # noqa: E402
from hub_cache import write_hub_cache  # noqa: E402
from run_vllm_suite import FAILED, compare  # noqa: E402

#: The project's regression tests of the rollback rules: each shows bad KV on stock and
#: none guarded; on the patched tree they run once, as ``native`` (tests/native_fix.py).
REGRESSION_TESTS = (
    "tests/test_preemption.py",
    "tests/test_kv_load_failure.py",
    "tests/test_hybrid_kv_load_failure.py",
    "tests/test_sharing.py",
    "tests/fuzz/test_soak_regressions.py",
)
#: The test of vLLM's that asserts the hazard; the patch changes it.
CHANGED_VLLM_TEST = (
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py"
    "::test_sync_load_failure_with_shared_blocks"
)
#: Where upstream/tests/ go in vLLM's tree.
TESTS_DEST = Path("tests/v1/core")
#: The fuzz figures that must match the guard's exactly.
EQUAL_FIGURES = ("hit_tokens", "preemptions", "computed_tokens", "steps")
STEPS_ASIDE = "already ships its own fix"
#: The checks, by name ("c:<selection>" holds vLLM's own tests of another selection).
CHECKS = ("a", "b", "c", "d", "e")


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


def check_a(trees: dict[str, Path], env: Env, work: Path) -> dict[str, Any]:
    """upstream/tests/: pass patched, each fails unpatched."""
    files = [str(TESTS_DEST / p.name) for p in sorted((HERE / "tests").glob("test_*.py"))]
    result: dict[str, Any] = {}
    for name, tree_dir in trees.items():
        environment = env(tree_dir, vllm_tests=True)
        _, outcomes = pytest(tree_dir, tree_dir, files, environment, work, f"a-{name}")
        result[name] = outcomes
    patched, unpatched = result["patched"], result["unpatched"]
    result["ok"] = (
        bool(patched)
        and set(patched) == set(unpatched)
        and all(o == "passed" for o in patched.values())
        and all(o.startswith(("failed", "error")) for o in unpatched.values())
    )
    return result


def fuzz(tree_dir: Path | None, modes: str, seeds: int, env: dict, work: Path, name: str):
    out = work / f"{name}.json"
    command = Path(sys.executable).parent / "vllm-prefix-guard"
    cmd = [str(command), "fuzz", "--seeds", str(seeds)]
    cmd += ["--modes", modes, "--json", "--shrink-seconds", "0"]
    with open(out, "w") as stdout, open(work / f"{name}.log", "w") as stderr:
        subprocess.run(cmd, env=env, cwd=ROOT, stdout=stdout, stderr=stderr)
    document = json.loads(out.read_text())
    return {c["name"]: c for c in document["configs"]}


def figures(config: dict, mode: str) -> dict[str, int]:
    run_ = config["modes"][mode]
    keys = ("violations", "hit_tokens", "invalid_hit_tokens", "preemptions", "computed_tokens")
    return {k: run_[k] for k in (*keys, "steps")}


def check_b(trees: dict[str, Path], env: Env, work: Path, seeds: int) -> dict[str, Any]:
    """The patch alone: regression tests and the fuzzer, against the guard's figures."""
    patched = trees["patched"]
    rc, outcomes = pytest(
        patched, ROOT, list(REGRESSION_TESTS), env(patched), work, "b-regression-patched"
    )
    regression_ok = rc == 0 and any(o == "passed" for o in outcomes.values())
    skipped = sorted(k for k, o in outcomes.items() if o.startswith("skipped"))
    native = fuzz(patched, "stock", seeds, env(patched), work, "b-fuzz-patched")
    reference = fuzz(None, "stock,guard,pr43569", seeds, env(None), work, "b-fuzz-unpatched")
    configs = {}
    for name, config in reference.items():
        row = {mode: figures(config, mode) for mode in ("stock", "guard", "pr43569")}
        row["patched"] = figures(native[name], "stock")
        row["targeted"] = config["targeted"]
        row["ok"] = row["patched"]["violations"] == 0 and all(
            row["patched"][k] == row["guard"][k] for k in EQUAL_FIGURES
        )
        configs[name] = row
    return {
        "seeds": seeds,
        "regression": {
            "passed": sum(o == "passed" for o in outcomes.values()),
            "skipped": skipped,
            "failed": sorted(k for k, o in outcomes.items() if o.startswith(("failed", "error"))),
        },
        "fuzz": configs,
        "ok": regression_ok and all(c["ok"] for c in configs.values()),
    }


def suite_outcomes(tests_tree: Path, vllm_tree: Path | None, selection: str, env: Env, work: Path):
    """vLLM's own tests of one selection, guard off, from ``tests_tree``."""
    out = work / f"c-suite-{'patched' if vllm_tree else 'unpatched'}"
    cmd = [sys.executable, str(ROOT / "tests" / "vllm_suite" / "run_vllm_suite.py")]
    cmd += ["--vllm-tests", str(tests_tree), "--selection", selection, "--mode", "stock"]
    cmd += ["--out", str(out)]
    started = time.monotonic()
    rc = run(cmd, env(vllm_tree, vllm_tests=True), ROOT, work / f"{out.name}.log")
    report = json.loads((out / "stock.json").read_text()) if (out / "stock.json").exists() else {}
    return rc, report.get("outcomes", {}), round(time.monotonic() - started)


def check_c(trees: dict[str, Path], env: Env, work: Path, selection: str) -> dict[str, Any]:
    """vLLM's own tests: nothing that passes unpatched fails patched."""
    rc_u, unpatched, wall_u = suite_outcomes(trees["unpatched"], None, selection, env, work)
    patched_tree = trees["patched"]
    rc_p, patched, wall_p = suite_outcomes(patched_tree, patched_tree, selection, env, work)
    diff = compare(unpatched, patched, expected=[])
    # The test the patch changes, in its old form, against the patched vLLM: it fails.
    changed_file, function = CHANGED_VLLM_TEST.split("::")
    old_file = Path(changed_file).with_name(f"{Path(changed_file).stem}_before_patch.py")
    (patched_tree / old_file).write_text((trees["unpatched"] / changed_file).read_text())
    _, old_form = pytest(
        patched_tree,
        patched_tree,
        [f"{old_file}::{function}"],
        env(patched_tree, vllm_tests=True),
        work,
        "c-old-form-on-patched",
    )
    changed = {k: o for k, o in patched.items() if k.startswith(CHANGED_VLLM_TEST)}
    return {
        "selection": selection,
        "unpatched": summarize(unpatched),
        "patched": summarize(patched),
        "regressed": [f"{n}: {b} -> {a}" for n, b, a, _ in diff["unexpected"]],
        "fixed": diff["fixed"],
        "changed_test_patched": changed,
        "changed_test_old_form_on_patched": old_form,
        "seconds": {"unpatched": wall_u, "patched": wall_p},
        "ok": rc_u in (0, 1)
        and rc_p in (0, 1)
        and bool(patched)
        and not diff["unexpected"]
        and bool(changed)
        and all(o == "passed" for o in changed.values())
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
from vllm_prefix_guard.diagnostics.factory import make_scheduler
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


def check_d(trees: dict[str, Path], env: Env, work: Path, seeds: int, b: dict | None):
    """The guard on the patched tree: it steps aside, and changes nothing."""
    patched = trees["patched"]
    probe = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env(patched, guard=True),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    lines = [line for line in probe.stdout.splitlines() if line.startswith("{")]
    seen = json.loads(lines[-1]) if lines else {"error": probe.stderr[-2000:]}
    guarded = fuzz(patched, "guard", seeds, env(patched, guard=True), work, "d-fuzz-guard-on")
    if b is not None:
        before = {name: row["patched"] for name, row in b["fuzz"].items()}
    else:  # run alone: (b)'s patched figures, measured here
        guard_off = fuzz(patched, "stock", seeds, env(patched), work, "d-fuzz-guard-off")
        before = {name: figures(config, "stock") for name, config in guard_off.items()}
    unchanged = {
        name: before.get(name) == figures(config, "guard") for name, config in guarded.items()
    }
    ok = (
        seen.get("native_fix") is not None
        and seen.get("applied") is False
        and seen.get("patched_targets") == []
        and seen.get("schedule_is_vllms") is True
        and seen.get("project_classes_in_pool_mro") == []
        and seen.get("steps_aside_lines") == 1
        and all(unchanged.values())
    )
    return {"guard_on_patched_tree": seen, "fuzz_unchanged": unchanged, "ok": ok}


#: The step-cost cell: 256 running requests, synchronous FCFS (every column follows one
#: trajectory, so instruction counts compare step for step).
BENCH_CELL = "256-fcfs-nopressure-sync"


def check_e(trees: dict[str, Path], env: Env, work: Path) -> dict[str, Any]:
    """Instructions per scheduler step under callgrind: the patched vLLM (guard off)
    against unpatched stock, the guard, and PR #43569's scope."""
    script = ROOT / "benchmarks" / "instructions.py"
    columns: dict[str, Any] = {}
    for name, vllm_tree, wanted in (
        ("unpatched", None, "stock,guard,pr43569"),
        ("patched", trees["patched"], "stock"),
    ):
        out = work / f"e-instructions-{name}.json"
        cmd = [sys.executable, str(script), "measure", "--cells", BENCH_CELL]
        cmd += ["--columns", wanted, "--out", str(out)]
        run(cmd, env(vllm_tree), ROOT, work / f"e-instructions-{name}.log")
        [cell] = json.loads(out.read_text())["cells"]
        for column in wanted.split(","):
            label = "patched (guard off)" if name == "patched" else column
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
        "--only", default="a,b,c,d", help="comma-separated checks to run (e: the step cost)"
    )
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    patch = tree.single_patch()
    trees = {
        "patched": tree.build(args.vllm_tests, work / "patched", patch),
        "unpatched": tree.build(args.vllm_tests, work / "unpatched", None),
    }
    for tree_dir in trees.values():
        for test_file in sorted((HERE / "tests").glob("test_*.py")):
            (tree_dir / TESTS_DEST / test_file.name).write_text(test_file.read_text())
    env = Env(work / "hf-home")
    # Checks not run this time keep their last results (the step cost is measured apart).
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    results.update(
        vllm=tree.installed_version(),
        patch={"file": f"upstream/{patch.name}", **tree.patch_stats(patch)},
    )
    timings: dict[str, int] = {}
    for name, check in (
        ("a", lambda: check_a(trees, env, work)),
        ("b", lambda: check_b(trees, env, work, args.seeds)),
        # vLLM's own tests: "c" is the selection CI runs, "c:<name>" any other.
        (
            "c" if args.selection == "ci" else f"c:{args.selection}",
            lambda: check_c(trees, env, work, args.selection),
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
