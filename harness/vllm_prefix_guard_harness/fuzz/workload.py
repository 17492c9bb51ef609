"""A workload: the scheduler to build and the timed events to feed it, as plain data.

Everything the fuzzer runs is a :class:`Workload`, so a run is reproducible from its
value alone (no RNG at run time), the shrinker can delete events from it, and a
shrunk one prints as Python a regression test can paste in (:meth:`Workload.to_python`).

Prompts are runs of consecutive token ids, ``((first, length), ...)``: a shared-prefix
family is one run every member repeats, and a reproducer stays a few lines long.
Block hashes depend only on token ids, so the ids need not be in the model's vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vllm_prefix_guard_harness.factory import SchedulerSpec

Runs = tuple[tuple[int, int], ...]


def expand(prompt: Runs) -> list[int]:
    """Token ids of a prompt given as runs ``(first, length)``."""
    return [token for first, length in prompt for token in range(first, first + length)]


def prompt_length(prompt: Runs) -> int:
    return sum(length for _, length in prompt)


@dataclass(frozen=True)
class Arrive:
    """``request_id`` is added before engine iteration ``step``.

    ``external_tokens``, ``fail_load``, ``failed_blocks`` and ``async_load_steps`` drive
    the fake KV connector (configurations with a ``kv_load_failure_policy``): the first
    ``external_tokens`` tokens are remotely available, and every load of this request
    fails: all of it, or, when ``failed_blocks`` names blocks of the prompt (by index),
    only theirs (the others load fine). With ``async_load_steps`` the load is
    asynchronous and the worker reports it done that many executed steps after it starts.
    """

    step: int
    request_id: str
    prompt: Runs
    max_tokens: int
    priority: int = 0
    external_tokens: int = 0
    fail_load: bool = False
    failed_blocks: tuple[int, ...] = ()
    async_load_steps: int = 0


@dataclass(frozen=True)
class Abort:
    """``request_id`` is aborted before iteration ``step``; the engine applies it just
    before the next ``update_from_output``, so with two steps in flight it lands while
    the request's later step is still running."""

    step: int
    request_id: str


@dataclass(frozen=True)
class Reset:
    """``reset_prefix_cache`` is called before iteration ``step``; with
    ``running=True`` every running request is preempted first."""

    step: int
    running: bool = True


@dataclass(frozen=True)
class Fault:
    """A fault in the engine loop before iteration ``step``, as vLLM's fault tolerance
    (``--enable-fault-tolerance``) handles it: the steps in flight never run,
    ``on_fault`` finishes every request, and the drain feeds the scheduler an empty
    output; the engine then serves new requests, and clients send the aborted ones again
    (the runner adds them, under new IDs, in the same iteration)."""

    step: int


Event = Arrive | Abort | Reset | Fault

# Arrivals first within a step, so an abort, reset or fault in the same step sees them.
_ORDER = {Arrive: 0, Abort: 1, Reset: 2, Fault: 3}


def _spec_overrides(spec: SchedulerSpec) -> dict[str, Any]:
    default = SchedulerSpec()
    return {
        f.name: getattr(spec, f.name)
        for f in dataclasses.fields(spec)
        if getattr(spec, f.name) != getattr(default, f.name)
    }


@dataclass(frozen=True)
class Workload:
    """A scheduler (``spec``), how many steps it keeps in flight (``depth``), and events.

    ``depth=2`` is ``EngineCore.step_with_batch_queue`` under async scheduling: the
    next ``schedule()`` runs before the previous step's ``update_from_output``.
    """

    spec: SchedulerSpec
    depth: int = 1
    events: tuple[Event, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.events, key=lambda e: (e.step, _ORDER[type(e)])))
        object.__setattr__(self, "events", ordered)

    @property
    def arrivals(self) -> list[Arrive]:
        return [e for e in self.events if isinstance(e, Arrive)]

    @property
    def last_step(self) -> int:
        return self.events[-1].step if self.events else 0

    def replace(self, events: tuple[Event, ...] | list[Event]) -> Workload:
        return dataclasses.replace(self, events=tuple(events))

    def with_consistent_events(self) -> Workload:
        """Drop aborts of requests that never arrive (the shrinker removes arrivals)."""
        arrived = {e.request_id for e in self.events if isinstance(e, Arrive)}
        return self.replace(
            [e for e in self.events if not isinstance(e, Abort) or e.request_id in arrived]
        )

    # -- serialisation -----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": _spec_overrides(self.spec),
            "depth": self.depth,
            "events": [{"type": type(e).__name__, **dataclasses.asdict(e)} for e in self.events],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        kinds: dict[str, type[Arrive] | type[Abort] | type[Reset] | type[Fault]] = {
            "Arrive": Arrive,
            "Abort": Abort,
            "Reset": Reset,
            "Fault": Fault,
        }
        events: list[Event] = []
        for raw in data["events"]:
            fields = {k: v for k, v in raw.items() if k != "type"}
            if "prompt" in fields:
                fields["prompt"] = tuple(tuple(run) for run in fields["prompt"])
            if "failed_blocks" in fields:
                fields["failed_blocks"] = tuple(fields["failed_blocks"])
            events.append(kinds[raw["type"]](**fields))
        return cls(SchedulerSpec(**data["spec"]), data["depth"], tuple(events))

    def to_python(self, name: str = "WORKLOAD") -> str:
        """Source for this workload, importing only what it uses; a test can paste it."""
        spec_args = ", ".join(f"{k}={v!r}" for k, v in _spec_overrides(self.spec).items())
        used = sorted({type(e).__name__ for e in self.events})
        lines = [
            "from vllm_prefix_guard_harness.fuzz.workload import " + ", ".join([*used, "Workload"]),
            "from vllm_prefix_guard_harness.factory import SchedulerSpec",
            "",
            f"{name} = Workload(",
            f"    spec=SchedulerSpec({spec_args}),",
            f"    depth={self.depth},",
            "    events=(",
        ]
        lines += [f"        {_event_source(e)}," for e in self.events]
        lines += ["    ),", ")"]
        return "\n".join(lines)


def _event_source(event: Event) -> str:
    defaults = {f.name: f.default for f in dataclasses.fields(event)}
    args = []
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        if f.name in ("step", "request_id"):
            args.append(repr(value))
        elif value != defaults[f.name] or f.default is dataclasses.MISSING:
            args.append(f"{f.name}={value!r}")
    return f"{type(event).__name__}({', '.join(args)})"
