"""`whisper-train average RUN_DIR`: a finished run's checkpoints averaged, evaluated on its own
sets, and written to --output or kept as final/ where it wins (training.average_run)."""

from __future__ import annotations

import argparse
from pathlib import Path

from whisper_train.commands.flags import add_field


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "average",
        help="Average a finished run's checkpoints; keep the average as final/ where it wins.",
        description="Average the weights (LoRA: the adapters) of a finished run's last or best "
        "N checkpoints, evaluate the average on the run's own evaluation sets, and replace "
        "final/ (and result.json, the model card) only where it beats what final/ holds by "
        "the run's own rule (lowest --metric-for-best WER, guard and non-speech sets held); "
        "with --output, write it there whatever the verdict.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="The --output-dir of a train run.")
    add_field(
        parser,
        "average_checkpoints",
        default=None,
        help="How many checkpoints to average (default: the run's own --average-checkpoints).",
    )
    add_field(
        parser,
        "average_by",
        default=None,
        help="The last N checkpoints saved, or the N best evaluated by the run's rule "
        "(default: the run's own --average-by).",
    )
    parser.add_argument(
        "--output",
        default=None,
        metavar="DIR",
        help="A new folder for the averaged model (final/ is then left as it is).",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from whisper_train.training.average_run import average_run

    average_run(
        Path(args.run_dir),
        count=args.average_checkpoints,
        by=args.average_by,
        output=Path(args.output) if args.output else None,
    )
    return 0


__all__ = ["add_parser", "run"]
