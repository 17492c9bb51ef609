"""vllm-prefix-guard: operator commands.

  doctor   will the guard be on for a server started from this shell, and does the installed
           vLLM have every internal it needs (--self-test: run the known failure, stock vs
           guarded, on this very build)

The fuzzer, soak and explorer are the repository's harness (vllm-prefix-guard-harness),
not part of this package.

Exit status: 0 everything passed; 1 a check failed; 2 bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from vllm_prefix_guard import __version__

EXIT_OK, EXIT_FAILED = 0, 1


def cmd_doctor(args: argparse.Namespace) -> int:
    from vllm_prefix_guard.doctor import report_lines, run_checks

    if args.json:
        # Only the document on stdout: vLLM binds its log handler to the stdout it sees
        # when first imported (0.30 logs import warnings there), so that is stderr here.
        with contextlib.redirect_stdout(sys.stderr):
            checks = run_checks(args.self_test)
        print(json.dumps([c.as_dict() for c in checks], indent=2))
    else:
        checks = run_checks(args.self_test)
        print("\n".join(report_lines(checks, args.verbose)))
    return EXIT_FAILED if any(c.failed for c in checks) else EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-prefix-guard",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    doctor = sub.add_parser(
        "doctor",
        help="check the installation against the installed vLLM",
        description="Check the entry point, the settings and every vLLM internal the guard "
        "uses; exit 1 if a check failed.",
    )
    doctor.add_argument(
        "--self-test", action="store_true", help="also run the known failure, stock vs guarded"
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument(
        "--verbose", action="store_true", help="list every internal, not only a failed one"
    )
    doctor.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
