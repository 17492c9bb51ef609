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

Usage::

    python compat/install_vllm.py VENV REQUIREMENT     # e.g. .nox/vllm-0.34 vllm==0.34.0
"""

from __future__ import annotations

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


def install(venv: Path, requirement: str) -> list[str]:
    """Make ``venv`` with ``requirement``; return the pins left out (empty: pip's own
    resolution installed everything)."""
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    if pip(python, "--quiet", "--upgrade", "pip").returncode:
        raise SystemExit("could not upgrade pip in the venv")
    done = pip(python, "--quiet", requirement)
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
            done = pip(python, "--quiet", *wanted)
            if not done.returncode:
                break
            more = missing_pins(done.stdout + done.stderr) - left_out
            if not more:
                raise SystemExit(f"pip could not install {name}'s requirements (see above)")
            left_out |= more
        else:
            raise SystemExit(f"too many of {name}'s pins are missing: {sorted(left_out)}")
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", *BREAKS_VLLM_IMPORT], check=False)
    (venv / ".vllm-missing-requirements").write_text("".join(f"{p}\n" for p in sorted(left_out)))
    return sorted(left_out)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit(__doc__)
    venv, requirement = Path(args[0]), args[1]
    left_out = install(venv, requirement)
    if left_out:
        print(
            f"{requirement}: installed without {', '.join(left_out)}, which the package index "
            "lacks (listed in .vllm-missing-requirements)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
