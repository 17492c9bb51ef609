"""The end-to-end harness: real ``api_server`` processes, a workload, and a reference check.

:mod:`guard_demo` runs it as the project's main job; ``tests/e2e`` reuse its parts.
Each module has one job:

* :mod:`.engine_proof` runs the bug and the fix on three in-process engines (the proof the
  demo's report opens with, run in a process of its own);
* :mod:`.server` starts, health-checks and stops an ``api_server`` process group;
* :mod:`.processes` finds live processes in ``/proc``, so that none is left behind;
* :mod:`.workload` builds the preemption-heavy request schedule and sends it;
* :mod:`.compare` decides whether a completion matches its reference;
* :mod:`.metrics` reads vLLM's Prometheus counters and the guard's own;
* :mod:`.reference_check` runs a workload on the guarded server, replays it on the reference
  server, and compares the two.

The demo's own process never imports vLLM: the servers are separate processes, spoken to
over HTTP, and so is the engine proof.
"""
