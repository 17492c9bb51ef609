"""The README is for operators: short, the two set-up commands on its first screen, and a
quick start that ``scripts/readme_quickstart.sh`` runs as pasted."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
FENCE = "`" * 3


def test_readme_is_short() -> None:
    assert len(README) <= 350


def test_the_two_set_up_commands_are_on_the_first_screen() -> None:
    first_screen = "\n".join(README[:60])
    assert re.search(r"^pip install nox && nox -s demo\b", first_screen, re.MULTILINE)
    assert re.search(r"^pip install nox && nox\s+#", first_screen, re.MULTILINE)


def _quick_start_commands() -> list[str]:
    """The commands of the quick start's code blocks, continuation lines joined."""
    start = README.index("## Quick start (CPU)")
    end = next(i for i in range(start + 1, len(README)) if README[i].startswith("## "))
    commands, inside = [], False
    for line in README[start:end]:
        if line.startswith(FENCE):
            inside = line.strip() == FENCE + "bash" if not inside else False
            continue
        if inside and line.strip():
            commands.append(line)
    return commands


def test_the_quick_start_script_runs_the_readme_commands() -> None:
    """Every quick-start line is in the script, verbatim (the server's and curl's output
    redirections aside), in the same order."""
    script = (ROOT / "scripts" / "readme_quickstart.sh").read_text(encoding="utf-8")
    position = 0
    for command in _quick_start_commands():
        found = script.find(command, position)
        assert found >= 0, f"not in scripts/readme_quickstart.sh (in order): {command}"
        position = found + len(command)


def test_the_quick_start_prompt_fills_blocks() -> None:
    """The completion's prompt spans full 32-token blocks, so the guard registers and
    tracks them (the tiny model's tokenizer averages under 2 characters a token)."""
    [curl] = [c for c in _quick_start_commands() if "/v1/completions" in c]
    prompt = re.search(r'"prompt": "([^"]+)"', curl)
    assert prompt is not None and len(prompt.group(1)) >= 2 * 64
