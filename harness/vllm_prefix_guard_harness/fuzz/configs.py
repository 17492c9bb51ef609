"""Named fuzz configurations: a scheduler, an engine depth, and the traffic to feed it.

A configuration plus a seed is one :class:`Workload`. *Targeted* configurations aim at a
known failure window, and stock vLLM must show violations in them within the CI run;
the others are broad random traffic, where stock rarely fails and the guard must not
change anything it does not have to (equal hits and preemptions).

Pools are small on purpose (preemption is the trigger); ``max_num_batched_tokens`` and
the chunk threshold keep steps cheap enough for 10^5-step soaks. The victim
configurations give every request a 16-block system prompt, as real traffic has: where
stock hits never-written KV the guard computes those tokens instead, and measured
against a realistic volume of valid hits that is the small fraction it is in practice.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

from vllm_prefix_guard_harness.factory import SchedulerSpec
from vllm_prefix_guard_harness.fuzz.generators import (
    FailedLoadEpisodes,
    Traffic,
    VictimEpisodes,
    failed_load_episodes,
    random_traffic,
    victim_episodes,
)
from vllm_prefix_guard_harness.fuzz.workload import Event, Workload


@dataclass(frozen=True)
class FuzzConfig:
    """One configuration. ``horizon`` is the CI size: iterations during which requests
    arrive (the run then drains); soaks pass a larger one."""

    name: str
    description: str
    spec: SchedulerSpec
    depth: int = 1
    horizon: int = 1000
    traffic: Traffic | None = None
    victims: VictimEpisodes | None = None
    failed_loads: FailedLoadEpisodes | None = None
    # Every request starts with this many blocks of a shared system prompt.
    system_prompt_blocks: int = 0
    # Stock vLLM must show violations here.
    targeted: bool = False

    @property
    def fails_kv_loads(self) -> bool:
        """Some KV-connector loads of this configuration fail: in failed-load episodes,
        or in its random traffic's external prefixes."""
        if self.failed_loads is not None:
            return True
        traffic = self.traffic
        return traffic is not None and traffic.external_share > 0 and traffic.fail_share > 0

    @property
    def loads_asynchronously(self) -> bool:
        """Some KV-connector loads of this configuration are asynchronous."""
        traffic, episodes = self.traffic, self.failed_loads
        return bool(
            (traffic is not None and traffic.external_share and traffic.async_share)
            or (episodes is not None and episodes.async_share)
        )

    def unavailable(self) -> str | None:
        """Why the installed vLLM cannot judge the guard on this configuration (None: it
        can); see ``capabilities``. Importing vLLM, and probing it once per process."""
        from vllm_prefix_guard_harness.fuzz import capabilities

        missing = capabilities.scheduler_features_missing(self.spec)
        if missing is not None:
            return missing
        if self.loads_asynchronously:
            unreported = capabilities.failed_loads_unreported() if self.fails_kv_loads else None
            reason = unreported or capabilities.async_loads_stall()
            if reason is not None:
                return reason
        if self.spec.mamba_block_multiple > 1:
            return capabilities.partial_state_hits_unsound()
        return None

    def workload(self, seed: int, horizon: int | None = None) -> Workload:
        """The workload of ``seed``; each generator draws from its own stream."""
        horizon = self.horizon if horizon is None else horizon
        size = self.spec.block_size
        system = self.system_prompt_blocks
        events: list[Event] = []
        if self.traffic is not None:
            rng = random.Random(f"{self.name}/{seed}/traffic")
            events += random_traffic(rng, self.traffic, horizon, size, system)
        if self.victims is not None:
            rng = random.Random(f"{self.name}/{seed}/victims")
            events += victim_episodes(rng, self.victims, horizon, size, system)
        if self.failed_loads is not None:
            rng = random.Random(f"{self.name}/{seed}/failed_loads")
            events += failed_load_episodes(rng, self.failed_loads, horizon, size, system)
        return Workload(self.spec, self.depth, tuple(events))


def _spec(**overrides: Any) -> SchedulerSpec:
    base: dict[str, Any] = dict(
        block_size=16,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=4096,
        long_prefill_token_threshold=64,
        # Every run replays the KV-event stream against the pool (oracle.MeteredDriver).
        kv_events=True,
    )
    base.update(overrides)
    return SchedulerSpec(**base)


_FAMILIES = Traffic(arrival_rate=0.6, n_prob=0.15, abort_prob=0.05)

CONFIGS: dict[str, FuzzConfig] = {
    c.name: c
    for c in (
        FuzzConfig(
            "fcfs-families",
            "FCFS; shared-prefix families, identical prompts, n>1, chunked prefill, aborts",
            _spec(num_blocks=48),
            traffic=_FAMILIES,
        ),
        FuzzConfig(
            "fcfs-families-async",
            "as fcfs-families on the AsyncScheduler, two steps in flight (aborts land "
            "while the next step runs)",
            _spec(num_blocks=48, async_scheduling=True),
            depth=2,
            traffic=_FAMILIES,
        ),
        FuzzConfig(
            "priority-random",
            "priority policy, random priorities, small pool (frequent preemption), aborts",
            _spec(num_blocks=40, policy="priority"),
            traffic=Traffic(arrival_rate=0.6, priority="random", abort_prob=0.05),
        ),
        FuzzConfig(
            "priority-phased-async",
            "priority policy, phased priorities (newcomers alternately outrank and yield "
            "to running requests), async, small pool, aborts in flight",
            _spec(num_blocks=40, policy="priority", async_scheduling=True),
            depth=2,
            traffic=Traffic(arrival_rate=0.6, priority="phased", abort_prob=0.08, n_prob=0.15),
        ),
        FuzzConfig(
            "reset-async",
            "priority policy, async; reset_prefix_cache mid-run, with and without "
            "preempting the running requests",
            _spec(num_blocks=40, policy="priority", async_scheduling=True),
            depth=2,
            traffic=Traffic(arrival_rate=0.6, priority="random", reset_interval=60),
        ),
        FuzzConfig(
            "fault-async",
            "priority policy, async, shared-prefix families, n>1, aborts; faults of the "
            "engine loop as vLLM's fault tolerance handles them (the steps in flight never "
            "run, every request is finished, the engine serves on)",
            _spec(num_blocks=40, policy="priority", async_scheduling=True),
            depth=2,
            traffic=Traffic(
                arrival_rate=0.6,
                priority="phased",
                abort_prob=0.05,
                n_prob=0.15,
                fault_interval=40,
            ),
        ),
        FuzzConfig(
            "victim",
            "targeted: an already-scheduled low-priority request is the priority victim "
            "while followers look up its prefix",
            _spec(num_blocks=24 + 16, policy="priority"),
            horizon=2000,
            victims=VictimEpisodes(),
            system_prompt_blocks=16,
            targeted=True,
        ),
        FuzzConfig(
            "victim-async",
            "targeted victim episodes on the AsyncScheduler, two steps in flight",
            _spec(num_blocks=24 + 16, policy="priority", async_scheduling=True),
            depth=2,
            horizon=2000,
            victims=VictimEpisodes(),
            system_prompt_blocks=16,
            targeted=True,
        ),
        FuzzConfig(
            "kv-load-recompute",
            "targeted: KV-connector sync loads fail (policy recompute) while followers "
            "look up the loaded prefix",
            _spec(num_blocks=64, kv_load_failure_policy="recompute"),
            failed_loads=FailedLoadEpisodes(),
            traffic=Traffic(arrival_rate=0.3, external_share=0.3, fail_share=0.3),
            targeted=True,
        ),
        FuzzConfig(
            "kv-load-shared",
            "targeted: identical prompts (n>1) load the same remote prefix in one step and "
            "the load fails (policy recompute); vLLM lets all but the first sharer keep "
            "the invalid blocks as computed while the first recomputes them chunk by chunk",
            _spec(num_blocks=64, kv_load_failure_policy="recompute"),
            traffic=Traffic(
                arrival_rate=0.3,
                prefix_blocks=(4, 10),
                n_prob=0.4,
                external_share=0.6,
                fail_share=0.5,
            ),
            targeted=True,
        ),
        FuzzConfig(
            "kv-load-fail-abort-async",
            "targeted: KV-connector sync loads fail (policy fail) and the loader is "
            "aborted before the failing step's update; async, two steps in flight",
            _spec(num_blocks=64, kv_load_failure_policy="fail", async_scheduling=True),
            depth=2,
            failed_loads=FailedLoadEpisodes(abort_loader=0.7),
            traffic=Traffic(arrival_rate=0.3, external_share=0.3, fail_share=0.3, abort_prob=0.1),
            targeted=True,
        ),
        FuzzConfig(
            "kv-load-partial",
            "targeted: KV-connector sync loads fail on some of their blocks only, the "
            "others loading fine (policy recompute), while followers look up the prefix",
            _spec(num_blocks=64, kv_load_failure_policy="recompute"),
            failed_loads=FailedLoadEpisodes(fail_share=0.7, partial_share=1.0),
            traffic=Traffic(arrival_rate=0.3),
            targeted=True,
        ),
        FuzzConfig(
            "kv-load-partial-async",
            "targeted: KV-connector sync loads fail on some of their blocks only (policy "
            "fail), the loader sometimes aborted first; async, two steps in flight",
            _spec(num_blocks=64, kv_load_failure_policy="fail", async_scheduling=True),
            depth=2,
            failed_loads=FailedLoadEpisodes(fail_share=0.7, abort_loader=0.3, partial_share=1.0),
            traffic=Traffic(arrival_rate=0.3, abort_prob=0.05),
            targeted=True,
        ),
        FuzzConfig(
            "everything-async",
            "all of it at once: priority phases, async, n>1, aborts in flight, resets, "
            "victim episodes, and sync loads that fail (policy recompute) in a small pool",
            _spec(
                num_blocks=40,
                policy="priority",
                async_scheduling=True,
                kv_load_failure_policy="recompute",
            ),
            depth=2,
            horizon=600,
            traffic=Traffic(
                arrival_rate=0.7,
                priority="phased",
                abort_prob=0.1,
                n_prob=0.2,
                reset_interval=80,
                external_share=0.3,
                fail_share=0.4,
            ),
            victims=VictimEpisodes(gap=30),
            failed_loads=FailedLoadEpisodes(gap=40, abort_loader=0.5),
            system_prompt_blocks=2,
            targeted=True,
        ),
        FuzzConfig(
            "hybrid-victim",
            "a hybrid model (full attention + a Mamba state group in align mode): the "
            "victim episodes, sync, with shared-prefix traffic around them",
            _spec(num_blocks=24 + 16, policy="priority", mamba_align=True),
            horizon=1000,
            traffic=Traffic(arrival_rate=0.2, priority="random", prefix_blocks=(2, 6)),
            victims=VictimEpisodes(),
            system_prompt_blocks=4,
        ),
        FuzzConfig(
            "hybrid-retry-async",
            "a hybrid model, async: priority phases, n>1, resets, victim episodes, and "
            "long prefills aborted in flight and retried at once (vLLM PR #56525's shape)",
            _spec(num_blocks=48, policy="priority", async_scheduling=True, mamba_align=True),
            depth=2,
            horizon=800,
            traffic=Traffic(
                arrival_rate=0.5,
                priority="phased",
                prefix_blocks=(4, 12),
                suffix_tokens=(16, 96),
                n_prob=0.15,
                abort_prob=0.15,
                abort_delay=4,
                retry_share=0.8,
                reset_interval=100,
            ),
            victims=VictimEpisodes(gap=50),
            system_prompt_blocks=2,
        ),
        FuzzConfig(
            "kv-load-async",
            "asynchronous KV-connector loads (WAITING_FOR_REMOTE_KVS; vLLM registers their "
            "blocks once finished_recving reports them): whole failures reported per "
            "request, partial ones by block id (policy recompute), loaders aborted while "
            "loading; async, priority phases, aborts",
            _spec(
                num_blocks=40,
                policy="priority",
                async_scheduling=True,
                kv_load_failure_policy="recompute",
            ),
            depth=2,
            failed_loads=FailedLoadEpisodes(async_share=1.0, partial_share=0.5, abort_loader=0.3),
            traffic=Traffic(
                arrival_rate=0.3,
                priority="phased",
                abort_prob=0.05,
                external_share=0.3,
                fail_share=0.3,
                async_share=1.0,
            ),
        ),
        FuzzConfig(
            "hybrid-kv-load-async",
            "a hybrid model, async: asynchronous KV-connector loads of attention KV and "
            "the boundary state, failing per request (failed_recving, the only report "
            "vLLM 0.31+ takes with several KV-cache groups; policy recompute), priority "
            "phases, n>1, aborts with retries, victim episodes",
            _spec(
                num_blocks=48,
                policy="priority",
                async_scheduling=True,
                mamba_align=True,
                kv_load_failure_policy="recompute",
            ),
            depth=2,
            horizon=800,
            traffic=Traffic(
                arrival_rate=0.4,
                priority="phased",
                prefix_blocks=(4, 12),
                suffix_tokens=(16, 96),
                n_prob=0.15,
                abort_prob=0.1,
                abort_delay=4,
                retry_share=0.5,
                external_share=0.4,
                fail_share=0.3,
                async_share=1.0,
            ),
            victims=VictimEpisodes(gap=50),
            failed_loads=FailedLoadEpisodes(gap=40, async_share=1.0, abort_loader=0.3),
            system_prompt_blocks=2,
        ),
    )
}


def _with_drafts(config: FuzzConfig, name: str) -> FuzzConfig:
    """``config`` with speculative decoding: three draft tokens per decode step (n-gram
    drafting, so no draft model and no EAGLE block drop), each right with probability
    ``shadow_kv.DRAFT_ACCEPTANCE``; the step keeps the drafts up to the first wrong one.
    Drafts are never registered; a step that accepts drafts across a state-block boundary
    leaves the state at that boundary in its block (vLLM's align-mode postprocess), which
    vLLM 0.33 (and 0.32's ``AsyncScheduler``) registers in ``update_from_output``."""
    return dataclasses.replace(
        config,
        name=name,
        description=f"as {config.name}, with speculative decoding (three draft tokens a step)",
        spec=dataclasses.replace(config.spec, num_speculative_tokens=3),
    )


def _with_eagle(config: FuzzConfig, name: str) -> FuzzConfig:
    """``config`` with an EAGLE drafter: two draft tokens per decode step, and the draft
    model's layers in the attention group. vLLM allocates lookahead slots for the drafts,
    and a prefix hit drops its last block (vLLM 0.30-0.32: the draft's KV at a block's last
    token depends on the token after it) or each block is hashed with the token after it
    (0.33), so entries of a decoding request's last block appear only in
    ``update_from_output``, once that token is sampled. Drafts are verified as with
    n-gram drafting (the shadow worker drafts); the draft model's own KV only changes which
    drafts are proposed, so the oracle checks the target's KV and state."""
    return dataclasses.replace(
        config,
        name=name,
        description=f"as {config.name}, with an EAGLE drafter (two draft tokens a step) (CI: "
        "tests/regression/test_spec_decoding.py)",
        spec=dataclasses.replace(config.spec, num_speculative_tokens=2, drafter="eagle"),
    )


def _with_partial_state_hits(config: FuzzConfig) -> FuzzConfig:
    """``config`` with a state block of four attention blocks: the scheduler steps in
    state blocks and hashes in attention blocks, so a prefix hit can end inside a state
    block, on the checkpoint vLLM keeps of the state at that hash boundary
    (``enable_partial_hash_hits``), which the reader's step first copies into its own
    block (``kv_cache_block_copies``; the oracle applies the copies before the forward
    pass)."""
    name = config.name.replace("hybrid-", "hybrid-partial-", 1)
    return dataclasses.replace(
        config,
        name=name,
        description=f"as {config.name}, with a state block of four attention blocks (prefix "
        "hits inside a state block: partial-hit checkpoints, copied on write)",
        spec=dataclasses.replace(config.spec, mamba_block_multiple=4),
    )


CONFIGS.update(
    (partial.name, partial)
    for partial in [_with_partial_state_hits(c) for c in CONFIGS.values() if c.spec.mamba_align]
)

#: Speculative decoding on a hybrid model: CI runs two, the soak all four (sync and
#: async, with and without prefix hits inside a state block).
_DRAFTED = {
    name: _with_drafts(CONFIGS[base], name)
    for name, base in (
        ("hybrid-spec-victim", "hybrid-victim"),
        ("hybrid-spec-retry-async", "hybrid-retry-async"),
        ("hybrid-partial-spec-victim", "hybrid-partial-victim"),
        ("hybrid-partial-spec-retry-async", "hybrid-partial-retry-async"),
    )
}
CONFIGS["hybrid-spec-retry-async"] = _DRAFTED["hybrid-spec-retry-async"]
#: An EAGLE drafter, soak-only: on attention only, and on a hybrid model sync and async.
_EAGLE = {
    name: _with_eagle(CONFIGS[base], name)
    for name, base in (
        ("eagle-victim-async", "victim-async"),
        ("hybrid-eagle-victim", "hybrid-victim"),
        ("hybrid-eagle-retry-async", "hybrid-retry-async"),
    )
}


def _with_engine_retention(config: FuzzConfig) -> FuzzConfig:
    """``config`` with the prefix-cache retention an engine has by default
    (``--prefix-cache-retention-interval 0``; a ``KVCacheConfig`` built by hand keeps every
    state): the state group keeps only its semantic checkpoints (the prompt's replay
    boundary, and shared-prefix junctions), allocates state blocks for the chunk reaching
    the prompt's checkpoint only, and drops a transient checkpoint's entry in the step that
    registered it. Fewer states are cached, but a prompt's checkpoint is the state every
    retry and twin resumes from: in the soak stock reads bad state in every one of these
    (docs/fuzzing.md); none is targeted (CI's few seeds need not show it)."""
    return dataclasses.replace(
        config,
        name=f"{config.name}-sparse",
        description=f"as {config.name}, with vLLM's default prefix-cache retention (only "
        "the replay boundary's state stays cached)",
        spec=dataclasses.replace(config.spec, retention_interval=0),
        targeted=False,
    )


#: Configurations outside CI's set (its tests, the upstream proof and ``fuzz`` without
#: ``--config`` run :data:`CONFIGS`): the soak runs them, ``fuzz --config NAME`` on request.
#: Each has a fast representative in CI, a hand-built layout named in its description.
_PARTIAL_LOADS = CONFIGS.pop("hybrid-partial-kv-load-async")
SOAK_ONLY: dict[str, FuzzConfig] = {
    **{
        name: dataclasses.replace(
            config,
            description=f"{config.description} (CI: hybrid-spec-retry-async, "
            "tests/regression/test_spec_decoding.py)",
        )
        for name, config in _DRAFTED.items()
        if name not in CONFIGS
    },
    **_EAGLE,
    # Stock reads nothing bad on CI's seeds of it; the soak's finding is a layout.
    "hybrid-partial-kv-load-async": dataclasses.replace(
        _PARTIAL_LOADS,
        description=f"{_PARTIAL_LOADS.description} (CI: hybrid-kv-load-async, "
        "tests/layouts.py HYBRID_PARTIAL_ZOMBIE_STATE)",
    ),
}

#: The hybrid configurations with an engine's default retention: CI runs two (the
#: async retry of vLLM PR #56525, with and without partial state hits), the soak every one.
_SPARSE = {
    sparse.name: sparse
    for sparse in (
        _with_engine_retention(config)
        for config in (*CONFIGS.values(), *SOAK_ONLY.values())
        if config.spec.mamba_align
    )
}
_SPARSE_IN_CI = ("hybrid-retry-async-sparse", "hybrid-partial-retry-async-sparse")
CONFIGS.update((name, _SPARSE[name]) for name in _SPARSE_IN_CI)
SOAK_ONLY.update(
    (
        name,
        dataclasses.replace(
            config, description=f"{config.description} (CI: {', '.join(_SPARSE_IN_CI)})"
        ),
    )
    for name, config in _SPARSE.items()
    if name not in CONFIGS
)


def _with_scheduler(config: FuzzConfig, name: str, description: str, **fields: Any) -> FuzzConfig:
    """``config`` with ``SchedulerConfig`` fields a newer vLLM added (a vLLM without them
    cannot run it: ``FuzzConfig.unavailable``)."""
    extra = {**config.spec.extra_scheduler_kwargs, **fields}
    return dataclasses.replace(
        config,
        name=name,
        description=description,
        spec=dataclasses.replace(config.spec, extra_scheduler_kwargs=extra),
    )


def _with_frontend_hashes(config: FuzzConfig) -> FuzzConfig:
    """``config`` with every prompt's block hashes computed by the frontend (vLLM 0.34's
    ``EngineCoreRequest.block_hashes``): a request hits only blocks whose tokens it has."""
    return dataclasses.replace(
        config,
        name=f"{config.name}-frontend-hashes",
        description=f"as {config.name}, with prompt block hashes computed by the frontend",
        spec=dataclasses.replace(config.spec, frontend_block_hashes=True),
    )


#: vLLM 0.34's new paths, in CI where a release has them: the bounded asynchronous
#: KV-load queue (``--max-num-inflight-kv-loads``: a load waits parked, holding a block
#: reservation, until one in flight is done; loaders abort or fail while parked or loading,
#: under both failure policies), cache-aware admission (``--cache-aware-admission-window``:
#: its probe counts entries registered but not written, and may move a request that would
#: hit them to the front), and frontend-computed prompt block hashes.
_ONE_LOAD_IN_FLIGHT = {"max_num_inflight_kv_loads": 1}
_CACHE_AWARE = {"cache_aware_admission_window": 8, "cache_aware_admission_threshold": 0.0}
CONFIGS.update(
    (config.name, config)
    for config in (
        _with_scheduler(
            CONFIGS["kv-load-async"],
            "kv-load-queue-async",
            "as kv-load-async, one asynchronous load in flight at a time "
            "(--max-num-inflight-kv-loads 1: the others wait parked), policy recompute",
            **_ONE_LOAD_IN_FLIGHT,
        ),
        _with_scheduler(
            dataclasses.replace(
                CONFIGS["kv-load-async"],
                spec=dataclasses.replace(
                    CONFIGS["kv-load-async"].spec, kv_load_failure_policy="fail"
                ),
                failed_loads=FailedLoadEpisodes(
                    async_share=1.0, partial_share=0.5, abort_loader=0.5
                ),
            ),
            "kv-load-queue-fail-async",
            "as kv-load-queue-async under policy fail, loaders aborted more often "
            "(while parked or loading)",
            **_ONE_LOAD_IN_FLIGHT,
        ),
        _with_scheduler(
            CONFIGS["hybrid-kv-load-async"],
            "hybrid-kv-load-queue-async",
            "as hybrid-kv-load-async, one asynchronous load in flight at a time",
            **_ONE_LOAD_IN_FLIGHT,
        ),
        FuzzConfig(
            "cache-aware-async",
            "FCFS with cache-aware admission over the first 8 waiting requests at any usage "
            "(its probe counts entries registered but not written); shared-prefix "
            "families, n>1, aborts, resets, sync loads that fail (policy recompute); async",
            _spec(
                num_blocks=48,
                async_scheduling=True,
                kv_load_failure_policy="recompute",
                extra_scheduler_kwargs=_CACHE_AWARE,
            ),
            depth=2,
            traffic=Traffic(
                arrival_rate=0.6,
                n_prob=0.15,
                abort_prob=0.05,
                reset_interval=80,
                external_share=0.3,
                fail_share=0.3,
            ),
            failed_loads=FailedLoadEpisodes(gap=40, abort_loader=0.3),
        ),
        _with_frontend_hashes(CONFIGS["victim-async"]),
        _with_frontend_hashes(CONFIGS["kv-load-partial-async"]),
    )
)
#: Every configuration, by name.
ALL_CONFIGS: dict[str, FuzzConfig] = {**CONFIGS, **SOAK_ONLY}


def runnable(configs: list[FuzzConfig]) -> tuple[list[FuzzConfig], dict[str, str]]:
    """(The configurations the installed vLLM can judge the guard on, and why the others
    cannot, by name), each in order."""
    kept: list[FuzzConfig] = []
    skipped: dict[str, str] = {}
    for config in configs:
        reason = config.unavailable()
        if reason is None:
            kept.append(config)
        else:
            skipped[config.name] = reason
    return kept, skipped
