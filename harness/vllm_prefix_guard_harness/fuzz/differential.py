"""Differential runs: every mode on the same seeds, totals per configuration, and verdicts.

The acceptance checks are computed here, once, for the CLI, the soak and CI:

- the guard reads no bad KV, in any configuration;
- stock vLLM does, in every targeted configuration (otherwise the run proved nothing);
- the guard's rollbacks are exact (audited against the shadow KV: it undoes only entries
  whose KV is wrong, preempts only readers of wrong KV, and commits only valid KV);
- the guard's hit tokens are at least stock's hits on *valid* KV, and its preemptions
  no more than stock's;
- PR #43569's scope is measured alongside and must be as clean as the guard;
- every run drains (requests left long after the last event are a liveness finding).

Where stock reads bad KV the comparison is between a wrong execution and a right one:
every admission that read bad KV skipped computing tokens the guard computes, and the
schedules part from there. A hit or preemption comparison that misses is then reported
as *explained*, never silently passed, and only when the numbers account for it: for
hits, every rollback and preemption the guard made was needed (the audit, or the ideal
policy's run), so the difference is divergence, not KV the guard dropped; for
preemptions, the excess is at most stock's bad admissions plus the readers the guard
preempted to recompute rolled-back blocks, or it lies wholly on seeds where stock read
bad KV with every rollback needed. Where stock reads nothing bad, guard and stock take
the same decisions, and the checks are strict.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from vllm_prefix_guard.metrics import ROLLBACK_CAUSES
from vllm_prefix_guard_harness.fuzz.audit import AuditCounts
from vllm_prefix_guard_harness.fuzz.configs import FuzzConfig
from vllm_prefix_guard_harness.fuzz.runner import MODES, RunResult, run_workload

HITS_CHECK = "guard hit tokens >= stock's valid hit tokens"
KV_EVENTS_CHECK = (
    "guard's KV events match its prefix cache after every step, for a set and a counting consumer"
)

_PEAKS = {"peak_uncommitted_entries"}
DECISIONS_CHECK = "guard decides as stock until stock reads bad KV"

_NOT_SUMMED = {
    "mode",
    "first_violation_iteration",
    "first_violation_step",
    "examples",
    "audit",
    "decisions",
    "decision_history",
}


def accumulate(total: RunResult, run: RunResult) -> None:
    """Add ``run``'s counters into ``total`` (peaks take the maximum)."""
    for f in dataclasses.fields(RunResult):
        if f.name in _NOT_SUMMED:
            continue
        a, b = getattr(total, f.name), getattr(run, f.name)
        setattr(total, f.name, max(a, b) if f.name in _PEAKS else a + b)
    if not total.examples and run.examples:
        total.examples = run.examples
    if run.audit is not None:
        if total.audit is None:
            total.audit = AuditCounts()
        total.audit.merge(run.audit)


OK, EXPLAINED, FAIL = "ok", "explained", "FAIL"


@dataclass
class Check:
    name: str
    status: str
    detail: str

    @property
    def ok(self) -> bool:
        return self.status != FAIL


def _status(strict: bool, explained: bool) -> str:
    return OK if strict else EXPLAINED if explained else FAIL


@dataclass
class ConfigResult:
    """Totals of one configuration over its seeds, per mode, and the seeds that failed."""

    config: FuzzConfig
    modes: tuple[str, ...]
    seeds: list[int] = field(default_factory=list)
    totals: dict[str, RunResult] = field(default_factory=dict)
    # mode -> seeds whose run read bad KV.
    violating_seeds: dict[str, list[int]] = field(default_factory=dict)
    # Seeds where stock read only valid KV, and those of them on which the guard decided
    # otherwise in some step.
    clean_seeds: int = 0
    parted_seeds: list[int] = field(default_factory=list)
    # Where stock read bad KV: steps from the guard's first different decision to
    # stock's first bad read, per seed (negative: the guard parted after it).
    parting_leads: list[int] = field(default_factory=list)
    # Guard preemptions minus stock's, summed over the seeds where stock read only valid
    # KV and over those where it read bad KV: where the excess lies.
    extra_preemptions_clean: int = 0
    extra_preemptions_where_stock_read_bad_kv: int = 0

    def __post_init__(self) -> None:
        for mode in self.modes:
            self.totals.setdefault(mode, RunResult(mode))
            self.violating_seeds.setdefault(mode, [])

    def add(self, seed: int, runs: dict[str, RunResult]) -> None:
        self.seeds.append(seed)
        for mode, run in runs.items():
            accumulate(self.totals[mode], run)
            if run.violations:
                self.violating_seeds[mode].append(seed)
        if "stock" in runs and "guard" in runs:
            guard, stock = runs["guard"], runs["stock"]
            parted = parting_step(guard, stock)
            extra = guard.preemptions - stock.preemptions
            if stock.first_violation_step is None:
                self.clean_seeds += 1
                self.extra_preemptions_clean += extra
                if parted is not None:
                    self.parted_seeds.append(seed)
            else:
                self.extra_preemptions_where_stock_read_bad_kv += extra
                if parted is not None:
                    self.parting_leads.append(stock.first_violation_step - parted)

    def checks(self) -> list[Check]:
        """The acceptance checks that apply to the modes that ran."""
        totals = self.totals
        checks = []
        for mode in ("guard", "pr43569"):
            if mode in totals:
                bad = totals[mode].violations
                detail = f"{bad} bad reads" + _seeds_note(self.violating_seeds[mode])
                checks.append(Check(f"{mode} reads no bad KV", OK if bad == 0 else FAIL, detail))
        if "guard" in totals:
            guard = totals["guard"]
            wrong = sum(_event_keys_wrong(guard))
            detail = _event_detail(guard) + (
                f"; {guard.kv_event_rolled_back_after_publish} of "
                f"{guard.kv_event_keys_stored} keys announced stored were rolled back after "
                "the announcement was published"
            )
            if "stock" in totals:
                detail += "; stock: " + _event_detail(totals["stock"])
            checks.append(Check(KV_EVENTS_CHECK, OK if wrong == 0 else FAIL, detail))
        for mode in ("guard",):
            audit = totals[mode].audit if mode in totals else None
            if audit is not None:
                checks += _audit_checks(mode, audit)
        if "stock" not in totals:
            return [*checks, self._drain_check()]
        stock = totals["stock"]
        if self.config.targeted:
            exposed = len(self.violating_seeds["stock"])
            checks.append(
                Check(
                    "stock reads bad KV",
                    OK if stock.violations else FAIL,
                    f"{stock.violations} bad reads in {exposed} of {len(self.seeds)} seeds"
                    + _seeds_note(self.violating_seeds["stock"]),
                )
            )
        if "guard" in totals:
            checks.append(self._decisions_check())
            checks += _guard_vs_stock(
                totals["guard"],
                stock,
                totals.get("ideal"),
                (self.extra_preemptions_clean, self.extra_preemptions_where_stock_read_bad_kv),
            )
        return [*checks, self._drain_check()]

    def _decisions_check(self) -> Check:
        """Per seed where stock read only valid KV, the guard's steps are stock's, step
        for step: it changes no decision (so no hit and no preemption) unless stock's
        run touches bad KV. Where stock does read bad KV the runs part, around its
        first bad read (the detail says how many steps before it: a lookup that hits
        bad KV can change a decision before the read, e.g. an admission that fails for
        want of blocks); from there only totals compare. A parting on a seed where stock
        read nothing bad is *explained* only by what the guard's needed rollbacks do to
        eviction order (:data:`EVICTION_ORDER`)."""
        parted = self.parted_seeds
        explained = (
            bool(parted) and _is_exact(self.totals["guard"]) and _reorders(self.totals["guard"])
        )
        if self.clean_seeds:
            detail = f"identical in {self.clean_seeds - len(parted)} of {self.clean_seeds} seeds"
            detail += _seeds_note(parted)
        else:
            detail = "no seed where stock read only valid KV"
        if self.parting_leads:
            low, high = min(self.parting_leads), max(self.parting_leads)
            span = f"{low}" if low == high else f"{low} to {high}"
            detail += (
                f"; where stock read bad KV ({len(self.parting_leads)} seeds), parted "
                f"{span} steps before its first bad read"
            )
        if explained:
            detail += "; " + EVICTION_ORDER
        return Check(DECISIONS_CHECK, _status(not parted, explained), detail)

    def _drain_check(self) -> Check:
        """Every run drained, or drained once the requests wedged on vLLM's own
        dropped-output bug (:func:`.runner.awaits_dropped_output`), which stock hits
        too, were aborted; which seeds hit it is chaotic once the modes'
        schedules diverge, so the counts are reported, not compared."""
        totals = self.totals.values()
        stalled = any(run.stalled_runs for run in totals)
        wedged = any(run.wedged_runs for run in totals)
        detail = ", ".join(f"{run.mode} {run.stalled_runs}" for run in totals) + " stalled runs"
        if wedged:
            detail += "; wedged by vLLM's dropped-output bug, released, drained: " + ", ".join(
                f"{run.mode} {run.wedged_runs} ({run.released_requests} aborted)" for run in totals
            )
        status = FAIL if stalled else EXPLAINED if wedged else OK
        return Check("runs drain", status, detail)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks())


#: Why the guard's run can part from stock's where stock reads nothing bad. Measured on
#: ``hybrid-victim`` seed 0, vLLM 0.32: the blocks holding a prefix differ from step 826
#: (the guard's rolled-back block was reused first), and at step 857 a resumed request's
#: full-attention hit reaches 96 tokens under the guard, 80 in stock, whose copy was
#: evicted; with a state group vLLM also ends prefill chunks at that hit (the
#: shared-prefix junction), so the chunks differ.
EVICTION_ORDER = (
    "every rollback needed (audit), and the blocks it undid were freed without a hash, "
    "which vLLM's pool reuses first (BlockPool.free_blocks) while stock keeps them as "
    "cached blocks and evicts valid ones before them: the runs evict differently"
)


def _reorders(guard: RunResult) -> bool:
    """Whether the guard undid entries (each changes when its block is reused), of any
    cause ``/metrics`` labels: a cause the runner does not record fails here, loudly."""
    return sum(getattr(guard, cause) for cause in ROLLBACK_CAUSES.values()) > 0


def _is_exact(guard: RunResult) -> bool:
    """Every entry the guard undid was bad and every reader it preempted read bad KV."""
    audit = guard.audit
    return audit is not None and audit.valid_rolled_back == 0 and audit.clean_readers_preempted == 0


def parting_step(guard: RunResult, stock: RunResult) -> int | None:
    """The first step in which ``guard``'s run decided otherwise than ``stock``'s (None:
    never). Runs of one workload in one process."""
    ours, theirs = guard.decision_history, stock.decision_history
    for step, (mine, its) in enumerate(zip(ours, theirs, strict=False)):
        if mine != its:
            return step
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def _audit_checks(mode: str, audit: AuditCounts) -> list[Check]:
    """The rollback audit's verdicts: exact rollbacks, no missed ones."""
    valid = audit.valid_rolled_back
    clean = audit.clean_readers_preempted
    detail = f"{valid} valid entries rolled back, {clean} clean readers preempted"
    if valid:
        detail += f" ({audit.causes_text()})"
    missed = audit.invalid_committed
    return [
        Check(f"{mode} rolls back only bad KV", OK if valid == clean == 0 else FAIL, detail),
        Check(
            f"{mode} commits only valid KV",
            OK if missed == 0 else FAIL,
            f"{missed} entries committed on wrong KV",
        ),
    ]


def _is_ideal(guard: RunResult, ideal: RunResult | None) -> bool:
    """Whether the guard's run is the ideal policy's: every rollback and preemption it
    made was needed (audited), so the oracle-filtered run takes the same decisions;
    or the ideal mode ran and got no more hits."""
    if ideal is not None:
        return guard.hit_tokens >= ideal.hit_tokens
    return _is_exact(guard)


def _guard_vs_stock(
    guard: RunResult,
    stock: RunResult,
    ideal: RunResult | None,
    extra_by_seed: tuple[int, int],
) -> list[Check]:
    """Hits against stock's *valid* hits (stock's others read bad KV), and preemptions.

    The guard must get at least every hit stock got on right KV. Below that, the run is
    explained only if every rollback and reader preemption it made was needed (the
    audit says so, or the ideal policy's run gets no more hits): then the difference is
    the schedule diverging after those necessary decisions (stock attended over bad KV
    where the guard recomputed), and the detail says how much.

    Preemptions over stock's are explained by stock's bad admissions and the readers the
    guard preempted, or, from ``extra_by_seed`` (the excess summed over the seeds where
    stock read only valid KV, and over the others), seed by seed with every rollback
    needed: on seeds where stock read bad KV the runs part there (a bad read that is no
    admission, e.g. a resumed request's wrong state, skips no computation, so the first
    explanation cannot count it), and on the others only eviction order parts them, as
    the decisions check allows (none of the excess there without rollbacks).
    """
    valid = stock.valid_hit_tokens
    hits_detail = f"{guard.hit_tokens} vs {valid} ({percent(guard.hit_tokens, valid)})"
    if stock.invalid_hit_tokens:
        hits_detail += (
            f"; stock's {stock.hit_tokens} hits include {stock.invalid_hit_tokens} on bad KV"
        )
    exact = _is_ideal(guard, ideal)
    # Where stock read nothing bad, only eviction order parts the runs.
    reordered = stock.violations == 0 and exact and _reorders(guard)
    if guard.hit_tokens < valid and exact:
        hits_detail += (
            f"; below by {valid - guard.hit_tokens}, with every rollback and preemption needed"
            + (f" (the ideal policy's run: {ideal.hit_tokens} hits)" if ideal is not None else "")
            + ": schedule divergence, no valid KV dropped"
        )
    extra = guard.preemptions - stock.preemptions
    explainable = stock.bad_admissions + guard.dependents_preempted
    pre_detail = f"{guard.preemptions} vs {stock.preemptions}"
    if extra > 0 and explainable:
        pre_detail += (
            f"; stock skipped recomputation in {stock.bad_admissions} bad admissions, "
            f"the guard preempted {guard.dependents_preempted} readers of rolled-back blocks"
        )
    clean_extra, dirty_extra = extra_by_seed
    # Seed by seed: where stock read bad KV the runs part there; elsewhere only eviction
    # order parts them, as in the decisions check.
    clean_reordered = clean_extra > 0 and exact and _reorders(guard)
    parted_where_bad = (
        extra > 0 and exact and stock.violations > 0 and (clean_extra <= 0 or clean_reordered)
    )
    if extra > 0:
        pre_detail += (
            f"; by seed: {clean_extra:+} where stock read only valid KV, {dirty_extra:+} "
            "where it read bad KV"
        )
        if parted_where_bad:
            pre_detail += " (every rollback needed: the runs part where stock read bad KV)"
    if (reordered or (parted_where_bad and clean_reordered)) and (
        extra > 0 or guard.hit_tokens < valid
    ):
        pre_detail += "; " + EVICTION_ORDER
    return [
        Check(
            HITS_CHECK,
            _status(guard.hit_tokens >= valid, exact and (stock.violations > 0 or reordered)),
            hits_detail,
        ),
        Check(
            "guard preemptions <= stock",
            _status(extra <= 0, extra <= explainable or reordered or parted_where_bad),
            pre_detail,
        ),
    ]


def _event_keys_wrong(run: RunResult) -> tuple[int, int]:
    """Keys wrong, summed over steps: (set consumer, counting consumer)."""
    return (
        run.kv_event_keys_missing + run.kv_event_keys_extra,
        run.kv_event_counted_keys_missing + run.kv_event_counted_keys_extra,
    )


def _event_detail(run: RunResult) -> str:
    return (
        f"set consumer {run.kv_event_keys_missing} keys missing, {run.kv_event_keys_extra} "
        f"extra, in {run.kv_event_inconsistent_steps} steps; counting consumer "
        f"{run.kv_event_counted_keys_missing} missing, {run.kv_event_counted_keys_extra} "
        f"extra, in {run.kv_event_counted_inconsistent_steps} steps"
    )


def _seeds_note(seeds: list[int], shown: int = 8) -> str:
    """`` (seeds 0, 3, ...)``: the seeds to replay, or nothing when none read bad KV."""
    if not seeds:
        return ""
    more = f", ... {len(seeds) - shown} more" if len(seeds) > shown else ""
    return f" (seeds {', '.join(map(str, seeds[:shown]))}{more})"


def percent(a: int, b: int, digits: int = 3) -> str:
    """``a`` as a percentage of ``b``, or ``n/a`` when ``b`` is 0."""
    return f"{a / b:.{digits}%}" if b else "n/a"


ProgressFn = Callable[[FuzzConfig, int, dict[str, RunResult]], None]


def run_seed(
    config: FuzzConfig, seed: int, modes: Sequence[str] = MODES, horizon: int | None = None
) -> dict[str, RunResult]:
    """Every mode on the workload of ``seed``."""
    workload = config.workload(seed, horizon)
    return {mode: run_workload(workload, mode, audit=mode == "guard") for mode in modes}


def run_matrix(
    configs: Iterable[FuzzConfig],
    seeds: Iterable[int] | None = None,
    *,
    modes: Sequence[str] = MODES,
    horizon: int | None = None,
    seconds: float | None = None,
    progress: ProgressFn | None = None,
) -> list[ConfigResult]:
    """Run each configuration on each seed in every mode.

    With ``seconds``, seeds 0, 1, 2, ... go round-robin over the configurations until
    the time is up (every configuration gets at least one seed); ``seeds``, if also
    given, caps how many.
    """
    configs = list(configs)
    results = [ConfigResult(c, tuple(modes)) for c in configs]
    seed_list = None if seeds is None else list(seeds)
    if seconds is None and seed_list is None:
        raise ValueError("give seeds, seconds, or both")
    deadline = None if seconds is None else time.monotonic() + seconds
    index = 0
    while True:
        if seed_list is not None and index >= len(seed_list):
            break
        seed = seed_list[index] if seed_list is not None else index
        for result in results:
            if deadline is not None and index > 0 and time.monotonic() >= deadline:
                return results
            runs = run_seed(result.config, seed, modes, horizon)
            result.add(seed, runs)
            if progress is not None:
                progress(result.config, seed, runs)
        index += 1
    return results
