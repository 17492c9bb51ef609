"""Pin Python's hash seed, without which a fuzz run is not a function of its seed.

vLLM's scheduler iterates sets of request ids and block hashes, whose order follows
``PYTHONHASHSEED``: measured on vLLM 0.32, priority-phased-async seed 10 (stock, no
guard) preempts 1328 or 1366 times depending on the process. A fuzz entry point
therefore re-executes itself under a fixed seed unless the caller already fixed one.
"""

from __future__ import annotations

import os
import sys

DEFAULT_HASH_SEED = "0"


def current_hash_seed() -> str:
    """``PYTHONHASHSEED`` as this process has it (``random`` when unset)."""
    return os.environ.get("PYTHONHASHSEED", "random")


def hash_seed_is_fixed() -> bool:
    return current_hash_seed() != "random"


def reexec_with_fixed_hash_seed() -> None:
    """Return if the hash seed is fixed; otherwise restart this process with seed 0."""
    if hash_seed_is_fixed():
        return
    os.environ["PYTHONHASHSEED"] = DEFAULT_HASH_SEED
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
