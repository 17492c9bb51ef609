"""An ``LLMEngine`` whose EngineCore (and worker) run in this process, for the scenarios that
observe or drive its scheduler step by step, and its clean shutdown."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from typing import Any


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
