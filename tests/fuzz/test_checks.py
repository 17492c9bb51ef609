"""The verdicts of a differential run, on hand-made totals (no vLLM run needed)."""

from __future__ import annotations

import pytest

from vllm_prefix_guard.fuzz.configs import CONFIGS
from vllm_prefix_guard.fuzz.differential import EXPLAINED, FAIL, OK, ConfigResult
from vllm_prefix_guard.fuzz.runner import RunResult


def _drain(stuck: dict[str, tuple[int, int]]) -> tuple[str, str]:
    """'runs drain' for one seed where mode -> (requests left, of which on vLLM's bug)."""
    result = ConfigResult(CONFIGS["everything-async"], ("stock", "guard"))
    runs = {mode: RunResult(mode, steps=10) for mode in result.modes}
    for mode, (left, vllm_bug) in stuck.items():
        runs[mode].stalled_runs = int(left > 0)
        runs[mode].stalled_requests = left
        runs[mode].stalled_on_dropped_output = vllm_bug
    result.add(0, runs)
    (check,) = [c for c in result.checks() if c.name == "runs drain"]
    return check.status, check.detail


@pytest.mark.parametrize(
    ("stuck", "status"),
    [
        ({}, OK),
        # Only vLLM's dropped-output bug: explained, on either side, even where stock
        # happened not to hit it on this seed.
        ({"guard": (1, 1)}, EXPLAINED),
        ({"stock": (2, 2), "guard": (1, 1)}, EXPLAINED),
        # Anything else left over is a finding, whatever stock did.
        ({"stock": (1, 1), "guard": (2, 1)}, FAIL),
        ({"guard": (1, 0)}, FAIL),
    ],
)
def test_a_stall_is_explained_only_by_vllms_dropped_output_bug(
    stuck: dict[str, tuple[int, int]], status: str
) -> None:
    got, detail = _drain(stuck)
    assert got == status, detail


def test_violating_seeds_are_listed() -> None:
    result = ConfigResult(CONFIGS["victim"], ("stock", "guard"))
    for seed in range(10):
        runs = {mode: RunResult(mode, steps=10) for mode in result.modes}
        runs["stock"].wrong_content = seed % 2
        result.add(seed, runs)
    (check,) = [c for c in result.checks() if c.name == "stock reads bad KV"]
    assert check.status == OK
    assert check.detail == "5 bad reads in 5 of 10 seeds (seeds 1, 3, 5, 7, 9)"
