"""Render differential results: a markdown table for people, JSON for tools."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_prefix_guard_harness.fuzz.differential import EXPLAINED, ConfigResult, percent
from vllm_prefix_guard_harness.fuzz.runner import RunResult

COLUMNS = (
    "configuration",
    "mode",
    "bad reads (never written / wrong)",
    "hit tokens",
    "of which on bad KV",
    "computed tokens",
    "preemptions",
    "rolled back: preempted (in flight) / KV load / dropped step",
    "peak ledger",
    "steps",
)


def _row(result: ConfigResult, run: RunResult, first: bool) -> list[str]:
    rolled = (
        f"{run.rolled_back_preempted} ({run.rolled_back_in_flight}) / "
        f"{run.rolled_back_kv_load_failure} / {run.rolled_back_dropped_step}"
        if run.mode != "stock"
        else "-"
    )
    name = result.config.name + (" (targeted)" if result.config.targeted else "")
    return [
        name if first else "",
        run.mode,
        f"{run.violations} ({run.never_written} / {run.wrong_content}"
        + (f"; {run.bad_state_reads} from a wrong state" if run.bad_state_reads else "")
        + (f"; {run.outputs_over_bad_kv} outputs over it" if run.outputs_over_bad_kv else "")
        + ")",
        str(run.hit_tokens),
        str(run.invalid_hit_tokens),
        str(run.computed_tokens),
        str(run.preemptions),
        rolled,
        str(run.peak_uncommitted_entries) if run.mode != "stock" else "-",
        str(run.steps),
    ]


def markdown_table(results: list[ConfigResult]) -> str:
    """One row per configuration and mode, totals over that configuration's seeds."""
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(COLUMNS))) + "|",
    ]
    for result in results:
        for i, mode in enumerate(result.modes):
            lines.append("| " + " | ".join(_row(result, result.totals[mode], i == 0)) + " |")
    return "\n".join(lines)


def summary_columns(modes: tuple[str, ...]) -> tuple[str, ...]:
    per_mode = " / ".join(modes)
    return (
        "configuration",
        "steps (per mode)",
        f"bad reads: {per_mode}",
        "guard hit tokens vs stock's valid hits (vs all stock's hits)",
        f"preemptions: {per_mode}",
        "pr43569 rolled back in flight",
        f"runs wedged by vLLM (released): {per_mode}",
        f"KV-event keys wrong, set consumer (missing + extra, summed over steps): {per_mode}",
        f"KV-event keys wrong, counting consumer: {per_mode}",
        "checks",
    )


def summary_table(results: list[ConfigResult]) -> str:
    """One row per configuration: the figures the acceptance checks compare."""
    columns = summary_columns(results[0].modes if results else ())
    lines = [
        "| " + " | ".join(columns) + " |",
        "|---|" + "---:|" * (len(columns) - 2) + "---|",
    ]
    for result in results:
        totals = result.totals
        runs = [totals[m] for m in result.modes]
        hits = "-"
        if "stock" in totals and "guard" in totals:
            stock, guard = totals["stock"], totals["guard"]
            hits = percent(guard.hit_tokens, stock.valid_hit_tokens, digits=2)
            if stock.invalid_hit_tokens:
                hits += f" ({percent(guard.hit_tokens, stock.hit_tokens, digits=2)})"
        checks = result.checks()
        failed = [c.name for c in checks if not c.ok]
        explained = sum(c.status == EXPLAINED for c in checks)
        verdict = "FAIL: " + ", ".join(failed) if failed else "ok"
        if explained and not failed:
            verdict += f" ({explained} explained)"
        name = result.config.name + (" (targeted)" if result.config.targeted else "")
        pr = totals.get("pr43569")
        cells = [
            name,
            str(min(run.steps for run in runs)),
            _per_mode(runs, "violations"),
            hits,
            _per_mode(runs, "preemptions"),
            str(pr.rolled_back_in_flight) if pr else "-",
            _per_mode(runs, "wedged_runs"),
            " / ".join(str(run.kv_event_keys_missing + run.kv_event_keys_extra) for run in runs),
            " / ".join(
                str(run.kv_event_counted_keys_missing + run.kv_event_counted_keys_extra)
                for run in runs
            ),
            verdict,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _per_mode(runs: list[RunResult], name: str) -> str:
    return " / ".join(str(getattr(run, name)) for run in runs)


def checks_text(results: list[ConfigResult]) -> str:
    lines = []
    for result in results:
        seeds = result.seeds
        span = f"seeds {seeds[0]}-{seeds[-1]}" if seeds else "no seeds"
        lines.append(f"{result.config.name} ({span}):")
        for check in result.checks():
            lines.append(f"  [{check.status:>9}] {check.name}: {check.detail}")
    return "\n".join(lines)


def _audit_json(run: RunResult) -> dict[str, Any] | None:
    """Rolled-back entries by cause and verdict (``fuzz.audit``), if audited."""
    if run.audit is None:
        return None
    return {
        "by_cause": {cause: dict(counter) for cause, counter in run.audit.by_cause.items()},
        "valid_rolled_back": run.audit.valid_rolled_back,
        "invalid_committed": run.audit.invalid_committed,
        "clean_readers_preempted": run.audit.clean_readers_preempted,
    }


def to_json(
    results: list[ConfigResult],
    environment: dict[str, Any],
    reproducers: dict[str, dict[str, str]] | None = None,
) -> dict[str, Any]:
    """Everything the table shows, per configuration, plus checks and reproducers."""
    configs = []
    for result in results:
        config = result.config
        configs.append(
            {
                "name": config.name,
                "description": config.description,
                "targeted": config.targeted,
                "depth": config.depth,
                "seeds": result.seeds,
                "modes": {
                    mode: {
                        k: v
                        for k, v in dataclasses.asdict(dataclasses.replace(run, audit=None)).items()
                        if k not in ("mode", "first_violation_iteration", "audit")
                    }
                    | {"violations": run.violations, "audit": _audit_json(run)}
                    for mode, run in result.totals.items()
                },
                "violating_seeds": result.violating_seeds,
                "checks": [dataclasses.asdict(c) for c in result.checks()],
                "ok": result.ok,
                "reproducers": (reproducers or {}).get(config.name, {}),
            }
        )
    return {
        **environment,
        "ok": all(r.ok for r in results),
        "configs": configs,
    }
