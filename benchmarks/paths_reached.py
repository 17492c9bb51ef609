#!/usr/bin/env python3
"""Do the fuzz configurations of vLLM 0.34's new paths reach them? And does cache-aware
admission change stock's exposure?

A configuration only judges a path if its runs take it. This counts, on the installed vLLM,
stock, one seed each, what each path does (vLLM's own methods wrapped to count, nothing
else changed):

- the bounded asynchronous KV-load queue: the most loads waiting in ``async_kv_waiting``,
  the steps with a parked reservation, the steps with an aborted load outstanding;
- cache-aware admission: reorders of the waiting queue, probes, probes that found cached
  tokens;
- hybrid states published after the output: ``cache_blocks`` calls from
  ``update_from_output`` and the prefix-cache entries they added;

then runs ``cache-aware-async`` on seeds 0-2 with and without the admission window, stock and
guard (bad reads, hit tokens, hit tokens on bad KV, admissions onto bad KV).

Usage (the Python of a vLLM 0.34 venv; docs/compat/README.md quotes its output)::

    PYTHONHASHSEED=0 python benchmarks/paths_reached.py
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from typing import Any

from vllm_prefix_guard_harness.fuzz.cli import quiet_vllm
from vllm_prefix_guard_harness.fuzz.configs import ALL_CONFIGS, CONFIGS
from vllm_prefix_guard_harness.fuzz.runner import run_workload

COUNTS: Counter[str] = Counter()
INSIDE_UPDATE = [False]


def counted(cls: Any, name: str, count: Any) -> None:
    """Wrap ``cls.name`` so that ``count(self, result, *args)`` sees every call."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        count(self, result, *args)
        return result

    setattr(cls, name, wrapper)


def instrument() -> None:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    def before_schedule(self: Any, _: Any) -> None:
        COUNTS["most loads waiting"] = max(COUNTS["most loads waiting"], len(self.async_kv_waiting))
        COUNTS["steps with a parked reservation"] += bool(self._parked_reservations)
        COUNTS["steps with an aborted load"] += bool(self._aborted_kv_loads)

    counted(Scheduler, "schedule", before_schedule)

    def probe(self: Any, cached: int, *_: Any) -> None:
        COUNTS["probes"] += 1
        COUNTS["probes that found cached tokens"] += bool(cached)

    counted(KVCacheManager, "get_num_cached_tokens", probe)
    reorder = Scheduler._reorder_waiting_by_cached_prefix

    @functools.wraps(reorder)
    def reorder_counted(self: Any) -> None:
        before = [r.request_id for r in self.waiting]
        reorder(self)
        COUNTS["reorders"] += before != [r.request_id for r in self.waiting]

    Scheduler._reorder_waiting_by_cached_prefix = reorder_counted
    update = Scheduler.update_from_output

    @functools.wraps(update)
    def update_marked(self: Any, *args: Any, **kwargs: Any) -> Any:
        INSIDE_UPDATE[0] = True
        try:
            return update(self, *args, **kwargs)
        finally:
            INSIDE_UPDATE[0] = False

    Scheduler.update_from_output = update_marked

    def cache_blocks(self: Any, *_: Any) -> None:
        COUNTS["cache_blocks calls from update_from_output"] += INSIDE_UPDATE[0]

    counted(KVCacheManager, "cache_blocks", cache_blocks)
    insert = BlockPool._insert_block_hash

    @functools.wraps(insert)
    def insert_counted(self: Any, key: Any, block: Any, num_tokens: Any) -> Any:
        new = block.block_hash is None or (
            block.block_hash != key
            and not self.cached_block_hash_to_block.contain(key, block.block_id)
        )
        COUNTS["entries added from update_from_output"] += INSIDE_UPDATE[0] and new
        return insert(self, key, block, num_tokens)

    BlockPool._insert_block_hash = insert_counted


def main() -> None:
    quiet_vllm()
    instrument()
    for name in (
        "kv-load-queue-async",
        "kv-load-queue-fail-async",
        "hybrid-kv-load-queue-async",
        "cache-aware-async",
        "hybrid-victim",
        "hybrid-partial-victim-sparse",
    ):
        COUNTS.clear()
        run_workload(ALL_CONFIGS[name].workload(0), "stock")
        print(f"{name} (seed 0, stock): " + ", ".join(f"{k} {v}" for k, v in COUNTS.items() if v))
    base = CONFIGS["cache-aware-async"]
    without = dataclasses.replace(
        base, spec=dataclasses.replace(base.spec, extra_scheduler_kwargs={})
    )
    for label, config in (("with the window", base), ("without it", without)):
        for mode in ("stock", "guard"):
            runs = [run_workload(config.workload(seed), mode) for seed in range(3)]
            print(
                f"cache-aware-async {label}, {mode}, seeds 0-2: "
                f"bad reads {sum(r.violations for r in runs)}, "
                f"hit tokens {sum(r.hit_tokens for r in runs)}, "
                f"on bad KV {sum(r.invalid_hit_tokens for r in runs)}, "
                f"admissions onto bad KV {sum(r.bad_admissions for r in runs)}"
            )


if __name__ == "__main__":
    main()
