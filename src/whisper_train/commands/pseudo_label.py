"""`whisper-train pseudo-label`: a model's transcripts of audio as a manifest `train --data`
reads (transcription.pseudo_label)."""

from __future__ import annotations

import argparse
import sys

from whisper_train.commands.evaluate import add_decoding_arguments, decoding_from_args
from whisper_train.commands.flags import add_field, add_shared, add_switch
from whisper_train.config.values import number_above


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "pseudo-label",
        help="Transcribe unlabelled audio with a model into a manifest train reads.",
        description="Label a folder, manifest or data layout with a model's transcripts, "
        "written row by row to a JSONL manifest that `whisper-train train --data` trains on. "
        "Run it again to continue where it stopped: no clip is labelled twice or lost. Where "
        "the data has transcripts, each row keeps them as reference_text with the model's WER "
        "against them.",
    )
    add_field(
        parser,
        "model",
        help="The model that labels: a CTranslate2 folder (fast path), Hugging Face folder, "
        "hub id, run folder, tiny.en.",
    )
    add_field(
        parser,
        "data",
        required=True,
        help="Audio to label: a folder of audio files, a manifest (with or without a text "
        "column), or any layout train reads (subtitles, audiofolder, Kaldi, ...).",
    )
    add_field(parser, "data_format", help="Force --data's layout instead of detecting it.")
    parser.add_argument(
        "--output",
        required=True,
        metavar="PATH",
        help="The manifest to write (FILE.jsonl); OUTPUT.progress beside it records the clips "
        "done, so a rerun continues.",
    )
    add_field(parser, "language", help="Language of the speech (default: the data's, else detect).")
    add_field(
        parser,
        "task",
        default=None,
        help="transcribe, or translate to English (default: the model's own).",
    )
    add_shared(parser, "beam_size")
    add_field(
        parser,
        "timestamps",
        help="Write one row per decoded segment, timed within its file, for `train "
        "--data-format subtitles --timestamps` (off: one row per clip, a recording over 30 s "
        "cut into windows of at most 30 s).",
    )
    parser.add_argument(
        "--max-wer",
        type=number_above(0, "0.1", or_equal=True),
        default=None,
        metavar="FRACTION",
        help="Leave out clips whose WER against the data's own transcript is over this "
        "(0.1 is 10%%; distil-whisper filters at 0.1 for English). Needs data with transcripts.",
    )
    add_switch(
        parser,
        "--overwrite",
        help="Label again from the start where --output holds labels made with other settings "
        "(or a file pseudo-label did not write) instead of refusing.",
    )
    add_decoding_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """0: every clip labelled; 1: some clips could not be read (named); 2: none could."""
    from whisper_train.transcription.pseudo_label import pseudo_label, skipped_line

    result = pseudo_label(
        args.model,
        args.data,
        args.output,
        data_format=args.data_format,
        language=args.language,
        task=args.task,
        beam_size=args.beam_size,
        decoding=decoding_from_args(args),
        timestamps=args.timestamps,
        max_wer=args.max_wer,
        overwrite=args.overwrite,
    )
    decoded = result.labelled + result.over_max_wer + result.no_speech
    if decoded:
        rate = decoded / result.seconds if result.seconds else 0.0
        speed = result.audio_seconds / result.seconds if result.seconds else 0.0
        print(
            f"labelled {decoded} clip(s), {result.audio_seconds:.1f} s of audio, in "
            f"{result.seconds:.1f} s ({rate:.2f} clips/s, {speed:.1f} s of audio a second): "
            f"{result.rows} row(s) written to {result.output}"
        )
    if result.over_max_wer:
        print(
            f"--max-wer {args.max_wer:g}: left out {result.over_max_wer} of {result.compared} "
            "clip(s) whose WER against their transcript was over it"
        )
    if result.no_speech:
        print(
            f"left out {result.no_speech} clip(s) where the model wrote nothing (no speech; "
            "train learns silence from --nonspeech)"
        )
    if result.skipped:
        print(skipped_line(result.skipped), file=sys.stderr)
        if not decoded and not result.already_done:
            print(f"error: none of the {result.clips} clips could be read", file=sys.stderr)
            return 2
        return 1
    return 0
