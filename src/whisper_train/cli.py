"""`whisper-train`: argument parsing only. Each command calls one library function.

Every option of `train` (and of the commands that share its flags) is a field of a dataclass in
`config.py`; the flags are generated from those fields, so a flag, a YAML key and the resolved
configuration written next to a model always agree.
"""

from __future__ import annotations

import argparse
import logging
import sys
import types
from dataclasses import MISSING, fields
from typing import Union, get_args, get_origin

from whisper_train import __version__
from whisper_train.config import GROUPS, RunConfig, field_owners
from whisper_train.errors import UserError

EXIT_USER_ERROR = 2


# ---------------------------------------------------------------------------------------------
# Flags generated from the configuration dataclasses


def add_config_arguments(parser: argparse.ArgumentParser, groups=tuple(GROUPS)) -> None:
    """One flag per dataclass field (`lora_r` → `--lora-r`), grouped as in config.py.

    Defaults are suppressed so that only flags the user typed override `--config FILE.yaml`.
    """
    parser.add_argument(
        "--config", metavar="FILE.yaml", help="Options from a YAML file; flags override it."
    )
    for group_name in groups:
        group = parser.add_argument_group(f"{group_name} options")
        for f in fields(GROUPS[group_name]):
            flag = "--" + f.name.replace("_", "-")
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            help_text = f.metadata.get("help", "")
            if default not in (None, False, [], ""):
                shown = ",".join(default) if isinstance(default, list) else default
                help_text += f" [default: {shown}]"
            if _is_bool(f.type):
                group.add_argument(
                    flag,
                    action=argparse.BooleanOptionalAction,
                    default=argparse.SUPPRESS,
                    help=help_text,
                )
            elif "const" in f.metadata:  # a flag that may stand alone: --resume
                group.add_argument(
                    flag,
                    metavar=_metavar(f.name),
                    nargs="?",
                    const=f.metadata["const"],
                    default=argparse.SUPPRESS,
                    help=help_text,
                )
            else:
                group.add_argument(
                    flag, metavar=_metavar(f.name), default=argparse.SUPPRESS, help=help_text
                )


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Defaults, then the YAML file, then the flags typed on the command line."""
    config = RunConfig.from_yaml(args.config) if getattr(args, "config", None) else RunConfig()
    owners = field_owners()
    config.update({key: value for key, value in vars(args).items() if key in owners})
    return config.validate()


def _is_bool(annotation) -> bool:
    if annotation in (bool, "bool", "bool | None"):
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        return bool in get_args(annotation)
    return False


def _metavar(name: str) -> str:
    return name.split("_")[-1].upper()


# ---------------------------------------------------------------------------------------------
# Commands


def _add_train_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="Fine-tune a Whisper model on your data.",
        description="Fine-tune Whisper (full, LoRA or frozen encoder) with non-reentrant gradient "
        "checkpointing, evaluate with generate-based WER, and save OUTPUT/final/.",
    )
    add_config_arguments(parser)
    parser.set_defaults(handler=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from whisper_train.train import train

    result = train(config_from_args(args))
    if result.final_wer is not None:
        print(f"final WER: {100 * result.final_wer:.2f}%")
    return 0


def _add_demo_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="Offline end-to-end demo: synthesise speech, fine-tune tiny.en, compare WER.",
        description="Synthesise a small English dataset, evaluate tiny.en on held-out utterances, "
        "fine-tune it, evaluate again and print both WERs. Runs offline in a few minutes on a CPU.",
    )
    parser.add_argument(
        "--output-dir",
        default="whisper-train-demo",
        help="Holds the synthesised data/ and the training run/ (its model in run/final/).",
    )
    parser.add_argument("--model", default="tiny.en", help="Model to fine-tune [default: tiny.en].")
    parser.add_argument(
        "--train-utterances", type=int, default=128, help="Synthesised utterances to train on."
    )
    parser.add_argument(
        "--eval-utterances",
        type=int,
        default=32,
        help="Held-out utterances scored before and after fine-tuning.",
    )
    parser.add_argument("--epochs", type=float, default=4, help="Passes over the training set.")
    parser.add_argument(
        "--seed", type=int, default=0, help="Seeds the synthesised data and training."
    )
    parser.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from whisper_train.demo import run_demo

    run_demo(
        output_dir=args.output_dir,
        model=args.model,
        train_utterances=args.train_utterances,
        eval_utterances=args.eval_utterances,
        epochs=args.epochs,
        seed=args.seed,
    )
    return 0


# Commands whose parsers live beside their library functions: (module, add_parser, run).
_PLUGGED_COMMANDS = [
    ("whisper_train.evaluate", "add_evaluate_parser", "run_evaluate"),
    ("whisper_train.doctor", "add_doctor_parser", "run_doctor"),
    ("whisper_train.checkdata", "add_check_data_parser", "run_check_data"),
    ("whisper_train.export", "add_export_parser", "run_export"),
    ("whisper_train.transcribe", "add_transcribe_parser", "run_transcribe"),
]


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="whisper-train",
        description="Fine-tune OpenAI Whisper on your own recordings, on the hardware you have.",
    )
    parser.add_argument("--version", action="version", version=f"whisper-train {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="Debug logging.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_train_parser(subparsers)
    for module_name, add_name, run_name in _PLUGGED_COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:  # a partial install (e.g. a vendored subset)
            if exc.name != module_name:
                raise
            continue
        before = set(subparsers.choices)
        getattr(module, add_name)(subparsers)
        for name in set(subparsers.choices) - before:
            sub = subparsers.choices[name]
            if sub.get_default("handler") is None:  # the module's run function handles it
                sub.set_defaults(handler=getattr(module, run_name))
    _add_demo_parser(subparsers)
    for sub in subparsers.choices.values():
        _document_options(sub)
    return parser


def _document_options(parser: argparse.ArgumentParser) -> None:
    """Every command's options read alike: a placeholder named like the flag's last word
    (`--batch-size SIZE`) and the default at the end of the help text."""
    for action in parser._actions:
        if not action.option_strings or action.help in (None, argparse.SUPPRESS):
            continue
        takes_value = action.nargs != 0
        if takes_value and action.metavar is None and action.choices is None:
            action.metavar = _metavar(action.dest)
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
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s" if args.verbose else "%(message)s",
    )
    _quiet_libraries(args.verbose)
    try:
        return int(args.handler(args) or 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


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
