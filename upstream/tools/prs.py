#!/usr/bin/env python3
"""Write the upstream pull requests, ``upstream/out/prs/<slug>.patch``, each against vLLM
0.34.0 on its own.

A pull request is made as a part of the series is (``series.py``): call sites and test
helpers written for vLLM (``call_sites.py``), methods taken verbatim from the plugin's
rules (so the plugin and the pull request run one copy), and vLLM-style tests
(``upstream/inputs/prs/<slug>/``, laid out as in vLLM's tree). ``--check`` fails if a
committed patch is stale (CI).

``--prove`` builds two vLLM trees per pull request, *stock* (its tests and test helpers
only) and *patched*, and records in ``upstream/out/prs/results.json``: its tests on each
(they must fail on stock and pass patched), and the project's fuzzer in stock mode on
each, every configuration (the patched tree is the vLLM under test, the guard off):
bad reads, hits, preemptions and KV-event keys wrong; and the fuzzer on one tree with every
pull request applied (an edit two share, once: ``combined``). ``report.py`` writes them
into ``upstream/README.md``.

``--tests-both-ways`` (CI) runs only the tests on both trees and fails unless every test
fails on stock and passes patched.

Usage (the Python of a venv with vLLM 0.34.0; ``DIR`` from scripts/fetch_vllm_tests.py):
    python upstream/tools/prs.py --vllm-tests DIR [--check | --tests-both-ways | --prove [--seeds N]
        [--only SLUG|combined]]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent  # upstream/tools
UPSTREAM = HERE.parent
INPUTS = UPSTREAM / "inputs"  # written by hand: call sites, PR templates, vLLM-style tests
OUT = UPSTREAM / "out"  # written by the tools: patches, PR texts, results
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(INPUTS))

import tree  # noqa: E402
from call_sites import (  # noqa: E402
    EVICT_FAULTED_STEPS,
    EVICT_PREEMPTED_BLOCKS,
    INVALID_BLOCKS_EVICTED,
    KV_EVENTS_PER_HASH,
    KV_LOAD_TESTS,
    PREFIX_CACHING_TESTS,
    Edit,
)
from series import Methods, apply_part, pristine_files, unified_diff, write_patches  # noqa: E402

PRS_DIR = OUT / "prs"
INVALID_BLOCKS_REUSE_TESTS = "tests/v1/kv_connector/unit/test_invalid_blocks_reuse.py"
FAULT_TESTS = "tests/v1/core/test_fault_prefix_cache.py"
SCHEDULER_TESTS = "tests/v1/core/test_scheduler.py"
ASYNC_SCHEDULER_TESTS = "tests/v1/core/test_async_scheduler.py"
#: results.json's key for every pull request applied at once (``--only combined``).
COMBINED = "combined"
RESULTS = PRS_DIR / "results.json"
VERSION = "0.34.0"
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA"]
PYTEST += ["-p", "vllm_tests_on_cpu"]
FUZZ = [sys.executable, "-m", "vllm_prefix_guard.cli", "fuzz", "--modes", "stock"]
FUZZ += ["--shrink-seconds", "0", "--json"]
#: What each configuration's stock run reports, as results.json keeps it.
FIGURES = (
    "violations",
    "hit_tokens",
    "preemptions",
    "kv_event_keys_missing",
    "kv_event_keys_extra",
    "kv_event_counted_keys_missing",
    "kv_event_counted_keys_extra",
)


@dataclass(frozen=True)
class PullRequest:
    slug: str
    subject: str
    edits: tuple[Edit, ...]
    generated: tuple[Methods, ...]
    #: New test files (from ``upstream/inputs/prs/<slug>/``).
    tests: tuple[str, ...]
    #: What to run, if not the new files: node IDs of tests the edits add.
    test_ids: tuple[str, ...] = ()
    #: vLLM's own tests of the code it changes (``--nearby``): outcomes the same on both
    #: trees but for its own tests.
    nearby: tuple[str, ...] = ()

    @property
    def patch_file(self) -> Path:
        return PRS_DIR / f"{self.slug}.patch"

    @property
    def tests_dir(self) -> Path:
        return INPUTS / "prs" / self.slug

    @property
    def num_tests(self) -> int:
        """Its test functions (module-level ``def test_`` of its new files)."""
        if self.test_ids:
            return len(self.test_ids)
        return sum(
            line.startswith("def test_")
            for test in self.tests
            for line in (self.tests_dir / test).read_text().splitlines()
        )


PULL_REQUESTS: tuple[PullRequest, ...] = (
    PullRequest(
        "evict-preempted-blocks",
        "[Core][Bugfix] Evict the blocks a request preempted while being scheduled never computes",
        EVICT_PREEMPTED_BLOCKS,
        (),
        ("tests/v1/core/test_preempted_prefix_cache.py",),
        nearby=(
            SCHEDULER_TESTS,
            PREFIX_CACHING_TESTS,
            "tests/v1/core/test_preempted_prefix_cache.py",
        ),
    ),
    PullRequest(
        "kv-events-per-hash",
        "[Core][KV Events] Emit BlockStored for a hash's first block and BlockRemoved for its last",
        KV_EVENTS_PER_HASH,
        (
            Methods(
                "block_pool",
                "BlockPoolAdditions",
                ("uncached_block_hashes", "first_copy_events"),
                "BlockPool",
                "_emit_block_removed_events",
            ),
        ),
        (),
        (
            f"{PREFIX_CACHING_TESTS}::test_kv_events_name_a_hash_once_whatever_its_copies",
            f"{PREFIX_CACHING_TESTS}::test_block_stored_names_only_the_blocks_that_cache_a_hash_first",
        ),
        nearby=(PREFIX_CACHING_TESTS, "tests/v1/core/test_kv_cache_utils.py"),
    ),
    PullRequest(
        "evict-invalid-blocks",
        "[Core][KV Connector][Bugfix] Keep KV a load failed, and KV computed over it, "
        "out of the prefix cache",
        INVALID_BLOCKS_EVICTED,
        (),
        (INVALID_BLOCKS_REUSE_TESTS,),
        (
            f"{INVALID_BLOCKS_REUSE_TESTS}::test_invalid_blocks_not_hit_until_recomputed",
            f"{INVALID_BLOCKS_REUSE_TESTS}::test_blocks_of_loader_finished_in_flight_evicted",
            f"{INVALID_BLOCKS_REUSE_TESTS}::test_output_in_flight_over_invalid_block_dropped",
            *(
                f"{KV_LOAD_TESTS}::test_sync_load_failure_with_shared_blocks[100-99-50-{p}]"
                for p in ("invalid_block_idxs0", "invalid_block_idxs1", "invalid_block_idxs2")
            ),
        ),
        nearby=(
            INVALID_BLOCKS_REUSE_TESTS,
            KV_LOAD_TESTS,
            *(
                f"tests/v1/kv_connector/unit/test_{name}.py"
                for name in (
                    "invalid_blocks_correctness",
                    "cache_pollution_prevention",
                    "error_propagation",
                )
            ),
            SCHEDULER_TESTS,
            ASYNC_SCHEDULER_TESTS,
        ),
    ),
    PullRequest(
        "evict-faulted-steps",
        "[Core][Fault Tolerance][Bugfix] Evict the blocks of the steps a fault discards",
        EVICT_FAULTED_STEPS,
        (),
        (FAULT_TESTS,),
        tuple(
            f"{FAULT_TESTS}::test_blocks_of_steps_in_flight_evicted_when_every_request_finishes[{n}]"
            for n in (0, 1)
        ),
        nearby=(
            FAULT_TESTS,
            SCHEDULER_TESTS,
            ASYNC_SCHEDULER_TESTS,
            "tests/v1/fault_tolerance/test_engine_core_sentinel.py",
        ),
    ),
)


def patches(vllm_tests: Path) -> dict[Path, str]:
    """Each pull request's patch against the installed vLLM's pristine files."""
    from importlib.metadata import version

    if version("vllm") != VERSION:
        raise SystemExit(f"the pull requests are made for vLLM {VERSION}")
    out = {}
    for pr in PULL_REQUESTS:
        files = pristine_files(vllm_tests, [pr])  # type: ignore[list-item]
        after = apply_part(pr, files)  # type: ignore[arg-type]
        out[pr.patch_file] = (
            f"Subject: [PATCH] {pr.subject}\n\n"
            f"Generated by upstream/tools/prs.py; its description: upstream/out/prs/{pr.slug}.md\n"
            "---\n" + unified_diff(files, after)
        )
    return out


def environment(vllm_tree: Path, hf_home: Path) -> dict[str, str]:
    """``check.py``'s environment of a run on ``vllm_tree`` (offline, vLLM's Hub configs
    cached, the tree first on the path, the guard off), with this directory on the path
    too, for the ``vllm_tests_on_cpu`` plugin."""
    from check import Env

    env = Env(hf_home)(vllm_tree)
    env["PYTHONPATH"] += os.pathsep.join(["", str(HERE), str(INPUTS)])
    return env


def build_trees(pr: PullRequest, vllm_tests: Path, work: Path) -> dict[str, Path]:
    """``patched``: the pull request applied; ``stock``: the same without its changes
    to ``vllm/`` (its tests and test helpers stay)."""
    patched = tree.build(vllm_tests, work / pr.slug / "patched", [pr.patch_file])
    stock = work / pr.slug / "stock"
    if stock.exists():
        shutil.rmtree(stock)
    shutil.copytree(patched, stock, symlinks=True)
    installed = tree.installed_vllm().parent
    for path in tree.patch_stats(pr.patch_file)["files"]:  # type: ignore[attr-defined]
        if path.startswith("vllm/"):
            shutil.copy2(installed / path, stock / path)
    return {"stock": stock, "patched": patched}


def run_tests(pr: PullRequest, vllm_tree: Path, env: dict[str, str]) -> dict[str, int]:
    """The pull request's tests in ``vllm_tree``: how many passed and failed."""
    done = subprocess.run(
        [*PYTEST, *(pr.test_ids or pr.tests)],
        cwd=vllm_tree,
        env=env,
        capture_output=True,
        text=True,
    )
    lines = done.stdout.splitlines()
    return {
        "passed": sum(line.startswith("PASSED ") for line in lines),
        "failed": sum(line.startswith("FAILED ") for line in lines),
    }


def outcomes(tests: tuple[str, ...], vllm_tree: Path, env: dict[str, str]) -> dict[str, str]:
    """Node ID -> PASSED, FAILED, ERROR or SKIPPED of ``tests`` in ``vllm_tree``."""
    done = subprocess.run([*PYTEST, *tests], cwd=vllm_tree, env=env, capture_output=True, text=True)
    found = {}
    for line in done.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR", "SKIPPED") and "::" in rest:
            found[rest.split(" - ")[0]] = word
    return found


def nearby(pr: PullRequest, vllm_tests: Path, work: Path) -> dict[str, Any]:
    """vLLM's own tests of what ``pr`` changes on its stock and patched trees: counts per
    outcome, and the tests whose outcome differs but for its own (any it breaks)."""
    result: dict[str, Any] = {"files": list(pr.nearby)}
    seen = {}
    for name, vllm_tree in build_trees(pr, vllm_tests, work).items():
        seen[name] = outcomes(pr.nearby, vllm_tree, environment(vllm_tree, work / "hf"))
        result[name] = dict(Counter(word.lower() for word in seen[name].values()))
    own = set(pr.test_ids) | {t for t in seen["patched"] if t.split("::")[0] in pr.tests}
    result["differ"] = sorted(
        t
        for t in seen["stock"].keys() | seen["patched"].keys()
        if seen["stock"].get(t) != seen["patched"].get(t) and t not in own
    )
    return result


def run_fuzz(env: dict[str, str], seeds: int) -> dict[str, dict[str, int]]:
    """The fuzzer in stock mode (the vLLM on the path), every configuration."""
    done = subprocess.run(
        [*FUZZ, "--seeds", str(seeds)],
        env=env,
        capture_output=True,
        text=True,
    )
    configs = json.loads(done.stdout)["configs"]
    return {
        config["name"]: {name: config["modes"]["stock"][name] for name in FIGURES}
        for config in configs
    }


def combined_patch(vllm_tests: Path, work: Path) -> Path:
    """Every pull request's changes to ``vllm/`` at once (an edit two of them share,
    once), as one patch: the tree on which the oracle judges them together."""
    edits = [edit for pr in PULL_REQUESTS for edit in pr.edits if edit.path.startswith("vllm/")]
    generated = tuple(item for pr in PULL_REQUESTS for item in pr.generated)
    combined = PullRequest(COMBINED, "", tuple(dict.fromkeys(edits)), generated, ())
    files = pristine_files(vllm_tests, [combined])  # type: ignore[list-item]
    patch = work / f"{COMBINED}.patch"
    patch.parent.mkdir(parents=True, exist_ok=True)
    patch.write_text(unified_diff(files, apply_part(combined, files)))  # type: ignore[arg-type]
    return patch


def prove(vllm_tests: Path, work: Path, seeds: int, only: list[str]) -> dict[str, Any]:
    """Every pull request's figures, and the fuzz of all of them applied at once
    (``only``: these, the others' and stock's fuzz kept from the last results). Stock
    vLLM is fuzzed once: the stock trees differ in tests alone."""
    saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    previous = saved.get("pull_requests", {})
    last = saved if only else {}
    kept = last.get("pull_requests", {}) if last.get("seeds") == seeds else {}
    results: dict[str, Any] = {"vllm": VERSION, "seeds": seeds, "pull_requests": {}}
    stock_fuzz = next((entry["stock"]["fuzz"] for entry in kept.values()), None)
    for pr in PULL_REQUESTS:
        if only and pr.slug not in only and pr.slug in kept:
            results["pull_requests"][pr.slug] = kept[pr.slug]
            continue
        trees = build_trees(pr, vllm_tests, work)
        entry: dict[str, Any] = {
            "subject": pr.subject,
            "diffstat": tree.patch_stats(pr.patch_file)["files"],
        }
        if pr.slug in previous and "nearby" in previous[pr.slug]:  # --nearby's, kept
            entry["nearby"] = previous[pr.slug]["nearby"]
        for name, vllm_tree in trees.items():
            env = environment(vllm_tree, work / "hf")
            tests = run_tests(pr, vllm_tree, env)
            if name == "stock":
                stock_fuzz = fuzz = stock_fuzz or run_fuzz(env, seeds)
            else:
                fuzz = run_fuzz(env, seeds)
            entry[name] = {"tests": tests, "fuzz": fuzz}
            print(f"{pr.slug} {name}: tests {tests}", flush=True)
        results["pull_requests"][pr.slug] = entry
    if only and COMBINED not in only and COMBINED in last and last.get("seeds") == seeds:
        results[COMBINED] = last[COMBINED]
    else:
        combined = tree.build(vllm_tests, work / COMBINED, [combined_patch(vllm_tests, work)])
        results[COMBINED] = {"fuzz": run_fuzz(environment(combined, work / "hf"), seeds)}
        print(f"{COMBINED}: fuzzed", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-tests", type=Path, required=True, help="fetch_vllm_tests DEST")
    parser.add_argument("--check", action="store_true", help="fail if a patch is stale")
    parser.add_argument("--prove", action="store_true", help="write upstream/out/prs/results.json")
    parser.add_argument(
        "--tests-both-ways", action="store_true", help="each test fails on stock, passes patched"
    )
    parser.add_argument("--work", type=Path, default=Path(".nox/upstream/prs"))
    parser.add_argument("--seeds", type=int, default=3, help="fuzz seeds per configuration")
    parser.add_argument("--only", action="append", default=[], help="prove this one (slug)")
    parser.add_argument(
        "--nearby", action="store_true", help="vLLM's own tests of each change, into results"
    )
    args = parser.parse_args(argv)
    args.work = args.work.resolve()  # the runs' working directories are the trees
    if args.tests_both_ways:
        failed = []
        for pr in PULL_REQUESTS:
            for name, vllm_tree in build_trees(pr, args.vllm_tests, args.work).items():
                counts = run_tests(pr, vllm_tree, environment(vllm_tree, args.work / "hf"))
                print(f"{pr.slug} {name}: {counts}")
                if counts["failed" if name == "stock" else "passed"] != pr.num_tests:
                    failed.append(f"{pr.slug} {name}")
        print("FAILED: " + ", ".join(failed) if failed else "ok")
        return 1 if failed else 0
    if args.nearby:
        results = json.loads(RESULTS.read_text())
        for pr in PULL_REQUESTS:
            if pr.nearby and (not args.only or pr.slug in args.only):
                entry = nearby(pr, args.vllm_tests, args.work)
                results["pull_requests"][pr.slug]["nearby"] = entry
                print(
                    f"{pr.slug}: {entry['stock']} -> {entry['patched']}, differ {entry['differ']}"
                )
        RESULTS.write_text(json.dumps(results, indent=1))
        return 0
    if args.prove:
        results = prove(args.vllm_tests, args.work, args.seeds, args.only)
        RESULTS.write_text(json.dumps(results, indent=1))
        print(f"wrote {RESULTS.relative_to(UPSTREAM.parent)}")
        return 0
    return write_patches(patches(args.vllm_tests), args.check, "upstream/tools/prs.py")


if __name__ == "__main__":
    sys.exit(main())
