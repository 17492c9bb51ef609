"""Write docs/kvcached.md's measured table from the kvcached scenario runs the tests assert on.

Runs both load orders' scenarios (``scenarios.py``, one interpreter each, as
``tests/kvcached`` does), and the same layouts on stock vLLM without kvcached in this
process, then replaces the block between ``<!-- kvcached:begin -->`` and
``<!-- kvcached:end -->`` of ``--doc``. Needs what the tests need: vLLM 0.30 (a vLLM kvcached
admits), ``KVCACHED_SRC``, wrapt and posix_ipc::

    KVCACHED_SRC=.nox/kvcached-0.1.6 .nox/vllm-0.30/bin/python tests/kvcached/table.py \\
        --doc docs/kvcached.md
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1] / "src")]

from kvcached_harness import scenarios, skip_reason  # noqa: E402

BEGIN, END = "<!-- kvcached:begin -->", "<!-- kvcached:end -->"
ORDERS = ("guard_first", "kvcached_first")
#: Run name -> (layout, scheduler), in table order.
ROWS = {
    "zombie_sync": ("priority-preemption zombie", "`Scheduler`"),
    "zombie_async": ("priority-preemption zombie", "`AsyncScheduler`, 2 in flight"),
    "kv_load_sync_recompute": ("KV-load failure, policy `recompute`", "`Scheduler`"),
    "kv_load_sync_fail_aborted": (
        "KV-load failure, `fail`, aborted before the update",
        "`Scheduler`",
    ),
    "kv_load_async": ("KV-load failure, later step in flight", "`AsyncScheduler`, 2 in flight"),
    "fcfs_sync": ("FCFS, 8 requests, 24 blocks", "`Scheduler`"),
    "fcfs_async": ("FCFS, 10 requests, 28 blocks", "`AsyncScheduler`, 2 in flight"),
}
OUTCOME = ("violations", "counts", "readers", "hit_tokens", "preemptions")


def stock_without_kvcached() -> dict[str, dict[str, Any]]:
    """The same layouts on stock vLLM's own pool, in this process (kvcached never loaded)."""
    import layouts
    from vllm_prefix_guard import plugin
    from vllm_prefix_guard_harness.notes_zombie import zombie_layout

    plugin.undo()
    runs = {
        "zombie_sync": lambda: zombie_layout(async_scheduling=False),
        "zombie_async": lambda: zombie_layout(async_scheduling=True),
        "kv_load_sync_recompute": lambda: layouts.failed_sync_load("recompute", False),
        "kv_load_sync_fail_aborted": lambda: layouts.failed_sync_load("fail", True),
        "kv_load_async": lambda: layouts.failed_load_two_in_flight()[0],
        "fcfs_sync": layouts.fcfs_preemption,
        "fcfs_async": layouts.fcfs_preemption_two_in_flight,
    }
    out = {}
    for name, run in runs.items():
        driver = run()
        out[name] = {
            "violations": driver.violations,
            "counts": dict(driver.kv.counts),
            "readers": sorted({v.request_id for v in driver.kv.violations}),
            "hit_tokens": driver.hit_tokens,
            "preemptions": driver.preemptions,
        }
    return out


def _outcome(run: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in run, run
    return {key: run[key] for key in OUTCOME}


def _rollbacks(stats: dict[str, int]) -> str:
    if stats["rolled_back_preempted"]:
        return f"{stats['rolled_back_preempted']} (preempted)"
    if stats["rolled_back_kv_load_failure"]:
        return f"{stats['rolled_back_kv_load_failure']} (KV-load)"
    return str(stats["rolled_back"])


def block(orders: dict[str, dict[str, Any]], stock: dict[str, dict[str, Any]]) -> str:
    first = orders[ORDERS[0]]
    same_orders = all(
        _outcome(orders[o][part][name]) == _outcome(first[part][name])
        for o in ORDERS
        for part in ("alone", "guarded")
        for name in ROWS
    )
    same_as_stock = all(_outcome(first["alone"][name]) == stock[name] for name in ROWS)
    same_counters = all(
        orders[o]["guarded"][name]["stats"] == first["guarded"][name]["stats"]
        for o in ORDERS
        for name in ROWS
    )
    lines = [
        BEGIN,
        "Written by `KVCACHED_SRC=.nox/kvcached-0.1.6 .nox/vllm-0.30/bin/python "
        "tests/kvcached/table.py --doc docs/kvcached.md` from the runs `tests/kvcached` asserts "
        f"on (load orders {', '.join(ORDERS)}: "
        + ("identical" if same_orders and same_counters else "**they differ**")
        + "). *Wrong reads*: positions whose KV was never written, plus positions with other "
        "content (the shadow-KV oracle); *hit tokens*: vLLM's own prefix-cache stats.",
        "",
        "| layout | scheduler | kvcached alone: wrong reads (never written / wrong content), "
        "readers | guarded: wrong reads | guard rollbacks | hit tokens alone → guarded | "
        "preemptions alone = guarded |",
        "|---|---|---|---|---|---|---|",
    ]
    audits = []
    for name, (layout, scheduler) in ROWS.items():
        alone, guarded = first["alone"][name], first["guarded"][name]
        counts = alone["counts"]
        wrong = (
            f"**{alone['violations']}** ({counts.get('never_written', 0)} / "
            f"{counts.get('wrong_content', 0)}), {', '.join(alone['readers'])}"
            if alone["violations"]
            else "0"
        )
        guarded_wrong = f"**{guarded['violations']}**" if alone["violations"] else "0"
        preemptions = (
            str(alone["preemptions"])
            if alone["preemptions"] == guarded["preemptions"]
            else f"{alone['preemptions']} ≠ {guarded['preemptions']}"
        )
        lines.append(
            f"| {layout} | {scheduler} | {wrong} | {guarded_wrong} | "
            f"{_rollbacks(guarded['stats'])} | {alone['hit_tokens']} → {guarded['hit_tokens']} "
            f"| {preemptions} |"
        )
        audit = guarded["audit"]
        audits.append(f"{audit['recorded_by_guard']}/{audit['inserted_while_step_open']}")
    lines += [
        "",
        "Registrations that reached kvcached's index while a step was open, against what the "
        f"guard recorded: {', '.join(audits)}, in table order.",
        "",
        "Stock vLLM 0.30 without kvcached gives "
        + (
            "the same numbers as kvcached alone in every row"
            if same_as_stock
            else "**other numbers** than kvcached alone"
        )
        + ". The guard's counters "
        + ("are the same" if same_counters else "**differ**")
        + " in both load orders.",
        END,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc", type=Path, required=True, help="e.g. docs/kvcached.md")
    args = parser.parse_args(argv)
    reason = skip_reason()
    if reason is not None:
        raise SystemExit(reason)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    orders = {order: scenarios(order) for order in ORDERS}
    text = args.doc.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{args.doc} has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    args.doc.write_text(head + block(orders, stock_without_kvcached()) + tail, encoding="utf-8")
    print(f"updated the kvcached block in {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
