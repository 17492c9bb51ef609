"""An ``LLMEngine`` whose EngineCore (and worker) run in this process, for the scenarios that
observe or drive its scheduler step by step, and its clean shutdown."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def in_process_engine(args: Any) -> Iterator[Any]:
    """An ``LLMEngine`` whose EngineCore (and worker) run in this process."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.v1.engine.llm_engine import LLMEngine

    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        engine = LLMEngine.from_engine_args(args)
    finally:
        if previous is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
    try:
        yield engine
    finally:
        engine.engine_core.shutdown()
        del engine
        gc.collect()
        cleanup_dist_env_and_memory()


def external_id(internal_id: str) -> str:
    """The id a request was added with: ``LLMEngine`` makes request ids unique with a
    ``-<random hex>`` suffix."""
    return internal_id.rpartition("-")[0] or internal_id


def trace_preemptions(scheduler: Any, preempted: list[set[str]]) -> None:
    """Record the requests every ``schedule()`` call of this scheduler instance preempted
    (external ids), one set per call.

    Wraps the bound method on the instance only, so stock vLLM and the guard's class-level
    wrapper both run unchanged underneath.
    """
    schedule = scheduler.schedule

    def traced(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        preempted.append({external_id(r) for r in output.preempted_req_ids or ()})
        return output

    scheduler.schedule = traced


def reference_stock_guarded(run: Callable[[bool], T]) -> tuple[T, T, T]:
    """``run(prefix_caching)`` three times, one engine after another, each EngineCore in
    this process (so its scheduler can be observed, and the guard applied here is the one
    it runs): no prefix caching, stock prefix caching, and prefix caching with the guard
    applied as vLLM applies it (``register()`` with ``VLLM_PREFIX_GUARD=1``). The guard is
    off and the environment as it was when this returns."""
    from vllm_prefix_guard import plugin

    names = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_PREFIX_GUARD")
    saved = {name: os.environ.get(name) for name in names}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("VLLM_PREFIX_GUARD", None)
    try:
        plugin.undo()
        reference = run(False)
        stock = run(True)
        os.environ["VLLM_PREFIX_GUARD"] = "1"
        plugin.register()
        guarded = run(True)
    finally:
        plugin.undo()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return reference, stock, guarded
