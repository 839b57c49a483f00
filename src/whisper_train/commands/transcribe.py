"""`whisper-train transcribe`: recordings of any length to txt, srt, vtt or json
(transcription.transcribe)."""

from __future__ import annotations

import argparse
import sys

from whisper_train.commands.evaluate import add_decoding_arguments, decoding_from_args
from whisper_train.commands.flags import add_field, add_shared, add_switch
from whisper_train.transcription.transcripts import TRANSCRIPT_FORMATS, render


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "transcribe",
        help="Transcribe audio files, folders or a manifest (any length) to txt/srt/vtt/json.",
        description="Transcribe recordings with a Whisper model; long recordings are decoded "
        "30 s window by window with timestamps, and a window whose text loops is decoded again "
        "at higher temperatures (openai-whisper's fallback).",
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="PATH",
        help="Audio files, folders of audio, or a manifest.",
    )
    add_field(
        parser,
        "model",
        help="CTranslate2 folder (fast path), Hugging Face folder, hub id, run folder, tiny.en.",
    )
    parser.add_argument(
        "--format",
        choices=TRANSCRIPT_FORMATS,
        default="txt",
        help="txt: the text; srt/vtt: subtitles with timestamps; json: the text and timed "
        "segments.",
    )
    add_field(
        parser,
        "output_dir",
        default=None,
        help="Write <name>.<format> per recording here (default: print to the terminal).",
    )
    add_field(parser, "language", help="Language of the speech (default: detect).")
    add_field(
        parser,
        "task",
        default=None,
        help="transcribe, or translate to English (default: the model's own: transcribe "
        "unless it was fine-tuned to translate).",
    )
    add_shared(parser, "beam_size")
    add_switch(
        parser,
        "--word-timestamps",
        help="Time each word from the model's alignment heads: json gives each segment its "
        "words, srt/vtt underline each word while it is spoken (not for whisper.cpp models).",
    )
    add_decoding_arguments(parser)
    add_shared(parser, "assistant")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """0: all transcribed; 1: some recordings failed; 2: none could be transcribed."""
    from whisper_train.transcription.transcribe import transcribe_paths  # loads every runtime

    results = transcribe_paths(
        args.model,
        args.inputs,
        format=args.format,
        language=args.language,
        task=args.task,
        beam_size=args.beam_size,
        output_dir=args.output_dir,
        decoding=decoding_from_args(args),
        word_timestamps=args.word_timestamps,
        assistant=args.assistant,
    )
    good = [r for r in results if r.error is None]
    if args.output_dir is None:
        for result in good:
            if len(results) > 1:
                print(f"==> {result.source} <==")
            print(render(result, args.format), end="")
    failed = len(results) - len(good)
    if not good:
        print(f"error: none of the {len(results)} recordings could be transcribed", file=sys.stderr)
        return 2
    if failed:
        print(f"{failed} of {len(results)} recordings failed (listed above)", file=sys.stderr)
        return 1
    if args.output_dir is not None:
        print(f"wrote {len(good)} transcript(s) to {args.output_dir}")
    return 0
