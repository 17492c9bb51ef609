"""Helpers of the kvcached tests: where kvcached's source is, whether kvcached admits the
installed vLLM, the scenario subprocesses (one per load order, cached for the session)
and the interpreter a kvcached install starts. Never imports kvcached in this process."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FETCH_HINT = (
    "set KVCACHED_SRC to the directory python scripts/fetch_kvcached.py .nox/kvcached-0.1.6 "
    "unpacks it into (nox -s kvcached-vllm-0.30 does both)"
)
#: kvcached 0.1.6's engine check admits every vLLM below this one (the gate starts here).
GATED_FROM = "0.29.0"


def kvcached_src() -> Path | None:
    src = os.environ.get("KVCACHED_SRC")
    if not src:
        return None
    path = Path(src).resolve()
    return path if (path / "kvcached" / "integration" / "vllm" / "patches.py").is_file() else None


def engine_window(src: Path) -> str:
    """kvcached's stated Model Runner V2 window, read from its source (not imported)."""
    text = (src / "kvcached" / "integration" / "vllm" / "patches.py").read_text()
    match = re.search(r'^VLLM_MRV2_RANGE\s*=\s*"([^"]+)"', text, re.MULTILINE)
    assert match, "kvcached's patches.py no longer states VLLM_MRV2_RANGE"
    return match.group(1)


def vllm_admitted(src: Path) -> bool:
    """Whether kvcached's engine check admits the installed vLLM."""
    import vllm
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    version = Version(vllm.__version__)
    return version < Version(GATED_FROM) or version in SpecifierSet(engine_window(src))


def skip_reason() -> str | None:
    src = kvcached_src()
    if src is None:
        return f"kvcached's source is not available: {FETCH_HINT}"
    missing = [m for m in ("wrapt", "posix_ipc") if importlib.util.find_spec(m) is None]
    if missing:
        return f"kvcached needs {', '.join(missing)} (pip install wrapt posix_ipc)"
    import vllm
    from packaging.version import Version

    if Version(vllm.__version__) < Version(GATED_FROM):
        return f"vLLM {vllm.__version__}: the kvcached tests cover vLLM {GATED_FROM} and later"
    return None


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment, the repository's ``src``, this directory and ``tests/`` first on the path,
    kvcached's switches cleared (each scenario sets its own), quiet logs."""
    env = dict(os.environ)
    for name in ("ENABLE_KVCACHED", "KVCACHED_AUTOPATCH", "VLLM_PREFIX_GUARD", "VLLM_PLUGINS"):
        env.pop(name, None)
    path = [
        str(ROOT / "src"),
        str(HERE),
        str(HERE.parent),  # tests/: the layouts the regression tests share
        *filter(None, env.get("PYTHONPATH", "").split(os.pathsep)),
    ]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["KVCACHED_SRC"] = str(kvcached_src())
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("PYTHONHASHSEED", "0")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("KVCACHED_LOG_LEVEL", "WARNING")
    env.update(extra)
    return env


#: Orders whose interpreter starts the way a kvcached install starts one: its
#: ``kvcached_autopatch.pth`` runs at start-up and kvcached patches vLLM on ``import vllm``.
INSTALLED_ORDERS = ("kvcached_first", "vllm_pool")


def installed_boot(tmp: Path) -> Path:
    """A ``sitecustomize`` that adds a site directory holding kvcached's own ``.pth``
    (site directories run their ``.pth`` files; ``PYTHONPATH`` entries do not)."""
    src = kvcached_src()
    assert src is not None
    site_dir = tmp / "site"
    site_dir.mkdir()
    shutil.copy(src / "kvcached_autopatch.pth", site_dir)
    boot = tmp / "boot"
    boot.mkdir()
    (boot / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site_dir)!r})\n")
    return boot


@functools.cache
def scenarios(order: str) -> dict[str, Any]:
    """Every scenario of one load order, run once per session in its own interpreter."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvcached-boot-") as tmp:
        env = subprocess_env()
        if order in INSTALLED_ORDERS:
            env.update(ENABLE_KVCACHED="1", VLLM_PREFIX_GUARD="1")
            boot = installed_boot(Path(tmp))
            env["PYTHONPATH"] = os.pathsep.join([str(boot), env["PYTHONPATH"], str(kvcached_src())])
        proc = subprocess.run(
            [sys.executable, "-m", "scenarios", order],
            capture_output=True,
            text=True,
            env=env,
            cwd=HERE,
            timeout=600,
            check=False,
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    return result
