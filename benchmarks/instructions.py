"""Instructions per scheduler step under callgrind: what a noisy VM's clock cannot settle.

The same cells, columns and engine loop as ``scheduler_bench.py`` (its :class:`Lane`), but
instead of timing, valgrind's callgrind counts the instructions executed inside the two
scheduler calls. Those go through ``operator.call`` (the C function ``_operator_call``),
which callgrind collects inside (``--toggle-collect``), so the shadow-KV worker and the
bookkeeping are not counted; instrumentation is switched on only after warm-up.

Reproducible: ``PYTHONHASHSEED=0``, and address-space randomisation off (``setarch -R``)
where the machine has ``setarch``: the same command counts the same to 0.001%. Not free of
memory layout, though: where objects land moves dict and set probing and the allocator's
paths, so one column run under another name (``stock`` and ``stock#2``) or from another
source tree counts up to 0.4% apart (2026-12-06, vLLM 0.32). To compare the guard's Python
work across trees, ``bytecodes.py`` counts what does not move.
Instructions are not time (cache misses are not counted), but the scheduler is
interpreter-bound and the two move together.

Two subcommands::

    # every column of the 256-running sync FCFS cell, one callgrind process each
    python benchmarks/instructions.py measure --out benchmarks/results/instructions.json
    python benchmarks/instructions.py measure --cells 256-fcfs-pressure-sync --steps 30

    # one column: the process ``measure`` runs under callgrind (prints its trajectory and
    # ledger as JSON); run it under valgrind yourself to look at the call graph
    valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no \\
        --toggle-collect=_operator_call \\
        python benchmarks/instructions.py count 256-fcfs-nopressure-sync guard

A column only this script has, ``graft``: the guard's scheduler hooks and pool mixin in
place, but its step calls (``begin_step``, ``end_step``, ``commit_step``) do nothing, so no
step record is ever open and the pool's overrides take their pass-through branch. ``graft``
against ``stock`` is the graft's own cost (the extra frames on vLLM's hot path); ``guard``
against ``graft`` is the rules' work (recording, commit, attribution).

Needs Python 3.11+ (``operator.call``) and valgrind.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from scheduler_bench import (
    COLUMNS,
    Cell,
    Lane,
    frozen_heap,
    mode_of,
    parse_cells,
    parse_columns,
    write_results,
)

DEFAULT_CELL = "256-fcfs-nopressure-sync"
#: The guard grafted, its rules idle (see the module docstring).
GRAFT = "graft"
DEFAULT_COLUMNS = (*COLUMNS, GRAFT)
#: Address-space randomisation off for the process callgrind runs (see the module docstring).
NO_ASLR = ["setarch", platform.machine(), "-R"] if shutil.which("setarch") else []
CALLGRIND = [
    *NO_ASLR, "valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
    "--toggle-collect=_operator_call",
]  # fmt: skip


def count(cell: Cell, column: str, warmup: int, steps: int) -> dict[str, Any]:
    """Warm up uninstrumented, then run ``steps`` iterations with instrumentation on.

    Under callgrind, ``callgrind_control -i`` switches instrumentation for this process;
    collection itself is toggled by the scheduler calls (see the module docstring).
    """
    pid = str(os.getpid())
    if mode_of(column) == GRAFT:
        idle_rules()
        column = "guard"
    with frozen_heap():
        lane = Lane(cell, column)
        for _ in range(warmup):
            lane.iterate(measured=False)
        subprocess.run(["callgrind_control", "-i", "on", pid], check=True, capture_output=True)
        time.sleep(0.5)  # callgrind polls its command file
        for _ in range(steps):
            lane.iterate(measured=True)
        subprocess.run(["callgrind_control", "-i", "off", pid], check=True, capture_output=True)
        counters = lane.counters()
    return {"trajectory": counters["trajectory"], "ledger": counters.get("ledger")}


def idle_rules() -> None:
    """The ``graft`` column: the guard's step calls do nothing in this process."""
    from vllm_prefix_guard.scheduler_guard import SchedulerGuard

    def idle(self: Any, *args: Any) -> None:
        return None

    for name in ("begin_step", "end_step", "commit_step"):
        setattr(SchedulerGuard, name, idle)


def columns_of(parser: argparse.ArgumentParser, text: str) -> tuple[str, ...]:
    """``--columns``: scheduler_bench's columns, and ``graft``."""
    columns = tuple(c for c in text.split(",") if c)
    parse_columns(parser, ",".join(c for c in columns if mode_of(c) != GRAFT))
    return columns


def measure(
    cells: list[Cell], columns: tuple[str, ...], warmup: int, steps: int
) -> list[dict[str, Any]]:
    """Instructions per measured step for each cell and column, one callgrind run each."""
    env = dict(os.environ, PYTHONHASHSEED="0")

    def one(cell: Cell, column: str) -> tuple[int, dict[str, Any]]:
        with tempfile.TemporaryDirectory() as tmp:
            command = [
                *CALLGRIND, f"--callgrind-out-file={tmp}/callgrind.out",
                sys.executable, __file__, "count", cell.name, column,
                "--warmup", str(warmup), "--steps", str(steps),
            ]  # fmt: skip
            done = subprocess.run(command, env=env, capture_output=True, text=True)
        found = re.search(r"Collected : (\d+)", done.stderr)
        if done.returncode != 0 or found is None:
            raise RuntimeError(f"callgrind run {cell.name}/{column} failed:\n{done.stderr[-2000:]}")
        return int(found.group(1)), json.loads(done.stdout.strip().splitlines()[-1])

    jobs = [(cell, column) for cell in cells for column in columns]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda job: one(*job), jobs))
    by_job = dict(zip(jobs, results, strict=True))
    summaries = []
    for cell in cells:
        reference, _ = by_job[(cell, columns[0])]
        entry: dict[str, Any] = {"cell": cell.name, "warmup": warmup, "steps": steps}
        for column in columns:
            instructions, info = by_job[(cell, column)]
            entry[column] = {
                "instructions_per_step": instructions // steps,
                "ratio": round(instructions / reference, 4),
                "trajectory": info["trajectory"],
            }
        summaries.append(entry)
        line = "  ".join(
            f"{c}={entry[c]['instructions_per_step'] / 1e6:.2f}M (x{entry[c]['ratio']:.4f})"
            for c in columns
        )
        print(f"  {cell.name} instructions/step: {line}", flush=True)
    return summaries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("measure", help="every cell x column, one callgrind run each")
    run.add_argument("--sizes", default="256", help="running requests per cell")
    run.add_argument("--cells", default=DEFAULT_CELL, help="comma-separated cell names")
    run.add_argument(
        "--columns", default=",".join(DEFAULT_COLUMNS), help="first (stock) is the reference"
    )
    run.add_argument("--out", type=Path, default=None, help="write the JSON results here")
    one = commands.add_parser("count", help="one column, in the process callgrind watches")
    one.add_argument("cell", help="a cell name, e.g. " + DEFAULT_CELL)
    one.add_argument("column", help="stock, guard or pr43569 (optionally #suffixed)")
    for sub in (run, one):
        sub.add_argument("--warmup", type=int, default=150, help="uninstrumented iterations")
        sub.add_argument("--steps", type=int, default=15, help="instrumented iterations")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    if args.command == "count":
        if mode_of(args.column) not in DEFAULT_COLUMNS:
            parser.error(f"column takes {', '.join(DEFAULT_COLUMNS)} (optionally with a #suffix)")
        (cell,) = parse_cells(parser, args.cell.split("-", 1)[0], args.cell)
        print(json.dumps(count(cell, args.column, args.warmup, args.steps)))
        return 0
    columns = columns_of(parser, args.columns)
    cells = parse_cells(parser, args.sizes, args.cells)
    started = time.monotonic()
    counts = measure(cells, columns, args.warmup, args.steps)
    write_results(args.out, "scheduler-instructions", columns, started, counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
