"""The scheduler benchmark runs on the harness the tests and the fuzzer use.

A short cell of every column, interleaved and timed as ``nox -s bench`` does: the guard
takes stock's trajectory under FCFS, the shadow-KV worker sees no bad read, only the
scheduler's calls are timed, the guard's step records drain; and the report puts two such
runs side by side (the before/after tables of the README's benchmark block).
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import report
        import scheduler_bench

        yield scheduler_bench, report
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_a_short_cell_times_every_column_on_the_harness(bench: Any, tmp_path: Path) -> None:
    scheduler_bench, report = bench
    cell = scheduler_bench.Cell(16, "fcfs", pressure=True, async_scheduling=True)
    plan = scheduler_bench.Plan(warmup=8, segments=2, segment_steps=3)
    summary = scheduler_bench.run_cell(cell, plan, scheduler_bench.COLUMNS, log=io.StringIO())
    columns = summary["columns"]
    stock, guard = columns["stock"], columns["guard"]
    assert stock["preemptions"] > 0  # the cell is under pressure
    assert guard["same_trajectory_as_stock"]
    assert guard["hit_ratio"] == guard["preemption_ratio"] == 1.0
    assert stock["median_step_us"] > 0 and stock["median_step_cpu_us"] > 0
    for name in ("guard", "pr43569"):
        counters = columns[name]["ledger"]  # the guard's counters (the documents' key)
        assert columns[name]["bad_kv_reads"] == 0
        assert counters["idle_after_drain"] and counters["uncommitted_entries"] == 0
        assert counters["peak_within_bound"]
        assert len(columns[name]["step_ratio"]["per_segment"]) == plan.segments

    # Two runs of the same plan, as before/after documents: identical counters.
    document = {
        "benchmark": "scheduler",
        "environment": {"vllm": "x", "python": "3", "cpus": 2, "load_average": 1.0},
        "columns": list(scheduler_bench.COLUMNS),
        "cells": [summary],
    }
    for side in ("before", "after"):
        (tmp_path / "compare" / side).mkdir(parents=True)
        (tmp_path / "compare" / side / "scheduler.json").write_text(json.dumps(document))
    text, _ = report.render(tmp_path)
    rows = [line for line in text.splitlines() if line.startswith(f"| {cell.name} | guard |")]
    assert len(rows) == 1 and rows[0].endswith(" | 17/17 |")


def test_bytecode_counts_repeat_exactly_and_name_the_guards_functions(bench: Any) -> None:
    """``bytecodes.py``: the same column counts the same in one process and the next
    (memory layout does not enter), and the guard's bytecodes are told apart by function."""
    import os
    import subprocess

    env = dict(os.environ, PYTHONHASHSEED="0")
    command = [
        sys.executable, str(BENCHMARKS / "bytecodes.py"), "--cell", "16-fcfs-pressure-sync",
        "--warmup", "8", "--steps", "3",
    ]  # fmt: skip
    counts = []
    for column in ("stock", "stock", "guard"):
        done = subprocess.run(
            [*command, "--one", column],
            capture_output=True,
            text=True,
            check=True,
            cwd=BENCHMARKS,
            env=env,
        )
        counts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    stock, again, guard = counts
    assert stock == again and set(stock["by_function"]) == {"vllm"}
    assert guard["trajectory"] == stock["trajectory"]
    assert guard["bytecodes_per_step"] > stock["bytecodes_per_step"]
    assert any(name.startswith("pool.py:") for name in guard["by_function"])
