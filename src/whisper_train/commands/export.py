"""`whisper-train export`: merge LoRA, save for transformers, faster-whisper, whisper.cpp or
openai-whisper, and prove it transcribes as its source does in that runtime (deploy.export)."""

from __future__ import annotations

import argparse

from whisper_train.commands.flags import add_field, add_switch
from whisper_train.config.values import whole_number
from whisper_train.deploy.parity import CHECK_CLIPS, ExportParityError
from whisper_train.formats.registry import DEFAULT_FORMAT, DEVICES, EXPORT_QUANTIZATIONS, FORMATS
from whisper_train.transcription.word_timestamps import ALIGNMENT_CLIPS


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "export",
        help="Merge LoRA, save for transformers, faster-whisper, whisper.cpp or openai-whisper, "
        "and verify in that runtime.",
        description="Export a model or a whisper-train run folder; ends with a check that the "
        "export, run by its own runtime, transcribes as the source does.",
    )
    add_field(
        parser,
        "model",
        required=True,
        default=None,
        help="Run folder (OUTPUT), model folder, hub id or tiny.en.",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default=DEFAULT_FORMAT,
        help="hf (transformers), ct2 (CTranslate2 / faster-whisper), ggml (whisper.cpp "
        "ggml-model.bin) or openai (openai-whisper model.pt) [default: hf].",
    )
    parser.add_argument(
        "--output", required=True, metavar="DIR", help="New folder for the exported model."
    )
    add_field(
        parser,
        "overwrite",
        help="If --output holds an earlier export, move it aside to OUTPUT.old-<date>-<time> "
        "(nothing is deleted) instead of refusing (off by default).",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default=None,
        help="Where the export will run; picks the default --quantization "
        "(default: cuda if this machine has a GPU, else cpu).",
    )
    parser.add_argument(
        "--quantization",
        choices=EXPORT_QUANTIZATIONS,
        default=None,
        help="Weight precision (default: float32 for hf; float16 for ggml and openai; for ct2 "
        "float16 with --device cuda, float32 with --device cpu; int8* only for ct2).",
    )
    parser.add_argument(
        "--check-data",
        default=None,
        metavar="PATH",
        help="Clips with transcripts for the check (default: --check-clips synthesised English "
        "sentences); their language is forced in both decoders.",
    )
    parser.add_argument(
        "--check-clips",
        type=whole_number(1),
        metavar="N",
        default=CHECK_CLIPS,
        help=f"Clips in the parity check [default: {CHECK_CLIPS}].",
    )
    add_switch(
        parser,
        "--check",
        default=True,
        help="Check that the export, run by its own runtime, transcribes as its source does; "
        "--no-check writes it unchecked (no runtime client needed).",
    )
    parser.add_argument(
        "--find-alignment-heads",
        metavar="PATH",
        default=None,
        help="Find the fine-tuned model's own alignment heads (word timestamps) on these clips "
        "and export them: the heads whose cross-attention best follows the reference model's "
        f"word times (up to {ALIGNMENT_CLIPS} clips of at most 30 s; tiny.en: about a CPU "
        "second a clip).",
    )
    parser.add_argument(
        "--alignment-reference",
        metavar="MODEL",
        default=None,
        help="Whose word times --find-alignment-heads follows (default: the run's base model).",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """0: exported and checked; 1: exported but the check failed; 2: a usage error (a missing
    runtime client included)."""
    from whisper_train.deploy.export import export_model  # here: --help need not load peft

    try:
        result = export_model(
            args.model,
            format=args.format,
            output=args.output,
            quantization=args.quantization,
            check_data=args.check_data,
            check=args.check,
            n_check_clips=args.check_clips,
            device=args.device,
            overwrite=args.overwrite,
            alignment_data=args.find_alignment_heads,
            alignment_reference=args.alignment_reference,
        )
    except ExportParityError as exc:
        print(f"error: {exc}")
        return 1
    merged = " (LoRA merged)" if result.merged_lora else ""
    print(
        f"exported {args.model}{merged} to {result.output} ({result.format}, {result.quantization})"
    )
    if result.alignment is not None:
        found = result.alignment
        print(
            f"alignment heads {found.heads}: word starts {found.error_s:.3f} s (median) from the "
            f"reference's on {found.words} words"
        )
    parity = result.parity
    if parity is not None:
        print(f"export check passed: {parity.summary()}")
    return 0
