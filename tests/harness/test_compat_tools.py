"""The release routine's tools on made-up inputs: what the static check calls a move, and
which pins the installer leaves out (no vLLM needed)."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

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
