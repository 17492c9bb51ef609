"""No tracked file names the machine it was made on.

Results, docs and reports name commands and repository-relative paths; an absolute path of
the build machine (its ``/work`` tree, root's home, a random temporary directory) means
nothing to a reader. ``vllm_prefix_guard_harness.records`` writes results that way.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Built from parts so that this file does not match itself.
MACHINE_PATH = re.compile(
    "|".join(
        (
            r"(?<![\w.~])/" + "work/",
            r"(?<![\w.~])/" + "root/",
            # tempfile.mkdtemp's names: a prefix, then 8 random characters (a digit among).
            r"(?<![\w.~])/" + r"tmp/[\w.-]*?(?=[a-z0-9_]{8}\b)(?=[a-z_]{0,7}\d)[a-z0-9_]{8}\b",
        )
    )
)


def tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    return [ROOT / name for name in listed.split("\0") if name]


def test_no_tracked_file_holds_a_machine_path() -> None:
    found = []
    for path in tracked_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary (images), or deleted in the working tree
        for number, line in enumerate(text.splitlines(), 1):
            match = MACHINE_PATH.search(line)
            if match:
                found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "/" + "work/main/.nox/x",
        "see /" + "root/.cache/y",
        "logs in /" + "tmp/vllm-prefix-guard-demo-24voe161",
        "/" + "tmp/tmpe90mird0/callgrind.out",
    ],
)
def test_the_pattern_finds_machine_paths(line: str) -> None:
    assert MACHINE_PATH.search(line)


@pytest.mark.parametrize(
    "line",
    ["python upstream/tools/tree.py --out .nox/upstream", "/tmp/tiny-llama", "~/.cache/x"],
)
def test_the_pattern_leaves_portable_paths(line: str) -> None:
    assert not MACHINE_PATH.search(line)
