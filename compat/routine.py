#!/usr/bin/env python3
"""Bring in a vLLM release: ``nox -s compat -- --vllm X.Y.Z``.

The routine a new vLLM release goes through before the project claims it, in order:

1. **static**: what moved in every internal the guard touches, read from the wheels'
   sources before anything is installed (``compat/static_check.py``), into
   ``docs/compat/vllm-X.Y.Z.md``;
2. **install**: the release's venv, ``.nox/vllm-X.Y`` (``compat/install_vllm.py``: also
   when the index lacks one of its pins, seeded from the nearest made venv of the same
   distribution), with this checkout installed editable;
3. **doctor**: ``VLLM_PREFIX_GUARD=1 vllm-prefix-guard doctor --self-test``;
4. **suite**: ``pytest tests --ignore=tests/e2e`` (the scheduler-level suite);
5. **fuzz**: every CI configuration on the CI seeds (0-2), stock, guard and PR #43569;
6. **explore**: the explorer's default scopes, stock and guard;
7. **soak**: a sample soak, ``--soak-steps`` steps per configuration and mode (every
   configuration; the full soak is ``nox -s soak-X.Y``).

Each stage's outcome and wall time go into ``benchmarks/results/releases.json``, the page's
"Brought in" section, and the release's row of the table in ``docs/exposure.md``. A stage
that fails is recorded and the routine goes on (a release the guard refuses still gets its
stock exposure from the fuzz); the exit status is 1 unless every stage passed.

Usage::

    python compat/routine.py --vllm 0.34.0 [--base 0.33.0] [--guard-rev REV]
                             [--soak-steps 10000] [--stages static,install,...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "compat"))
import install_vllm  # noqa: E402
import static_check  # noqa: E402

from vllm_prefix_guard_harness.records import portable_command  # noqa: E402


def _load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem + "_survey", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: The release survey's helpers (doctor and fuzz summaries, the venv's environment).
survey = _load(ROOT / "benchmarks" / "compat.py")

STAGES = ("static", "install", "doctor", "suite", "fuzz", "explore", "soak")
RECORD = ROOT / "benchmarks" / "results" / "releases.json"
EXPOSURE = ROOT / "docs" / "exposure.md"
BEGIN, END = "<!-- releases:begin -->", "<!-- releases:end -->"
RUN_BEGIN, RUN_END = "<!-- routine:begin -->", "<!-- routine:end -->"


def short(version: str) -> str:
    return version.rsplit(".", 1)[0]


def run_logged(cmd: list[str], log: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """``cmd`` with its stderr appended to ``log``; ``(exit status, its stdout)``."""
    out = log.with_suffix(".stdout")
    rc, _ = survey.run(cmd, log, timeout=timeout, env=env, cwd=ROOT, stdout_to=out)
    return rc, out.read_text(errors="replace") if out.exists() else ""


class Routine:
    """One release's stages, their outcomes and timings."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.version: str = args.vllm
        self.args = args
        self.venv = ROOT / ".nox" / f"vllm-{short(self.version)}"
        self.work = ROOT / ".nox" / "compat" / self.version
        self.work.mkdir(parents=True, exist_ok=True)
        self.log = self.work / "routine.log"
        self.env = survey.venv_env(self.venv, self.work)
        self.bin = self.venv / "bin"
        self.entry: dict[str, Any] = {"version": self.version, "stages": {}}

    def stage(self, name: str, outcome: dict[str, Any], started: float) -> None:
        outcome["seconds"] = round(time.monotonic() - started)
        self.entry["stages"][name] = outcome
        print(f"[{name}] {'ok' if outcome.get('ok') else 'FAIL'} ({outcome['seconds']} s)")

    def static(self) -> dict[str, Any]:
        argv = ["--vllm", self.version, "--out", str(self.page)]
        if self.args.base:
            argv += ["--base", self.args.base]
        if self.args.guard_rev:
            argv += ["--guard-rev", self.args.guard_rev]
        static_check.main(argv)
        text = self.page.read_text()
        refusing = len(re.findall(r"\| (?:removed|signature changed) \|", text.split("## Now")[-1]))
        return {"ok": refusing == 0, "page": str(self.page.relative_to(ROOT)), "refusing": refusing}

    @property
    def page(self) -> Path:
        return ROOT / "docs" / "compat" / f"vllm-{self.version}.md"

    def install(self) -> dict[str, Any]:
        requirement = self.args.requirement or f"vllm=={self.version}"
        left_out: list[str] = []
        if not install_vllm.is_made(self.venv, requirement):
            seed = install_vllm.seed_source(self.venv, requirement)
            left_out = install_vllm.install(self.venv, requirement, seed)
        else:
            missing = self.venv / ".vllm-missing-requirements"
            left_out = missing.read_text().split() if missing.exists() else []
        rc, _ = run_logged(
            [
                str(self.bin / "python"),
                "-m",
                "pip",
                "install",
                "--quiet",
                "-e",
                f"{ROOT}[test]",
                "-e",
                str(ROOT / "harness"),
            ],
            self.log,
            self.env,
            1800,
        )
        size = sum(f.stat().st_size for f in self.venv.rglob("*") if f.is_file())
        return {
            "ok": rc == 0,
            "requirement": requirement,
            "left_out": left_out,
            "gigabytes": round(size / 1e9, 1),
        }

    def doctor(self) -> dict[str, Any]:
        env = {**self.env, "VLLM_PREFIX_GUARD": "1"}
        cmd = [str(self.bin / "vllm-prefix-guard"), "doctor", "--self-test", "--json"]
        rc, out = run_logged(cmd, self.log, env, 1800)
        try:
            checks = survey.first_json(out)
        except ValueError:
            return {"ok": False, "rc": rc}
        checks = checks.get("checks", checks) if isinstance(checks, dict) else checks
        summary = survey.doctor_summary(checks)
        self_test = [c["detail"] for c in checks if c["name"].startswith("self-test")]
        return {"ok": rc == 0, **summary, "self_test": self_test[0] if self_test else None}

    def suite(self) -> dict[str, Any]:
        junit = self.work / "suite.xml"
        cmd = [
            str(self.bin / "pytest"),
            "tests",
            "--ignore=tests/e2e",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
        ]
        rc, _ = run_logged(cmd, self.log, self.env, 7200)
        if not junit.exists():
            return {"ok": False, "rc": rc}
        suite = ET.parse(junit).getroot()
        suite = suite[0] if suite.tag == "testsuites" else suite
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        return {"ok": rc == 0, "passed": passed, **counts}

    def fuzz(self) -> dict[str, Any]:
        out = self.work / "fuzz.json"
        cmd = [
            str(self.bin / "vllm-prefix-guard-harness"),
            "fuzz",
            "--json",
            "--seeds",
            "3",
            "--shrink-seconds",
            "0",
        ]
        rc, stdout = run_logged(cmd, self.log, self.env, 7200)
        refused = rc == 2  # the guard cannot apply: stock's exposure all the same
        if refused:
            rc, stdout = run_logged([*cmd, "--modes", "stock"], self.log, self.env, 7200)
        try:
            document = survey.slim_fuzz(survey.first_json(stdout))
        except ValueError:
            return {"ok": False, "rc": rc}
        out.write_text(json.dumps(document))
        return {
            "ok": rc == 0 and not refused,
            "guard_refused": refused,
            **survey.fuzz_summary(document),
        }

    def explore(self) -> dict[str, Any]:
        out = self.work / "explore.json"
        cmd = [str(self.bin / "vllm-prefix-guard-harness"), "explore", "--json", str(out)]
        rc, _ = run_logged(cmd, self.log, self.env, 14400)
        scopes = json.loads(out.read_text())["scopes"] if out.exists() else []
        violations = {
            mode: sum(scope["violations"].get(mode, 0) for scope in scopes)
            for mode in ("stock", "guard")
        }
        return {"ok": rc == 0, "scopes": scopes, "violations": violations}

    def soak(self) -> dict[str, Any]:
        report = ROOT / "benchmarks" / "results" / f"soak-sample-vllm-{short(self.version)}.md"
        cmd = [
            str(self.bin / "python"),
            "-m",
            "vllm_prefix_guard_harness.fuzz.soak",
            "--steps",
            str(self.args.soak_steps),
            "--jobs",
            str(self.args.jobs),
            "--out",
            str(report),
        ]
        rc, _ = run_logged(cmd, self.log, self.env, 6 * 3600)
        return {
            "ok": rc == 0,
            "steps": self.args.soak_steps,
            "report": str(report.relative_to(ROOT)),
        }

    def run(self, stages: list[str]) -> dict[str, Any]:
        started_all = time.monotonic()
        for name in stages:
            started = time.monotonic()
            try:
                outcome = getattr(self, name)()
            except Exception as exc:  # a stage that crashes is recorded, the rest go on
                outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            self.stage(name, outcome, started)
        self.entry["seconds"] = round(time.monotonic() - started_all)
        self.entry["date"] = time.strftime("%Y-%m-%d", time.gmtime())
        self.entry["command"] = portable_command(["python", "compat/routine.py", *sys.argv[1:]])
        self.entry["cpus"] = os.cpu_count()
        return self.entry


def merge(entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` over the release's recorded one (stages not run this time are kept)."""
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    previous = record.get(entry["version"], {"stages": {}})
    merged = {**previous, **entry, "stages": {**previous["stages"], **entry["stages"]}}
    if previous.get("command") and set(entry["stages"]) != set(STAGES):
        # A partial re-run: the page keeps naming the full run, and lists this one.
        merged.update((k, previous[k]) for k in ("command", "date", "cpus") if k in previous)
        merged["reruns"] = [*previous.get("reruns", []), f"{entry['command']} ({entry['date']})"]
    record[entry["version"]] = merged
    RECORD.write_text(json.dumps(dict(sorted(record.items())), indent=1) + "\n")
    return record


def total_seconds(entry: dict[str, Any]) -> float:
    """The stages' wall time, summed (partial re-runs replace their stages' times)."""
    return float(sum(stage.get("seconds", 0) for stage in entry["stages"].values()))


def row(entry: dict[str, Any]) -> str:
    """The release's row of the table in docs/exposure.md."""
    stages = entry["stages"]

    def cell(name: str, text: str) -> str:
        stage = stages.get(name)
        if stage is None:
            return "not run"
        return text if stage.get("ok") else f"**FAIL** {text}"

    static, install, doctor = (stages.get(n, {}) for n in ("static", "install", "doctor"))
    suite, fuzz, soak = (stages.get(n, {}) for n in ("suite", "fuzz", "soak"))
    totals = fuzz.get("totals", {})
    stock_bad = totals.get("stock", {}).get("violations", "?")
    guard_bad = totals.get("guard", {}).get("violations", "?")
    explore = stages.get("explore", {})
    explored = explore.get("violations", {})
    cells = [
        f"[{entry['version']}](compat/vllm-{entry['version']}.md)",
        cell("static", f"{static.get('refusing', '?')} refusing"),
        cell("install", ", ".join(install.get("left_out", [])) or "as pinned"),
        cell("doctor", f"{doctor.get('internals_ok', '?')} of {doctor.get('internals', '?')}"),
        cell("suite", f"{suite.get('passed', '?')} passed, {suite.get('failures', '?')} failed"),
        cell("fuzz", f"stock {stock_bad}, guard {guard_bad}"),
        cell(
            "explore",
            f"stock {explored.get('stock', '?')}, guard {explored.get('guard', '?')} "
            f"({len(explore.get('scopes', []))} scopes)",
        ),
        cell("soak", f"{soak.get('steps', '?')} steps per mode"),
        f"{total_seconds(entry) / 60:.0f} min",
    ]
    return "| " + " | ".join(cells) + " |"


def reruns_sentence(reruns: list[str]) -> str:
    """`` Re-run since: `CMD` (DATE); ...`` for the stages run again after the routine."""
    if not reruns:
        return ""
    parts = []
    for rerun in reruns:
        command, _, date = rerun.rpartition(" (")
        parts.append(f"`{command}` ({date}" if command else f"`{rerun}`")
    return " Re-run since: " + "; ".join(parts) + "."


def page_section(entry: dict[str, Any]) -> str:
    """The routine's block of the release's page: each stage's outcome and time."""
    lines = [
        RUN_BEGIN,
        "## Brought in by the routine",
        "",
        f"`{entry['command']}` on {entry['date']} ({entry['cpus']} CPUs), "
        f"{total_seconds(entry) / 60:.0f} min; every figure: `benchmarks/results/releases.json`."
        + reruns_sentence(entry.get("reruns", [])),
        "",
        "| stage | outcome | wall time |",
        "|---|---|---:|",
    ]
    for name, stage in entry["stages"].items():
        shown = {
            k: v
            for k, v in stage.items()
            if k
            not in (
                "ok",
                "seconds",
                "scopes",
                "totals",
                "bad_in",
                "modes",
                "missing",
                "other_failed",
            )
            and not (isinstance(v, dict) and k != "violations")
        }
        detail = "; ".join(f"{k.replace('_', ' ')}: {_shown(v)}" for k, v in shown.items())
        verdict = "ok" if stage.get("ok") else "**FAIL**"
        lines.append(
            f"| {name} | {verdict}{': ' + detail if detail else ''} "
            f"| {stage.get('seconds', 0) / 60:.1f} min |"
        )
    return "\n".join([*lines, RUN_END]) + "\n"


def _shown(value: Any) -> str:
    """A figure as the page prints it: ratios to four digits, pairs joined."""
    if isinstance(value, float):
        return f"{value:.4f}".rstrip("0").rstrip(".")
    if isinstance(value, dict):
        return ", ".join(f"{k} {_shown(v)}" for k, v in value.items())
    if isinstance(value, tuple | list):
        return " ".join(_shown(v) for v in value) or "none"
    return str(value)


def write_page(entry: dict[str, Any]) -> None:
    page = ROOT / "docs" / "compat" / f"vllm-{entry['version']}.md"
    text = page.read_text() if page.exists() else f"# vLLM {entry['version']}\n"
    text = text.split(RUN_BEGIN)[0].rstrip("\n") + "\n\n" + page_section(entry)
    page.write_text(text)


def write_docs(record: dict[str, Any]) -> None:
    header = [
        BEGIN,
        "| vLLM | static check | install (pins the index lacks) | doctor internals "
        "| suite | fuzz bad reads (CI seeds) | explorer violating transitions | soak sample "
        "| wall time |",
        "|---|---|---|---|---|---|---|---|---:|",
    ]
    rows = [row(entry) for _, entry in sorted(record.items())]
    block = "\n".join([*header, *rows, END])
    text = EXPOSURE.read_text()
    if BEGIN in text:
        start, end = text.index(BEGIN), text.index(END) + len(END)
        text = text[:start] + block + text[end:]
    else:
        text += "\n" + block + "\n"
    EXPOSURE.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", required=True)
    parser.add_argument("--base", default=None, help="release the static check compares with")
    parser.add_argument("--guard-rev", default=None, help="the static check's guard revision")
    parser.add_argument("--requirement", default=None, help="default: vllm==VERSION")
    parser.add_argument("--soak-steps", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument(
        "--render-only", action="store_true", help="rewrite the docs from the record, run nothing"
    )
    args = parser.parse_args(argv)
    if args.render_only:
        record = json.loads(RECORD.read_text())
        write_page(record[args.vllm])
        write_docs(record)
        return 0
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(stages) - set(STAGES)
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}; known: {', '.join(STAGES)}")
    if shutil.which("git") is None:
        parser.error("needs git")
    entry = Routine(args).run(stages)
    record = merge(entry)
    write_page(record[entry["version"]])
    write_docs(record)
    print(f"recorded in {RECORD.relative_to(ROOT)} and {EXPOSURE.relative_to(ROOT)}")
    return 0 if all(s.get("ok") for s in entry["stages"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
