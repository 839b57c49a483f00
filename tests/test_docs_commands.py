"""Every `whisper-train` command printed in the README and the guides under docs/ is one the tool
accepts: its flags exist, their values are legal, and for `train` and `doctor` the resolved
configuration passes validation, as it would before the run starts.

Commands are read from the ```bash blocks (backslash continuations joined, comments dropped),
from indented code lines and from inline `whisper-train ...` spans, skipping elided ones (`...`),
and parsed by the real parser (`cli.build_parser`), then `commands.flags.config_from_args`
where the command builds a RunConfig. A guide that advertises a flag the tool no longer has,
or a value it refuses, fails here naming the file and the command. The README's Python snippet
and docs/checkpointing.md's Trainer recipe are run by tests/test_readme.py and
tests/test_compat.py.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from whisper_train.cli import build_parser
from whisper_train.commands.flags import config_from_args

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PROGRAM = re.compile(r"^(?:\.venv/bin/)?whisper-train\s")
# Commands that build a RunConfig from their flags (train's options), validated before a run.
CONFIGURED = ("train", "doctor")


def documented_commands() -> list[tuple[str, str]]:
    """(document name, command line) for every whole whisper-train command in a document."""
    found = []
    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        lines = []
        for block in re.findall(r"^```(?:bash|sh|console)\n(.*?)^```", text, re.S | re.M):
            lines += re.sub(r"\\\n\s*", " ", block).splitlines()
        lines += re.findall(r"^ {4}(whisper-train .*)$", text, re.M)  # indented code
        lines += re.findall(r"`((?:\.venv/bin/)?whisper-train [^`]+)`", text)  # inline spans
        for line in lines:
            line = line.strip().removeprefix("$ ")
            whole = len(shlex.split(line, comments=True)) > 2  # not just a command's name
            if PROGRAM.match(line) and whole and "..." not in line:
                found.append((document.name, line))
    return found


COMMANDS = documented_commands()


def test_the_documents_print_commands_to_check():
    """The reader below can fail: it finds the README's five commands and the guides' too."""
    names = {shlex.split(line, comments=True)[1] for _, line in COMMANDS}
    assert {"check-data", "train", "evaluate", "export", "transcribe"} <= names
    assert len({document for document, _ in COMMANDS}) >= 4  # README and three guides


@pytest.mark.parametrize(
    ("document", "line"), COMMANDS, ids=[f"{d}:{i}" for i, (d, _) in enumerate(COMMANDS)]
)
def test_a_documented_command_is_accepted(document, line, monkeypatch):
    monkeypatch.chdir(REPO)  # a --config path in the docs is relative to the checkout
    argv = shlex.split(line, comments=True)[1:]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{document}: `{line}` is refused: {errors.getvalue().strip()[-300:]}")
    if args.command in CONFIGURED:
        config_from_args(args)  # a UserError names the flag and the remedy
