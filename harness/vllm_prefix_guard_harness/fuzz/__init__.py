"""Shadow-KV differential fuzzer: stock vLLM vs the guard vs PR #43569's rollback scope.

Modules, one job each (data flows top to bottom):

- ``workload``: a run as plain data (scheduler spec, engine depth, timed events);
- ``generators``: seedable traffic, random and aimed at the failure windows;
- ``configs``: named configurations (scheduler + depth + generators);
- ``pr43569``: the comparator policy, the guard's rules with PR #43569's rollback scope;
- ``oracle``: the shadow-KV driver with the fuzzer's meters;
- ``runner``: one workload in one mode -> exact counters;
- ``differential``: every mode on the same seeds, totals and acceptance checks;
- ``shrink``: delta debugging of a failing workload into a paste-able reproducer;
- ``report``: markdown and JSON; ``cli``: ``vllm-prefix-guard-harness fuzz``; ``soak``: long runs.
"""
