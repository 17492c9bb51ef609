"""Turn the benchmark JSON into the markdown tables docs/benchmarks.md shows; check the targets.

Reads what ``scheduler_bench.py`` and ``engine_bench.py`` wrote (and, if present, the
``instructions.py`` counts), writes ``benchmarks/results/latest.md``,
prints it, and with ``--doc`` replaces the block between ``<!-- bench:begin -->`` and
``<!-- bench:end -->`` in that document (``docs/benchmarks.md``). Targets are those of the
performance issue; with ``--check`` a missed target makes the exit status 1.

A before/after comparison is added when ``results/compare/before`` and
``results/compare/after`` hold documents of the same benchmarks (``instructions.json``,
``scheduler.json``, ``engine.json``), e.g. the same commands run on two commits: per cell
and column, instructions per step and the step-time ratios to stock, before and after, and
whether every counter of the run (hits, preemptions, trajectory, ledger, ...) is identical;
the engine's tokens/s ratio, hit rate and ledger counters.
``results/compare/labels.json`` may name the two sides (``{"before": ..., "after": ...}``)
and add a ``"note"`` printed under the tables.

Usage::

    python benchmarks/report.py                                # results/ -> latest.md
    python benchmarks/report.py --doc docs/benchmarks.md --check
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"

STEP_RATIO_MAX = 1.02  # guard/stock, median of pairs, at TARGET_RUNNING
# The rules-module issue's target for the graft: instructions per step, guard/stock.
GRAFT_INSTRUCTIONS_MAX = 1.005
TARGET_RUNNING = 256
ENGINE_RATIO_MIN = 0.99
PRIORITY_HIT_RATIO_MIN = 0.999
PRIORITY_PREEMPTION_RATIO_MAX = 1.001


@dataclass
class Target:
    name: str
    met: bool
    detail: str

    def row(self) -> str:
        return f"| {self.name} | {'met' if self.met else '**missed**'} | {self.detail} |"


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _x(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _ratio(value: float, reference: float) -> float | None:
    return value / reference if reference else None


def _us(value: float) -> str:
    return f"{value:,.0f}"


def scheduler_tables(doc: dict[str, Any]) -> list[str]:
    columns = doc["columns"]
    others = [c for c in columns if c != "stock"]
    env = doc["environment"]
    lines = [
        f"Scheduler step time: `schedule()` + `update_from_output()` per engine iteration, "
        f"vLLM {env['vllm']}, Python {env['python']}, {env['cpus']} CPUs "
        f"(load average {env.get('load_average', 0):.1f} at the end). Columns take turns in "
        "segments of a few steps, same seeded traffic; ratio = median over segment pairs "
        "of the segment medians (wall clock; CPU = thread CPU time), [quartiles].",
        "",
        "| cell | stock us | "
        + " | ".join(f"{c} us | {c}/stock | {c}/stock CPU" for c in others)
        + " |",
        "|---|---:|" + "---:|---:|---:|" * len(others),
    ]
    for cell in doc["cells"]:
        cols = cell["columns"]
        row = f"| {cell['cell']} | {_us(cols['stock']['median_step_us'])} |"
        for c in others:
            ratio, cpu = cols[c]["step_ratio"], cols[c]["cpu_step_ratio"]
            row += (
                f" {_us(cols[c]['median_step_us'])} |"
                f" {ratio['median']:.3f} [{ratio['q1']:.2f}-{ratio['q3']:.2f}] |"
                f" {cpu['median']:.3f} |"
            )
        lines.append(row)
    # Documents of the harness-based benchmark count bad KV reads beside zombie hits.
    shadow = any("bad_kv_reads" in col for c in doc["cells"] for col in c["columns"].values())
    checked = (
        "hit tokens whose KV slot does not hold the content the request expects (checked "
        "by the shadow-KV worker)"
        if shadow
        else "hits on blocks that do not hold the content their hash names (checked by the "
        "fake worker)"
    )
    lines += [
        "",
        "Cache efficiency and ledger memory over the whole run (warm-up, measured window, "
        "drain). Ratios to stock as hits / preemptions / computed tokens (all scheduled "
        f"tokens: recomputation shows here). Zombie hit tokens: {checked}. Ledger peak is "
        "bounded by steps in flight x the most registrations one step made.",
        "",
        "| cell | stock hit tokens | stock preemptions | "
        + " | ".join(f"{c} hits / preempt. / computed" for c in others)
        + " | zombie hit tokens (stock/"
        + "/".join(others)
        + ") | rolled back ("
        + "/".join(others)
        + ") | ledger peak / bound | after drain |",
        "|---|---:|---:|" + "---|" * len(others) + "---|---|---|---|",
    ]
    for cell in doc["cells"]:
        cols = cell["columns"]
        stock = cols["stock"]
        row = f"| {cell['cell']} | {stock['hit_tokens']:,} | {stock['preemptions']:,} |"
        for c in others:
            computed = _ratio(cols[c]["scheduled_tokens"], stock["scheduled_tokens"])
            row += (
                f" {_x(cols[c]['hit_ratio'], 4)} / {_x(cols[c]['preemption_ratio'], 4)} /"
                f" {_x(computed, 4)} |"
            )
        zombies = "/".join(str(cols[c]["zombie_hit_tokens"]) for c in columns)
        rollbacks = "/".join(str(cols[c]["ledger"]["rolled_back"]) for c in others)
        peaks = ", ".join(
            f"{cols[c]['ledger']['peak_uncommitted_entries']} / {cols[c]['ledger']['peak_bound']}"
            for c in others
        )
        drained = ", ".join(
            f"{cols[c]['ledger']['uncommitted_entries']}"
            + ("" if cols[c]["ledger"]["idle_after_drain"] else " (not idle)")
            for c in others
        )
        row += f" {zombies} | {rollbacks} | {peaks} | {drained} |"
        lines.append(row)
    return lines


def noise_range(noise: dict[str, Any]) -> tuple[float, float]:
    """The lowest and highest CPU-time ratio of stock against itself over the cells."""
    ratios = [
        ratio
        for cell in noise["cells"]
        for column, run in cell["columns"].items()
        if column != "stock" and (ratio := run["cpu_step_ratio"]["median"]) is not None
    ]
    return min(ratios), max(ratios)


def noise_table(noise: dict[str, Any]) -> list[str]:
    """Stock against itself (``--columns stock,stock#2``): what a ratio on this machine
    can tell apart."""
    others = [c for c in noise["columns"] if c != "stock"]
    lines = [
        "Noise floor: stock against itself, same cells, same machine "
        "(`scheduler_bench.py --sizes 256 --columns stock,stock#2`).",
        "",
        "| cell | " + " | ".join(f"{c}/stock | {c}/stock CPU" for c in others) + " |",
        "|---|" + "---:|---:|" * len(others),
    ]
    for cell in noise["cells"]:
        row = f"| {cell['cell']} |"
        for c in others:
            ratio, cpu = cell["columns"][c]["step_ratio"], cell["columns"][c]["cpu_step_ratio"]
            row += (
                f" {ratio['median']:.3f} [{ratio['q1']:.2f}-{ratio['q3']:.2f}] |"
                f" {cpu['median']:.3f} |"
            )
        lines.append(row)
    return lines


def engine_table(doc: dict[str, Any]) -> list[str]:
    env, work = doc["environment"], doc["workload"]
    (reference, first), (other, second) = doc["columns"].items()
    lines = [
        f"Engine (offline `LLM.generate`, tiny Llama on CPU, vLLM {env['vllm']}): "
        f"{work['num_prompts']} prompts over {work['num_prefixes']} shared "
        f"{work['prefix_len']}-token prefixes, {work['max_tokens']} output tokens each, "
        f"{doc['rounds']} interleaved pairs, cold prefix cache per run.",
        "",
        "| column | output tokens/s (median) | ratio to stock (median of pairs) | hit rate |",
        "|---|---:|---:|---:|",
        f"| {reference} | {first['median_tokens_per_s']:,.0f} | | {_x(first['hit_rate'], 4)} |",
        f"| {other} | {second['median_tokens_per_s']:,.0f} | "
        f"{second['tokens_per_s_ratio']:.3f} "
        f"[{min(second['tokens_per_s_ratio_per_pair']):.3f}-"
        f"{max(second['tokens_per_s_ratio_per_pair']):.3f}] | {_x(second['hit_rate'], 4)} |",
    ]
    return lines


def instruction_table(doc: dict[str, Any]) -> list[str]:
    columns = doc["columns"]
    lines = [
        "Instructions per step (`schedule()` + `update_from_output()` only, callgrind, "
        "deterministic; immune to noisy neighbours):",
        "",
        "| cell | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for cell in doc["cells"]:
        lines.append(
            f"| {cell['cell']} | "
            + " | ".join(
                f"{cell[c]['instructions_per_step'] / 1e6:.2f}M (x{cell[c]['ratio']:.4f})"
                for c in columns
            )
            + " |"
        )
    if any("#" in column for column in columns):
        lines += [
            "",
            "A `#2` column runs the same code again in another process; the spread between "
            "repeats (memory layout differs per process) is the floor of what one run tells.",
        ]
    for cell in doc["cells"]:
        if {"stock", "guard", "graft"} <= cell.keys():
            stock, graft, guard = (
                mean_instructions(cell, column) for column in ("stock", "graft", "guard")
            )
            repeats = "mean of the repeats, " if any("#" in c for c in columns) else ""
            lines += [
                "",
                f"Where the guard's instructions go ({cell['cell']}, {repeats}of stock's): "
                f"the graft's own frames (`graft`: hooks and pool mixin in place, rules idle) "
                f"{(graft / stock - 1) * 100:+.2f}%, the rules' work (recording, commit, "
                f"attribution) {(guard - graft) / stock * 100:+.2f}%, in all "
                f"{(guard / stock - 1) * 100:+.2f}%.",
            ]
    return lines


def repeats_of(cell: dict[str, Any], column: str) -> dict[str, dict[str, Any]]:
    """``column``'s runs in an instructions cell: itself and its repeats (``column#2``, ...)."""
    return {
        name: run
        for name, run in cell.items()
        if isinstance(run, dict) and name.split("#", 1)[0] == column
    }


def mean_instructions(cell: dict[str, Any], column: str) -> float:
    """Instructions per step of ``column`` averaged over its repeats."""
    runs = [run["instructions_per_step"] for run in repeats_of(cell, column).values()]
    return sum(runs) / len(runs)


#: Counters of a scheduler run that do not depend on the clock: equal before and after
#: means both runs did the same work (``ledger`` ones for the guarded columns).
RUN_COUNTERS = (
    "hit_tokens",
    "query_tokens",
    "preemptions",
    "scheduled_tokens",
    "zombie_hit_tokens",
    "requests_admitted",
    "iterations",
    "drain_iterations",
    "trajectory",
    "mean_running",
)
LEDGER_COUNTERS = (
    "peak_uncommitted_entries",
    "peak_bound",
    "rolled_back",
    "uncommitted_entries",
    "registrations_tracked",
    "max_registrations_per_step",
    "idle_after_drain",
)


def _same_counters(before: dict[str, Any], after: dict[str, Any]) -> tuple[int, int]:
    """``(identical, compared)`` over :data:`RUN_COUNTERS` and :data:`LEDGER_COUNTERS`."""
    pairs = [(before.get(k), after.get(k)) for k in RUN_COUNTERS]
    if "ledger" in before or "ledger" in after:
        old, new = before.get("ledger") or {}, after.get("ledger") or {}
        pairs += [(old.get(k), new.get(k)) for k in LEDGER_COUNTERS]
    return sum(a == b for a, b in pairs), len(pairs)


def comparison_tables(compare: Path) -> list[str]:
    """Before/after tables from ``compare/before`` and ``compare/after`` (empty if absent):
    one per benchmark both sides hold."""
    labels = _load(compare / "labels.json") or {}
    sides = (labels.get("before", "before"), labels.get("after", "after"))
    lines: list[str] = []
    for name, table in (
        ("instructions.json", instructions_comparison),
        ("scheduler.json", scheduler_comparison),
        ("engine.json", engine_comparison),
    ):
        old, new = _load(compare / "before" / name), _load(compare / "after" / name)
        if old is not None and new is not None:
            lines += [*table(old, new, *sides), ""]
    if lines and labels.get("note"):
        lines += [labels["note"], ""]
    return lines


def paired_cells(
    old: dict[str, Any], new: dict[str, Any]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``(before, after)`` of every cell both documents measured, in the older one's order."""
    after_cells = {c["cell"]: c for c in new["cells"]}
    return [(c, after_cells[c["cell"]]) for c in old["cells"] if c["cell"] in after_cells]


def instructions_comparison(
    old: dict[str, Any], new: dict[str, Any], before_label: str, after_label: str
) -> list[str]:
    lines = [
        f"Before/after, instructions per step (callgrind, deterministic). Before: "
        f"{before_label}. After: {after_label}.",
        "",
        "| cell | column | before | after | after/before | column/stock before -> after "
        "| same trajectory |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for cell, other in paired_cells(old, new):
        for c in old["columns"]:
            if c not in other:
                continue
            a, b = cell[c], other[c]
            lines.append(
                f"| {cell['cell']} | {c} | {a['instructions_per_step'] / 1e6:.3f}M |"
                f" {b['instructions_per_step'] / 1e6:.3f}M |"
                f" {b['instructions_per_step'] / a['instructions_per_step']:.4f} |"
                f" {a['ratio']:.4f} -> {b['ratio']:.4f} |"
                f" {'yes' if a['trajectory'] == b['trajectory'] else '**no**'} |"
            )
    return lines


def scheduler_comparison(
    old: dict[str, Any], new: dict[str, Any], before_label: str, after_label: str
) -> list[str]:
    env_old, env_new = old["environment"], new["environment"]
    lines = [
        f"Before/after, step-time ratios to stock (median over segment pairs). Before: "
        f"{before_label} (load average {env_old.get('load_average', 0):.1f}). After: "
        f"{after_label} (load average {env_new.get('load_average', 0):.1f}). CPU = thread "
        "CPU time, the figure to compare on a loaded machine; wall clock as measured. "
        "Counters: hits, preemptions, scheduled tokens, zombie "
        "hits, iterations, trajectory digest and the ledger's, identical / compared.",
        "",
        "| cell | column | CPU ratio before -> after | wall ratio before -> after "
        "| stock CPU us before -> after | counters identical |",
        "|---|---|---|---|---|---:|",
    ]
    for cell, other in paired_cells(old, new):
        stock_a, stock_b = cell["columns"]["stock"], other["columns"]["stock"]
        for c, a in cell["columns"].items():
            b = other["columns"].get(c)
            if b is None:
                continue
            same, compared = _same_counters(a, b)
            if c == "stock":
                ratios = "| | |"
            else:
                ratios = (
                    f"| {a['cpu_step_ratio']['median']:.3f} ->"
                    f" {b['cpu_step_ratio']['median']:.3f} |"
                    f" {a['step_ratio']['median']:.3f} -> {b['step_ratio']['median']:.3f} |"
                )
            stock_cpu = (
                f"{_us(stock_a['median_step_cpu_us'])} -> {_us(stock_b['median_step_cpu_us'])}"
            )
            lines.append(f"| {cell['cell']} | {c} {ratios} {stock_cpu} | {same}/{compared} |")
    return lines


def engine_comparison(
    old: dict[str, Any], new: dict[str, Any], before_label: str, after_label: str
) -> list[str]:
    """Each guarded column's tokens/s ratio to stock, hit rate and ledger counters."""
    lines = [
        f"Before/after, engine (offline `LLM.generate`, vLLM {new['environment']['vllm']}). "
        f"Before: {before_label}. After: {after_label}. Ratio = median over interleaved "
        "pairs of guard/stock output tokens/s.",
        "",
        "| column | tokens/s ratio to stock before -> after | hit rate before -> after "
        "| ledger counters identical |",
        "|---|---|---|---:|",
    ]
    for column, a in old["columns"].items():
        b = new["columns"].get(column)
        if b is None or "tokens_per_s_ratio" not in a:
            continue
        ledger_a, ledger_b = a.get("ledger") or {}, b.get("ledger") or {}
        same = sum(ledger_a.get(k) == ledger_b.get(k) for k in ledger_a)
        lines.append(
            f"| {column} | {a['tokens_per_s_ratio']:.3f} -> {b['tokens_per_s_ratio']:.3f} |"
            f" {a['hit_rate']:.4f} -> {b['hit_rate']:.4f} | {same}/{len(ledger_a)} |"
        )
    return lines


def targets(
    scheduler: dict[str, Any] | None,
    engine: dict[str, Any] | None,
    instructions: dict[str, Any] | None,
    noise: dict[str, Any] | None = None,
) -> list[Target]:
    found: list[Target] = []
    if scheduler is not None:
        cells = scheduler["cells"]
        at_target = [c for c in cells if c["running"] == TARGET_RUNNING]
        if at_target:
            ratios = {c["cell"]: c["columns"]["guard"]["step_ratio"]["median"] for c in at_target}
            worst = max(ratios, key=lambda k: ratios[k])
            floor = ""
            if noise is not None:
                low, high = noise_range(noise)
                floor = f"; stock against itself on the same machine: {low:.3f}-{high:.3f}"
            found.append(
                Target(
                    f"step time guard/stock <= {STEP_RATIO_MAX} at {TARGET_RUNNING} running",
                    all(r <= STEP_RATIO_MAX for r in ratios.values()),
                    ", ".join(f"{k.split('-', 1)[1]} {v:.3f}" for k, v in ratios.items())
                    + f" (worst: {worst}{floor})",
                )
            )
        fcfs = [c for c in cells if c["policy"] == "fcfs"]
        if fcfs:
            bad = [
                c["cell"]
                for c in fcfs
                if c["columns"]["guard"]["hit_ratio"] != 1.0
                or c["columns"]["guard"]["preemption_ratio"] != 1.0
            ]
            found.append(
                Target(
                    "FCFS: hit tokens and preemptions = stock (ratio 1.000)",
                    not bad,
                    f"{len(fcfs) - len(bad)}/{len(fcfs)} cells exact"
                    + (f"; off: {', '.join(bad)}" if bad else ""),
                )
            )
        priority = [c for c in cells if c["policy"] == "priority"]
        if priority:
            hits = {c["cell"]: c["columns"]["guard"]["hit_ratio"] or 0.0 for c in priority}
            pre = {c["cell"]: c["columns"]["guard"]["preemption_ratio"] or 0.0 for c in priority}
            low, high = min(hits, key=lambda k: hits[k]), max(pre, key=lambda k: pre[k])
            zombies = sum(c["columns"]["stock"]["zombie_hit_tokens"] for c in priority)
            found.append(
                Target(
                    f"PRIORITY: hits >= {PRIORITY_HIT_RATIO_MIN}, "
                    f"preemptions <= {PRIORITY_PREEMPTION_RATIO_MAX}",
                    hits[low] >= PRIORITY_HIT_RATIO_MIN
                    and pre[high] <= PRIORITY_PREEMPTION_RATIO_MAX,
                    f"lowest hits x{hits[low]:.4f} ({low}), highest preemptions "
                    f"x{pre[high]:.4f} ({high}); stock zombie hit tokens: {zombies}",
                )
            )
        memory_ok, worst_peak = True, ""
        for c in cells:
            for name, col in c["columns"].items():
                ledger = col.get("ledger")
                if ledger is None:
                    continue
                memory_ok &= ledger["uncommitted_entries"] == 0 and ledger["idle_after_drain"]
                memory_ok &= ledger["peak_within_bound"]
                if not worst_peak or ledger["peak_uncommitted_entries"] > int(
                    worst_peak.split()[0]
                ):
                    worst_peak = (
                        f"{ledger['peak_uncommitted_entries']} (bound {ledger['peak_bound']}, "
                        f"{c['cell']} {name})"
                    )
        found.append(
            Target(
                "ledger: 0 after drain, peak <= in-flight steps x registrations per step",
                memory_ok,
                f"largest peak {worst_peak}",
            )
        )
    if engine is not None:
        _, guard = list(engine["columns"].items())[1]
        stock = next(iter(engine["columns"].values()))
        found.append(
            Target(
                f"engine tokens/s guard/stock >= {ENGINE_RATIO_MIN}",
                guard["tokens_per_s_ratio"] >= ENGINE_RATIO_MIN,
                f"{guard['tokens_per_s_ratio']:.3f}; hit rate {_x(guard['hit_rate'], 4)} vs "
                f"{_x(stock['hit_rate'], 4)}",
            )
        )
    if instructions is not None:
        for cell in instructions["cells"]:
            if "guard" in cell and cell["cell"].startswith(f"{TARGET_RUNNING}-"):
                ratio = cell["guard"]["ratio"]
                found.append(
                    Target(
                        f"instructions guard/stock <= {STEP_RATIO_MAX} ({cell['cell']})",
                        ratio <= STEP_RATIO_MAX,
                        f"{ratio:.4f}",
                    )
                )
                mean = mean_instructions(cell, "guard") / mean_instructions(cell, "stock")
                each = ", ".join(
                    f"{name} x{run['ratio']:.4f}" for name, run in repeats_of(cell, "guard").items()
                )
                found.append(
                    Target(
                        f"instructions guard/stock <= {GRAFT_INSTRUCTIONS_MAX}, mean of repeats "
                        f"({cell['cell']})",
                        mean <= GRAFT_INSTRUCTIONS_MAX,
                        f"{mean:.4f} ({each})",
                    )
                )
    return found


def render(results: Path, compare: Path | None = None) -> tuple[str, list[Target]]:
    scheduler = _load(results / "scheduler.json")
    noise = _load(results / "scheduler-noise.json")
    engine = _load(results / "engine.json")
    instructions = _load(results / "instructions.json")
    found = targets(scheduler, engine, instructions, noise)
    parts: list[str] = ["### Benchmark results", ""]
    if found:
        parts += ["| target | status | measured |", "|---|---|---|"]
        parts += [t.row() for t in found]
        parts.append("")
    if scheduler is not None:
        parts += [*scheduler_tables(scheduler), ""]
    if noise is not None:
        parts += [*noise_table(noise), ""]
    if instructions is not None:
        parts += [*instruction_table(instructions), ""]
    if engine is not None:
        parts += [*engine_table(engine), ""]
    parts += comparison_tables(compare or results / "compare")
    if scheduler is None and engine is None:
        parts.append(f"No results in {results}: run the benchmarks first.")
    return "\n".join(parts).rstrip() + "\n", found


def update_doc(doc: Path, block: str) -> bool:
    """Replace the text between the bench markers; False if the markers are absent."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        return False
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{block}{END}{tail}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=None, help="default: RESULTS/latest.md")
    parser.add_argument(
        "--compare", type=Path, default=None, help="before/after documents; RESULTS/compare"
    )
    parser.add_argument(
        "--doc", type=Path, default=None, help="update its bench block (docs/benchmarks.md)"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = parser.parse_args(argv)
    text, found = render(args.results, args.compare)
    out = args.out or args.results / "latest.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"wrote {out}")
    if args.doc is not None:
        if update_doc(args.doc, text):
            print(f"updated the bench block in {args.doc}")
        else:
            print(f"{args.doc} has no {BEGIN} ... {END} block; left unchanged")
    missed = [t.name for t in found if not t.met]
    if missed and args.check:
        print("missed: " + "; ".join(missed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
