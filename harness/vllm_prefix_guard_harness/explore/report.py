"""What an exploration prints: one table row per scope and lane, and each finding's
shortest event sequence as a regression test.

A path made only of arrivals, aborts and resets is also a fuzz :class:`Workload`
(``Workload.to_python``, as ``fuzz`` prints its shrunk reproducers): the runner replays it
independently of the explorer. Partial load failures and dropped outputs have no
workload event, so every finding is also printed as an explorer replay.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_prefix_guard_harness.explore.scope import Scope
from vllm_prefix_guard_harness.explore.search import Finding, SearchResult
from vllm_prefix_guard_harness.explore.system import Path
from vllm_prefix_guard_harness.fuzz.workload import Abort, Arrive, Event, Reset, Workload

HEADER = (
    "| scope | lane | states | transitions | complete paths | depth | seconds "
    "| violations (first bad read on a path) | KV events wrong (first on a path: a set or a "
    "counting consumer disagrees with the pool) | paths compared: guard hits = clean stock's "
    "| complete |"
)


def table(results: Sequence[SearchResult]) -> str:
    """A markdown row per scope and lane."""
    lines = [HEADER, "|---|---|" + "---:|" * 8 + "---|"]
    for result in results:
        c = result.counters
        gaps = len(result.of("hit_gap"))
        reordered = len(result.of("hit_gap_reordered"))
        compared = (
            f"{c['compared_paths'] - gaps - reordered} of {c['compared_paths']}"
            if c["compared_paths"]
            else "-"
        )
        if reordered:
            compared += f" ({reordered} above: eviction order)"
        if gaps:
            compared += f" ({gaps} differ)"
        for mode in result.modes:
            lines.append(
                f"| {result.scope.name} | {mode} | {c['states']} | {c['transitions']} "
                f"| {c['complete_paths']} | {c['max_depth']} | {result.seconds:.1f} "
                f"| {result.violations(mode)} | {result.events_wrong(mode)} | {compared} "
                f"| {'yes' if result.complete else 'NO'} |"
            )
    return "\n".join(lines)


def summary(result: SearchResult) -> dict[str, Any]:
    """One scope's figures, as ``explore --json`` writes them (``upstream/tools/check.py``
    reads them for the series)."""
    return {
        "scope": result.scope.name,
        "bounds": result.scope.bounds(),
        "complete": result.complete,
        "seconds": round(result.seconds, 1),
        **{key: result.counters[key] for key in ("states", "transitions", "complete_paths")},
        "depth": result.counters["max_depth"],
        "violations": {mode: result.violations(mode) for mode in result.modes},
        "kv_events_wrong": {mode: result.events_wrong(mode) for mode in result.modes},
        "compared_paths": result.counters["compared_paths"],
        "hit_gaps": len(result.of("hit_gap")),
        "hit_gaps_reordered": len(result.of("hit_gap_reordered")),
    }


def describe_path(path: Path) -> str:
    return "; ".join(f"{i}: {step.describe()}" for i, step in enumerate(path))


def as_workload(scope: Scope, path: Path) -> Workload | None:
    """``path`` as a fuzz workload, or None if it fails loads or drops outputs."""
    events: list[Event] = []
    for iteration, step in enumerate(path):
        if step.outcome.failed or step.outcome.drop:
            return None
        for index in step.events.arrive:
            spec = scope.requests[index]
            events.append(
                Arrive(
                    iteration,
                    f"r{index}",
                    spec.prompt,
                    spec.max_tokens,
                    spec.priority,
                    spec.external_tokens,
                )
            )
        if step.events.abort is not None:
            events.append(Abort(iteration, step.events.abort))
        if step.events.reset:
            events.append(Reset(iteration, scope.reset_running))
    return Workload(scope.spec(), scope.depth, tuple(events))


def reproducer(scope: Scope, finding: Finding) -> str:
    """Paste-able source: the explorer replay, and the workload when there is one."""
    steps = ",\n".join(f"    Step.from_json({step.to_json()!r})" for step in finding.path)
    source = [
        f"# {finding.kind} in lane {finding.lane!r}, scope {scope.name!r}: "
        f"{describe_path(finding.path)}",
        "from vllm_prefix_guard_harness.explore.scope import SCOPES",
        "from vllm_prefix_guard_harness.explore.system import Step, drain, replay",
        "",
        f"PATH = (\n{steps},\n)",
        f"system = drain(replay(SCOPES[{scope.name!r}], PATH, ({finding.lane!r},)))",
    ]
    workload = as_workload(scope, finding.path)
    if workload is not None:
        source += ["", "# The same events as a fuzz workload (fuzz.runner.run_workload):"]
        source.append(workload.to_python())
    return "\n".join(source)


def findings_text(results: Sequence[SearchResult]) -> str:
    """Each lane's shortest violation, every hit mismatch's shortest path, errors."""
    blocks = []
    for result in results:
        for mode in result.modes:
            shortest = result.shortest("violation", mode)
            if shortest is not None:
                counts = shortest.detail.get("counts")
                blocks.append(
                    f"## {result.scope.name}: {mode} reads bad KV ({counts}), "
                    f"{result.violations(mode)} transition(s); shortest:\n"
                    + reproducer(result.scope, shortest)
                )
        wrong = result.shortest("kv_events", "guard")
        if wrong is not None:
            blocks.append(
                f"## {result.scope.name}: the guard's KV events disagree with its pool "
                f"({wrong.detail}), {result.events_wrong('guard')} transition(s); shortest:\n"
                + reproducer(result.scope, wrong)
            )
        reordered = result.shortest("hit_gap_reordered")
        if reordered is not None:
            blocks.append(
                f"## {result.scope.name}: guard hits above clean stock's on "
                f"{len(result.of('hit_gap_reordered'))} path(s) where the guard undid entries "
                f"(explained: eviction order; {reordered.detail}); shortest:\n"
                + reproducer(result.scope, reordered)
            )
        gap = result.shortest("hit_gap")
        if gap is not None:
            blocks.append(
                f"## {result.scope.name}: guard hits differ from clean stock's on "
                f"{len(result.of('hit_gap'))} path(s) ({gap.detail}); shortest:\n"
                + reproducer(result.scope, gap)
            )
        for error in result.of("error")[:3]:
            blocks.append(f"## {result.scope.name}: ERROR\n{error.detail.get('traceback')}")
    return "\n\n".join(blocks)
