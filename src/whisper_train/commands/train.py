"""`whisper-train train`: every option is a field of `config.RunConfig` (flags.py)."""

from __future__ import annotations

import argparse

from whisper_train.commands.flags import (
    add_config_arguments,
    add_help_options,
    config_from_args,
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="Fine-tune a Whisper model on your data.",
        add_help=False,  # -h lists the options a first run needs, --help-all every option
        description="Fine-tune Whisper (full, LoRA or frozen encoder) with non-reentrant gradient "
        "checkpointing, evaluate with generate-based WER, and save OUTPUT/final/.",
    )
    add_help_options(parser)
    add_config_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """0 when the run finished; prints the final WER when it was measured."""
    from whisper_train.training.train import train

    result = train(config_from_args(args))
    if result.final_wer is not None:
        print(f"final WER: {100 * result.final_wer:.2f}%")
    return 0
