"""``vllm-prefix-guard-harness fuzz|explore``: the repository's proofs, from a shell."""

from __future__ import annotations

import os
import sys

USAGE = """usage: vllm-prefix-guard-harness {fuzz,explore} ...

  fuzz     differential fuzzing against the installed vLLM (fuzz --help)
  explore  bounded-exhaustive exploration of the rules (explore --help)
"""


def main(argv: list[str] | None = None) -> int:
    """Each command has its own parser; ``reexec`` (a real command line) lets it restart
    under a fixed ``PYTHONHASHSEED``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["fuzz"]:
        from vllm_prefix_guard_harness.fuzz.cli import main as fuzz_main

        return fuzz_main(arguments[1:], reexec=argv is None)
    if arguments[:1] == ["explore"]:
        from vllm_prefix_guard_harness.explore.cli import main as explore_main

        return explore_main(arguments[1:], reexec=argv is None)
    asked = arguments[:1] in (["-h"], ["--help"])
    print(USAGE, file=sys.stdout if asked else sys.stderr)
    return 0 if asked else 2
