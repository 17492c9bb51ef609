"""Render the guard's dashboard panels from real ``/metrics`` samples (a PNG for the README).

The samples come from the demo: ``python -m guard_demo --metrics-trace guarded.json`` (the
guarded server) and, for contrast, ``python -m guard_demo --no-guard --metrics-trace
stock.json`` (stock vLLM, same workload and seed, a separate run). Then::

    python examples/grafana/plot_metrics.py guarded.json --stock stock.json \\
        --out docs/images/prefix-guard-metrics.png

Three rows, as in ``prefix-guard-dashboard.json``: the guard's rollbacks by cause, its
uncommitted registrations, and vLLM's prefix-cache hit rate. Stock vLLM has no guard series,
so only its hit rate can be drawn; the title says how many of each server's completions
differed from the no-prefix-caching reference. Rates are computed as Prometheus' ``rate()``
would over a window of ``--window`` seconds, summed over engines.
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


def plot(guarded: dict[str, Any], stock: dict[str, Any] | None, out: Path, window: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max(active_until(guarded), active_until(stock) if stock else 0.0)
    fig, axes = plt.subplots(3, 1, figsize=(8.0, 7.2), sharex=True, dpi=100)
    rollbacks, uncommitted, hit_rate = axes

    totals = []
    for cause in CAUSES:
        t, v = summed(guarded, "vllm:prefix_guard_rollbacks_total", cause=cause)
        totals.append(f"{cause} {v[-1]:.0f}" if v else f"{cause} 0")
        rt, rv = windowed_rate(t, v, window)
        rollbacks.plot(rt, rv, color=COLOURS[cause], label=cause, linewidth=1.6)
    rollbacks.set_title(
        f"Guard rollbacks by cause, per second ({window:.0f} s window); totals: "
        + ", ".join(totals),
        fontsize=9,
        loc="left",
    )
    rollbacks.set_ylabel("registrations/s")
    rollbacks.legend(fontsize=8, loc="upper right")

    t, v = summed(guarded, "vllm:prefix_guard_uncommitted_entries")
    uncommitted.step(t, v, where="post", color="#3274d9", linewidth=1.4)
    uncommitted.set_title(
        "Uncommitted registrations (steps in flight), sampled every second", fontsize=9, loc="left"
    )
    uncommitted.set_ylabel("entries")

    gt, gv = windowed_ratio(
        guarded, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", window
    )
    hit_rate.plot(gt, gv, color="#37872d", linewidth=1.8, label="guarded vLLM")
    if stock is not None:
        st, sv = windowed_ratio(
            stock, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", window
        )
        hit_rate.plot(st, sv, color="#8f8f8f", linewidth=1.4, linestyle="--", label="stock vLLM")
    hit_rate.set_title(
        f"vLLM prefix-cache hit rate ({window:.0f} s window)", fontsize=9, loc="left"
    )
    hit_rate.set_ylabel("hit tokens / queried")
    hit_rate.set_ylim(0, 1)
    hit_rate.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    hit_rate.legend(fontsize=8, loc="upper right")
    hit_rate.set_xlabel("seconds since the workload started")
    hit_rate.set_xlim(0, end)

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    engines = guarded.get("data_parallel_size", 1)
    lines = [
        f"vllm-prefix-guard on vLLM {guarded.get('vllm_version', '?')}: "
        f"{guarded.get('requests', '?')} requests, {engines} engine(s), tiny model on CPU",
        f"guarded: {outcome(guarded)}" if outcome(guarded) else "",
    ]
    if stock is not None and outcome(stock):
        lines.append(f"stock (same workload, separate run; no guard series): {outcome(stock)}")
    fig.suptitle("\n".join(line for line in lines if line), fontsize=9.5, x=0.01, ha="left")
    fig.tight_layout()
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
