"""What every benchmark records about its run, and how it writes its JSON document.

Shared by ``scheduler_bench.py``, ``instructions.py`` and ``engine_bench.py`` (run as
scripts, so this folder is on ``sys.path``); ``report.py`` reads what they write.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from vllm_prefix_guard_harness.records import portable_path


def environment(vllm_version: str) -> dict[str, Any]:
    """The machine and load a figure was measured under, so results can be compared."""
    return {
        "vllm": vllm_version,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "executable": portable_path(sys.executable),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_document(out: Path | None, document: dict[str, Any]) -> None:
    """Write ``document`` to ``out`` (if given) and say where, with its run time."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {out} ({document['seconds']} s)")
