"""One CLI language: every option of every command declared once, here or in `config`.

Every option of `train` is a field of a dataclass in `config` (its help and the words it takes
there); `add_config_arguments` makes the flags from those fields, so a flag, a YAML key and the
resolved configuration written next to a model always agree. Another command that takes one of
those settings declares it with `add_field` (the same flag, form, choices and placeholder; its
own default), and the options several commands share that no training run has (`--beam-size`,
`--json`) are declared once in `SHARED` and added with `add_shared`. Every yes/no option is a
pair, `--x/--no-x`; every value option's placeholder says what goes there (`PLACEHOLDERS`), a
choice shows its choices. tests/test_cli_help.py fails when two commands spell one setting
differently.

`train --help` is one screen: the options a first run needs (the fields marked `first_run` in
`config.options`), grouped as every option is; `train --help-all` lists them all
(`add_help_options`), and docs/options.md tells each one's whole story.
"""

from __future__ import annotations

import argparse
import sys
import types
from dataclasses import MISSING, Field, fields
from typing import Any, Union, get_args, get_origin

from whisper_train.config import GROUPS, RunConfig, field_owners
from whisper_train.config.options import TRACKERS, first_run_options
from whisper_train.config.values import whole_number

# What goes where a flag's value goes, when the flag's last word does not say it: a whole
# number is N, a choice shows its choices (`{full,lora,freeze-encoder}`).
PLACEHOLDERS = {
    "data": "PATH",
    "eval_data": "[NAME[:LANG]=]PATH",
    "data_format": "LAYOUT",
    "language": "LANG",
    "model": "MODEL",
    "output_dir": "DIR",
    "encoder_cache_dir": "DIR",
    "guard": "SET",
    "metric_for_best": "SET",
    "report_to": "{" + ",".join(TRACKERS) + "}[,...]",
    "gradient_checkpointing": "{off,on,full,encoder,every-N,auto}",
    "resume": "CHECKPOINT",
    "max_memory": "SIZE",
    "encoder_cache_max_size": "SIZE",
    "lora_targets": "MODULE[,...]",
    "temperatures": "T[,...]",
    "compression_ratio_threshold": "RATIO|none",
    "logprob_threshold": "LOGPROB|none",
    "no_speech_threshold": "P|none",
    "learning_rate": "LR",
    "epochs": "N",
    "eval_split": "FRACTION",
    "lora_dropout": "P",
    "prompt_probability": "P",
    "max_regression": "POINTS",
    "preserve_base": "WEIGHT",
    "weight_decay": "DECAY",
    "max_grad_norm": "NORM",
    "encoder_lr_scale": "SCALE",
    "nonspeech": "PATH|builtin|none",
    "new_language": "CODE",
    "new_language_init": "LANG",
    "nonspeech_share": "FRACTION",
    "max_nonspeech_rise": "WORDS",
    "teacher": "MODEL",
    "distill_temperature": "T",
    "distill_kl_weight": "WEIGHT",
    "distill_ce_weight": "WEIGHT",
}


# Each group's title in a command's help, in `config.GROUPS` order.
GROUP_TITLES = {
    "data": "data",
    "model": "model",
    "memory": "memory and speed",
    "train": "training, evaluation and the run folder",
}
# Where each option is explained at length (docs/options.md; tests/test_cli_help.py checks it).
OPTIONS_REFERENCE = "docs/options.md"


def placeholder(name: str, annotation: Any = None, choices=None) -> str:
    """The placeholder of a value option: PLACEHOLDERS', a choice's choices, N for a whole
    number, else the flag's last word (`--png FILE`)."""
    if name in PLACEHOLDERS:
        return PLACEHOLDERS[name]
    if choices is not None:
        return "{" + ",".join(choices) + "}"
    if annotation is not None and str(annotation).startswith("int"):
        return "N"
    return name.split("_")[-1].upper()


def metavar(name: str) -> str:
    """The placeholder of an option without a declared type (cli's fallback)."""
    return placeholder(name)


def add_config_arguments(
    parser: argparse.ArgumentParser, groups=tuple(GROUPS), only: frozenset[str] | None = None
) -> None:
    """One flag per dataclass field (`lora_r` → `--lora-r`), grouped as in config.py; with
    `only`, just those fields (a command shows only the options it uses).

    Defaults are suppressed so that only flags the user typed override `--config FILE.yaml`.
    """
    parser.add_argument(
        "--config", metavar="FILE.yaml", help="Options from a YAML file; flags override it."
    )
    for group_name in groups:
        group = parser.add_argument_group(GROUP_TITLES[group_name])
        for f in fields(GROUPS[group_name]):
            if only is not None and f.name not in only:
                continue
            default = _default(f)
            # argparse %-formats help text: a percent sign in prose must reach it doubled
            help_text = f.metadata.get("help", "").replace("%", "%%")
            if default not in (None, False, [], ""):
                shown = ",".join(default) if isinstance(default, list) else default
                help_text += f" [default: {str(shown).replace('%', '%%')}]"
            # Choices are shown, not enforced here: the configuration checks them (a YAML file's
            # values too), in one line that names the flag and what it takes.
            flag, kwargs = _declaration(f, help_text, argparse.SUPPRESS)
            group.add_argument(flag, **kwargs)


def add_field(
    parser: argparse.ArgumentParser, name: str, *, help: str | None = None, default=MISSING, **kw
) -> argparse.Action:
    """A `train` setting that another command takes: train's flag, form, choices and
    placeholder; the field's default unless `default` is given; its help unless the command
    needs other words (`help`). A choice is enforced by argparse here (no configuration checks
    it); `kw` adds argparse arguments (`type`, `required`)."""
    f = _config_field(name)
    text = f.metadata.get("help", "") if help is None else help
    flag, kwargs = _declaration(f, text, _default(f) if default is MISSING else default)
    if "choices" in f.metadata:
        kwargs["choices"], kwargs["metavar"] = f.metadata["choices"], None
    if str(f.type).startswith("int"):  # every whole-number setting counts from 1
        kwargs["type"] = whole_number(1)
    return parser.add_argument(flag, **{**kwargs, **kw})


def add_help_options(parser: argparse.ArgumentParser, *, also: tuple[str, ...] = ()) -> None:
    """`-h/--help`: the options a first run needs; `--help-all`: every option. The parser is
    made with `add_help=False`; the first-run options are the fields marked `first_run`, and
    `also` the fields a command's first run needs besides (distill's --teacher)."""
    parser.add_argument(
        "-h",
        "--help",
        action=FirstRunHelp,
        also=also,
        help="Show the options a first run needs and exit.",
    )
    parser.add_argument("--help-all", action=AllOptionsHelp, help="Show every option and exit.")


class AllOptionsHelp(argparse._HelpAction):
    """--help-all: every option, grouped, and where each is explained at length."""

    def __call__(self, parser, namespace, values, option_string=None):
        saved = parser.usage, parser.epilog
        parser.usage, parser.epilog = short_usage(parser), f"Each at length: {OPTIONS_REFERENCE}."
        try:
            parser.print_help()
        finally:
            parser.usage, parser.epilog = saved
        parser.exit()


class FirstRunHelp(argparse._HelpAction):
    """-h/--help: `first_run_help`, with the command's own first-run fields (`also`)."""

    def __init__(self, *args, also: tuple[str, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.also = tuple(also)

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(first_run_help(parser, also=self.also))
        parser.exit()


def short_usage(parser: argparse.ArgumentParser) -> str:
    """The usage line of a help page that lists its options below (argparse's own names every
    option: 60 lines for train)."""
    return f"{parser.prog} [-h] [--help-all] [--config FILE.yaml] [OPTION ...]"


def first_run_help(parser: argparse.ArgumentParser, *, also: tuple[str, ...] = ()) -> str:
    """The help of `parser` with only the options a first run needs (and those no training
    setting owns: --config, the help flags), a short usage line, and a last line that names
    --help-all. The other options' help is hidden for this one rendering, then restored."""
    shown = set(first_run_options()) | set(also)
    owners = field_owners()
    hidden = [a for a in parser._actions if a.dest in owners and a.dest not in shown]
    saved = [(action, action.help) for action in hidden], parser.usage, parser.epilog
    try:
        for action in hidden:
            action.help = argparse.SUPPRESS
        parser.usage = short_usage(parser)
        parser.epilog = f"{parser.prog} --help-all shows all {len(owners)} options."
        return parser.format_help()
    finally:
        for action, text in saved[0]:
            action.help = text
        parser.usage, parser.epilog = saved[1], saved[2]


# The options several commands share that no training run has: (flag, argparse arguments).
SHARED: dict[str, tuple[str, dict[str, Any]]] = {
    "beam_size": (
        "--beam-size",
        {"type": whole_number(1), "default": 1, "metavar": "N", "help": "1 is greedy decoding."},
    ),
    "json": (
        "--json",
        {
            "action": argparse.BooleanOptionalAction,
            "default": False,
            "help": "Print the report as JSON.",
        },
    ),
    "assistant": (
        "--assistant",
        {
            "default": None,
            "metavar": "MODEL",
            "help": "Speculative decoding: this smaller model (any form --model takes; same "
            "tokenizer, e.g. a student distilled from --model) drafts tokens and --model "
            "verifies them, one clip at a time: the text is --model's own greedy text, faster "
            "where the two agree. transformers only (another format is read into it); not "
            "with --beam-size or --word-timestamps; evaluate: for --model, not --baseline.",
        },
    ),
}


def add_shared(parser: argparse.ArgumentParser, name: str, **overrides) -> argparse.Action:
    """One of `SHARED`'s options; `overrides` (help, default) where the command needs them."""
    flag, kwargs = SHARED[name]
    return parser.add_argument(flag, **{**kwargs, **overrides})


def add_switch(parser, flag: str, *, help: str, default: bool = False) -> argparse.Action:
    """A yes/no option, in the one form every command uses: `--x` and `--no-x`."""
    return parser.add_argument(
        flag, action=argparse.BooleanOptionalAction, default=default, help=help
    )


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Defaults, then the YAML file, then the flags typed on the command line."""
    config = RunConfig.from_yaml(args.config) if getattr(args, "config", None) else RunConfig()
    owners = field_owners()
    config.update({key: value for key, value in vars(args).items() if key in owners})
    return config.validate()


def _declaration(f: Field, help_text: str, default: Any) -> tuple[str, dict[str, Any]]:
    """A field's flag and its argparse arguments: a yes/no pair, a repeatable flag, a flag
    that may stand alone (`--resume`) or a flag with a value."""
    flag = "--" + f.name.replace("_", "-")
    shown = placeholder(f.name, f.type, f.metadata.get("choices"))
    if _is_bool(f.type):
        return flag, {
            "action": argparse.BooleanOptionalAction,
            "default": default,
            "help": help_text,
        }
    kwargs: dict[str, Any] = {"metavar": shown, "default": default, "help": help_text}
    if f.metadata.get("repeatable"):  # --eval-data A=x --eval-data B=y
        kwargs["action"] = "append"
    elif "const" in f.metadata:  # a flag that may stand alone: --resume
        kwargs.update(nargs="?", const=f.metadata["const"])
    return flag, kwargs


def _config_field(name: str) -> Field:
    group = GROUPS[field_owners()[name]]
    return next(f for f in fields(group) if f.name == name)


def _default(f: Field) -> Any:
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]


def _is_bool(annotation) -> bool:
    if annotation in (bool, "bool", "bool | None"):
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        return bool in get_args(annotation)
    return False
