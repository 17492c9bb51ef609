"""``scripts/fetch_kvcached.py``: kvcached's sdist found through pip's configuration, verified
against a pinned digest, unpacked once. Offline: each test builds ``file://`` indexes
(PEP 691 JSON and PEP 503 HTML) holding a small stand-in archive, pinned with
``--sha256``; pip reads no configuration but the test's own (``HOME`` is the test's)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fetch_kvcached.py"
NAME = "kvcached-0.1.6.tar.gz"


def archive(path: Path, members: dict[str, str] | None = None) -> str:
    """A stand-in sdist at ``path``; returns its sha256."""
    members = members or {
        "kvcached-0.1.6/PKG-INFO": "Metadata-Version: 2.1\nName: kvcached\nVersion: 0.1.6\n",
        "kvcached-0.1.6/kvcached/__init__.py": "",
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buffer.getvalue())
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def index(root: Path, fmt: str, sdist: Path | None) -> str:
    """A ``file://`` simple index at ``root`` holding ``sdist`` (or lacking the project)."""
    simple = root / "simple"
    simple.mkdir(parents=True)
    if sdist is None:
        return simple.as_uri()
    files = root / "files"
    files.mkdir()
    (files / NAME).write_bytes(sdist.read_bytes())
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    project = simple / "kvcached"
    project.mkdir()
    url = f"../../files/{NAME}"
    if fmt == "json":
        page = {
            "meta": {"api-version": "1.0"},
            "name": "kvcached",
            "files": [{"filename": NAME, "url": url, "hashes": {"sha256": digest}}],
        }
        (project / "index.json").write_text(json.dumps(page))
    else:
        (project / "index.html").write_text(
            f'<html><body><a href="{url}#sha256={digest}">{NAME}</a></body></html>'
        )
    return simple.as_uri()


@pytest.fixture
def sdist(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / NAME
    return path, archive(path)


def fetch(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run the script with only this test's pip configuration."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    base.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "xdg"), **env)
    base.setdefault("PIP_CONFIG_FILE", os.devnull)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=base,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize("fmt", ["json", "html"])
def test_falls_back_from_an_index_without_the_project(
    tmp_path: Path, sdist: tuple[Path, str], fmt: str
) -> None:
    path, digest = sdist
    empty = index(tmp_path / "empty", fmt, None)
    good = index(tmp_path / "good", fmt, path)
    out = tmp_path / "out"
    proc = fetch(
        tmp_path, str(out), "--sha256", digest, PIP_INDEX_URL=empty, PIP_EXTRA_INDEX_URL=good
    )
    assert proc.returncode == 0, proc.stderr
    assert f"skipped: {empty}" in proc.stderr
    assert ("PEP 691 JSON" if fmt == "json" else "PEP 503 HTML") in proc.stderr
    assert "Version: 0.1.6" in (out / "PKG-INFO").read_text()
    assert (out / ".sdist-sha256").read_text().strip() == digest
    assert proc.stdout.strip() == str(out)


def test_a_second_run_fetches_nothing(tmp_path: Path, sdist: tuple[Path, str]) -> None:
    path, digest = sdist
    out = tmp_path / "out"
    good = index(tmp_path / "good", "json", path)
    assert fetch(tmp_path, str(out), "--sha256", digest, PIP_INDEX_URL=good).returncode == 0
    (out / "kvcached" / "local-edit").write_text("kept")
    nowhere = (tmp_path / "nowhere").as_uri()
    proc = fetch(tmp_path, str(out), "--sha256", digest, PIP_INDEX_URL=nowhere)
    assert proc.returncode == 0, proc.stderr
    assert "already unpacked" in proc.stderr
    assert (out / "kvcached" / "local-edit").exists()  # not unpacked again


def test_a_directory_from_another_archive_is_replaced(
    tmp_path: Path, sdist: tuple[Path, str]
) -> None:
    path, digest = sdist
    out = tmp_path / "out"
    out.mkdir()
    (out / ".sdist-sha256").write_text("0" * 64)
    (out / "stale").write_text("from another archive")
    good = index(tmp_path / "good", "html", path)
    proc = fetch(tmp_path, str(out), "--sha256", digest, PIP_INDEX_URL=good)
    assert proc.returncode == 0, proc.stderr
    assert not (out / "stale").exists() and (out / "PKG-INFO").exists()


def test_wrong_pin_is_refused_and_nothing_unpacked(tmp_path: Path, sdist: tuple[Path, str]) -> None:
    path, _ = sdist
    good = index(tmp_path / "good", "json", path)
    proc = fetch(tmp_path, str(tmp_path / "out"), "--sha256", "0" * 64, PIP_INDEX_URL=good)
    assert proc.returncode != 0
    assert "sha256" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_an_archive_escaping_its_directory_is_refused(tmp_path: Path) -> None:
    path = tmp_path / NAME
    digest = archive(path, {"kvcached-0.1.6/PKG-INFO": "x", "../escaped": "x"})
    good = index(tmp_path / "good", "json", path)
    proc = fetch(tmp_path, str(tmp_path / "out" / "src"), "--sha256", digest, PIP_INDEX_URL=good)
    assert proc.returncode != 0 and "cannot unpack" in proc.stderr
    assert not (tmp_path / "out" / "escaped").exists() and not (tmp_path / "escaped").exists()


def test_no_index_has_it(tmp_path: Path, sdist: tuple[Path, str]) -> None:
    empty = index(tmp_path / "empty", "json", None)
    proc = fetch(tmp_path, str(tmp_path / "out"), PIP_INDEX_URL=empty, PIP_EXTRA_INDEX_URL=empty)
    assert proc.returncode != 0
    assert "is on no configured index" in proc.stderr


def test_index_order_follows_pip_environment(tmp_path: Path) -> None:
    proc = fetch(
        tmp_path,
        "--list-indexes",
        PIP_INDEX_URL="file:///a",
        PIP_EXTRA_INDEX_URL="file:///b file:///c file:///a",
    )
    assert proc.returncode == 0, proc.stderr
    urls = [line.split("\t")[0] for line in proc.stdout.splitlines()]
    assert urls == ["file:///a", "file:///b", "file:///c"]


def test_indexes_come_from_pip_config_file(tmp_path: Path, sdist: tuple[Path, str]) -> None:
    path, digest = sdist
    empty = index(tmp_path / "empty", "html", None)
    good = index(tmp_path / "good", "html", path)
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nindex-url = {empty}\nextra-index-url = {good}\n")
    proc = fetch(tmp_path, str(tmp_path / "out"), "--sha256", digest, PIP_CONFIG_FILE=str(conf))
    assert proc.returncode == 0, proc.stderr
    assert f"on {good} (pip config global.extra-index-url)" in proc.stderr


def test_without_configuration_pip_default_index_is_first(tmp_path: Path) -> None:
    """No index configured: pip's own default (read from pip, not written in the script)."""
    proc = fetch(tmp_path, "--list-indexes")
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.endswith("\tpip's built-in default") and first.startswith("https://")
