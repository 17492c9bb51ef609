"""Every relative link in the project's documents points at a file that exists and, for a
``#fragment``, at a heading (or an explicit anchor) that exists, slugged the way GitHub
slugs headings. Read from the files: no vLLM needed."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted(
    {
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        ROOT / "benchmarks" / "README.md",
        *(ROOT / "docs").glob("*.md"),
        ROOT / "upstream" / "README.md",
        *(ROOT / "upstream" / "out" / "series").glob("*.md"),
        *(ROOT / "upstream" / "out" / "prs").glob("*.md"),
    }
)

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(.*?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped (code spans keep their text,
    links their label), lower case, every character but letters, digits, spaces, ``-``
    and ``_`` removed, spaces turned into ``-``."""
    text = _INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def prose_lines(path: Path) -> list[str]:
    """The document's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """The fragments a link may name in ``path``: its headings' slugs (a repeated slug gets
    ``-1``, ``-2``, ... as on GitHub) and its explicit HTML anchors."""
    found: set[str] = set()
    seen: Counter[str] = Counter()
    for line in prose_lines(path):
        heading = _HEADING.match(line)
        if heading:
            slug = github_slug(heading.group(2))
            found.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
            seen[slug] += 1
        found |= set(_HTML_ANCHOR.findall(line))
    return found


def links(path: Path) -> list[str]:
    """The link targets of ``path``'s prose (inline, images and reference definitions),
    code spans excluded."""
    targets = []
    for line in prose_lines(path):
        reference = _REFERENCE.match(line)
        if reference:
            targets.append(reference.group(1))
            continue
        targets += _LINK.findall(_INLINE_CODE.sub("", line))
    return targets


def broken_links(path: Path) -> list[str]:
    problems = []
    for target in links(path):
        if _EXTERNAL.match(target):
            continue
        file_part, _, fragment = target.partition("#")
        linked = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{target}: no such file {os.path.relpath(linked, ROOT)}")
            continue
        if fragment and linked.suffix == ".md" and unquote(fragment) not in anchors(linked):
            problems.append(f"{target}: no heading or anchor #{fragment} in {linked.name}")
    return problems


@pytest.mark.parametrize(
    "document",
    [d for d in DOCUMENTS if d.exists()],
    ids=lambda d: str(d.relative_to(ROOT)),
)
def test_every_link_resolves(document: Path) -> None:
    assert broken_links(document) == []


def test_docs_pages_exist() -> None:
    assert (ROOT / "docs").is_dir() and len(list((ROOT / "docs").glob("*.md"))) >= 6


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("vLLM's own unit tests, with the guard", "vllms-own-unit-tests-with-the-guard"),
        ("Is your vLLM exposed? Across releases", "is-your-vllm-exposed-across-releases"),
        ("Install, enable, check", "install-enable-check"),
        ("On vLLM's `/metrics`", "on-vllms-metrics"),
        (
            "Measured (vLLM 0.30.0, kvcached 0.1.6; identical in both load orders)",
            "measured-vllm-0300-kvcached-016-identical-in-both-load-orders",
        ),
        ("The `SchedulerGuard` and [its rules](x.md)", "the-schedulerguard-and-its-rules"),
        ("snake_case stays", "snake_case-stays"),
    ],
)
def test_github_slug(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Twice\n\n## Twice\n\n"
        "[ok](other.md#a-section) [ok](#twice-1) [ok](https://example.org/#x) `[no](code.md)`\n"
        "[bad](missing.md) [bad](other.md#nowhere) [bad](#twice-2)\n"
        "```\n[fenced](ignored.md)\n```\n"
    )
    found = broken_links(page)
    assert [problem.split(":")[0] for problem in found] == [
        "missing.md",
        "other.md#nowhere",
        "#twice-2",
    ]
