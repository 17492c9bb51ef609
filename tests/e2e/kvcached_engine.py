"""One engine of the kvcached engine check, alone in a fresh interpreter; writes JSON.

kvcached keeps per-process state (its allocator, its IPC with the workers), so each
engine of ``test_engine_zombie_kvcached.py`` runs in its own process, as engines do in a
kvcached deployment. The process starts like any other on that machine: kvcached's
``kvcached_autopatch.pth`` (installed with kvcached) patches vLLM on ``import vllm`` when
``ENABLE_KVCACHED`` is set; in ``guarded`` mode vLLM itself then loads the guard through
its plugin entry point (``VLLM_PREFIX_GUARD=1``), after kvcached: the order of a real
server.

Usage::

    python tests/e2e/kvcached_engine.py MODE MODEL_DIR OUT_JSON

MODE is ``reference`` (prefix caching off), ``stock`` (prefix caching on, no guard) or
``guarded``. The layout is ``test_engine_zombie.run_scenario``'s, with the engine
arguments of ``VLLM_PREFIX_GUARD_E2E_ENGINE_ARGS`` on top.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("reference", "stock", "guarded")


def main(mode: str, model: str, out: str) -> int:
    if mode not in MODES:
        raise SystemExit(f"MODE must be one of {', '.join(MODES)}")
    if mode == "guarded":
        os.environ["VLLM_PREFIX_GUARD"] = "1"
    else:
        os.environ.pop("VLLM_PREFIX_GUARD", None)
    # In-process EngineCore: the scheduler is read directly (preemptions, pool, counters).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path[:0] = [str(HERE), str(HERE.parents[1] / "examples")]
    import test_engine_zombie as scenario

    from vllm_prefix_guard import plugin

    run = scenario.run_scenario(Path(model), prefix_caching=mode != "reference")
    document = {
        "mode": mode,
        "completions": {
            name: {
                "token_ids": list(completion.token_ids),
                "top_logprobs": [
                    {str(token): logprob for token, logprob in position.items()}
                    for position in completion.top_logprobs
                ],
            }
            for name, completion in run.completions.items()
        },
        "num_cached_tokens": run.num_cached_tokens,
        "preempted": [sorted(ids) for ids in run.preempted],
        "async_scheduling": run.async_scheduling,
        "pool_mro": run.pool_mro,
        "guard_counters": run.guard_counters,
        "guard_applied": plugin.is_applied(),
        "kvcached_enabled": os.environ.get("ENABLE_KVCACHED", ""),
    }
    Path(out).write_text(json.dumps(document))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
