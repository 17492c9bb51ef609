"""Named exploration scopes, each stated in full: what may happen, and where the search stops.

A scope is a small world the explorer enumerates completely: a fixed list of requests
(prompts that share prefixes, each with its priority, length and remotely available
tokens), a tiny pool, and the events allowed at each engine iteration before the
*horizon*. From the horizon on nothing happens any more: the run drains
deterministically (every KV load succeeds, no step is dropped) to completion, within
``drain_limit`` iterations. The bound is therefore explicit and finite: every sequence
of events of length ``horizon`` is explored, each to the end of its drain, so "no state
left unexplored within the bounds" is checkable (the report counts any run that did not
drain; a complete exploration has none).

Events per iteration (arrivals apply first, then the abort, then the reset, as in
``fuzz.workload``):

- up to ``arrivals_per_step`` requests arrive: the next ones of ``requests``
  (``arrivals="fixed"``) or any that have not arrived (``"any"``);
- one live request is aborted (``aborts``; it lands before the next update, as in
  ``EngineCore``);
- ``reset_prefix_cache`` (``resets``; preempting the running requests first when
  ``reset_running``);
- the KV load of the step just scheduled fails on any non-empty subset of the blocks it
  loads (scopes with a ``kv_load_failure_policy``);
- the output of the oldest step in flight is dropped and the next step's output comes
  back first (``drops``, async scopes): see ``system.Lane.drop_oldest`` for exactly when.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal

from vllm_prefix_guard_harness.factory import SchedulerSpec
from vllm_prefix_guard_harness.fuzz.workload import Runs, prompt_length


@dataclass(frozen=True)
class RequestSpec:
    """One request a scope may add: ``r<index>`` in the order of ``Scope.requests``."""

    prompt: Runs
    max_tokens: int = 2
    priority: int = 0
    # The fake connector holds this many leading tokens remotely (whole blocks load).
    external_tokens: int = 0

    def describe(self) -> str:
        extra = f", {self.external_tokens} remote" if self.external_tokens else ""
        return (
            f"prompt {list(self.prompt)} ({prompt_length(self.prompt)} tokens), "
            f"max_tokens {self.max_tokens}, priority {self.priority}{extra}"
        )


@dataclass(frozen=True)
class Scope:
    """Everything that bounds one exploration."""

    name: str
    description: str
    requests: tuple[RequestSpec, ...]
    block_size: int = 4
    num_blocks: int = 8
    max_num_batched_tokens: int = 8
    max_num_seqs: int = 4
    # Prefill chunks of at most this many tokens (0: the token budget alone).
    long_prefill_token_threshold: int = 0
    policy: Literal["fcfs", "priority"] = "fcfs"
    async_scheduling: bool = False
    kv_load_failure_policy: Literal["fail", "recompute"] | None = None
    horizon: int = 5
    drain_limit: int = 40
    arrivals: Literal["fixed", "any"] = "fixed"
    # At most this many requests arrive at one iteration.
    arrivals_per_step: int = 1
    aborts: bool = False
    resets: bool = False
    reset_running: bool = True
    drops: bool = False
    max_model_len: int = 64
    # A second KV-cache group holding a Mamba / linear-attention state per block, in the
    # align mode prefix caching uses (the oracle checks the state each step starts from).
    mamba_align: bool = False
    # The state group's prefix-cache retention (``SchedulerSpec.retention_interval``):
    # None keeps every boundary state, 0 (an engine's default) a prompt's checkpoint only.
    retention_interval: int | None = None

    @property
    def depth(self) -> int:
        """Steps in flight: two under async scheduling (``step_with_batch_queue``)."""
        return 2 if self.async_scheduling else 1

    @property
    def load_failures(self) -> bool:
        return self.kv_load_failure_policy is not None

    @property
    def max_iterations(self) -> int:
        return self.horizon + self.drain_limit

    def spec(self) -> SchedulerSpec:
        return SchedulerSpec(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.policy,
            async_scheduling=self.async_scheduling,
            kv_load_failure_policy=self.kv_load_failure_policy,
            mamba_align=self.mamba_align,
            retention_interval=self.retention_interval,
            # Every lane's KV events are replayed by a set and a counting consumer.
            kv_events=True,
        )

    def bounds(self) -> str:
        """The bound in one sentence (the upstream PR text states it per scope)."""
        order = "in order" if self.arrivals == "fixed" else "in any order"
        events = [f"up to {self.arrivals_per_step} arrival(s) {order}"]
        events += ["an abort"] * self.aborts + ["a prefix-cache reset"] * self.resets
        if self.load_failures:
            events.append(
                f"the failure of any subset of the step's KV loads "
                f"(policy {self.kv_load_failure_policy})"
            )
        events += ["a dropped output"] * self.drops
        model = ", a hybrid model (a Mamba state group, align mode)" * self.mamba_align
        model += ", a prompt's checkpoint the only state retained" * (self.retention_interval == 0)
        return (
            f"every sequence of {self.horizon} engine iterations, each with any of: "
            f"{'; '.join(events)}; over {len(self.requests)} requests on a "
            f"{self.num_blocks}-block pool (block size {self.block_size}, "
            f"{self.max_num_batched_tokens}-token budget, {self.policy}, "
            f"{self.depth} step{'s' * (self.depth > 1)} in flight{model}), "
            f"each run on to its drain"
        )

    def describe(self) -> str:
        """The scope in full, one setting a line."""
        lines = [f"{self.name}: {self.description}"]
        for index, request in enumerate(self.requests):
            lines.append(f"  r{index}: {request.describe()}")
        for f in fields(self):
            if f.name not in ("name", "description", "requests"):
                lines.append(f"  {f.name} = {getattr(self, f.name)!r}")
        lines.append(f"  steps in flight = {self.depth}")
        return "\n".join(lines)


# Prompts of a family share their leading blocks (block size 4): P is 2 blocks, Q shares
# its first block, R shares both and adds one.
_P: Runs = ((100, 8),)
_Q: Runs = ((100, 4), (300, 5))
_R: Runs = ((100, 8), (200, 5))
_S: Runs = ((100, 8), (200, 8))
# The shared notes' zombie layout (``notes_zombie``) at a quarter of the tokens,
# block size 4 (the same block counts): D short, A long at low priority, B outranks A
# while A is being scheduled, C is A again.
_D: Runs = ((1000, 4),)
_A: Runs = ((1, 40),)
_B: Runs = ((2000, 30),)
_ZOMBIE = (
    RequestSpec(_D, max_tokens=3),
    RequestSpec(_A, max_tokens=4, priority=1),
    RequestSpec(_B, max_tokens=4),
    RequestSpec(_A, max_tokens=2, priority=1),
)
_ZOMBIE_POOL = dict(
    num_blocks=20, max_num_batched_tokens=64, long_prefill_token_threshold=16, policy="priority"
)

SCOPES: dict[str, Scope] = {
    s.name: s
    for s in (
        Scope(
            "ci",
            "CI: the zombie layout, sync priority; two arrivals a step in order, 4 iterations",
            requests=_ZOMBIE,
            horizon=4,
            arrivals="fixed",
            arrivals_per_step=2,
            **_ZOMBIE_POOL,  # type: ignore[arg-type]
        ),
        Scope(
            "sync-priority",
            "sync priority: the zombie layout, two arrivals a step in order, aborts",
            requests=_ZOMBIE,
            horizon=5,
            arrivals="fixed",
            arrivals_per_step=2,
            aborts=True,
            **_ZOMBIE_POOL,  # type: ignore[arg-type]
        ),
        Scope(
            "sync-fcfs",
            "sync FCFS: three requests of one family arrive in any order, aborts, resets",
            requests=(RequestSpec(_P, 2), RequestSpec(_R, 1), RequestSpec(_Q, 2)),
            num_blocks=7,
            horizon=3,
            arrivals="any",
            aborts=True,
            resets=True,
        ),
        Scope(
            "sync-fcfs-recompute",
            "sync FCFS: a remote prefix loaded while a sharer with the same prompt hits it "
            "in the same step; the load fails on any subset of its blocks (policy "
            "recompute); chunked prefill",
            requests=(RequestSpec(_S, 2, external_tokens=12), RequestSpec(_S, 2)),
            num_blocks=12,
            long_prefill_token_threshold=4,
            kv_load_failure_policy="recompute",
            horizon=3,
            arrivals="fixed",
            arrivals_per_step=2,
        ),
        Scope(
            "async-fcfs-recompute",
            "async FCFS, two steps in flight; a remote prefix whose load fails on any "
            "subset of its blocks (policy recompute); dropped outputs",
            requests=(
                RequestSpec(_P, 1, external_tokens=8),
                RequestSpec(_R, 1),
                RequestSpec(_P, 1),
            ),
            num_blocks=8,
            async_scheduling=True,
            kv_load_failure_policy="recompute",
            horizon=4,
            arrivals="fixed",
            drops=True,
        ),
        Scope(
            "async-priority-fail",
            "async priority, two steps in flight; a remote prefix whose load fails on any "
            "subset of its blocks (policy fail); aborts in flight",
            requests=(
                RequestSpec(_R, 1, priority=1, external_tokens=8),
                RequestSpec(_P, 2, priority=0),
                RequestSpec(_R, 1, priority=0),
            ),
            num_blocks=7,
            policy="priority",
            async_scheduling=True,
            kv_load_failure_policy="fail",
            horizon=4,
            arrivals="fixed",
            aborts=True,
        ),
        Scope(
            "async-reset-loader",
            "async FCFS, two steps in flight: a loader whose load fails on any subset of its "
            "blocks, reset (preempting the running requests; the cache stays, its step is in "
            "flight) before the failure's report, so it can resume at once on its own load's "
            "entries (the everything-async seed-2 soak finding's window, policy recompute), "
            "and a second request on the loaded prefix",
            requests=(
                RequestSpec(((100, 4), (200, 4), (300, 1)), 2, external_tokens=8),
                RequestSpec(((100, 4), (200, 4), (400, 2)), 1),
            ),
            num_blocks=12,
            long_prefill_token_threshold=8,
            async_scheduling=True,
            kv_load_failure_policy="recompute",
            horizon=2,
            arrivals="fixed",
            resets=True,
        ),
        Scope(
            "hybrid-priority",
            "a hybrid model (full attention + a Mamba state group in align mode), sync "
            "priority: the zombie layout, two arrivals a step in order, aborts",
            requests=_ZOMBIE,
            horizon=4,
            arrivals="fixed",
            arrivals_per_step=2,
            aborts=True,
            mamba_align=True,
            **_ZOMBIE_POOL,  # type: ignore[arg-type]
        ),
        Scope(
            "hybrid-async-retry",
            "a hybrid model, async FCFS, two steps in flight: a long chunked prefill "
            "aborted in flight and its retry (vLLM PR #56525's shape), any arrival order, "
            "resets",
            requests=(RequestSpec(_S, 1), RequestSpec(_S, 2), RequestSpec(_R, 1)),
            num_blocks=12,
            long_prefill_token_threshold=4,
            async_scheduling=True,
            horizon=4,
            arrivals="any",
            aborts=True,
            resets=True,
            mamba_align=True,
        ),
        Scope(
            "hybrid-async-drop",
            "a hybrid model, async FCFS, two steps in flight: requests of one family "
            "arrive in order while the oldest step's output may be dropped; aborts",
            requests=(RequestSpec(_P, 1), RequestSpec(_R, 1), RequestSpec(_P, 1)),
            num_blocks=8,
            async_scheduling=True,
            horizon=5,
            arrivals="fixed",
            aborts=True,
            drops=True,
            mamba_align=True,
        ),
    )
}

# The zombie layout and the dropped output again, with an engine's default retention.
SCOPES.update(
    (sparse.name, sparse)
    for sparse in (
        replace(
            SCOPES[name],
            name=f"{name}-sparse",
            description=f"as {name}, with vLLM's default prefix-cache retention",
            retention_interval=0,
        )
        for name in ("hybrid-priority", "hybrid-async-drop")
    )
)

#: The scope CI explores on every run (well under two minutes on two busy cores).
CI_SCOPE = "ci"
#: What ``explore`` runs by default and ``nox -s explore`` writes into docs/fuzzing.md.
DEFAULT_SCOPES = tuple(name for name in SCOPES if name != CI_SCOPE)
