"""Write docs/vllm-tests.md's table from the runs of vLLM's own tests, stock and guarded.

``run_vllm_suite.py`` leaves ``summary.json`` in its ``--out`` directory; the nox sessions
put it in ``.nox/vllm-suite-<selection>-<X.Y>/``. This script turns each summary it finds
into its session's row of the table between ``<!-- vllm-suite:begin -->`` and
``<!-- vllm-suite:end -->`` in ``--doc``; a session without a summary here keeps the row it
has. ``nox -s vllm-suite-0.32`` / ``-0.33`` run it after their run; after ``nox -s
vllm-suite-ci`` (in CI, which leaves the documents alone) run it by hand::

    python3 tests/vllm_suite/report.py --doc docs/vllm-tests.md

Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / ".nox"
BEGIN, END = "<!-- vllm-suite:begin -->", "<!-- vllm-suite:end -->"
#: Session -> (selection, vLLM release), in table order.
SESSIONS = {
    "vllm-suite-0.33": ("full", "0.33"),
    "vllm-suite-0.32": ("full", "0.32"),
    "vllm-suite-ci": ("ci", "0.33"),
}
HEADER = (
    "| session | vLLM | tests | stock: passed / failed / skipped | guard: passed / failed / "
    "skipped | guarded-only failures | guard used in | wall (stock + guard) |\n"
    "|---|---|---|---|---|---|---|---|"
)
_ROW_SESSION = re.compile(r"^\| `([^`]+)` \|")


def _count(summary: str, outcome: str) -> int:
    match = re.search(rf"(\d+) {outcome}\b", summary)
    return int(match.group(1)) if match else 0


def row(session: str, summary: dict[str, Any]) -> str:
    counts = summary["counts"]

    def outcomes(mode: str) -> str:
        failed = _count(counts[mode], "failed") + _count(counts[mode], "error")
        return f"{_count(counts[mode], 'passed')} / {failed} / {_count(counts[mode], 'skipped')}"

    tests = sum(int(n) for n in re.findall(r"(\d+) \w+", counts["guard"]))
    expected, unexpected = len(summary["expected"]), len(summary["unexpected"])
    guarded_only = f"{expected + unexpected}" + (
        ", all listed" if not unexpected else f", **{unexpected} not listed**"
    )
    walls = summary["wall_s"]
    return (
        f"| `{session}` | {summary['vllm']} | {tests} | {outcomes('stock')} | "
        f"{outcomes('guard')} | {guarded_only} | {summary['exercised_by_guard']} tests | "
        f"{walls['stock']:.0f} s + {walls['guard']:.0f} s |"
    )


def block(existing: str, runs: Path = RUNS) -> str:
    kept = {}
    for line in existing.splitlines():
        match = _ROW_SESSION.match(line)
        if match:
            kept[match.group(1)] = line
    rows = []
    for session, (selection, release) in SESSIONS.items():
        summary = runs / f"vllm-suite-{selection}-{release}" / "summary.json"
        if summary.exists():
            rows.append(row(session, json.loads(summary.read_text())))
        elif session in kept:
            rows.append(kept[session])
    return "\n".join([BEGIN, HEADER, *rows, END])


def update_doc(doc: Path, runs: Path = RUNS) -> None:
    text = doc.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    existing, tail = rest.split(END, 1)
    doc.write_text(head + block(existing, runs) + tail, encoding="utf-8")
    print(f"updated the vLLM-suite table in {doc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc", type=Path, required=True, help="e.g. docs/vllm-tests.md")
    parser.add_argument("--runs", type=Path, default=RUNS, help="where the sessions' --out are")
    args = parser.parse_args(argv)
    update_doc(args.doc, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
