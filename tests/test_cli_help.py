"""Every option of every command says what it does and what happens without it, and the
commands speak one language: a setting several commands take is spelled, shaped and shown
alike in each (`commands.flags` declares each once)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from dataclasses import fields
from pathlib import Path

import pytest

from whisper_train.choices import MODES, OPTIMIZERS, PACKING_AUTO, PACKINGS, TASKS
from whisper_train.cli import build_parser
from whisper_train.commands.flags import GROUP_TITLES, OPTIONS_REFERENCE
from whisper_train.config import GROUPS
from whisper_train.config.options import PRECISIONS, SCHEDULERS, first_run_options

PARSER = build_parser()


def _subparsers(parser):
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _all_commands() -> dict[str, argparse.ArgumentParser]:
    """Every command, and every action of a command that has actions (`cache ls`)."""
    found = {}
    for name, sub in _subparsers(PARSER).items():
        if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
            found.update({f"{name} {n}": s for n, s in _subparsers(sub).items()})
        else:
            found[name] = sub
    return found


COMMANDS = _all_commands()
TRAIN_FIELDS = {f.name: f for group in GROUPS.values() for f in fields(group)}


def _options(command: str):
    for action in COMMANDS[command]._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            yield action


def _shown_choices(action) -> tuple[str, ...] | None:
    """The choices a usage line shows: argparse's own, or a `{a,b}` placeholder."""
    if action.choices is not None:
        return tuple(action.choices)
    match = re.fullmatch(r"\{([^}]*)\}.*", str(action.metavar))
    return tuple(match.group(1).split(",")) if match else None


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


# The words a placeholder is made of: each says what goes there (`--guard SET`, not GUARD).
PLACEHOLDER_WORDS = {
    "N", "PATH", "DIR", "FILE", "MODEL", "LANG", "LAYOUT", "NAME", "SET", "SIZE", "LR", "P",
    "FRACTION", "POINTS", "WEIGHT", "DECAY", "NORM", "SCALE", "CHECKPOINT", "KEY", "T",
    "RATIO", "LOGPROB", "MODULE", "WORDS", "CODE", "none", "builtin",
}  # fmt: skip


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_placeholders_say_what_goes_there(command):
    """`--report-to TO` and `--guard GUARD` said nothing; a choice shows its choices."""
    odd = [
        (a.option_strings[0], a.metavar)
        for a in _options(command)
        if a.nargs != 0
        and _shown_choices(a) is None
        and a.metavar != "FILE.yaml"
        and not set(re.findall(r"[A-Za-z]+", str(a.metavar))) <= PLACEHOLDER_WORDS
    ]
    assert not odd, odd


# The train settings that take one of a few words, and the words.
CLOSED = {
    "mode": MODES,
    "optim": OPTIMIZERS,
    "packing": (PACKING_AUTO, *PACKINGS),
    "packing_timestamps": ("on", "off"),
    "task": TASKS,
    "precision": PRECISIONS,
    "lr_scheduler": SCHEDULERS,
    "attn_implementation": ("sdpa", "eager"),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_usage_line_shows_the_choices(command):
    """train's --mode, --packing and --optim showed MODE, PACKING, OPTIM."""
    usage = " ".join(COMMANDS[command].format_usage().split())
    for action in _options(command):
        if action.dest in CLOSED:
            shown = "{" + ",".join(CLOSED[action.dest]) + "}"
            assert f"{action.option_strings[0]} {shown}" in usage, (command, action.dest)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_yes_no_options_take_one_form_everywhere(command):
    """`--x` / `--no-x` in every command (train had pairs, evaluate and export single flags)."""
    single = [
        a.option_strings[0]
        for a in _options(command)
        if a.nargs == 0
        and not isinstance(a, argparse.BooleanOptionalAction)
        and (command, a.dest) not in NOT_YES_NO
    ]
    assert not single, f"{command}: yes/no options that are not --x/--no-x pairs: {single}"


# A flag without a value that is a choice of action, not a yes or no.
NOT_YES_NO = {("cache clear", "all"): "with --model-key: which entries to remove"}

# Options of one name whose settings differ on purpose, and why.
DIFFERENT_ON_PURPOSE = {
    ("export", "format"): "a model's format; transcribe's --format is a transcript's",
    ("transcribe", "format"): "a transcript's format; export's --format is a model's",
    ("evaluate", "data"): "named sets, repeated, as train's --eval-data takes them",
    ("demo", "language"): "the demo has sentences in these two languages only",
    ("export", "output"): "the export's folder; evaluate's --output is its report (a file)",
    (
        "average",
        "output",
    ): "the average's model folder, as export's (optional here: final/ is the default)",
}


def _form(action) -> tuple:
    return (
        tuple(action.option_strings),
        type(action).__name__,
        action.nargs,
        action.const,
        _shown_choices(action),
        None if _shown_choices(action) else action.metavar,
    )


def test_one_setting_is_spelled_alike_in_every_command():
    """Fails when two commands spell one setting differently: the same destination under
    another flag, form (a pair or a single flag, a value or none), choices or placeholder, or
    one flag for two destinations."""
    forms: dict[str, dict[tuple, list[str]]] = {}
    dests: dict[str, set[str]] = {}
    for command in COMMANDS:
        for action in _options(command):
            if (command, action.dest) in DIFFERENT_ON_PURPOSE:
                continue
            forms.setdefault(action.dest, {}).setdefault(_form(action), []).append(command)
            for flag in action.option_strings:
                dests.setdefault(flag, set()).add(action.dest)
    spelled_differently = {dest: by_form for dest, by_form in forms.items() if len(by_form) > 1}
    assert not spelled_differently, spelled_differently
    assert not {flag: d for flag, d in dests.items() if len(d) > 1}


def test_a_command_that_shares_a_train_setting_spells_it_as_train_does():
    """evaluate's --max-length was train's --generation-max-length."""
    for command in COMMANDS:
        for action in _options(command):
            field = TRAIN_FIELDS.get(action.dest)
            if field is not None and (command, action.dest) not in DIFFERENT_ON_PURPOSE:
                assert action.option_strings[0] == "--" + field.name.replace("_", "-")
    evaluate = {a.dest for a in _options("evaluate")}
    assert "generation_max_length" in evaluate and "max_length" not in evaluate


def test_doctor_offers_only_the_options_it_reads():
    """doctor listed train's evaluation options (--eval-data, --eval-split), which it never
    uses."""
    offered = {flag for a in _options("doctor") for flag in a.option_strings}
    assert "--model" in offered and "--gradient-checkpointing" in offered
    assert not {flag for flag in offered if flag.startswith("--eval")}
    assert "--shuffle-buffer" not in offered and "--prompt-probability" not in offered


def test_help_renders_for_every_command():
    for name, sub in COMMANDS.items():
        assert name.split()[-1] in sub.format_help().splitlines()[0]


def _train_help(flag: str, monkeypatch) -> str:
    """What `whisper-train train FLAG` prints, on an 80-column terminal."""
    monkeypatch.setenv("COLUMNS", "80")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["train", flag])
    assert exit_.value.code == 0
    return printed.getvalue()


def _option_rows(help_text: str) -> set[str]:
    """The first flag of each option row of a help page (`  --data PATH  Training data...`)."""
    return set(re.findall(r"^  (--[a-z][a-z-]*)", help_text, re.M))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def test_train_help_is_one_screen_of_the_options_a_first_run_needs(monkeypatch):
    """`train --help` was 452 lines: every option with every measurement. It lists the fields
    marked first_run (and --config, --help-all) in their groups, and its last line names
    --help-all."""
    text = _train_help("--help", monkeypatch)
    lines = text.rstrip("\n").splitlines()
    assert len(lines) <= 100, len(lines)
    assert _option_rows(text) == {_flag(n) for n in first_run_options()} | {
        "--help-all",
        "--config",
    }
    assert {"--data", "--model", "--mode", "--learning-rate", "--resume"} <= _option_rows(text)
    assert f"--help-all shows all {len(TRAIN_FIELDS)} options" in lines[-1]
    assert "data:" in lines and "model:" in lines  # grouped, each group under its title
    assert len(lines) < len(_train_help("--help-all", monkeypatch).splitlines()) / 2


def test_train_help_all_lists_every_option_grouped(monkeypatch):
    """Every field of the configuration dataclasses has its row in `--help-all`, under its
    group's title, and no help text carries the measurements behind it (docs/options.md
    does)."""
    text = _train_help("--help-all", monkeypatch)
    assert _option_rows(text) == {_flag(n) for n in TRAIN_FIELDS} | {"--help-all", "--config"}
    for group, title in GROUP_TITLES.items():
        section = text[text.index(f"\n{title}:\n") :]
        first = _flag(fields(GROUPS[group])[0].name)
        assert section.index(first) < section.index("\n\n", 1), (group, first)
    assert "BENCHMARKS" not in text and OPTIONS_REFERENCE in text.splitlines()[-1]


def test_every_train_option_is_explained_in_the_options_reference():
    """docs/options.md, which the help points to, has a section for every option."""
    reference = (Path(__file__).resolve().parents[1] / OPTIONS_REFERENCE).read_text("utf-8")
    explained = re.findall(r"^### `(--[a-z][a-z-]*)", reference, re.M)
    assert sorted(explained) == sorted(_flag(name) for name in TRAIN_FIELDS)
