"""The demo's traffic: a timed, preemption-heavy request schedule, and a client that sends it.

Requests go to ``/v1/completions`` as token ids, greedy, with top logprobs keyed by token id, so
that every completion can be compared with a reference (:mod:`guard_demo.compare`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from guard_demo.compare import TOP_LOGPROBS, Completion
from guard_demo.server import BLOCK_SIZE, SERVED_MODEL_NAME

__all__ = ["PROMPT_VOCAB", "Outcome", "WorkItem", "make_workload", "run_workload"]

#: Token ids prompts draw from: the tiny tokenizer's ids below its two special tokens.
PROMPT_VOCAB = 500


@dataclass(frozen=True)
class WorkItem:
    """One request of the workload."""

    request_id: str
    prompt: tuple[int, ...]
    priority: int
    max_tokens: int
    #: When to send it, in seconds from the start of the workload.
    arrival_s: float = 0.0
    #: Disconnect this many seconds after sending, unless the completion arrived first.
    cancel_after_s: float | None = None


def make_workload(num_requests: int, seed: int = 0, wave_period_s: float = 0.8) -> list[WorkItem]:
    """A deterministic, preemption-heavy, prefix-sharing request schedule.

    Requests arrive in waves, one every ``wave_period_s``, each shaped like the guard's case:

    * first a long, unique, low-priority "background" prompt V. It is admitted while the cache
      has room and prefills in chunks, scheduled first in every step and registering fresh
      blocks;
    * within about one engine step, two or three "interactive" priority-0 prompts. Admitted
      behind V, they run out of blocks in a step where V was already scheduled, and the
      priority policy picks V as the victim: its fresh registrations are the ones the guard
      rolls back (stock vLLM keeps them, hashed but never written);
    * in every other wave, V's prompt again, a little later and at priority 0: the reader that
      would hit those blocks.

    Prompts are token ids, for exact control over block boundaries; interactive prompts extend
    one of three block-aligned shared prefixes. About one in eight clients disconnects early.
    The exact interleaving with engine steps depends on timing, so preemptions and rollbacks
    vary from run to run; what must not vary is that every completion matches the reference.
    """
    rng = random.Random(seed)
    prefixes = [_random_tokens(rng, BLOCK_SIZE * blocks) for blocks in (2, 3, 5)]
    backgrounds: list[tuple[int, ...]] = []
    items: list[WorkItem] = []

    def add(prompt: tuple[int, ...], priority: int, arrival_s: float) -> None:
        cancel = rng.uniform(0.05, 1.0) if rng.random() < 0.125 else None
        items.append(
            WorkItem(
                request_id=f"demo-{seed}-{len(items)}",
                prompt=prompt,
                priority=priority,
                max_tokens=rng.randint(4, 32),
                arrival_s=round(arrival_s, 3),
                cancel_after_s=cancel,
            )
        )

    wave = 0
    while len(items) < num_requests:
        start = wave * wave_period_s
        # Unique, so that it prefills in several chunks instead of hitting the cache.
        backgrounds.append(_random_tokens(rng, rng.randint(320, 440)))
        add(backgrounds[-1], priority=2, arrival_s=start)
        for _ in range(rng.randint(2, 3)):
            prompt = rng.choice(prefixes) + _random_tokens(rng, rng.randint(32, 96))
            add(prompt, priority=0, arrival_s=start + rng.uniform(0.01, 0.1))
        if rng.random() < 0.5:
            add(backgrounds[-1], priority=0, arrival_s=start + rng.uniform(0.1, 0.4))
        wave += 1
    return items[:num_requests]


def _random_tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(PROMPT_VOCAB) for _ in range(n))


@dataclass
class Outcome:
    """What happened to one :class:`WorkItem`."""

    item: WorkItem
    status: str  # "completed" | "cancelled" | "failed"
    completion: Completion | None = None
    error: str | None = None


def run_workload(
    url: str,
    items: Sequence[WorkItem],
    *,
    replay: bool = False,
    concurrency: int = 32,
    timeout_s: float = 600.0,
    desc: str | None = None,
    model: str = SERVED_MODEL_NAME,
) -> list[Outcome]:
    """Send ``items`` to the server at ``url``; return their outcomes in order.

    By default each item is sent at its ``arrival_s`` and cancelled after its
    ``cancel_after_s``. With ``replay=True`` (for the reference) items are sent at once and
    never cancelled. At most ``concurrency`` requests are in flight either way. ``desc`` shows
    a progress bar with that title.

    Raises:
        TimeoutError: the whole workload took longer than ``timeout_s``; the requests still in
            flight were cancelled (and so aborted by the server) first.
    """
    from tqdm import tqdm

    with tqdm(total=len(items), desc=desc, unit="req", disable=desc is None) as progress:
        coro = _run_workload_async(url, items, replay, concurrency, progress, model)
        try:
            return asyncio.run(asyncio.wait_for(coro, timeout=timeout_s))
        except asyncio.TimeoutError:
            raise TimeoutError(f"workload did not finish within {timeout_s:.0f}s") from None


async def _run_workload_async(
    url: str,
    items: Sequence[WorkItem],
    replay: bool,
    concurrency: int,
    progress: Any,
    model: str,
) -> list[Outcome]:
    import aiohttp

    semaphore = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    start = time.monotonic()

    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def send(item: WorkItem) -> Outcome:
            if not replay:
                await asyncio.sleep(max(0.0, start + item.arrival_s - time.monotonic()))
            async with semaphore:
                outcome = await _run_one(session, url, item, model, cancel=not replay)
            if progress is not None:
                progress.update(1)
            return outcome

        return list(await asyncio.gather(*(send(item) for item in items)))


async def _run_one(session: Any, url: str, item: WorkItem, model: str, cancel: bool) -> Outcome:
    request = _complete(session, url, item, model)
    try:
        if cancel and item.cancel_after_s is not None:
            # Timing out closes the connection; the server aborts the request.
            completion = await asyncio.wait_for(request, timeout=item.cancel_after_s)
        else:
            completion = await request
    except asyncio.TimeoutError:
        return Outcome(item, "cancelled")
    except Exception as exc:  # reported, not raised: one bad request must not hide the rest
        return Outcome(item, "failed", error=f"{type(exc).__name__}: {exc}")
    return Outcome(item, "completed", completion)


async def _complete(session: Any, url: str, item: WorkItem, model: str) -> Completion:
    async with session.post(f"{url}/v1/completions", json=_request_body(item, model)) as resp:
        payload = await resp.json(content_type=None)
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {payload}")
    return Completion.from_openai_choice(payload["choices"][0])


def _request_body(item: WorkItem, model: str) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": list(item.prompt),
        "max_tokens": item.max_tokens,
        "temperature": 0.0,
        "logprobs": TOP_LOGPROBS,
        "ignore_eos": True,
        "priority": item.priority,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
