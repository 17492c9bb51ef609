"""Render the guard's dashboard panels from real ``/metrics`` samples (a PNG for the README).

The samples come from the demo, sampling the server under test every second::

    python -m guard_demo --requests 160 --metrics-trace guarded.json
    python -m guard_demo --requests 160 --no-guard --metrics-trace stock.json
    python examples/grafana/plot_metrics.py guarded.json --stock stock.json \\
        --out docs/images/prefix-guard-metrics.png

(``docs/images/prefix-guard-metrics-data/`` holds the two traces behind the committed PNG.)

One column per server, rows as in ``prefix-guard-dashboard.json``: the guard's rollbacks by
cause, its uncommitted registrations, vLLM's prefix-cache hit rate and preemptions. Stock vLLM
has no guard series, so its guard rows stay empty: that is what an operator of stock vLLM
sees. The two runs are separate and their schedules differ with timing, so their hit rates are
not a measure of the guard's cost (the figure says so, with both preemption counts). Rates are
computed as Prometheus' ``rate()`` would over ``--window`` seconds, summed over engines.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_SERIES = re.compile(r"^(?P<name>[^{]+)\{(?P<labels>[^}]*)\}$")
CAUSES = ("preempted", "kv_load_failure", "dropped_step")
COLOURS = {"preempted": "#e8743b", "kv_load_failure": "#945ecf", "dropped_step": "#bf1b00"}


def load(path: Path) -> dict[str, Any]:
    trace: dict[str, Any] = json.loads(path.read_text())
    return trace


def _labels(key: str) -> tuple[str, dict[str, str]]:
    match = _SERIES.match(key)
    if match is None:
        return key, {}
    pairs = [p.split("=", 1) for p in match["labels"].split(",") if "=" in p]
    return match["name"], dict(pairs)


def summed(trace: dict[str, Any], name: str, **want: str) -> tuple[list[float], list[float]]:
    """``(times, values)`` of ``name`` summed over the series whose labels match ``want``."""
    times, values = [], []
    for sample in trace["samples"]:
        total = 0.0
        for key, value in sample["series"].items():
            series, labels = _labels(key)
            if series == name and all(labels.get(k) == v for k, v in want.items()):
                total += value
        times.append(sample["t"])
        values.append(total)
    return times, values


def windowed_rate(
    times: Sequence[float], values: Sequence[float], window: float
) -> tuple[list[float], list[float]]:
    """Per-second increase over the last ``window`` seconds at each sample (``rate()``)."""
    out_t, out_v = [], []
    start = 0
    for i, t in enumerate(times):
        while times[start] < t - window:
            start += 1
        if i > start:
            out_t.append(t)
            out_v.append((values[i] - values[start]) / (t - times[start]))
    return out_t, out_v


def windowed_ratio(
    trace: dict[str, Any], numerator: str, denominator: str, window: float
) -> tuple[list[float], list[float]]:
    t, hits = summed(trace, numerator)
    _, queries = summed(trace, denominator)
    rt, hit_rate = windowed_rate(t, hits, window)
    _, query_rate = windowed_rate(t, queries, window)
    pairs = [(x, h / q) for x, h, q in zip(rt, hit_rate, query_rate, strict=True) if q > 0]
    return [x for x, _ in pairs], [y for _, y in pairs]


def active_until(trace: dict[str, Any]) -> float:
    """The time of the last sample where any series changed (the workload's end), + 3 s."""
    last, previous = 0.0, None
    for sample in trace["samples"]:
        if previous is not None and sample["series"] != previous:
            last = sample["t"]
        previous = sample["series"]
    return last + 3.0


def outcome(trace: dict[str, Any]) -> str:
    result = trace.get("result", {})
    if not result:
        return ""
    return (
        f"{result['mismatches']} of {result['completed']} completions differ from "
        "the no-prefix-caching reference"
    )


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666666")
    ax.set_yticks([])


def _column(axes: Sequence[Any], trace: dict[str, Any], window: float, guarded: bool) -> None:
    """One server's panels, top to bottom: rollbacks by cause, uncommitted registrations,
    hit rate, preemptions. A server without guard series gets empty guard panels."""
    rollbacks, uncommitted, hit_rate, preemptions = axes
    has_guard = any(
        key.startswith("vllm:prefix_guard_")
        for sample in trace["samples"]
        for key in sample["series"]
    )
    if has_guard:
        for cause in CAUSES:
            t, v = summed(trace, "vllm:prefix_guard_rolled_back_total", cause=cause)
            rt, rv = windowed_rate(t, v, window)
            label = f"{cause} (total {v[-1]:.0f})" if v else cause
            rollbacks.plot(rt, rv, color=COLOURS[cause], label=label, linewidth=1.6)
        rollbacks.legend(fontsize=7, loc="upper right")
        rollbacks.set_title("guard rollbacks by cause, per second", fontsize=8.5, loc="left")
        t, v = summed(trace, "vllm:prefix_guard_uncommitted_entries")
        uncommitted.step(t, v, where="post", color="#3274d9", linewidth=1.3)
        uncommitted.set_title(
            "uncommitted registrations (steps in flight)", fontsize=8.5, loc="left"
        )
    else:
        rollbacks.set_title("guard rollbacks by cause", fontsize=8.5, loc="left")
        _empty(
            rollbacks, "no series: stock vLLM cannot see\nregistrations whose KV was never written"
        )
        uncommitted.set_title("uncommitted registrations", fontsize=8.5, loc="left")
        _empty(uncommitted, "no series")
    ht, hv = windowed_ratio(
        trace, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", window
    )
    _, hits = summed(trace, "vllm:prefix_cache_hits_total")
    _, queries = summed(trace, "vllm:prefix_cache_queries_total")
    overall = hits[-1] / queries[-1] if queries and queries[-1] else 0.0
    hit_rate.plot(ht, hv, color="#37872d" if guarded else "#8f8f8f", linewidth=1.6)
    hit_rate.set_title(f"prefix-cache hit rate; whole run {overall:.1%}", fontsize=8.5, loc="left")
    hit_rate.set_ylim(0, 1)
    hit_rate.yaxis.set_major_formatter(_percent())
    t, v = summed(trace, "vllm:num_preemptions_total")
    pt, pv = windowed_rate(t, v, window)
    preemptions.plot(pt, pv, color="#a352cc", linewidth=1.3)
    preemptions.set_title(
        f"preemptions, /s; total {v[-1]:.0f}" if v else "preemptions", fontsize=8.5, loc="left"
    )
    preemptions.set_xlabel("seconds since the workload started", fontsize=8)


def _percent() -> Any:
    from matplotlib.ticker import PercentFormatter

    return PercentFormatter(1.0)


def plot(guarded: dict[str, Any], stock: dict[str, Any] | None, out: Path, window: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = [("guarded vLLM (VLLM_PREFIX_GUARD=1)", guarded, True)]
    if stock is not None:
        traces.append(("stock vLLM, same workload, a separate run", stock, False))
    end = max(active_until(trace) for _, trace, _ in traces)
    fig = plt.figure(figsize=(5.0 * len(traces), 8.6), dpi=100, layout="constrained")
    guarded_preempted = summed(guarded, "vllm:num_preemptions_total")[1]
    lines = [
        "vllm-prefix-guard: real /metrics sampled every second during the demo's workload "
        f"(vLLM {guarded.get('vllm_version', '?')},",
        f"tiny model on CPU, {guarded.get('requests', '?')} requests); rates over "
        f"{window:.0f} s windows, as the dashboard's rate() panels.",
    ]
    if stock is not None:
        stock_preempted = summed(stock, "vllm:num_preemptions_total")[1]
        lines += [
            "The two runs' schedules differ (timing on two shared cores: "
            f"{guarded_preempted[-1]:.0f} vs {stock_preempted[-1]:.0f} preemptions), and so do "
            "their hit rates;",
            "on identical schedules the guard's hit tokens equal stock's "
            "(scheduler benchmark in the README).",
        ]
    fig.suptitle("\n".join(lines), fontsize=8.5, x=0.01, ha="left")
    columns = fig.subfigures(1, len(traces), squeeze=False)[0]
    for column, (title, trace, is_guarded) in zip(columns, traces, strict=True):
        axes = column.subplots(
            4, 1, sharex=True, gridspec_kw={"height_ratios": (1.0, 0.8, 1.0, 0.8)}
        )
        _column(axes, trace, window, is_guarded)
        column.suptitle(f"{title}\n{outcome(trace)}", fontsize=9, fontweight="bold")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7.5)
            ax.set_xlim(0, end)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("guarded", type=Path, help="metrics trace of the guarded server")
    parser.add_argument("--stock", type=Path, default=None, help="metrics trace of stock vLLM")
    parser.add_argument("--out", type=Path, default=Path("docs/images/prefix-guard-metrics.png"))
    parser.add_argument("--window", type=float, default=5.0, help="rate window, seconds")
    args = parser.parse_args(argv)
    plot(load(args.guarded), load(args.stock) if args.stock else None, args.out, args.window)
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
