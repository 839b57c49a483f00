"""`whisper-train`: argument parsing only. Each command calls one library function.

The commands live in `whisper_train.commands`, one module each (`add_parser` + `run`); this
module puts them under one parser, documents their options alike and runs the one asked for.
The flags of `train` (and of the commands that share them) are generated from the
configuration dataclasses by `whisper_train.commands.flags`.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import re
import sys
import traceback
import warnings
from types import ModuleType

from whisper_train import __version__
from whisper_train.commands import COMMANDS
from whisper_train.commands.flags import add_config_arguments, config_from_args, metavar
from whisper_train.errors import AlreadySaid, RunRefused, UserError

# The flag helpers stay importable from here, where callers have always found them.
__all__ = ["add_config_arguments", "build_parser", "config_from_args", "main"]

EXIT_USER_ERROR = 2
# A negative number in any notation, -inf and nan too: a value, never an option.
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$|^-(inf|nan)$", re.IGNORECASE)


class Parser(argparse.ArgumentParser):
    """argparse, strict where a typo could start the wrong run: a long option is matched only
    whole (`--epoch 2` is not taken for `--epochs 2`), and an unknown one is answered by the
    command it was given to, with its usage and the nearest option it has. Each command's
    parser is of this class too (argparse makes subparsers of their parent's class)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        # `--learning-rate -1e-5` is a value, as `-0.5` already is: Python 3.11's argparse takes
        # a number only in plain or decimal form for a value, and anything else with a leading
        # dash for an option ("expected one argument"); no option of ours looks like a number.
        self._negative_number_matcher = NEGATIVE_NUMBER

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        unknown = [a for a in extras if a.startswith("-")]
        if unknown:  # here, not in the parent: the usage and options are this command's
            near = difflib.get_close_matches(
                unknown[0].split("=")[0], list(self._option_string_actions), n=1
            )
            hint = f": did you mean {near[0]}?" if near else ""
            self.error(f"unrecognized option {unknown[0]}{hint}")
        return namespace, extras

    def _check_value(self, action, value):
        """A word outside the choices, said as the configuration says it (`--mode partial`
        in train): what the flag takes, not argparse's "invalid choice"."""
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(str, action.choices))
            raise argparse.ArgumentError(action, f"expected one of {choices}, not {value!r}")

    def error(self, message: str):
        """One line, not argparse's usage block first (train's alone is 50 lines): the error,
        and where the options are listed."""
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="whisper-train",
        description="Fine-tune OpenAI Whisper on your own recordings, on the hardware you have.",
    )
    parser.add_argument("--version", action="version", version=f"whisper-train {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="Debug logging.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in _command_modules():
        command.add_parser(subparsers)
    for sub in subparsers.choices.values():
        _document_options(sub)
    return parser


def _command_modules() -> list[ModuleType]:
    """`whisper_train.commands`' modules in `COMMANDS` order. A command whose module or library
    module is missing from a partial install (e.g. a vendored subset without export.py) is left
    out."""
    found = []
    for name in COMMANDS:
        module_name = f"whisper_train.commands.{name}"
        try:
            found.append(importlib.import_module(module_name))
        except ModuleNotFoundError as exc:
            if exc.name not in (module_name, f"whisper_train.{name}"):
                raise
    return found


def _document_options(parser: argparse.ArgumentParser) -> None:
    """Every command's options read alike: a placeholder named like the flag's last word
    (`--batch-size SIZE`) and the default at the end of the help text."""
    for action in parser._actions:
        if not action.option_strings or action.help in (None, argparse.SUPPRESS):
            continue
        takes_value = action.nargs != 0
        if takes_value and action.metavar is None and action.choices is None:
            action.metavar = metavar(action.dest)
        shown = action.default
        if shown in (None, False, [], "", argparse.SUPPRESS) or "[default:" in action.help:
            continue
        if isinstance(shown, (list, tuple)):
            shown = ",".join(map(str, shown))
        action.help = f"{action.help} [default: {str(shown).replace('%', '%%')}]"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s" if args.verbose else "%(message)s",
    )
    _quiet_libraries(args.verbose)
    if not args.verbose and os.environ.get("RANK", "0") != "0":
        # The other processes of a run started by torchrun or accelerate launch: their info
        # lines are the main process's again (each would print "screening: ... (cached)");
        # their warnings and errors still show.
        logging.getLogger("whisper_train").setLevel(logging.WARNING)
    try:
        code = _handled(args)
    except SystemExit as stop:  # a run stopped by a signal: 130 / 143, its checkpoint saved
        _end_process_of_run(stop.code if isinstance(stop.code, int) else 1)
        raise
    except BaseException:  # a traceback: printed as Python would, then the same exit code
        if _holds_process_group():
            traceback.print_exc()
            _end_process_of_run(1)
        raise
    _end_process_of_run(code)
    return code


def _handled(args: argparse.Namespace) -> int:
    """The command's exit code; a user's error printed in one line."""
    try:
        return int(args.handler(args) or 0)
    except AlreadySaid:
        return EXIT_USER_ERROR
    except UserError as exc:
        if not (isinstance(exc, RunRefused) and os.environ.get("RANK", "0") != "0"):
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _holds_process_group() -> bool:
    """True in a process that ran a multi-process run (only then is its module imported)."""
    train_module = sys.modules.get("whisper_train.training.train")
    return train_module is not None and train_module.holds_process_group()


def _end_process_of_run(code: int) -> None:
    """A process of a multi-process run exits here, without tearing its process group down
    (`training.train.exit_keeping_process_group` says why); any other process returns."""
    if _holds_process_group():
        sys.modules["whisper_train.training.train"].exit_keeping_process_group(code)


def _quiet_libraries(verbose: bool) -> None:
    """Library chatter (deprecation notes, hub retries) buries the one line a user needs."""
    if verbose:
        return
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    for name in ("transformers", "accelerate", "peft", "huggingface_hub", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # "Processing audio with duration ..." for every recording `transcribe` hands it.
    logging.getLogger("faster_whisper").setLevel(logging.WARNING)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()  # "Loading weights" bars for every model load
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
