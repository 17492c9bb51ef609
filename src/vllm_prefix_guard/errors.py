"""The guard's errors: a bad setting, and a vLLM (or pool) the guard cannot vouch for.

Both abort engine start-up when raised from the plugin entry point: an enabled guard
that cannot apply fails loudly instead of running unguarded.
"""

from __future__ import annotations


class GuardConfigError(SystemExit):
    """A guard setting (an environment variable) holds a value that is not understood.

    A ``SystemExit``: the plugin entry point runs at process start, where an operator's
    typo deserves one clear line, not a traceback through vLLM's plugin loader. Uncaught, it
    ends the process with its message alone (exit status 1); ``doctor`` and tests catch it
    by name.
    """

    def __init__(self, message: str) -> None:
        super().__init__(f"vllm-prefix-guard: {message}")
        self.message = message

    def __str__(self) -> str:
        return self.message


class GuardUnsupportedError(RuntimeError):
    """The installed vLLM, or a pool replacing vLLM's, lacks an internal the guard needs."""
