"""``vllm-prefix-guard-harness explore``: every sequence of events within a scope, not a sample.

Drives the installed vLLM's real scheduler (stock, the guard, or the guard with one rule
taken out) through every step each named scope allows, and prints per scope the
states, transitions, depth and time, each lane's violations with the shortest event
sequence as a regression test, and the path-by-path hit comparison. Exit status: 0
every check passed (with ``--mutation``: the mutation was caught), 1 a check failed,
2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
from pathlib import Path
from typing import Any

from vllm_prefix_guard_harness.explore.mutations import MUTATION_SCOPES, MUTATIONS
from vllm_prefix_guard_harness.explore.scope import DEFAULT_SCOPES, SCOPES
from vllm_prefix_guard_harness.fuzz.hash_seed import (
    current_hash_seed,
    reexec_with_fixed_hash_seed,
)

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE = 0, 1, 2
DOC_BEGIN, DOC_END = "<!-- explore:begin -->", "<!-- explore:end -->"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-prefix-guard-harness explore", description=__doc__)
    parser.add_argument(
        "--scope",
        action="append",
        choices=sorted(SCOPES),
        metavar="NAME",
        help="scope to explore (repeatable; default: the default set; see --list)",
    )
    parser.add_argument("--modes", default="stock,guard", help="lanes (default stock,guard)")
    parser.add_argument(
        "--mutation",
        choices=[*sorted(MUTATIONS), "stock"],
        help="explore the guard with this rule taken out (alone; default scope: the one it "
        "must be caught on); passes if it reads bad KV",
    )
    parser.add_argument("--list", action="store_true", help="state every scope in full")
    parser.add_argument(
        "--doc", help="also rewrite the marked explore section of this markdown file"
    )
    parser.add_argument("--json", help="also write each scope's figures to this JSON file")
    return parser


def main(argv: list[str], reexec: bool = False) -> int:
    args = build_parser().parse_args(argv)
    if reexec and not args.list:
        reexec_with_fixed_hash_seed()
    return run(args, argv)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    if args.list:
        for scope in SCOPES.values():
            print(scope.describe(), end="\n\n")
        return EXIT_OK
    from vllm_prefix_guard_harness.fuzz.cli import quiet_vllm

    quiet_vllm()
    from vllm_prefix_guard.targets import vllm_version
    from vllm_prefix_guard_harness.explore.report import findings_text, table
    from vllm_prefix_guard_harness.explore.search import SearchResult, explore
    from vllm_prefix_guard_harness.explore.system import BASE_MODES

    if args.mutation:
        modes: tuple[str, ...] = (args.mutation,)
        names = args.scope or [MUTATION_SCOPES[args.mutation]]
    else:
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        names = args.scope or list(DEFAULT_SCOPES)
        unknown = set(modes) - set(BASE_MODES) - set(MUTATIONS)
        if unknown:
            print(f"unknown mode(s) {', '.join(sorted(unknown))}", file=sys.stderr)
            return EXIT_USAGE
    results: list[SearchResult] = []
    for name in names:
        print(f"exploring {name} ({', '.join(modes)})...", file=sys.stderr, flush=True)
        results.append(explore(SCOPES[name], modes))
    failed = checks(results, mutation=args.mutation is not None)
    header = (
        f"vLLM {vllm_version()}, Python {platform.python_version()}, "
        f"PYTHONHASHSEED={current_hash_seed()}"
    )
    print(header)
    print()
    print(table(results))
    text = findings_text(results)
    if text:
        print()
        print(text)
    print()
    print("\n".join(f"FAILED: {line}" for line in failed) or "every check passed")
    print("re-run: " + " ".join(["vllm-prefix-guard", "explore", *argv]))
    if args.doc:
        write_doc(Path(args.doc), header, results, argv)
    if args.json:
        from vllm_prefix_guard_harness.explore.report import summary

        document = {"vllm": vllm_version(), "scopes": [summary(r) for r in results]}
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return EXIT_CHECK_FAILED if failed else EXIT_OK


def checks(results: list[Any], mutation: bool) -> list[str]:
    """What failed: an exploration left states unexplored or erred; the guard read bad
    KV; its hits differ from stock's on a clean path; a mutation went uncaught."""
    failed = []
    for result in results:
        name = result.scope.name
        if not result.complete:
            failed.append(
                f"{name}: incomplete ({result.counters['unfinished']} runs undrained, "
                f"{result.counters['errors']} errors)"
            )
        if mutation:
            if not any(result.violations(mode) for mode in result.modes):
                failed.append(f"{name}: the mutation {result.modes[0]} read no bad KV")
            continue
        if "guard" in result.modes and result.violations("guard"):
            failed.append(f"{name}: the guard read bad KV")
        if "guard" in result.modes and result.events_wrong("guard"):
            failed.append(f"{name}: the guard's KV events disagreed with its prefix cache")
        if result.of("hit_gap"):
            failed.append(f"{name}: guard hits differ from clean stock's on some path")
    return failed


def write_doc(path: Path, header: str, results: list[Any], argv: list[str]) -> None:
    """Replace the text between the explore markers of ``path`` with this run's table."""
    from vllm_prefix_guard_harness.explore.report import table

    command = " ".join(["vllm-prefix-guard", "explore", *[a for a in argv if a != "--doc"]])
    command = re.sub(r" \S*\.md\b", "", command)
    body = "\n".join(
        [
            DOC_BEGIN,
            f"Written by `nox -s explore` (`{command}`); {header}.",
            "",
            table(results),
            "",
            "Bounds, per scope (`vllm-prefix-guard-harness explore --list` states each in full):",
            "",
            *(f"- `{r.scope.name}`: {r.scope.bounds()}." for r in results),
            DOC_END,
        ]
    )
    text = path.read_text(encoding="utf-8")
    start, end = text.index(DOC_BEGIN), text.index(DOC_END) + len(DOC_END)
    path.write_text(text[:start] + body + text[end:], encoding="utf-8")
