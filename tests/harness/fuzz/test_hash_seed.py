"""Fuzz entry points pin PYTHONHASHSEED: vLLM's scheduling order follows it."""

from __future__ import annotations

import os
import sys

import pytest

from vllm_prefix_guard_harness.fuzz import hash_seed


def _execs(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    calls: list[list[str]] = []
    monkeypatch.setattr(os, "execv", lambda path, args: calls.append([path, *args]))
    return calls


@pytest.mark.parametrize("value", [None, "random"])
def test_an_unfixed_seed_restarts_the_process_with_seed_0(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", value)
    calls = _execs(monkeypatch)
    hash_seed.reexec_with_fixed_hash_seed()
    assert calls == [[sys.executable, sys.executable, *sys.orig_argv[1:]]]
    assert os.environ["PYTHONHASHSEED"] == "0"


def test_a_fixed_seed_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    calls = _execs(monkeypatch)
    hash_seed.reexec_with_fixed_hash_seed()
    assert calls == [] and os.environ["PYTHONHASHSEED"] == "7"
