"""Seedable workload generators: random traffic, and traffic aimed at the failure windows.

Why targeted generators exist: a zombie entry is read only if, after a priority victim
that was already scheduled in the same ``schedule()`` is preempted, someone looks up its
prefix before any allocation evicts the victim's unwritten tail (``free_blocks`` queues
that tail first, so the aggressor's retry and the next allocations take it). Random
traffic almost never lines this up, so it passes on stock vLLM and proves nothing.
:func:`victim_episodes` builds the line-up on purpose with randomised sizes (a few
percent of its episodes read a zombie on stock vLLM), and :func:`failed_load_episodes`
does the same for KV-connector load failures.

Every generator is a pure function of a ``random.Random``, its knobs, a horizon and the
block size, so a configuration name plus a seed names one workload exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from vllm_prefix_guard_harness.fuzz.workload import (
    Abort,
    Arrive,
    Event,
    Fault,
    Reset,
    Runs,
    prompt_length,
)

# Token ids: the system prompt is 1..; every other run comes from a generator's own
# space (``space * _SPACE_SIZE`` on), one ``_RUN_SIZE`` slot per run, so prompts share a
# prefix only where a generator means it. The shrinker renumbers runs compactly. Every id
# fits in an int32, as vLLM 0.34 stores token ids (spaces 1-3 end below 2**31).
SYSTEM_PROMPT_BASE = 1
_SPACE_SIZE = 2**29
_RUN_SIZE = 10_000


class _Namer:
    """Request ids ``<prefix>0, <prefix>1, ...`` and fresh token runs for one generator."""

    def __init__(self, prefix: str, space: int) -> None:
        self.prefix = prefix
        self.requests = 0
        self.runs = 0
        self.base = space * _SPACE_SIZE

    def request(self) -> str:
        self.requests += 1
        return f"{self.prefix}{self.requests - 1}"

    def run(self) -> int:
        """First token id of a run no other run overlaps."""
        self.runs += 1
        assert (self.runs + 1) * _RUN_SIZE <= _SPACE_SIZE, "a workload of too many runs"
        return self.base + self.runs * _RUN_SIZE


def _system_prompt(blocks: int, block_size: int) -> Runs:
    return ((SYSTEM_PROMPT_BASE, blocks * block_size),) if blocks else ()


# -- random traffic ------------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """Knobs of random traffic; sizes are in tokens unless named ``*_blocks``."""

    # Mean arrivals per engine iteration.
    arrival_rate: float = 0.5
    # Shared-prefix families: how many, their prefix lengths, and how often a request
    # belongs to one (the rest are unique prompts after the system prompt, if any).
    families: int = 4
    prefix_blocks: tuple[int, int] = (2, 8)
    family_share: float = 0.7
    suffix_tokens: tuple[int, int] = (1, 48)
    # Parallel sampling: probability an arrival is a group of identical prompts, and the
    # largest group (vLLM expands n>1 into n requests with the same prompt).
    n_prob: float = 0.1
    n_max: int = 4
    max_tokens: tuple[int, int] = (1, 24)
    # "none": all 0; "random": uniform in [0, priorities); "phased": the range shifts
    # every ``phase_steps``, so newcomers alternately outrank and yield to running ones.
    priority: str = "none"
    priorities: int = 3
    phase_steps: int = 50
    # Probability a request is aborted, 0..abort_delay iterations after it arrives.
    abort_prob: float = 0.0
    abort_delay: int = 12
    # Share of aborted requests sent again, under a new id, the iteration after the
    # abort (a client's retry: the shape of vLLM PR #56525, where the retry hits the
    # aborted request's entries while the step writing them may still be in flight).
    retry_share: float = 0.0
    # Mean iterations between reset_prefix_cache calls (0: never); share with running=True.
    reset_interval: int = 0
    reset_running_share: float = 0.5
    # Mean iterations between faults of the engine loop (0: never; workload.Fault).
    fault_interval: int = 0
    # KV connector: share of family requests whose prefix is remotely available, and
    # share of those whose loads fail.
    external_share: float = 0.0
    fail_share: float = 0.0
    # Share of those loads that are asynchronous, and how many executed steps they take.
    async_share: float = 0.0
    async_steps: tuple[int, int] = (1, 3)
    # Longest prompt + output, in blocks, so every request fits the pool on its own.
    max_request_blocks: int = 24


def _priority(rng: random.Random, traffic: Traffic, step: int) -> int:
    if traffic.priority == "random":
        return rng.randrange(traffic.priorities)
    if traffic.priority == "phased":
        newcomers_first = (step // traffic.phase_steps) % 2
        low = 0 if newcomers_first else traffic.priorities
        return low + rng.randrange(traffic.priorities)
    return 0


def _fit(prompt: Runs, max_tokens: int, limit_tokens: int) -> tuple[Runs, int]:
    """Trim the last run (then the output) so prompt + output fits ``limit_tokens``."""
    excess = prompt_length(prompt) + max_tokens - limit_tokens
    if excess <= 0:
        return prompt, max_tokens
    *head, (first, length) = prompt
    cut = min(excess, length - 1)
    return (*head, (first, length - cut)), max(1, max_tokens - (excess - cut))


def random_traffic(
    rng: random.Random,
    traffic: Traffic,
    horizon: int,
    block_size: int,
    system_prompt_blocks: int = 0,
) -> list[Event]:
    """Shared-prefix families, identical prompts and n>1 groups, mixed lengths (chunked
    prefill past the chunk threshold), priorities, aborts at random points (also while
    the request's step is in flight), ``reset_prefix_cache`` calls, connector loads."""
    names = _Namer("r", 1)
    system = _system_prompt(system_prompt_blocks, block_size)
    families = [
        (names.run(), rng.randint(*traffic.prefix_blocks) * block_size + rng.randrange(block_size))
        for _ in range(traffic.families)
    ]
    limit = traffic.max_request_blocks * block_size
    events: list[Event] = []
    for step in range(horizon):
        arrivals = sum(rng.random() < traffic.arrival_rate / 4 for _ in range(4))
        for _ in range(arrivals):
            in_family = rng.random() < traffic.family_share
            family = rng.randrange(traffic.families) if in_family else None
            group = rng.randint(2, traffic.n_max) if rng.random() < traffic.n_prob else 1
            leader = names.request()
            suffix = (names.run(), rng.randint(*traffic.suffix_tokens))
            shared: Runs = (*system, families[family]) if family is not None else system
            prompt, max_tokens = _fit((*shared, suffix), rng.randint(*traffic.max_tokens), limit)
            priority = _priority(rng, traffic, step)
            external = 0
            fails = False
            async_steps = 0
            if family is not None and rng.random() < traffic.external_share:
                external = prompt_length(shared)
                fails = rng.random() < traffic.fail_share
                # Drawn only where asynchronous loads are on: other configurations' draws stay.
                if traffic.async_share and rng.random() < traffic.async_share:
                    async_steps = rng.randint(*traffic.async_steps)
            for member in range(group):
                request_id = leader if member == 0 else names.request()
                events.append(
                    Arrive(
                        step,
                        request_id,
                        prompt,
                        max_tokens,
                        priority,
                        external,
                        fails,
                        async_load_steps=async_steps,
                    )
                )
                if rng.random() < traffic.abort_prob:
                    aborted_at = step + rng.randint(0, traffic.abort_delay)
                    events.append(Abort(aborted_at, request_id))
                    if traffic.retry_share and rng.random() < traffic.retry_share:
                        events.append(
                            Arrive(aborted_at + 1, names.request(), prompt, max_tokens, priority)
                        )
        if traffic.reset_interval and rng.random() < 1 / traffic.reset_interval:
            events.append(Reset(step, running=rng.random() < traffic.reset_running_share))
        if traffic.fault_interval and rng.random() < 1 / traffic.fault_interval:
            events.append(Fault(step))
    return events


# -- targeted: an already-scheduled request as the priority victim ---------------------------


@dataclass(frozen=True)
class VictimEpisodes:
    """One episode every ``gap`` iterations (each starts from a drained scheduler).

    Fillers (priority 0, short) and the victim (priority 2, long, chunked) arrive
    together, so the victim runs ahead of the aggressor in ``running``; the aggressor
    (priority 0-1) arrives a step or two later and, in a pool sized to be nearly full
    at its next chunk, cannot allocate after the victim was scheduled: the victim is
    preempted with this step's registrations in place. Followers share the victim's
    prefix and look it up while the unwritten tail may still be cached. Sizes are in
    blocks unless named ``*_tokens``; short fillers and aggressors keep the pool
    slack after the trigger, so the rest of the episode does not hinge on timing.
    """

    gap: int = 40
    fillers: tuple[int, int] = (2, 4)
    filler_tokens: tuple[int, int] = (8, 32)
    filler_max_tokens: tuple[int, int] = (2, 6)
    victim_blocks: tuple[int, int] = (6, 14)
    aggressor_delay: tuple[int, int] = (1, 2)
    aggressor_blocks: tuple[int, int] = (2, 6)
    aggressor_max_tokens: tuple[int, int] = (2, 6)
    followers: tuple[int, int] = (1, 3)
    follower_delay: tuple[int, int] = (1, 5)


def victim_episodes(
    rng: random.Random,
    knobs: VictimEpisodes,
    horizon: int,
    block_size: int,
    system_prompt_blocks: int = 0,
) -> list[Event]:
    """Priority-preemption episodes that often leave a zombie for a follower to read."""
    names = _Namer("v", 2)
    system = _system_prompt(system_prompt_blocks, block_size)
    events: list[Event] = []
    for start in range(0, horizon, knobs.gap):
        for _ in range(rng.randint(*knobs.fillers)):
            prompt = (*system, (names.run(), rng.randint(*knobs.filler_tokens)))
            max_tokens = rng.randint(*knobs.filler_max_tokens)
            events.append(Arrive(start, names.request(), prompt, max_tokens))
        victim_start = names.run()
        victim_len = rng.randint(*knobs.victim_blocks) * block_size + rng.randrange(block_size)
        victim_prompt = (*system, (victim_start, victim_len))
        events.append(Arrive(start, names.request(), victim_prompt, rng.randint(2, 8), 2))
        aggressor_at = start + rng.randint(*knobs.aggressor_delay)
        aggressor_blocks = rng.randint(*knobs.aggressor_blocks)
        aggressor_len = aggressor_blocks * block_size + rng.randrange(block_size)
        events.append(
            Arrive(
                aggressor_at,
                names.request(),
                (*system, (names.run(), aggressor_len)),
                rng.randint(*knobs.aggressor_max_tokens),
                priority=rng.randint(0, 1),
            )
        )
        for _ in range(rng.randint(*knobs.followers)):
            if rng.random() < 0.5:
                prompt = victim_prompt
            else:
                kept = victim_len - rng.randrange(victim_len // 2)
                prompt = (*system, (victim_start, kept), (names.run(), rng.randint(1, 20)))
            events.append(
                Arrive(
                    aggressor_at + rng.randint(*knobs.follower_delay),
                    names.request(),
                    prompt,
                    rng.randint(2, 8),
                    priority=rng.randint(0, 1),
                )
            )
    return events


# -- targeted: KV-connector synchronous loads that fail ------------------------------------


@dataclass(frozen=True)
class FailedLoadEpisodes:
    """One episode every ``gap`` iterations: a request loads a long remote prefix
    (several chunks) and the load fails; followers with the same prefix arrive a step
    or a few later, before the loader recomputes it (policy "recompute"), or after the
    loader was aborted before the failing step's update (``abort_loader``: under policy
    "fail" vLLM then never evicts the invalid blocks). A share of the failing loads
    (``partial_share``) fail on some of the prefix's blocks only, the others loading fine.
    A share of the loads (``async_share``) are asynchronous, reported done
    ``async_steps`` executed steps after they start; followers then arrive while the load
    is under way or just after."""

    gap: int = 24
    prefix_blocks: tuple[int, int] = (6, 12)
    fail_share: float = 0.5
    abort_loader: float = 0.0
    partial_share: float = 0.0
    async_share: float = 0.0
    async_steps: tuple[int, int] = (1, 3)
    followers: tuple[int, int] = (1, 3)
    follower_delay: tuple[int, int] = (1, 4)
    max_tokens: tuple[int, int] = (2, 8)


def failed_load_episodes(
    rng: random.Random,
    knobs: FailedLoadEpisodes,
    horizon: int,
    block_size: int,
    system_prompt_blocks: int = 0,
) -> list[Event]:
    """Remote-prefix loads, half of them failing, with followers reading the prefix."""
    names = _Namer("k", 3)
    system = _system_prompt(system_prompt_blocks, block_size)
    events: list[Event] = []
    for start in range(0, horizon, knobs.gap):
        prefix_len = rng.randint(*knobs.prefix_blocks) * block_size
        shared = (*system, (names.run(), prefix_len))
        external = prompt_length(shared)
        fails = rng.random() < knobs.fail_share
        request_id = names.request()
        loader = (*shared, (names.run(), rng.randint(1, 24)))
        max_tokens = rng.randint(*knobs.max_tokens)
        failed_blocks: tuple[int, ...] = ()
        # Drawn only where partial failures are on: the other configurations' draws stay.
        if fails and knobs.partial_share and rng.random() < knobs.partial_share:
            num_blocks = external // block_size
            failed_blocks = tuple(
                sorted(rng.sample(range(num_blocks), rng.randint(1, num_blocks - 1)))
            )
        async_steps = 0
        if knobs.async_share and rng.random() < knobs.async_share:
            async_steps = rng.randint(*knobs.async_steps)
        events.append(
            Arrive(
                start,
                request_id,
                loader,
                max_tokens,
                0,
                external,
                fails,
                failed_blocks,
                async_steps,
            )
        )
        if fails and rng.random() < knobs.abort_loader:
            events.append(Abort(start, request_id))
        for _ in range(rng.randint(*knobs.followers)):
            events.append(
                Arrive(
                    start + rng.randint(*knobs.follower_delay),
                    names.request(),
                    (*shared, (names.run(), rng.randint(1, 24))),
                    rng.randint(*knobs.max_tokens),
                )
            )
    return events
