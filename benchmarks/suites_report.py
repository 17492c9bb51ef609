#!/usr/bin/env python3
"""Record the suite's outcome on each vLLM release (``nox -s suites-record``).

A plain ``nox`` runs the suite on the releases of ``noxfile.DEFAULT_SUITES``; the others
(``nox -s tests-vllm-0.31 tests-vllm-0.33``) are too slow for every CI run and are proven
here instead: each whole ``tests-vllm-X`` run (none narrowed after ``--``) leaves a JUnit
file in ``.nox/``, and this script keeps one row per release in
``benchmarks/results/suites.json`` (a release not run this time keeps its row) and renders
them as a table.

Usage::

    python benchmarks/suites_report.py --out benchmarks/results/suites.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOX = ROOT / ".nox"
RECORD = ROOT / "benchmarks" / "results" / "suites.json"


def read_junit(path: Path) -> dict[str, object]:
    suite = ET.parse(path).getroot()
    if suite.tag == "testsuites":
        suite = suite[0]
    tests, failures, errors, skipped = (
        int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")
    )
    return {
        "tests": tests,
        "passed": tests - failures - errors - skipped,
        "failed": failures,
        "errors": errors,
        "skipped": skipped,
        "seconds": round(float(suite.get("time", 0))),
        "date": (suite.get("timestamp") or "")[:10],
    }


def installed_vllm(release: str) -> str:
    marker = NOX / f"vllm-{release}" / ".vllm-requirement"
    return marker.read_text().strip() if marker.exists() else "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows: dict[str, dict[str, object]] = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    commit += " with changes" if dirty else ""
    for junit in sorted(NOX.glob("suite-vllm-*.xml")):
        release = re.sub(r"^suite-vllm-|\.xml$", "", junit.name)
        rows[release] = {
            **read_junit(junit),
            "distribution": installed_vllm(release),
            "commit": commit,
        }
    RECORD.write_text(json.dumps(dict(sorted(rows.items())), indent=1) + "\n")
    lines = [
        "# The suite on every tested vLLM release",
        "",
        "`nox -s tests-vllm-X` per release (`tests/`, without the engine end to end), recorded "
        "by `nox -s suites-record`. A plain `nox` (CI) runs the default releases' suites "
        "every time (noxfile.py `DEFAULT_SUITES`); the rows of the others are their latest "
        "named runs.",
        "",
        "| release | installed | passed | failed | errors | skipped | wall time | date | commit |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for release, row in sorted(rows.items(), key=lambda kv: [int(p) for p in kv[0].split(".")]):
        lines.append(
            f"| {release} | `{row['distribution']}` | {row['passed']} | {row['failed']} "
            f"| {row['errors']} | {row['skipped']} | {int(row['seconds']) / 60:.1f} min "
            f"| {row['date'] or datetime.date.today()} | {row['commit']} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out} ({len(rows)} releases)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
