"""`whisper-train`: argument parsing only. Each command calls one library function.

The commands live in `whisper_train.commands`, one module each (`add_parser` + `run`); this
module puts them under one parser, documents their options alike and runs the one asked for.
The flags of `train` (and of the commands that share them) are generated from the
configuration dataclasses by `whisper_train.commands.flags`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
from types import ModuleType

from whisper_train import __version__
from whisper_train.commands import COMMANDS
from whisper_train.commands.flags import add_config_arguments, config_from_args, metavar
from whisper_train.errors import AlreadySaid, RunRefused, UserError

# The flag helpers stay importable from here, where callers have always found them.
__all__ = ["add_config_arguments", "build_parser", "config_from_args", "main"]

EXIT_USER_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    # bitsandbytes (imported by peft) warns on import about an optional CPU 4-bit kernel that
    # whisper-train never uses; keep it from being the first line a user reads.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    parser = build_parser()
    args = parser.parse_args(_negative_values_joined(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s" if args.verbose else "%(message)s",
    )
    _quiet_libraries(args.verbose)
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


# A negative number in any notation: argparse takes only `-5` and `-0.5` for values, and reads
# `-1e-5` as an unknown option ("expected one argument" after the whole usage).
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$|^-(inf|nan)$", re.IGNORECASE)


def _negative_values_joined(argv: list[str]) -> list[str]:
    """`--flag -1e-5` as `--flag=-1e-5`, so that a negative value reaches the option, whose
    own check then says in one line what it takes."""
    joined: list[str] = []
    for arg in argv:
        previous = joined[-1] if joined else ""
        if (
            NEGATIVE_NUMBER.match(arg)
            and previous.startswith("--")
            and "=" not in previous
            and previous != "--"
        ):
            joined[-1] = f"{previous}={arg}"
        else:
            joined.append(arg)
    return joined


def _quiet_libraries(verbose: bool) -> None:
    """Library chatter (deprecation notes, hub retries) buries the one line a user needs."""
    if verbose:
        return
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    for name in ("transformers", "accelerate", "peft", "huggingface_hub", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()  # "Loading weights" bars for every model load
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
