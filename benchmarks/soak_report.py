"""Put the soak reports' summary tables into a document (``docs/fuzzing.md``).

Each ``benchmarks/results/soak-vllm-<X.Y>.md`` is a soak's own report, written by
``python -m vllm_prefix_guard.diagnostics.fuzz.soak --out FILE`` (``nox -s soak-<X.Y>``): a
line saying where and how long it ran, the command, the per-configuration summary, the
per-mode counters, the timings and every check. This script copies the first three into
the block between ``<!-- soak:begin -->`` and ``<!-- soak:end -->`` of ``--doc``, one
section per vLLM release, each linking its full report. Standard library only.

Usage::

    python benchmarks/soak_report.py --doc docs/fuzzing.md
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
BEGIN, END = "<!-- soak:begin -->", "<!-- soak:end -->"
#: Soak reports of a whole release (not the reports of one configuration re-run alone).
REPORT = re.compile(r"^soak-vllm-(\d+)\.(\d+)\.md$")


def release(report: Path) -> tuple[int, int] | None:
    """``(X, Y)`` of a release's soak report ``soak-vllm-X.Y.md``; None for any other file."""
    match = REPORT.match(report.name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def reports(results: Path) -> list[Path]:
    found = [p for p in results.glob("soak-vllm-*.md") if release(p) is not None]
    return sorted(found, key=lambda p: release(p) or (0, 0))


def summary(report: Path) -> tuple[str, str, list[str]]:
    """A report's first line, its command line and its first table."""
    lines = report.read_text(encoding="utf-8").splitlines()
    heading = lines[0].strip()
    command = next((line.strip() for line in lines if line.startswith("Command: ")), "")
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return heading, command, lines[start:end]


def block(results: Path, doc_dir: Path) -> str:
    parts = [
        BEGIN,
        "Written by `python benchmarks/soak_report.py --doc docs/fuzzing.md` from the soak "
        "reports in `benchmarks/results/` (`nox -s soak-<X.Y>` writes them and runs it).",
    ]
    for report in reports(results):
        heading, command, table = summary(report)
        link = Path(os.path.relpath(report, doc_dir)).as_posix()
        version = ".".join(str(n) for n in release(report) or ())
        parts += [
            "",
            f"#### Soak on vLLM {version}",
            "",
            f"{heading} {command} Full report (per-mode counters, rollbacks by cause, ledger "
            f"peaks, time per step, every check): [`{report.name}`]({link}).",
            "",
            *table,
        ]
    if len(parts) == 2:
        parts += ["", f"No soak report in {results}: run `nox -s soak-<X.Y>` first."]
    return "\n".join([*parts, END])


def update_doc(doc: Path, results: Path = RESULTS) -> None:
    text = doc.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(head + block(results.resolve(), doc.resolve().parent) + tail, encoding="utf-8")
    print(f"updated the soak block in {doc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc", type=Path, required=True, help="e.g. docs/fuzzing.md")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    update_doc(args.doc, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
