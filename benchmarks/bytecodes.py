"""Bytecodes per scheduler step: the guard's Python work, free of where objects land.

``instructions.py`` counts machine instructions, and those move with the process's memory
layout: one column counts up to 0.4% apart between processes (dict and set probing, the
allocator's paths), as much as the whole guard costs. The guard's overhead is Python code,
so this counts what does not move: the bytecodes CPython executes inside the two scheduler
calls (``sys.settrace`` with opcode events, switched on only around them, after the same
warm-up as ``instructions.py``). A bytecode is not an instruction (a dict lookup costs more
than a ``LOAD_FAST``), but for the same vLLM the ratio of two columns is the ratio of
their Python work, and it repeats exactly.

    python benchmarks/bytecodes.py [--cell 256-fcfs-nopressure-sync] [--columns stock,guard,graft]

Each column runs in its own process (the guard's patches are process-wide).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import scheduler_bench
from instructions import DEFAULT_CELL, GRAFT, idle_rules
from scheduler_bench import Lane, frozen_heap, mode_of, parse_cells

HERE = Path(__file__).resolve().parent


class OpcodeCounter:
    """Counts opcode events of every Python frame started inside :meth:`call`, in all and
    per function of the guard (``vllm`` for everything else), and the frames started."""

    def __init__(self) -> None:
        self.by_function: collections.Counter[str] = collections.Counter()
        self.frames = 0

    def _frame(self, frame: Any, event: str, arg: Any) -> Any:
        self.frames += 1
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        path = frame.f_code.co_filename
        name = "vllm"
        if "vllm_prefix_guard" in path:
            name = f"{path.rpartition('vllm_prefix_guard/')[2]}:{frame.f_code.co_qualname}"
        by_function = self.by_function

        def opcode(frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode":
                by_function[name] += 1
            return opcode

        return opcode

    def call(self, method: Any, *args: Any) -> Any:
        sys.settrace(self._frame)
        try:
            return method(*args)
        finally:
            sys.settrace(None)


def count(cell_name: str, column: str, warmup: int, steps: int) -> dict[str, Any]:
    """Bytecodes per measured step of one column, in this process."""
    parser = argparse.ArgumentParser()
    (cell,) = parse_cells(parser, cell_name.split("-", 1)[0], cell_name)
    if mode_of(column) == GRAFT:
        idle_rules()
        column = "guard"
    counter = OpcodeCounter()
    with frozen_heap():
        lane = Lane(cell, column)
        for _ in range(warmup):
            lane.iterate(measured=False)
        plain = scheduler_bench._call
        scheduler_bench._call = counter.call
        try:
            for _ in range(steps):
                lane.iterate(measured=True)
        finally:
            scheduler_bench._call = plain
        trajectory = lane.counters()["trajectory"]
    by_function = {k: v // steps for k, v in counter.by_function.most_common()}
    return {
        "bytecodes_per_step": sum(counter.by_function.values()) // steps,
        "frames_per_step": counter.frames // steps,
        "trajectory": trajectory,
        "by_function": by_function,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cell", default=DEFAULT_CELL)
    parser.add_argument("--columns", default=f"stock,guard,{GRAFT}")
    parser.add_argument("--warmup", type=int, default=150)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON results here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(count(args.cell, args.one, args.warmup, args.steps)))
        return 0
    env = dict(os.environ, PYTHONHASHSEED="0", HF_HUB_OFFLINE="1")
    results: dict[str, Any] = {"cell": args.cell, "warmup": args.warmup, "steps": args.steps}
    for column in args.columns.split(","):
        done = subprocess.run(
            [sys.executable, __file__, "--cell", args.cell, "--one", column,
             "--warmup", str(args.warmup), "--steps", str(args.steps)],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        results[column] = json.loads(done.stdout.strip().splitlines()[-1])
    reference = results[args.columns.split(",")[0]]["bytecodes_per_step"]
    for column in args.columns.split(","):
        entry = results[column]
        entry["ratio"] = round(entry["bytecodes_per_step"] / reference, 4)
        print(
            f"  {column}: {entry['bytecodes_per_step']:,} bytecodes/step (x{entry['ratio']:.4f}),"
            f" {entry['frames_per_step']:,} frames/step"
        )
        for name, per_step in list(entry["by_function"].items())[1:6]:
            print(f"      {per_step:>9,}  {name}")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
