"""Live processes, read from ``/proc``: which ones a server left behind, and waiting them out.

vLLM only runs on Linux, so ``/proc`` is always there; reading it needs no extra dependency.
"""

from __future__ import annotations

import time
from pathlib import Path

__all__ = ["live_pids", "wait_group_gone"]

_PROC = Path("/proc")


def live_pids(
    *, process_group: int | None = None, cmdline_contains: str | None = None
) -> list[int]:
    """Live (not zombie) processes, only those of ``process_group`` and whose command line
    contains ``cmdline_contains`` when these are given.

    A process that exits while we look is skipped.
    """
    pids = []
    for stat in _PROC.glob("[0-9]*/stat"):
        try:
            # The command name in parentheses may contain spaces; the fields after it may not.
            fields = stat.read_text().rpartition(")")[2].split()
            state, pgid = fields[0], int(fields[2])
            if state == "Z" or (process_group is not None and pgid != process_group):
                continue
            if cmdline_contains is not None:
                cmdline = (stat.parent / "cmdline").read_bytes()
                if cmdline_contains.encode() not in cmdline:
                    continue
        except OSError:
            continue
        pids.append(int(stat.parent.name))
    return pids


def wait_group_gone(pgid: int, timeout_s: float) -> None:
    """Wait until no live (non-zombie) process is left in group ``pgid``.

    SIGKILL is asynchronous; callers that check for leaked processes or reuse the port right
    after stopping a server need the group to be gone, not just signalled.
    """
    deadline = time.monotonic() + timeout_s
    while live_pids(process_group=pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
