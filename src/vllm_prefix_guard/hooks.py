"""Scheduler hooks: call each scheduler's :class:`SchedulerGuard` where the series calls the rules.

    Scheduler.__init__              attach a guard (the rules over the scheduler's pool)
    Scheduler.schedule              begin the step; end it with the output it returns
    Scheduler._preempt_request      roll back the victim's open-step entries, before free
    Scheduler.update_from_output    roll back failed KV loads first; after it, preempt
                                    the readers of bad KV and commit the step
    Scheduler.reset_prefix_cache    drop every record once the pool was reset
    Scheduler.finish_requests       all at once (fault tolerance): undo the steps in flight
    Scheduler.shutdown              one summary line with the counters, last JSON write

Why each exists and when it can go: the patch table (:mod:`vllm_prefix_guard.patches`),
which ``plugin.apply`` applies. Data flows one way: hook -> guard -> rules -> pool. Each
wrapper carries the original's name, docstring and ``__wrapped__`` (``functools.wraps``),
and on a scheduler without a guard (prefix caching off, built before the guard was
applied, a stand-in object) runs the original and nothing else.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable
from typing import Any

from vllm_prefix_guard import metrics
from vllm_prefix_guard.log import logger
from vllm_prefix_guard.rules.failed_kv_loads import FailedKVLoads
from vllm_prefix_guard.rules.uncommitted import UncommittedPrefixCache
from vllm_prefix_guard.scheduler_guard import SchedulerGuard
from vllm_prefix_guard.stats import STATS_FILE_ENV, StatsPublisher, stats_file_path

GUARD_ATTR = "_prefix_guard"
PUBLISHER_ATTR = "_prefix_guard_publisher"

AnyFn = Callable[..., Any]


def guard_of(scheduler: Any) -> SchedulerGuard | None:
    """The guard attached to ``scheduler``, if any."""
    guard: SchedulerGuard | None = getattr(scheduler, GUARD_ATTR, None)
    return guard


def attach_guard(
    scheduler: Any,
    rules: UncommittedPrefixCache | None = None,
    rollback_class: type[FailedKVLoads] = FailedKVLoads,
) -> SchedulerGuard | None:
    """Give ``scheduler`` a guard over its pool (replacing any, before its first step);
    None when prefix caching is off.

    Args:
        rules: the rules to run (default: :class:`UncommittedPrefixCache` itself;
            diagnostics pass their subclasses, which observe or compare).
        rollback_class: the failed-load rollback (diagnostics: a subclass).
    """
    if not scheduler.kv_cache_manager.enable_caching:
        return None
    guard = SchedulerGuard(scheduler, rules, rollback_class)
    setattr(scheduler, GUARD_ATTR, guard)
    if getattr(scheduler, PUBLISHER_ATTR, None) is None:
        publisher = make_publisher(scheduler)
        if publisher is not None:
            setattr(scheduler, PUBLISHER_ATTR, publisher)
            publisher.start()
    return guard


def engine_labels(scheduler: Any) -> tuple[str, int, int]:
    """``(model_name, engine index, engine count)`` as vLLM labels its own metrics; a
    vLLM that moved these reports ``unknown``/0 rather than failing (reporting only).

    The engine is vLLM's ``data_parallel_index``, the DP rank its own ``engine`` label
    carries. Not ``data_parallel_rank``: for a dense (non-MoE) model each EngineCore runs as
    an independent rank and vLLM rewrites its ``data_parallel_rank`` to 0 and its
    ``data_parallel_size`` to 1 before the scheduler exists
    (``ParallelConfig.reconfigure_for_independent_dp_rank``), so every engine would claim
    rank 0 and share one file. The count is then at least ``index + 1`` (engine 0 of such a
    server cannot see that it has peers).
    """
    config = getattr(scheduler, "vllm_config", None)
    model = getattr(getattr(config, "model_config", None), "served_model_name", None)
    parallel = getattr(config, "parallel_config", None)
    engine = getattr(parallel, "data_parallel_index", None)
    if engine is None:  # a vLLM without the field: the rank is not rewritten there
        engine = getattr(parallel, "data_parallel_rank", 0)
    engine = int(engine or 0)
    engines = max(int(getattr(parallel, "data_parallel_size", 1) or 1), engine + 1)
    if isinstance(model, (list, tuple)):
        model = model[0] if model else None
    return (str(model) if model else "unknown"), engine, engines


def make_publisher(scheduler: Any) -> StatsPublisher | None:
    """The engine's counter files (its ``/metrics`` file in the run directory, the
    operator's stats file) and its multiprocess export, where set up; None if none is."""
    model, engine, engines = engine_labels(scheduler)
    paths = []
    directory = metrics.run_dir()
    if directory is not None:
        paths.append(metrics.engine_file(directory, engine))
    template = os.environ.get(STATS_FILE_ENV, "").strip()
    if template:
        paths.append(stats_file_path(template, engine, engines))
    labels = {"model_name": model, "engine": str(engine)}
    export = metrics.multiprocess_export(labels)
    if not paths and export is None:
        return None
    # A weak reference: the thread ends with the scheduler, it never keeps it alive.
    owner = weakref.ref(scheduler)

    def read() -> dict[str, int] | None:
        guard = guard_of(owner())
        return None if guard is None else guard.counters()

    return StatsPublisher(read, paths, labels, export=export.update if export is not None else None)


# -- wrappers (each takes the original and returns the replacement) ------------------


def wrap_init(original: AnyFn) -> AnyFn:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        attach_guard(self)

    return __init__


def wrap_schedule(original: AnyFn) -> AnyFn:
    @functools.wraps(original)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        guard = getattr(self, GUARD_ATTR, None)  # guard_of, inline: once per step
        if guard is None:
            return original(self, *args, **kwargs)
        guard.begin_step()
        output = original(self, *args, **kwargs)
        guard.end_step(output)
        return output

    return schedule


def wrap_preempt_request(original: AnyFn) -> AnyFn:
    @functools.wraps(original)
    def _preempt_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        guard = guard_of(self)
        if guard is not None:
            guard.preempted(request)
        return original(self, request, *args, **kwargs)

    return _preempt_request


def wrap_finish_requests(original: AnyFn) -> AnyFn:
    @functools.wraps(original)
    def finish_requests(self: Any, request_ids: Any, *args: Any, **kwargs: Any) -> Any:
        guard = guard_of(self) if request_ids is None else None
        if guard is not None:
            guard.all_requests_finishing()
        return original(self, request_ids, *args, **kwargs)

    return finish_requests


def wrap_update_from_output(original: AnyFn) -> AnyFn:
    @functools.wraps(original)
    def update_from_output(
        self: Any, scheduler_output: Any, model_runner_output: Any, *args: Any, **kwargs: Any
    ) -> Any:
        guard = getattr(self, GUARD_ATTR, None)  # guard_of, inline: once per step
        if guard is None:
            return original(self, scheduler_output, model_runner_output, *args, **kwargs)
        kv_output = model_runner_output.kv_connector_output
        rollback = None
        if kv_output is not None and kv_output.invalid_block_ids:
            # Before the original: it may fail or free the requests involved.
            rollback = guard.loads_failed(scheduler_output, kv_output.invalid_block_ids)
        result = original(self, scheduler_output, model_runner_output, *args, **kwargs)
        if rollback is not None:
            guard.preempt_bad_kv_readers(rollback)
        guard.commit_step(scheduler_output)
        return result

    return update_from_output


def wrap_reset_prefix_cache(original: AnyFn) -> AnyFn:
    @functools.wraps(original)
    def reset_prefix_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        guard = guard_of(self)
        if guard is not None:
            guard.prefix_cache_reset()
        return result

    return reset_prefix_cache


def wrap_shutdown(original: AnyFn) -> AnyFn:
    @functools.wraps(original)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            guard = guard_of(self)
            if guard is not None:
                report_counters(guard, getattr(self, PUBLISHER_ATTR, None))
        except Exception:  # reporting never stops vLLM's own shutdown
            logger().exception("vllm-prefix-guard: reporting the counters at shutdown failed")
        finally:
            result = original(self, *args, **kwargs)
        return result

    return shutdown


def report_counters(guard: SchedulerGuard, publisher: StatsPublisher | None) -> None:
    """The counters' last write to their files, then one INFO line with them."""
    if publisher is not None:
        publisher.close()
    counters = guard.counters()
    logger().info(
        "vllm-prefix-guard counters: %s", " ".join(f"{k}={v}" for k, v in counters.items())
    )
