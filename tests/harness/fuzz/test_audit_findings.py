"""Cases the rollback audit once misjudged, replayed.

``reset-async`` at three times its horizon (``reset-async~long``: the name seeds the
workload), seed 950007, vLLM 0.33: the audit reported one entry rolled back on preemption
that held valid KV (request r406, step 2203, block 14, 112 tokens). Traced: r406 had
computed tokens 96-111 into block 14 before a preemption; resumed, it was handed block 14
again at the same index, its in-flight step rewrote tokens 96-106, and it registered the
112-token key in the step where it was preempted again (computed up to 107). The
preemption rule was right: no step writes tokens 107-111 for that tenancy. The bytes there
were the earlier tenancy's, identical by coincidence (vLLM may zero a block it hands out
afresh). The audit now tells such ``leftover`` bytes from KV written since the request's
last admission.

``hybrid-partial-kv-load-async`` at the soak's horizon, seed 8, vLLM 0.33: one state entry
rolled back on preemption held the right state (v290, 176 tokens, block 5). Traced: v289,
a twin with the same prefix, wrote the state after 176 tokens into block 5 and freed it;
v290 was handed block 5 in the next ``schedule()`` for its chunk to 176, registered the key
and was preempted in the same call. The bytes were v289's: a write vouches for an entry
only if it was made for the registering request, since its last admission.
"""

from __future__ import annotations

import dataclasses

import pytest
import vllm

from native_fix import guard_only
from vllm_prefix_guard_harness.fuzz.audit import LEFTOVER, PREEMPTED, VALID
from vllm_prefix_guard_harness.fuzz.configs import ALL_CONFIGS, CONFIGS
from vllm_prefix_guard_harness.fuzz.runner import run_workload


@pytest.mark.slow
@guard_only("the audit is the guard's rules")
def test_leftover_bytes_are_not_valid_kv_rolled_back() -> None:
    from vllm_prefix_guard_harness.fuzz.cli import quiet_vllm

    quiet_vllm()
    config = CONFIGS["reset-async"]
    long = dataclasses.replace(config, name="reset-async~long", horizon=config.horizon * 3)
    guard = run_workload(long.workload(950007), "guard", audit=True)
    assert guard.violations == 0
    assert guard.audit is not None
    assert guard.audit.valid_rolled_back == 0, guard.audit.examples
    assert guard.audit.invalid_committed == 0, guard.audit.examples
    preempted = guard.audit.by_cause.get(PREEMPTED, {})
    assert preempted.get(VALID, 0) == 0
    if vllm.__version__.startswith("0.33."):
        assert preempted.get(LEFTOVER, 0) == 1  # the traced case, r406's block 14


@pytest.mark.slow
@guard_only("the audit is the guard's rules")
def test_a_twins_state_left_in_a_reused_block_is_not_valid_state_rolled_back() -> None:
    from vllm_prefix_guard_harness.fuzz.cli import quiet_vllm

    quiet_vllm()
    config = ALL_CONFIGS["hybrid-partial-kv-load-async"]
    reason = config.unavailable()
    if reason is not None:
        pytest.skip(reason)
    guard = run_workload(config.workload(8, horizon=config.horizon * 5), "guard", audit=True)
    assert guard.violations == 0
    assert guard.audit is not None
    assert guard.audit.valid_rolled_back == 0, guard.audit.examples
    assert guard.audit.invalid_committed == 0, guard.audit.examples
