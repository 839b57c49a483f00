"""Every option of every command says what it does and what happens without it."""

from __future__ import annotations

import argparse
import re

import pytest

from whisper_train.cli import build_parser

PARSER = build_parser()
COMMANDS = next(a for a in PARSER._actions if isinstance(a, argparse._SubParsersAction)).choices


def _options(command: str):
    for action in COMMANDS[command]._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            yield action


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_help_and_shows_its_default(command):
    undocumented = [a.option_strings[0] for a in _options(command) if not a.help]
    assert not undocumented, f"{command}: options without help: {undocumented}"
    hidden_default = [
        a.option_strings[0]
        for a in _options(command)
        if a.default not in (None, False, [], "", argparse.SUPPRESS) and "[default:" not in a.help
    ]
    assert not hidden_default, f"{command}: defaults not shown: {hidden_default}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_placeholders_are_named_like_the_flag(command):
    """`--batch-size SIZE` everywhere, not BATCH_SIZE in one command and SIZE in another."""
    odd = [
        (a.option_strings[0], a.metavar)
        for a in _options(command)
        if a.nargs != 0
        and a.choices is None
        and not re.fullmatch(r"[A-Z][A-Z0-9]*(\.[a-z]+)?", str(a.metavar))  # SIZE, FILE.yaml
    ]
    assert not odd, odd


def test_help_renders_for_every_command():
    for name, sub in COMMANDS.items():
        assert name in sub.format_help().splitlines()[0]
