"""`whisper-train doctor`: the pre-flight checks and a gradient-parity probe (doctor.py)."""

from __future__ import annotations

import argparse
import json

from whisper_train.commands.flags import add_config_arguments, add_shared, config_from_args
from whisper_train.config.values import whole_number

# The train options doctor reads (`doctor.check_config`: the model it loads and how, the probe
# batch, the checkpointing and the compile and packing decisions): no evaluation or data-order
# option, which it never uses, is offered.
DOCTOR_OPTIONS = frozenset(
    {
        "data",
        "data_format",
        "language",
        "task",
        "packing",
        "streaming",
        "model",
        "mode",
        "lora_r",
        "lora_alpha",
        "lora_dropout",
        "lora_targets",
        "attn_implementation",
        "gradient_checkpointing",
        "offload_activations",
        "cache_encoder",
        "compile",
    }
)


def add_parser(subparsers) -> None:
    """The model, data, mode and memory flags of `train` that the checks read."""
    parser = subparsers.add_parser(
        "doctor",
        help="Check that gradient checkpointing is sound for a configuration (seconds).",
        description="Run the pre-flight checks and a gradient-parity probe (one step with and "
        "without checkpointing) for the model, mode and memory flags you would train with. "
        "--data is optional: without it a synthetic batch of the right shape is used.",
    )
    add_config_arguments(parser, groups=("data", "model", "memory"), only=DOCTOR_OPTIONS)
    parser.add_argument(
        "--probe-batch-size",
        type=whole_number(1),
        metavar="N",
        default=2,
        help="Utterances in the probe batch [default: 2].",
    )
    add_shared(parser, "json")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Exit 0 when nothing fails, 1 otherwise."""
    from whisper_train.doctor import check_config, format_report

    report = check_config(config_from_args(args), probe_batch_size=args.probe_batch_size)
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
    return 0 if report.ok else 1
