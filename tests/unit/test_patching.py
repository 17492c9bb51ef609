"""The patch primitive: records, refuses doubles, keeps originals, undoes exactly."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_prefix_guard.patching import PatchError, PatchRegistry


class Target:
    def method(self) -> str:
        return "original"


class Child(Target):
    pass


def wrap(original: Any) -> Any:
    def method(self: Any) -> str:
        return "wrapped:" + original(self)

    return method


def test_apply_keeps_original_reachable_and_undo_restores() -> None:
    registry = PatchRegistry()
    original = Target.__dict__["method"]
    registry.apply(Target, "method", wrap)
    assert Target().method() == "wrapped:original"
    assert registry.original_of(Target, "method") is original
    assert [p.target for p in registry.applied] == ["Target.method"]
    registry.undo_all()
    assert Target.__dict__["method"] is original and registry.applied == []


def test_patching_twice_is_refused() -> None:
    registry = PatchRegistry()
    registry.apply(Target, "method", wrap)
    try:
        with pytest.raises(PatchError, match="already patched"):
            registry.apply(Target, "method", wrap)
        # A second registry (e.g. after a module reload) recognises the marker too.
        with pytest.raises(PatchError, match="another registry"):
            PatchRegistry().apply(Target, "method", wrap)
    finally:
        registry.undo_all()
    assert Target().method() == "original"


def test_missing_attribute_is_added_then_removed() -> None:
    registry = PatchRegistry()
    registry.apply(Child, "method", lambda original: property(lambda self: "prop"))
    assert Child().method == "prop"
    registry.undo_all()
    assert "method" not in vars(Child) and Child().method() == "original"


def test_property_patches_carry_the_marker() -> None:
    registry = PatchRegistry()
    registry.apply(Child, "extra", lambda _: property(lambda self: 1))
    try:
        with pytest.raises(PatchError):
            PatchRegistry().apply(Child, "extra", lambda _: property(lambda self: 2))
    finally:
        registry.undo_all()
