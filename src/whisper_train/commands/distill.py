"""`whisper-train distill`: `train` with a teacher. Every train option applies (flags.py); the
student is made from --teacher (--decoder-layers N) or is --student, and the encoder is frozen
unless --mode says otherwise (distil-whisper's student keeps the teacher's encoder, frozen)."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from whisper_train.commands.flags import (
    add_config_arguments,
    add_help_options,
    config_from_args,
)
from whisper_train.config import RunConfig, read_yaml
from whisper_train.errors import UserError

# The options a first distillation needs besides train's first-run ones: shown by `distill -h`.
DISTILL_OPTIONS = ("teacher", "decoder_layers")
# The mode of a distillation unless --mode (or --config) gives one: the teacher's encoder,
# copied and frozen, is shared with the teacher (one encoder pass a step for both).
DISTILL_MODE = "freeze-encoder"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "distill",
        help="Distil a Whisper model into a smaller, faster student.",
        add_help=False,  # -h lists the options a first run needs, --help-all every option
        description="Train a student (the teacher's encoder and N of its decoder layers, or "
        "--student) on cross-entropy plus the KL divergence from the teacher's next-token "
        "distribution; every train option applies.",
    )
    add_help_options(parser, also=DISTILL_OPTIONS)
    add_config_arguments(parser)
    parser.add_argument(
        "--student",
        metavar="MODEL",
        default=None,
        help="Distil into this model (it must share the teacher's tokenizer) instead of one "
        "made from the teacher with --decoder-layers.",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """0 when the run finished; prints the final WER when it was measured."""
    from whisper_train.training.train import train

    result = train(distill_config(args))
    if result.final_wer is not None:
        print(f"final WER: {100 * result.final_wer:.2f}%")
    return 0


def distill_config(args: argparse.Namespace) -> RunConfig:
    """train's configuration from distill's flags: --student is --model, and the mode is
    DISTILL_MODE unless one was given."""
    asked = vars(args)
    from_file = _yaml_options(args.config)
    if "teacher" not in asked and not from_file.get("teacher"):
        raise UserError(
            "distill needs --teacher MODEL: the model to distil (a folder, run folder, hub id, "
            "or tiny.en / base)"
        )
    student, layers = args.student, asked.get("decoder_layers", from_file.get("decoder_layers"))
    if student is not None and "model" in asked:
        raise UserError(f"--student {student} with --model {args.model}: give the student once")
    if student is not None and layers is not None:
        raise UserError(
            f"--student {student} with --decoder-layers {layers}: the student is either a "
            "model of its own or made from the teacher; drop one of them"
        )
    if student is None and layers is None and "model" not in asked:
        raise UserError(
            "distill needs the student: --decoder-layers N (the teacher's encoder and N of its "
            "decoder layers; distil-whisper keeps 2) or --student MODEL"
        )
    if student is not None:
        args.model = student
        if "cache_encoder" not in asked and "cache_encoder" not in from_file:
            # its encoder is not the teacher's: the teacher reads the audio, never cached
            args.cache_encoder = False
    if "mode" not in asked and "mode" not in from_file:
        args.mode = DISTILL_MODE
    return config_from_args(args)


def _yaml_options(path: str | None) -> dict:
    """The options in --config FILE (empty where there is none, or it does not read: the
    configuration reads it again and says why in one line)."""
    if not path or not Path(path).is_file():
        return {}
    try:
        options = read_yaml(Path(path).read_text(encoding="utf-8"))
    except (UserError, ValueError, OSError, yaml.YAMLError):
        return {}
    return options if isinstance(options, dict) else {}
