"""Workloads are plain data: seed-determined, serialisable, and printable as a test."""

from __future__ import annotations

import json
import random

import pytest

from vllm_prefix_guard_harness.fuzz.configs import ALL_CONFIGS, CONFIGS
from vllm_prefix_guard_harness.fuzz.generators import (
    FailedLoadEpisodes,
    Traffic,
    failed_load_episodes,
    random_traffic,
)
from vllm_prefix_guard_harness.fuzz.workload import Abort, Arrive, Reset, Workload, expand


@pytest.mark.parametrize("config", list(ALL_CONFIGS))
def test_a_seed_names_one_workload(config: str) -> None:
    first, again, other = (ALL_CONFIGS[config].workload(s, horizon=200) for s in (7, 7, 8))
    assert first == again
    assert first != other
    assert first.events == tuple(sorted(first.events, key=lambda e: e.step))


def test_round_trips_through_json_and_python_source() -> None:
    workload = CONFIGS["kv-load-partial-async"].workload(0, horizon=100)
    assert any(isinstance(e, Abort) for e in workload.events)
    assert any(isinstance(e, Arrive) and e.failed_blocks for e in workload.events)
    assert Workload.from_dict(json.loads(json.dumps(workload.to_dict()))) == workload
    namespace: dict[str, object] = {}
    exec(workload.to_python("PASTED"), namespace)
    assert namespace["PASTED"] == workload


def test_random_traffic_has_every_ingredient() -> None:
    traffic = Traffic(
        n_prob=0.3,
        priority="phased",
        abort_prob=0.2,
        reset_interval=20,
        external_share=0.5,
        fail_share=0.5,
    )
    events = random_traffic(random.Random(0), traffic, 300, 16, system_prompt_blocks=2)
    arrivals = [e for e in events if isinstance(e, Arrive)]
    prompts = [e.prompt for e in arrivals]
    assert len(set(prompts)) < len(prompts)  # identical prompts (n>1 groups)
    assert len({p[:2] for p in prompts}) < len(set(prompts))  # shared-prefix families
    assert all(p[0] == (1, 32) for p in prompts)  # the system prompt
    assert {e.priority for e in arrivals} >= {0, 3}  # phases shift the range
    assert any(e.fail_load for e in arrivals) and any(
        e.external_tokens and not e.fail_load for e in arrivals
    )
    assert any(isinstance(e, Reset) and e.running for e in events)
    assert any(isinstance(e, Reset) and not e.running for e in events)
    assert any(isinstance(e, Abort) for e in events)
    assert max(len(expand(e.prompt)) + e.max_tokens for e in arrivals) <= 24 * 16


def test_failed_load_followers_share_the_loaded_prefix() -> None:
    knobs = FailedLoadEpisodes(fail_share=1.0, abort_loader=1.0)
    events = failed_load_episodes(random.Random(1), knobs, 24, 16)
    loader, abort, *followers = events
    assert isinstance(loader, Arrive) and loader.fail_load
    assert loader.external_tokens == loader.prompt[0][1]
    assert abort == Abort(loader.step, loader.request_id)
    assert followers and all(
        isinstance(f, Arrive) and f.prompt[0] == loader.prompt[0] and f.step > loader.step
        for f in followers
    )
