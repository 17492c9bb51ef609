"""The bug and the fix on one engine: stock prefix caching reads KV that was never written.

The scheduler-level layout (``tests/regression/test_preemption.py``,
:mod:`vllm_prefix_guard_harness.notes_zombie`) scaled from block size 16 to 32 and run on a
real in-process ``LLMEngine`` with the tiny Llama model:

* 20 KV blocks of 32 tokens (``num_gpu_blocks_override=20``, the null block being one of them,
  exactly like the scheduler-level ``KVCacheConfig(num_blocks=20)``), priority policy,
  ``long_prefill_token_threshold=128``, ``max_num_batched_tokens=512``,
  ``scheduler_reserve_full_isl=False``;
* D (32 tokens, priority 0, 3 outputs) and A (320 tokens, priority 1) arrive; one step;
  B (240 tokens, priority 0) arrives; two steps. In the second, A is scheduled first and
  registers its blocks 9 and 10 (tokens 256-319), then B cannot allocate and A, already
  scheduled, is the victim. A's step is withdrawn, so those blocks are never written, but
  stock vLLM keeps their hashes;
* C arrives with A's prompt. On stock vLLM it hits 288 tokens, block 9 included, and attends
  over memory that holds no KV of its prompt; so does A when it resumes.

With the guard, A's registrations of the withdrawn step are rolled back when it is preempted:
C hits 256 tokens and recomputes the rest, and every completion matches an engine without
prefix caching. Every completion is compared with that engine's (greedy tokens, top-5
logprobs, :data:`~guard_demo.compare.LOGPROB_ATOL`).

The same arrivals reproduce the bug with async scheduling: the project's shadow-KV scheduler
driver with ``AsyncScheduler`` and two steps in flight shows A preempted in the third
``schedule()`` call and C and A reading the never-written block (vLLM's CPU backend always
schedules synchronously; ``--engine-args '{"async_scheduling": true}'`` on a GPU).

``python -m guard_demo.engine_proof --model-dir DIR --json OUT`` runs the three engines
(no prefix caching, stock, guarded) one after another in this process and writes
:class:`EngineProof` as JSON; ``--mode stock`` (or ``reference``, ``guarded``) runs one
engine, the guard then loaded by vLLM's own plugin loader from ``VLLM_PREFIX_GUARD=1``, as in
a server (kvcached's engine check runs each engine in its own process). The demo
(``python -m guard_demo``) opens its report with this proof; ``tests/e2e/test_engine_zombie.py``
asserts on it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from guard_demo.compare import LOGPROB_ATOL, TOP_LOGPROBS, Completion, find_mismatches
from guard_demo.in_process import in_process_engine, reference_stock_guarded, trace_preemptions
from guard_demo.workload import PROMPT_VOCAB
from vllm_prefix_guard_harness.factory import SchedulerSpec

__all__ = [
    "LAYOUT",
    "MODES",
    "Divergence",
    "EngineProof",
    "ScenarioRun",
    "first_divergence",
    "prove",
    "run_scenario",
]

#: The scheduler-level layout (block size 16) scaled to the tiny model's block size 32.
SCALE = 2
LAYOUT = SchedulerSpec(
    block_size=16 * SCALE,
    num_blocks=20,
    max_model_len=512,
    policy="priority",
    long_prefill_token_threshold=64 * SCALE,
    max_num_batched_tokens=256 * SCALE,
    reserve_full_isl=False,
)
OUTPUT_TOKENS = 8
#: The requests of the layout; A is the victim, C arrives with A's prompt.
REQUESTS = ("A", "B", "C", "D")
MODES = ("reference", "stock", "guarded")


def tokens(n16: int, offset: int) -> list[int]:
    """``n16`` tokens at block size 16, scaled; distinct per ``offset``, below the tiny model's
    special ids."""
    return [(offset * 7 + i * 13) % PROMPT_VOCAB for i in range(n16 * SCALE)]


def engine_args(model: Path, spec: SchedulerSpec, extra: Mapping[str, Any] | None = None) -> Any:
    """``EngineArgs`` for the tiny model with ``spec``'s scheduler and KV cache, and the
    platform's ``extra`` arguments on top. ``num_blocks`` counts the null block, as
    ``num_gpu_blocks_override`` does."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "seed": 0,
        "enforce_eager": True,
        "block_size": spec.block_size,
        "num_gpu_blocks_override": spec.num_blocks,
        "max_model_len": spec.max_model_len,
        "max_num_seqs": spec.max_num_seqs,
        "enable_prefix_caching": spec.enable_prefix_caching,
        "scheduling_policy": spec.policy,
        "long_prefill_token_threshold": spec.long_prefill_token_threshold,
        "max_num_batched_tokens": spec.max_num_batched_tokens,
        "scheduler_reserve_full_isl": spec.reserve_full_isl,
        "async_scheduling": spec.async_scheduling,
    }
    return EngineArgs(**{**kwargs, **(extra or {})})


@dataclass
class ScenarioRun:
    """What one engine did with the layout."""

    completions: dict[str, Completion] = field(default_factory=dict)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    #: Per ``schedule()`` call, the requests it preempted (external ids).
    preempted: list[set[str]] = field(default_factory=list)
    async_scheduling: bool = False
    #: The class names of the scheduler's pool, outermost first (vLLM's, or kvcached's).
    pool_mro: list[str] = field(default_factory=list)
    #: Whether a guard attached to that pool (its state on the pool object).
    pool_guarded: bool = False
    #: The guard's counters for this engine's scheduler, when it had a guard.
    guard_counters: dict[str, int] | None = None
    #: Whether the guard's patches were in place in the engine's process.
    guard_applied: bool = False

    def to_json(self) -> dict[str, Any]:
        document = asdict(self)
        document["completions"] = {
            name: {
                "token_ids": list(c.token_ids),
                "top_logprobs": [{str(t): lp for t, lp in p.items()} for p in c.top_logprobs],
            }
            for name, c in self.completions.items()
        }
        document["preempted"] = [sorted(ids) for ids in self.preempted]
        return document

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> ScenarioRun:
        fields = dict(document)
        fields["completions"] = {
            name: Completion(
                token_ids=tuple(c["token_ids"]),
                top_logprobs=tuple(
                    {int(t): float(lp) for t, lp in p.items()} for p in c["top_logprobs"]
                ),
            )
            for name, c in document["completions"].items()
        }
        fields["preempted"] = [set(ids) for ids in document["preempted"]]
        return cls(**fields)


def run_scenario(
    model: Path, *, prefix_caching: bool, extra_engine_args: Mapping[str, Any] | None = None
) -> ScenarioRun:
    """Drive the layout step by step on a fresh in-process engine (its EngineCore in this
    process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    from vllm import SamplingParams

    from vllm_prefix_guard import plugin
    from vllm_prefix_guard.hooks import guard_of

    run = ScenarioRun()
    with _engine(model, prefix_caching, extra_engine_args) as engine:
        core = engine.engine_core.engine_core  # InprocClient -> EngineCore
        run.async_scheduling = bool(core.vllm_config.scheduler_config.async_scheduling)
        pool = core.scheduler.kv_cache_manager.block_pool
        run.pool_mro = [c.__name__ for c in type(pool).__mro__]
        run.pool_guarded = bool(getattr(pool, "guard_attached", False))
        trace_preemptions(core.scheduler, run.preempted)

        def add(name: str, prompt: list[int], priority: int, max_tokens: int) -> None:
            params = SamplingParams(
                temperature=0.0, max_tokens=max_tokens, logprobs=TOP_LOGPROBS, ignore_eos=True
            )
            engine.add_request(name, {"prompt_token_ids": prompt}, params, priority=priority)

        def step() -> None:
            for output in engine.step():
                if output.finished:
                    run.completions[output.request_id] = Completion.from_vllm_output(
                        output.outputs[0]
                    )
                    run.num_cached_tokens[output.request_id] = output.num_cached_tokens or 0

        a_prompt = tokens(160, offset=1)
        add("D", tokens(16, offset=3), priority=0, max_tokens=3)
        add("A", a_prompt, priority=1, max_tokens=OUTPUT_TOKENS)
        step()
        add("B", tokens(120, offset=2), priority=0, max_tokens=OUTPUT_TOKENS)
        step()
        step()
        add("C", a_prompt, priority=0, max_tokens=OUTPUT_TOKENS)
        while engine.has_unfinished_requests():
            step()
        guard = guard_of(core.scheduler)
        run.guard_counters = guard.counters() if guard is not None else None
        run.guard_applied = plugin.is_applied()
    return run


@contextlib.contextmanager
def _engine(
    model: Path, prefix_caching: bool, extra_engine_args: Mapping[str, Any] | None
) -> Iterator[Any]:
    spec = replace(LAYOUT, enable_prefix_caching=prefix_caching)
    with in_process_engine(engine_args(model, spec, extra_engine_args)) as engine:
        yield engine


# -- the verdict -------------------------------------------------------------------------


@dataclass(frozen=True)
class Divergence:
    """Where one completion first leaves its reference."""

    request: str
    #: Output position (0: the first generated token).
    position: int
    token: int
    reference_token: int
    #: The largest logprob difference over the top-k both sides report at that position.
    logprob_gap: float

    def describe(self) -> str:
        tokens_ = (
            f"token {self.token} vs {self.reference_token}"
            if self.token != self.reference_token
            else f"same token {self.token}"
        )
        return (
            f"{self.request}: from output token {self.position} ({tokens_}), "
            f"logprob off by {self.logprob_gap:.2f}"
        )


def _gap(got: Mapping[int, float], want: Mapping[int, float]) -> float:
    common = got.keys() & want.keys()
    return max((abs(got[t] - want[t]) for t in common), default=float("inf"))


def first_divergence(
    actual: Completion, reference: Completion, name: str, atol: float = LOGPROB_ATOL
) -> Divergence | None:
    """The first output position whose token or top-k logprobs leave the reference by more
    than ``atol``; None when the whole completion is within it."""
    for position, (got, want) in enumerate(
        zip(actual.token_ids, reference.token_ids, strict=False)
    ):
        gap = _gap(actual.top_logprobs[position], reference.top_logprobs[position])
        if got != want or gap > atol:
            return Divergence(name, position, got, want, gap)
    return None


def largest_gap(runs: Mapping[str, Completion], reference: Mapping[str, Completion]) -> float:
    """The largest logprob difference, over every position of every completion, from the
    reference (as far as the tokens agree)."""
    gap = 0.0
    for name, completion in runs.items():
        want = reference[name]
        for position, (got_id, want_id) in enumerate(
            zip(completion.token_ids, want.token_ids, strict=False)
        ):
            gap = max(gap, _gap(completion.top_logprobs[position], want.top_logprobs[position]))
            if got_id != want_id:
                break
    return gap


@dataclass
class EngineProof:
    """The three engines' runs and what they show."""

    reference: ScenarioRun
    stock: ScenarioRun
    guarded: ScenarioRun
    atol: float = LOGPROB_ATOL
    seconds: float = 0.0

    def stock_mismatches(self) -> dict[str, str]:
        return find_mismatches(self.stock.completions, self.reference.completions, self.atol)

    def stock_divergences(self) -> list[Divergence]:
        """Where each stock completion that differs from the reference first leaves it."""
        found = [
            first_divergence(
                self.stock.completions[name], self.reference.completions[name], name, self.atol
            )
            for name in sorted(self.stock_mismatches())
        ]
        return [d for d in found if d is not None]

    def guard_mismatches(self) -> dict[str, str]:
        return find_mismatches(self.guarded.completions, self.reference.completions, self.atol)

    @property
    def stock_diverges(self) -> bool:
        """Stock diverges where the layout says (A and C), and only there."""
        return set(self.stock_mismatches()) == {"A", "C"}

    @property
    def guard_matches(self) -> bool:
        return not self.guard_mismatches()

    def failed_checks(self) -> list[str]:
        """What the layout promises and did not happen (empty: the proof holds)."""
        block = LAYOUT.block_size
        runs = {"reference": self.reference, "stock": self.stock, "guarded": self.guarded}
        checks = {
            f"A preempted in the step that scheduled it ({name})": len(run.preempted) > 2
            and "A" in run.preempted[2]
            for name, run in runs.items()
        }
        checks.update(
            {
                "the guard in the guarded engine only": self.guarded.guard_applied
                and not self.stock.guard_applied,
                f"stock: C hits {9 * block} tokens (A's never-written block)": (
                    self.stock.num_cached_tokens.get("C") == 9 * block
                ),
                "stock: A and C differ from no prefix caching, B and D do not": (
                    self.stock_diverges
                ),
                f"guarded: C hits {8 * block} tokens (A's written blocks)": (
                    self.guarded.num_cached_tokens.get("C") == 8 * block
                ),
                "guarded: A's registrations rolled back": (
                    (self.guarded.guard_counters or {}).get("rolled_back_preempted", 0) > 0
                ),
                "guarded: every completion matches no prefix caching": self.guard_matches,
            }
        )
        return [name for name, held in checks.items() if not held]

    @property
    def ok(self) -> bool:
        return not self.failed_checks()

    def render(self) -> list[str]:
        """The report's lines (without the heading)."""
        block = LAYOUT.block_size
        stock_hit = self.stock.num_cached_tokens.get("C", 0)
        guard_hit = self.guarded.num_cached_tokens.get("C", 0)
        divergences = self.stock_divergences()
        lines = [
            f"  layout            A ({len(tokens(160, 1))} tokens) preempted in the step that "
            f"scheduled it; C arrives with A's prompt ({block}-token blocks)",
            f"  stock vLLM        C hits {stock_hit} tokens"
            + (
                f", block {stock_hit // block} that A never wrote;"
                if stock_hit > guard_hit
                else ";"
            )
            + f" {len(divergences)} of {len(REQUESTS)} completions differ from no prefix caching",
        ]
        lines += [f"                      {d.describe()}" for d in divergences]
        rolled_back = (self.guarded.guard_counters or {}).get("rolled_back_preempted", 0)
        mismatches = self.guard_mismatches()
        lines.append(
            f"  with the guard    C hits {guard_hit} tokens ({rolled_back} registrations rolled "
            "back); "
            + (
                f"all {len(REQUESTS)} completions within "
                f"{largest_gap(self.guarded.completions, self.reference.completions):.1e} "
                f"of no prefix caching (atol {self.atol:g})"
                if not mismatches
                else f"{len(mismatches)} completions differ: "
                + "; ".join(f"{k}: {v}" for k, v in mismatches.items())
            )
        )
        failed = self.failed_checks()
        lines.append(
            "  verdict           "
            + ("OK: stock read never-written KV, the guard did not" if not failed else "FAILED")
            + (f" ({self.seconds:.0f}s)" if self.seconds else "")
        )
        lines += [f"    not so: {name}" for name in failed]
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": self.reference.to_json(),
            "stock": self.stock.to_json(),
            "guarded": self.guarded.to_json(),
            "atol": self.atol,
            "seconds": self.seconds,
        }

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> EngineProof:
        return cls(
            reference=ScenarioRun.from_json(document["reference"]),
            stock=ScenarioRun.from_json(document["stock"]),
            guarded=ScenarioRun.from_json(document["guarded"]),
            atol=float(document["atol"]),
            seconds=float(document.get("seconds", 0.0)),
        )


def prove(
    model: Path,
    extra_engine_args: Mapping[str, Any] | None = None,
    atol: float = LOGPROB_ATOL,
) -> EngineProof:
    """The layout on three in-process engines, one after another: no prefix caching, stock,
    and guarded (the guard applied as vLLM applies it: ``register()`` with
    ``VLLM_PREFIX_GUARD=1``). The guard is off again when this returns."""
    import time

    started = time.monotonic()
    reference, stock, guarded = reference_stock_guarded(
        lambda prefix_caching: run_scenario(
            model, prefix_caching=prefix_caching, extra_engine_args=extra_engine_args
        )
    )
    return EngineProof(reference, stock, guarded, atol, time.monotonic() - started)


def _run_one(mode: str, model: Path, extra_engine_args: Mapping[str, Any]) -> ScenarioRun:
    """One engine in this fresh process, the guard (``guarded``) loaded by vLLM's own plugin
    loader from the environment, as in a server."""
    if mode == "guarded":
        os.environ["VLLM_PREFIX_GUARD"] = "1"
    else:
        os.environ.pop("VLLM_PREFIX_GUARD", None)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return run_scenario(
        model, prefix_caching=mode != "reference", extra_engine_args=extra_engine_args
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m guard_demo.engine_proof", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True, help="where to write the result")
    parser.add_argument(
        "--mode", choices=MODES, help="run this one engine only (default: all three)"
    )
    parser.add_argument(
        "--engine-args", type=json.loads, default={}, help="extra EngineArgs, as JSON"
    )
    parser.add_argument("--atol", type=float, default=LOGPROB_ATOL)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the layout sets the blocks
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.mode is not None:
        document = _run_one(args.mode, args.model_dir, args.engine_args).to_json()
        args.json.write_text(json.dumps(document))
        return 0
    proof = prove(args.model_dir, args.engine_args, args.atol)
    args.json.write_text(json.dumps(proof.to_json()))
    print("\n".join(proof.render()))
    return 0 if proof.ok else 1


if __name__ == "__main__":
    sys.exit(main())
