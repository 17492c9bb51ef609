"""Put the soak reports' summary tables into a document (``docs/fuzzing.md``).

Each ``benchmarks/results/soak-vllm-<X.Y>.md`` is a soak's own report, written by
``python -m vllm_prefix_guard_harness.fuzz.soak --out FILE`` (``nox -s soak-<X.Y>``): a
line saying where and how long it ran, the command, the per-configuration summary, the
per-mode counters, the timings and every check. This script copies the first three into
the block between ``<!-- soak:begin -->`` and ``<!-- soak:end -->`` of ``--doc``, one
section per vLLM release, each linking its full report, with stock's bad reads on the
release before (where that one was soaked) beside the release's own. A soak run in parts
(``--config`` sets that together cover every configuration, each ``--out
soak-vllm-<X.Y>-part<N>of<M>.md``) stands for the release once all M parts are there; its
tables are merged. Standard library only.

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


#: One part of a release's soak: ``soak-vllm-<X.Y>-part<N>of<M>.md``.
PART = re.compile(r"^soak-vllm-(\d+)\.(\d+)-part(\d+)of(\d+)\.md$")


def release(report: Path) -> tuple[int, int] | None:
    """``(X, Y)`` of a release's soak report ``soak-vllm-X.Y.md``; None for any other file."""
    match = REPORT.match(report.name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def reports(results: Path) -> list[tuple[tuple[int, int], list[Path]]]:
    """Each soaked release and its report, or its parts once all are there, oldest first."""
    by_release = {release(p): [p] for p in results.glob("soak-vllm-*.md") if release(p)}
    parts: dict[tuple[int, int], dict[int, Path]] = {}
    expected: dict[tuple[int, int], int] = {}
    for path in results.glob("soak-vllm-*-part*of*.md"):
        if match := PART.match(path.name):
            key = (int(match.group(1)), int(match.group(2)))
            parts.setdefault(key, {})[int(match.group(3))] = path
            expected[key] = int(match.group(4))
    for key, found in parts.items():
        if key not in by_release and sorted(found) == list(range(1, expected[key] + 1)):
            by_release[key] = [found[n] for n in sorted(found)]
    return sorted((key, files) for key, files in by_release.items() if key is not None)


def bad_reads_column(table: list[str]) -> int | None:
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    return next((i for i, name in enumerate(header) if name.startswith("bad reads")), None)


def configuration(cells: list[str]) -> str:
    """A row's configuration, without its ``(targeted)`` mark."""
    return cells[0].split("(")[0].strip()


def stock_bad_reads(table: list[str]) -> dict[str, str]:
    """Stock's bad reads per configuration (the first figure of the ``bad reads`` column)."""
    column = bad_reads_column(table)
    if column is None:
        return {}
    rows = (row.strip("|").split("|") for row in table[2:])
    return {configuration(cells): cells[column].split("/")[0].strip() for cells in rows}


def beside(table: list[str], before: dict[str, str], version: str) -> list[str]:
    """``table`` with stock's bad reads on ``version`` after its own bad-reads column."""
    column = bad_reads_column(table)
    if column is None or not before:
        return table
    column += 1
    out = []
    for n, row in enumerate(table):
        cells = row.strip("|").split("|")
        if n == 0:
            extra = f" stock's bad reads on {version} "
        elif n == 1:
            extra = "---:"
        else:
            extra = f" {before.get(configuration(cells), '-')} "
        out.append("|" + "|".join([*cells[:column], extra, *cells[column:]]) + "|")
    return out


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
    previous: tuple[str, dict[str, str]] | None = None
    for (major, minor), files in reports(results):
        version = f"{major}.{minor}"
        summaries = [summary(report) for report in files]
        table = [*summaries[0][2][:2], *(row for _, _, t in summaries for row in t[2:])]
        parts += ["", f"#### Soak on vLLM {version}", ""]
        what = (
            "Full report (per-mode counters, rollbacks by cause, ledger peaks, time per step, "
            "every check)"
        )
        for n, (heading, command, _) in enumerate(summaries):
            link = Path(os.path.relpath(files[n], doc_dir)).as_posix()
            part = f"Part {n + 1} of {len(files)}. " if len(files) > 1 else ""
            parts += [f"{part}{heading} {command} {what}: [`{files[n].name}`]({link}).", ""]
        if previous is not None:
            before_version, before = previous
            table = beside(table, before, before_version)
        parts += table
        previous = (version, stock_bad_reads(table))
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
