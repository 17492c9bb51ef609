"""The vLLM-suite harness itself: the sdist fetcher, the Hub cache, the comparison.

Fast and offline (no vLLM sdist, no index): a fake sdist behind a ``file://`` index.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli before Python 3.11
    import tomli as tomllib

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

import run_vllm_suite  # noqa: E402
from hub_cache import MODEL_CONFIGS, write_hub_cache  # noqa: E402


def load_fetcher():
    spec = importlib.util.spec_from_file_location(
        "fetch_vllm_tests", ROOT / "scripts" / "fetch_vllm_tests.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_sdist(path: Path, version: str) -> str:
    """A vllm-VERSION.tar.gz with tests/, pyproject.toml and a file outside both."""
    with tarfile.open(path, "w:gz") as tar:
        for name, text in {
            "tests/__init__.py": "",
            "tests/v1/core/test_x.py": "def test_x():\n    pass\n",
            "pyproject.toml": "[tool.pytest.ini_options]\n",
            "vllm/__init__.py": "raise SystemExit('not extracted')\n",
            "setup.py": "",
        }.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def file_index(tmp_path: Path, version: str) -> tuple[Path, str]:
    """A PEP 503 ``file://`` index holding only the fake sdist; (index dir, digest)."""
    (tmp_path / "files").mkdir()
    digest = fake_sdist(tmp_path / "files" / f"vllm-{version}.tar.gz", version)
    page = tmp_path / "simple" / "vllm"
    page.mkdir(parents=True)
    page.joinpath("index.html").write_text(
        f'<a href="../../files/vllm-{version}.tar.gz#sha256={digest}">vllm-{version}.tar.gz</a>'
    )
    return tmp_path / "simple", digest


def test_fetcher_reads_a_file_index_verifies_and_extracts_tests_only(tmp_path: Path) -> None:
    index, digest = file_index(tmp_path, "9.9.9")
    dest = tmp_path / "out"
    env = {**os.environ, "PIP_INDEX_URL": index.as_uri(), "PIP_EXTRA_INDEX_URL": ""}
    script = str(ROOT / "scripts" / "fetch_vllm_tests.py")
    run = [sys.executable, script, "9.9.9", str(dest), "--sha256", digest]
    proc = subprocess.run(run, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "PEP 503 HTML (file index" in proc.stderr
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
        ".sdist-sha256",
        "pyproject.toml",
        "tests/__init__.py",
        "tests/v1/core/test_x.py",
    ]
    bad = subprocess.run(
        [*run[:-1], "0" * 64], env=env, capture_output=True, text=True, check=False
    )
    assert bad.returncode != 0 and "pinned" in bad.stderr


def checked_versions() -> set[str]:
    """Every vLLM version some selection of selection.toml was run on."""
    selections = tomllib.loads((HERE / "selection.toml").read_text())
    return {v for selection in selections.values() for v in selection["versions"]}


def test_fetcher_pins_every_supported_version() -> None:
    fetcher = load_fetcher()
    assert checked_versions() <= set(fetcher.SHA256)
    assert all(len(d) == 64 for d in fetcher.SHA256.values())


def test_selections_are_well_formed() -> None:
    selections = tomllib.loads((HERE / "selection.toml").read_text())
    assert {"full", "ci"} <= set(selections)
    for name, selection in selections.items():
        files = selection["files"]
        assert files and len(set(files)) == len(files), name
        assert all(f.startswith("tests/v1/") and f.endswith(".py") for f in files), name
    # The fast representative is a part of the regression net, on a version it ran on.
    assert set(selections["ci"]["files"]) <= set(selections["full"]["files"])
    assert set(selections["ci"]["versions"]) <= set(selections["full"]["versions"])
    with pytest.raises(SystemExit, match=r"not run on vLLM 0\.0\.1"):
        run_vllm_suite.load_selection("full", "0.0.1")


def test_fetcher_is_idempotent_offline(tmp_path: Path) -> None:
    """A DEST already extracted from the pinned archive is kept: no index is asked."""
    index, digest = file_index(tmp_path, "9.9.9")
    dest = tmp_path / "out"
    script = str(ROOT / "scripts" / "fetch_vllm_tests.py")
    run = [sys.executable, script, "9.9.9", str(dest), "--sha256", digest]
    env = {**os.environ, "PIP_INDEX_URL": index.as_uri(), "PIP_EXTRA_INDEX_URL": ""}
    subprocess.run(run, env=env, capture_output=True, text=True, check=True)
    gone = {**env, "PIP_INDEX_URL": (tmp_path / "nowhere").as_uri()}
    again = subprocess.run(run, env=gone, capture_output=True, text=True, check=False)
    assert again.returncode == 0 and "already in" in again.stderr, again.stderr


def test_fetcher_index_order_follows_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    fetcher = load_fetcher()
    index = sys.modules["package_index"]  # what the fetcher looks indexes up with
    monkeypatch.setattr(index, "pip_config", lambda: {"global.extra-index-url": "file:///b"})
    # pip's built-in default is read from pip's internals: not imported into this process
    # (pip imports distutils, which breaks setuptools' import in later tests).
    monkeypatch.setattr(index, "_pip_default_index", lambda: "file:///default")
    monkeypatch.setenv("PIP_INDEX_URL", "file:///a")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    assert [u for u, _ in fetcher.index_urls()] == ["file:///a", "file:///b"]
    monkeypatch.delenv("PIP_INDEX_URL")
    assert [u for u, _ in fetcher.index_urls()] == ["file:///default", "file:///b"]


def test_fetcher_reads_pips_default_index() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no index-url from any configuration file
    script = str(ROOT / "scripts" / "fetch_vllm_tests.py")
    proc = subprocess.run(
        [sys.executable, script, "--list-indexes"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    url, _, why = proc.stdout.splitlines()[0].partition("\t")
    assert url.startswith("https://") and why == "pip's built-in default"


def test_hub_cache_resolves_offline(tmp_path: Path) -> None:
    huggingface_hub = pytest.importorskip("huggingface_hub")
    hub = write_hub_cache(tmp_path)
    for model_id in MODEL_CONFIGS:
        path = huggingface_hub.try_to_load_from_cache(model_id, "config.json", cache_dir=hub)
        assert isinstance(path, str) and Path(path).is_file(), model_id


def test_expected_differences_are_complete() -> None:
    data = tomllib.loads((HERE / "expected_differences.toml").read_text())
    versions = checked_versions()
    for entry in data["difference"]:
        assert set(entry) == {"versions", "test", "reason", "hazard_test"}, entry
        assert set(entry["versions"]) <= versions
        assert entry["reason"].strip()
        path, _, name = entry["hazard_test"].partition("::")
        assert f"def {name}(" in (ROOT / path).read_text(), entry["hazard_test"]


def test_comparison_accepts_only_stock_failures_and_listed_differences() -> None:
    expected = [{"test": "t.py::listed", "reason": "why", "versions": ["1"]}]
    stock = {
        "t.py::ok": "passed",
        "t.py::broken": "failed",
        "t.py::listed[a]": "passed",
        "t.py::skip": "skipped",
    }
    guard = {
        "t.py::ok": "passed",
        "t.py::broken": "error",
        "t.py::listed[a]": "failed",
        "t.py::skip": "failed",
    }
    diff = run_vllm_suite.compare(stock, guard, expected)
    assert [u[0] for u in diff["unexpected"]] == ["t.py::skip"]
    assert diff["fixed"] == [] and diff["only_stock"] == []
    assert [j[0] for j in diff["justified"]] == ["t.py::listed[a]"]
    assert diff["stale"] == []
    clean = run_vllm_suite.compare(stock, stock, expected)
    assert clean["unexpected"] == clean["justified"] == [] and clean["stale"] == expected


def test_comparison_rejects_a_pass_that_is_skipped_or_lost_guarded() -> None:
    stock = {"t.py::a": "passed", "t.py::b": "passed", "t.py::c": "failed", "t.py::d": "skipped"}
    guard = {"t.py::a": "skipped", "t.py::c": "passed", "t.py::d": "passed", "t.py::e": "error"}
    diff = run_vllm_suite.compare(stock, guard, [])
    assert [(u[0], u[1], u[2]) for u in diff["unexpected"]] == [
        ("t.py::a", "passed", "skipped"),
        ("t.py::b", "passed", "missing"),
        ("t.py::e", "missing", "error"),
    ]
    assert diff["fixed"] == ["t.py::c"] and diff["only_stock"] == ["t.py::b"]
