"""The patch table (``patches.PATCHES``): each patch gives its reasons, names what exists,
and its wrapper takes the parameters the table checks on vLLM's method."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_prefix_guard import targets
from vllm_prefix_guard.patches import PATCHES
from vllm_prefix_guard.patching import Patch

ROOT = Path(__file__).resolve().parents[2]
WRAPPERS = [p for p in PATCHES if p.name is not None and not p.wraps_addition]


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.path)
def test_each_patch_says_why_where_upstream_and_when_it_goes(patch: Patch) -> None:
    for reason in (patch.why, patch.upstream, patch.remove_when):
        assert reason.strip() and reason == reason.strip(), patch.path


def test_one_patch_per_target() -> None:
    wrapped = [p.path for p in PATCHES if p.name is not None]
    assert len(wrapped) == len(set(wrapped))
    added = [n for p in PATCHES if p.name is None for n in p.members()]
    assert len(added) == len(set(added))


@pytest.mark.parametrize("patch", WRAPPERS, ids=lambda p: p.path)
def test_each_wrapper_names_the_parameters_the_table_checks(patch: Patch) -> None:
    """The table's parameters are checked on vLLM's method at start-up; the wrapper built
    over it must take the same ones (all of them, in order, where it forwards them)."""
    original = targets.check(
        targets.Internal(patch.module, patch.path, targets.Kind.CALLABLE, "test", patch.params)
    )
    replacement = patch.resolve_how()(original)
    assert replacement.__wrapped__ is original and replacement.__name__ == original.__name__
    taken = [
        p.name
        for p in inspect.signature(replacement, follow_wrapped=False).parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ][1:]
    if patch.exact:
        assert tuple(taken) == patch.params
    else:
        assert tuple(taken) == patch.params[: len(taken)]


def test_design_page_registry_is_rendered_from_the_table() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "patch_registry.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
