"""Paths and command lines as recorded results show them: never the machine's own.

Soak reports, benchmark results and the compatibility table are committed; a path of the
machine that made them (a home directory, a scratch folder, a venv) means nothing to a
reader and leaks the build machine. A path inside the working directory (the repository,
where the project's commands run) is written relative to it; any other is reduced to its
name.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def portable_path(path: str | os.PathLike[str]) -> str:
    """``path`` relative to the working directory if inside it, else its name alone."""
    given = Path(path)
    if not given.is_absolute():
        return str(given)
    try:
        return str(given.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return given.name


def portable_command(args: Iterable[str]) -> str:
    """A command line with every absolute path in it (``--out=/x/y`` too) made portable."""
    words = []
    for arg in args:
        option, equals, value = arg.partition("=")
        if equals and os.path.isabs(value):
            words.append(f"{option}={portable_path(value)}")
        elif os.path.isabs(arg):
            words.append(portable_path(arg))
        else:
            words.append(arg)
    return " ".join(words)
