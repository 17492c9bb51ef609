"""What the installed vLLM gets right outside prefix caching, where a configuration needs it.

A fuzz configuration judges the guard by the shadow-KV oracle, so it is meaningful only on
a vLLM whose own machinery (outside the registration order the guard fixes) writes what
its prefix-cache entries promise. Where a probe finds it does not, the configurations
that rely on it are not run, and say why.

Partial state hits (a hybrid model whose state block spans several attention blocks:
a prefix hit may end inside a state block, on the checkpoint vLLM keeps of the state at
that hash boundary, copied into the reader's block before its step). On vLLM 0.30 and
0.31, under async scheduling, ``MambaManager`` copies those checkpoints wrong, with and
without the guard: 0.31 queues the same copies in two consecutive steps, and the second
runs after the producer's next step overwrote the source with the state one token later;
0.30 copies a checkpoint out of the producer's running block after the producer moved on,
and copies another request's state over a checkpoint already moved to its own block.
A request resuming from such a copy starts from the wrong state. Shrunk from
``hybrid-partial-retry-async`` (0.31 seed 2, 0.30 seed 0) to :data:`PARTIAL_STATE_PROBES`;
vLLM 0.32 rewrote the partial-tail bookkeeping and reads nothing bad in either.

Asynchronous KV loads. On vLLM 0.30 a request whose asynchronous load is done waits in the
same queue as new requests: when the request at its head cannot be admitted (nothing
running to preempt, the loaded request holding its blocks), the waiting loop stops there
and the loaded request is never resumed, with and without the guard. vLLM 0.31 keeps
requests that hold blocks in a queue of their own. :data:`ASYNC_LOAD_PROBE` is the
smallest such layout: a low-priority request loading 64 tokens, then a higher-priority one
needing more blocks than are left.

New scheduler paths. A configuration that turns on a scheduler feature vLLM 0.34 added (a
``SchedulerConfig`` field: the bounded asynchronous KV-load queue, cache-aware admission)
or sends frontend-computed block hashes (``Request(block_hashes=...)``) needs a vLLM that
has it: :func:`scheduler_features_missing`.

Per-request load failures. A worker reports an asynchronous load that failed as a whole in
``KVConnectorOutput.failed_recving``; vLLM 0.27 has no such field (measured by
``nox -s compat``), so the configurations whose asynchronous loads fail are not run there.
"""

from __future__ import annotations

from functools import cache

from vllm_prefix_guard_harness.factory import SchedulerSpec
from vllm_prefix_guard_harness.fuzz.workload import Abort, Arrive, Workload

_PROBE_SPEC = SchedulerSpec(
    num_blocks=48,
    max_model_len=4096,
    policy="priority",
    long_prefill_token_threshold=64,
    async_scheduling=True,
    mamba_align=True,
    mamba_block_multiple=4,
)

PARTIAL_STATE_PROBES = (
    Workload(
        spec=_PROBE_SPEC,
        depth=2,
        events=(
            Arrive(0, "r0", prompt=((1000, 32), (2000, 126), (3000, 77)), max_tokens=6),
            Arrive(1, "r1", prompt=((1000, 32), (2000, 126), (4000, 69)), max_tokens=23),
            Arrive(4, "r2", prompt=((1000, 32), (5000, 103), (6000, 57)), max_tokens=16),
            Arrive(7, "r3", prompt=((1000, 32), (7000, 87), (8000, 35)), max_tokens=16, priority=5),
            Arrive(12, "r4", prompt=((5000, 103), (9000, 85)), max_tokens=19, priority=5),
            Arrive(12, "r5", prompt=((1000, 32), (10000, 93)), max_tokens=23),
            Arrive(34, "r6", prompt=((1000, 32), (11000, 31)), max_tokens=5),
            Arrive(
                35, "r7", prompt=((1000, 32), (12000, 165), (13000, 55)), max_tokens=1, priority=5
            ),
            Arrive(36, "r8", prompt=((1000, 32), (14000, 48)), max_tokens=8),
            Arrive(36, "r9", prompt=((1000, 32), (14000, 48)), max_tokens=4, priority=3),
            Arrive(36, "r10", prompt=((1000, 32), (14000, 48)), max_tokens=4, priority=3),
            Arrive(36, "r11", prompt=((1000, 32), (14000, 48)), max_tokens=4, priority=3),
            Arrive(40, "r12", prompt=((1000, 32), (15000, 145)), max_tokens=6),
            Arrive(40, "r13", prompt=((1000, 32), (15000, 150)), max_tokens=3),
            Arrive(44, "r14", prompt=((1000, 32),), max_tokens=16),
            Arrive(
                48, "r15", prompt=((1000, 32), (2000, 126), (16000, 65)), max_tokens=1, priority=1
            ),
            Arrive(
                48, "r16", prompt=((1000, 32), (2000, 126), (16000, 65)), max_tokens=1, priority=1
            ),
            Arrive(
                48, "r17", prompt=((1000, 32), (2000, 126), (16000, 65)), max_tokens=1, priority=1
            ),
            Arrive(
                48, "r18", prompt=((1000, 32), (2000, 126), (16000, 65)), max_tokens=1, priority=1
            ),
        ),
    ),
    Workload(
        spec=_PROBE_SPEC,
        depth=2,
        events=(
            Arrive(0, "r0", prompt=((1000, 32), (2000, 52)), max_tokens=1, priority=4),
            Arrive(1, "r1", prompt=((1000, 32), (3000, 159), (4000, 54)), max_tokens=1, priority=5),
            Abort(4, "r0"),
            Arrive(5, "r2", prompt=((1000, 32), (2000, 52)), max_tokens=21),
            Arrive(6, "r3", prompt=((1000, 32), (3000, 159), (5000, 75)), max_tokens=21),
            Arrive(7, "r4", prompt=((1000, 32), (6000, 171), (7000, 60)), max_tokens=14),
            Arrive(7, "r5", prompt=((1000, 32), (6000, 171), (7000, 60)), max_tokens=14),
            Arrive(7, "r6", prompt=((1000, 32), (6000, 171), (7000, 60)), max_tokens=14),
            Arrive(26, "r7", prompt=((1000, 32), (8000, 128), (9000, 84)), max_tokens=6),
            Arrive(30, "r8", prompt=((1000, 32), (10000, 35)), max_tokens=1, priority=1),
            Arrive(34, "r9", prompt=((1000, 32), (11000, 141)), max_tokens=6),
            Arrive(35, "r10", prompt=((1000, 32), (3000, 159), (12000, 68)), max_tokens=15),
            Arrive(
                35, "r11", prompt=((1000, 32), (3000, 159), (12000, 68)), max_tokens=15, priority=2
            ),
            Arrive(37, "r12", prompt=((3000, 159), (13000, 42)), max_tokens=24),
            Arrive(
                37, "r13", prompt=((1000, 32), (6000, 171), (14000, 25)), max_tokens=1, priority=2
            ),
            Arrive(
                42, "r14", prompt=((1000, 32), (15000, 178), (16000, 65)), max_tokens=1, priority=2
            ),
            Arrive(45, "r15", prompt=((1000, 32), (6000, 171), (17000, 42)), max_tokens=1),
            Arrive(54, "r16", prompt=((1000, 32), (6000, 171), (18000, 36)), max_tokens=1),
            Arrive(55, "r17", prompt=((1000, 32), (19000, 17)), max_tokens=16),
            Abort(56, "r16"),
            Arrive(57, "r18", prompt=((1000, 32), (6000, 171), (18000, 18)), max_tokens=7),
            Arrive(65, "r19", prompt=((1000, 32), (20000, 43)), max_tokens=1),
            Arrive(
                69, "r20", prompt=((1000, 32), (8000, 128), (21000, 23)), max_tokens=1, priority=1
            ),
            Abort(73, "r20"),
            Arrive(74, "r21", prompt=((1000, 32), (8000, 128), (21000, 23)), max_tokens=5),
            Arrive(75, "r22", prompt=((1000, 32), (22000, 18)), max_tokens=4),
            Arrive(
                75, "r23", prompt=((1000, 32), (3000, 159), (23000, 33)), max_tokens=5, priority=1
            ),
            Arrive(
                75, "r24", prompt=((1000, 32), (15000, 178), (24000, 64)), max_tokens=1, priority=1
            ),
            Arrive(78, "r25", prompt=((1000, 32), (25000, 36)), max_tokens=1),
            Arrive(80, "r26", prompt=((1000, 32), (26000, 12)), max_tokens=1),
        ),
    ),
)


ASYNC_LOAD_PROBE = Workload(
    spec=SchedulerSpec(num_blocks=8, policy="priority", kv_load_failure_policy="recompute"),
    events=(
        Arrive(0, "a", ((1000, 80),), 2, priority=1, external_tokens=64, async_load_steps=2),
        Arrive(1, "b", ((2000, 90),), 2, priority=0),
    ),
)


@cache
def async_loads_stall() -> str | None:
    """Why this vLLM's asynchronous loads cannot be judged (None: they can): stock vLLM
    never resuming the loaded request of :data:`ASYNC_LOAD_PROBE`."""
    from vllm_prefix_guard_harness.fuzz.runner import run_workload

    if not run_workload(ASYNC_LOAD_PROBE, "stock").stalled_runs:
        return None
    return (
        "this vLLM never resumes a request whose asynchronous load is done while a waiting "
        "request ahead of it cannot be admitted (stock and guard alike stall in "
        "capabilities.ASYNC_LOAD_PROBE; vLLM 0.30 measured)"
    )


@cache
def failed_loads_unreported() -> str | None:
    """Why this vLLM cannot be told that an asynchronous load failed as a whole (None: it
    can): its ``KVConnectorOutput`` takes no ``failed_recving``."""
    import inspect

    from vllm.v1.outputs import KVConnectorOutput

    if "failed_recving" in inspect.signature(KVConnectorOutput).parameters:
        return None
    return (
        "this vLLM's KVConnectorOutput has no failed_recving: a worker cannot report an "
        "asynchronous load that failed as a whole"
    )


@cache
def partial_state_hits_unsound() -> str | None:
    """Why this vLLM's partial state hits cannot be judged (None: they can): stock vLLM
    starting a request from a wrong state in one of :data:`PARTIAL_STATE_PROBES`."""
    from vllm_prefix_guard_harness.fuzz.runner import run_workload

    if not any(
        run_workload(probe, "stock", stop_on_violation=True).bad_state_reads
        for probe in PARTIAL_STATE_PROBES
    ):
        return None
    return (
        "this vLLM copies partial-hit state checkpoints from the wrong state "
        "(stock and guard alike start a request from a wrong state in "
        "capabilities.PARTIAL_STATE_PROBES; vLLM 0.30 and 0.31 measured)"
    )


def scheduler_features_missing(spec: SchedulerSpec) -> str | None:
    """Why this vLLM lacks what ``spec`` asks of it (None: it has it): a ``SchedulerConfig``
    field ``spec`` passes through, or requests that carry their prompt's block hashes."""
    import dataclasses
    import inspect

    from vllm.config import SchedulerConfig
    from vllm.v1.request import Request

    fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    missing = sorted(set(spec.extra_scheduler_kwargs) - fields)
    if missing:
        return f"this vLLM's SchedulerConfig has no {', '.join(missing)} (added in vLLM 0.34)"
    if spec.frontend_block_hashes and "block_hashes" not in inspect.signature(Request).parameters:
        return "this vLLM's Request takes no block_hashes computed by a frontend (vLLM 0.34+)"
    return None
