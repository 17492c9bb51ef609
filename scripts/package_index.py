"""Find and download one file of a project from the package indexes pip is configured
with, without building anything (the sdists this project's tests use cannot be built, or
even ``pip download``ed, on a CPU-only machine). Shared by ``fetch_kvcached.py`` and
``fetch_vllm_tests.py``.

1. index URLs come from pip's own configuration, in pip's order: ``PIP_INDEX_URL``
   (else ``index-url`` from ``pip config list``: the ``download`` section, then
   ``global``; else pip's built-in default, read from pip itself), then the
   ``extra-index-url`` entries found the same way. No index host is named here.
2. each index is asked for the project page through the PEP 691 JSON simple API.
   ``file://`` indexes cannot negotiate content types, so for them
   ``<project>/index.json`` is read if present, else the PEP 503 ``index.html`` is
   parsed. An index that lacks the project or the file is skipped and the next one asked.

Standard library only (plus pip, for its configuration and default index URL).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

PEP691_JSON = "application/vnd.pypi.simple.v1+json"
ACCEPT = f"{PEP691_JSON}, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"
TIMEOUT_S = 120
#: Written into a destination after a verified unpack: the sha256 of its archive.
MARKER = ".sdist-sha256"


class NotOnIndex(Exception):
    """This index does not have the project or the wanted file."""


# -- where to look -------------------------------------------------------------------


@functools.cache
def pip_config() -> dict[str, str]:
    """pip's merged configuration, as ``pip config list`` prints it (``section.key``).

    ``pip config list`` merges every file (global, user, site, ``PIP_CONFIG_FILE``) and
    the ``PIP_*`` variables (as ``:env:.key``) in pip's own override order. ``pip config
    get KEY`` is not used: without ``--global/--user/--site`` it reads only the user (or
    site) file, so an index set in a system-wide file or in PIP_CONFIG_FILE is missed.
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
    """pip's precedence for an option: environment, then the ``download`` section, then
    ``global`` (the command-specific section beats ``global``, the environment beats both)."""
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
    except Exception:  # pragma: no cover - pip layout changed: ask pip's CLI instead
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "index", "--help"],
            capture_output=True,
            text=True,
            check=True,
        )
        for line in proc.stdout.splitlines():
            if "(default" in line and "simple" in line:
                return line.split("(default", 1)[1].split()[0].rstrip(").")
        raise SystemExit("cannot read pip's default index URL") from None


def ssl_context() -> ssl.SSLContext:
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


_SSL: list[ssl.SSLContext] = []


def _context() -> ssl.SSLContext:
    if not _SSL:
        _SSL.append(ssl_context())
    return _SSL[0]


# -- reading one index ---------------------------------------------------------------


def _normalize(name: str) -> str:
    """PEP 503 project-name normalisation."""
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def _project_url(index: str, project: str) -> str:
    return index.rstrip("/") + "/" + _normalize(project) + "/"


class _Links(HTMLParser):
    """PEP 503 anchors -> PEP 691-shaped file entries."""

    def __init__(self) -> None:
        super().__init__()
        self.files: list[dict] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag != "a":
            return
        href = dict(attrs).get("href")
        if not href:
            return
        url, _, fragment = href.partition("#")
        hashes = {}
        if "=" in fragment:
            algo, _, digest = fragment.partition("=")
            hashes[algo] = digest
        filename = urllib.parse.unquote(url.rsplit("/", 1)[-1])
        self.files.append({"filename": filename, "url": url, "hashes": hashes})


def project_files(index: str, project: str) -> tuple[list[dict], str, str]:
    """The project's file entries on ``index``, the page URL, and the format read.

    Raises:
        NotOnIndex: the index has no page for the project.
    """
    page = _project_url(index, project)
    scheme = urllib.parse.urlsplit(page).scheme
    if scheme == "file":
        directory = Path(urllib.request.url2pathname(urllib.parse.urlsplit(page).path))
        if (directory / "index.json").is_file():
            data = json.loads((directory / "index.json").read_text())
            return data["files"], page, "PEP 691 JSON (index.json)"
        if (directory / "index.html").is_file():
            parser = _Links()
            parser.feed((directory / "index.html").read_text())
            return parser.files, page, "PEP 503 HTML (file index, no content negotiation)"
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


def find_file(project: str, filename: str) -> tuple[str, dict, str, str]:
    """``(download URL, file entry, index URL, format)`` from the first index that has
    ``project``'s ``filename``."""
    misses = []
    for index, why in index_urls():
        try:
            files, page, fmt = project_files(index, project)
        except (NotOnIndex, urllib.error.URLError, OSError) as exc:
            misses.append(f"{index} ({why}): {exc}")
            continue
        entry = next((f for f in files if f["filename"] == filename), None)
        if entry is None:
            misses.append(f"{index} ({why}): project page has no {filename}")
            continue
        url = urllib.parse.urljoin(page, entry["url"])
        print(f"found {filename} on {index} ({why}) via {fmt}", file=sys.stderr)
        for miss in misses:
            print(f"  skipped: {miss}", file=sys.stderr)
        return url, entry, index, fmt
    raise SystemExit(f"{filename} is on no configured index:\n  " + "\n  ".join(misses))


# -- download ------------------------------------------------------------------------


def download(url: str, dest: Path) -> str:
    """Stream ``url`` to ``dest``; return its sha256."""
    digest = hashlib.sha256()
    opener = urllib.request.urlopen(url, timeout=TIMEOUT_S, context=_context())
    with opener as response, dest.open("wb") as out:
        while chunk := response.read(1 << 16):
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def unpacked_digest(dest: Path) -> str | None:
    """The digest ``dest`` was unpacked from by this script, if it was."""
    try:
        return (dest / MARKER).read_text().strip()
    except OSError:
        return None
