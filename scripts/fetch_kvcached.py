#!/usr/bin/env python3
"""Fetch, verify and unpack kvcached's source distribution, without building it.

kvcached's ``setup.py`` imports torch and asks it for CUDA/HIP at module level, so even
``pip download`` (which prepares metadata) fails on a CPU-only machine. The project's
kvcached tests only need the unpacked source, so this script talks to the package index
directly:

1. index URLs come from pip's own configuration, in pip's order: ``PIP_INDEX_URL``
   (else ``index-url`` from ``pip config list``: the ``download`` section, then
   ``global``; else pip's built-in default, read from pip itself), then the
   ``extra-index-url`` entries found the same way. No index host is named here.
2. each index is asked for the project page through the PEP 691 JSON simple API
   (``Accept: application/vnd.pypi.simple.v1+json``). ``file://`` indexes cannot
   negotiate content types, so for them ``<project>/index.json`` is read if present,
   else the PEP 503 ``index.html`` is parsed. An index that lacks the project (404,
   missing directory) or the file is skipped and the next one is asked.
3. the file is downloaded, its sha256 compared with the pinned digest (and with the
   index's own ``hashes`` entry when it gives one), and it is unpacked with tarfile's
   ``data`` filter into ``DEST``, which then holds ``.sdist-sha256``.

Idempotent: when ``DEST/.sdist-sha256`` already holds the pinned digest, nothing is
fetched (no network). Any other ``DEST`` is replaced.

Usage:
    python scripts/fetch_kvcached.py DEST [--keep-archive PATH] [--version V --sha256 HEX]
    python scripts/fetch_kvcached.py --list-indexes

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
    unpacked_digest,
)

PROJECT = "kvcached"
VERSION = "0.1.6"
# Digest of kvcached-0.1.6.tar.gz as published (recorded on first fetch, checked since).
SHA256 = "4a1a428244b5e3667841e28f03a4a20be7066a21a856b2deaef727e18f845068"


def unpack(archive: Path, target: Path, digest: str) -> Path:
    """Extract ``archive`` into ``target`` (replaced if present), mark it with ``digest``."""
    staging = Path(tempfile.mkdtemp(prefix="kvcached-unpack-", dir=target.parent))
    try:
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(staging, filter="data")
            else:  # pragma: no cover - Python without PEP 706
                for member in tar.getmembers():
                    resolved = (staging / member.name).resolve()
                    if not resolved.is_relative_to(staging.resolve()) or member.issym():
                        raise SystemExit(f"refusing to extract {member.name}")
                tar.extractall(staging)
        roots = list(staging.iterdir())
        root = roots[0] if len(roots) == 1 and roots[0].is_dir() else staging
        (root / MARKER).write_text(digest + "\n")
        if target.exists():
            shutil.rmtree(target)
        shutil.move(str(root), str(target))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("dest", type=Path, nargs="?", help="directory to unpack the sdist into")
    parser.add_argument("--version", default=VERSION)
    parser.add_argument("--sha256", default=SHA256, help="expected digest of the sdist")
    parser.add_argument("--keep-archive", type=Path, help="also keep the .tar.gz here")
    parser.add_argument(
        "--list-indexes", action="store_true", help="print the indexes pip is configured with"
    )
    args = parser.parse_args(argv)
    if args.list_indexes:
        for url, why in index_urls():
            print(f"{url}\t{why}")
        return 0
    if args.dest is None:
        parser.error("DEST is required")
    dest = args.dest.resolve()
    if unpacked_digest(dest) == args.sha256:
        print(
            f"{PROJECT} {args.version} already unpacked in {dest} (sha256 {args.sha256})",
            file=sys.stderr,
        )
        print(dest)
        return 0
    filename = f"{PROJECT}-{args.version}.tar.gz"
    url, entry, _, _ = find_file(PROJECT, filename)
    published = entry.get("hashes", {}).get("sha256")
    if published and published != args.sha256:
        raise SystemExit(f"index lists sha256 {published} for {filename}, pinned {args.sha256}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        archive = Path(tmp) / filename
        got = download(url, archive)
        if got != args.sha256:
            raise SystemExit(f"sha256 mismatch for {filename}: got {got}, pinned {args.sha256}")
        print(f"sha256 ok: {got}", file=sys.stderr)
        if args.keep_archive:
            args.keep_archive.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(archive, args.keep_archive)
        try:
            unpack(archive, dest, got)
        except (tarfile.TarError, OSError) as exc:
            raise SystemExit(f"cannot unpack {filename}: {exc}") from exc
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
