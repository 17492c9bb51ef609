"""The rules, as the upstream series adds them to vLLM: one copy, run by the plugin.

Each module here is, line for line, code that ``upstream/series.py`` writes into vLLM
0.33.0 (in vLLM's style: its line length, its names); only the license header and the
import lines differ (``tests/test_rules_are_upstream.py``). The plugin imports these
modules and grafts the rest (the pool mixin, the scheduler hooks) around them.

- ``uncommitted``: the per-step record of uncommitted prefix-cache entries and the
  rules that remove them (``vllm/v1/core/sched/uncommitted.py``);
- ``failed_kv_loads``: the rollback of a failed KV load
  (``vllm/v1/core/sched/failed_kv_loads.py``);
- ``block_pool``: the entry types and exact removal (``BlockPool``);
- ``kv_cache_manager``: the rewind of cached-block counts (``KVCacheManager``).
"""
