"""`whisper-train evaluate`: WER/CER of a model on held-out data, optionally against a baseline
model (evaluation.evaluate)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from whisper_train.commands.flags import PLACEHOLDERS, add_field, add_shared
from whisper_train.config import long_form_sets, named_sets, nonspeech_sets
from whisper_train.evaluation.scoring import NORMALIZERS
from whisper_train.models import folder_added_languages
from whisper_train.transcription import decoding

if TYPE_CHECKING:
    from whisper_train.evaluation.evaluate import EvalReport
    from whisper_train.evaluation.nonspeech import NonSpeechReport


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "evaluate",
        help="Transcribe held-out data and report WER/CER (optionally against a baseline model).",
        description="Generate transcripts for --data with --model and score them.",
    )
    add_field(
        parser,
        "model",
        required=True,
        default=None,
        help="Model folder, hub id, run folder or tiny.en.",
    )
    parser.add_argument(
        "--data",
        required=True,
        action="append",
        metavar=PLACEHOLDERS["eval_data"],
        help="Data in any layout `check-data` accepts; NAME=PATH, repeated, scores several sets "
        "(each set's reports then go to OUTPUT/NAME/); NAME:LANG=PATH states a set's language "
        "(e.g. general:en=general-english/). NAME:long=PATH is long recordings (audio + "
        ".srt/.vtt/.txt of the same name, or manifest rows), each decoded whole in 30 s windows "
        "with timestamps, as `transcribe` does, and scored over its whole transcript; a clip "
        "over 30 s in any set is decoded that way too, never cut to its first window. "
        "NAME:nonspeech=PATH is clips where nobody speaks (a folder of audio, or any layout "
        "with empty transcripts; PATH builtin synthesises silence, noise, hum, tones, clicks "
        "and chords), scored by the words the model invents per minute of audio and the share "
        "of clips given any text.",
    )
    add_field(parser, "data_format", help="Force a data layout.")
    parser.add_argument(
        "--output",
        default=None,
        metavar="PATH",
        help="Write the JSON report to this file (a folder gets report.json); --baseline adds "
        "report.baseline.json, report.md and report.png beside it. Default: none without "
        "--baseline; with it, RUN/evaluation/report.json when --model is a whisper-train run "
        "folder (RUN or RUN/final), else ./report.json.",
    )
    add_field(
        parser,
        "overwrite",
        help="Replace report files that already exist at --output (off by default: refused).",
    )
    parser.add_argument(
        "--normalizer",
        choices=NORMALIZERS,
        default=None,
        help="Text normaliser before scoring (default: english when every clip is decoded in "
        "English, basic otherwise).",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="MODEL",
        help="Also evaluate this model; writes report.md and report.png beside the JSON.",
    )
    add_field(parser, "batch_size", default=8, help="Clips per generate call.")
    add_field(parser, "eval_subset", help="Use only the first N clips (default: all).")
    add_field(
        parser,
        "language",
        help="Language of the speech, e.g. en or de, for rows without a `language` column and "
        "sets without NAME:LANG (default: the model's configured language; with none, each "
        "clip's language is detected, as openai-whisper does). Multilingual models also "
        "report the language they detect in each clip, and language-ID accuracy where the "
        "language is stated.",
    )
    add_shared(parser, "beam_size")
    add_field(parser, "generation_max_length", help="Longest transcript in tokens.")
    add_decoding_arguments(parser)
    add_shared(parser, "assistant")
    add_field(
        parser,
        "condition_on_previous_text",
        help="Long-form decoding (clips over 30 s, NAME:long sets) gives each window the "
        "previous windows' text as its prompt, as openai-whisper's and faster-whisper's "
        "transcribe do by default (off: each window alone, as `whisper-train transcribe` "
        "decodes).",
    )
    parser.set_defaults(handler=run)


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """--temperatures, --compression-ratio-threshold, --logprob-threshold,
    --no-speech-threshold (evaluate, transcribe): train's flags, in decoding's words."""
    add_field(parser, "temperatures", help=decoding.TEMPERATURES_HELP + ".")
    add_field(parser, "compression_ratio_threshold", help=decoding.COMPRESSION_RATIO_HELP + ".")
    add_field(parser, "logprob_threshold", help=decoding.LOGPROB_HELP + ".")
    add_field(parser, "no_speech_threshold", help=decoding.NO_SPEECH_HELP + ".")


def decoding_from_args(args: argparse.Namespace):
    """The DecodingOptions the decoding flags ask for (UserError if malformed)."""
    return decoding.DecodingOptions(
        temperatures=decoding.parse_temperatures(args.temperatures),
        compression_ratio_threshold=decoding.parse_threshold(
            args.compression_ratio_threshold, "--compression-ratio-threshold"
        ),
        logprob_threshold=decoding.parse_threshold(args.logprob_threshold, "--logprob-threshold"),
        no_speech_threshold=decoding.parse_threshold(
            args.no_speech_threshold, "--no-speech-threshold"
        ),
    )


def run(args: argparse.Namespace) -> int:
    """Prints WER/CER (the model's as soon as it is scored, then the baseline's) and where the
    reports went; `evaluate` writes report.json (+ .md/.png with --baseline)."""
    # The library, imported when the command runs: --help need not load matplotlib and more.
    from whisper_train.evaluation.evaluate import evaluate, report_paths

    decoding_options = decoding_from_args(args)

    def show(role: str, report: EvalReport) -> None:
        if role == "baseline":
            _print_scores(f"baseline {args.baseline}", report)
            return
        _print_scores(args.model, report)
        if report.skipped:
            writes_json = bool(args.output or args.baseline)
            where = "see the JSON report" if writes_json else "--output FILE.json lists them"
            print(f"skipped {len(report.skipped)} unreadable clip(s); {where}")

    added = folder_added_languages(args.model)  # NAME:LANG may name a language it adds
    sets = named_sets(args.data, "--data", added)
    long_form = long_form_sets(args.data, "--data", added)
    nonspeech = nonspeech_sets(args.data, "--data", added)
    several = len(sets) > 1
    default_reports = report_paths(args.model, output=None, baseline=args.baseline)
    reports_root = Path(args.output) if args.output else None
    if several and reports_root is None and default_reports:
        reports_root = default_reports[0].parent
    for name, (data, set_language) in sets.items():
        if several:
            print(f"[{name}] {data}")
        output = args.output if not several else (reports_root / name if reports_root else None)
        if name in nonspeech:
            _evaluate_nonspeech(args, data, set_language, output, several, decoding_options)
            continue
        result = evaluate(
            args.model,
            data,
            data_format=args.data_format,
            output=f"{output}/" if several and output else output,
            overwrite=args.overwrite,
            baseline=args.baseline,
            normalizer=args.normalizer,
            batch_size=args.batch_size,
            eval_subset=args.eval_subset,
            language=set_language or args.language,
            beam_size=args.beam_size,
            max_length=args.generation_max_length,
            on_report=show,
            decoding=decoding_options,
            long_form=name in long_form,
            condition_on_previous_text=args.condition_on_previous_text,
            assistant=args.assistant,
        )
        _say_written(result.paths)
    return 0


def _evaluate_nonspeech(args, data, language, output, several, decoding_options) -> None:
    from whisper_train.evaluation.nonspeech import evaluate_nonspeech

    def show(role: str, report: NonSpeechReport) -> None:
        name = f"baseline {args.baseline}" if role == "baseline" else args.model
        print_nonspeech(name, report)

    paths = evaluate_nonspeech(
        args.model,
        data,
        data_format=args.data_format,
        output=f"{output}/" if several and output else output,
        overwrite=args.overwrite,
        baseline=args.baseline,
        batch_size=args.batch_size,
        eval_subset=args.eval_subset,
        language=language or args.language,
        beam_size=args.beam_size,
        max_length=args.generation_max_length,
        decoding=decoding_options,
        on_report=show,
        assistant=args.assistant,
    )
    _say_written(paths)


def _say_written(paths) -> None:
    """One line that says where every file went: the default may be a folder never named."""
    if paths:
        names = ", ".join(path.name for path in paths)
        print(f"wrote {names} to {paths[0].parent.resolve()}")


def print_nonspeech(name: str, report: NonSpeechReport) -> None:
    s = report.scores
    print(
        f"{name}: {s.words_per_minute:.1f} words per minute where nobody speaks; text on "
        f"{s.clips_with_text} of {s.clips} clips ({100 * s.share_with_text:.0f}%), "
        f"{s.seconds / 60:.1f} min of audio"
    )


def _print_scores(name: str, report: EvalReport) -> None:
    s = report.scores
    print(
        f"{name}: WER {100 * s.wer:.2f}%  CER {100 * s.cer:.2f}%  "
        f"(orthographic WER {100 * s.orthographic_wer:.2f}%, n={s.n}, "
        f"normalizer {report.normalizer})"
    )
    if counts := report.detected_languages:
        detected = ", ".join(f"{code} {n}" for code, n in counts.items())
        identified = report.language_id
        accuracy = (
            f"; language ID {100 * identified.accuracy:.1f}% of {identified.n} with a stated "
            "language"
            if identified is not None
            else ""
        )
        print(f"  detected languages: {detected}{accuracy}")
    if report.long_form_recordings:
        # What a dropped window (deletions) or a repeated one (insertions) costs shows here.
        previous = "with" if report.condition_on_previous_text else "without"
        print(
            f"  long-form: {report.long_form_recordings} of {s.n} recording(s) decoded in 30 s "
            f"windows with timestamps, {previous} the previous text; insertions "
            f"{100 * s.insertion_rate:.2f}%, deletions {100 * s.deletion_rate:.2f}% of "
            f"{s.reference_words} reference words"
        )
    if report.pauses is not None:  # recordings with subtitles: where their cues say nobody speaks
        pauses = report.pauses
        print(
            f"  in the pauses between subtitle cues ({pauses.clips} pause(s), "
            f"{pauses.seconds / 60:.1f} min): {pauses.words_per_minute:.1f} words a minute "
            f"invented, text in {pauses.clips_with_text} of them"
        )
    # Long-form recordings fall back window by window inside generate, which does not say
    # which windows did: the count is of the other utterances.
    windowed = s.n - report.long_form_recordings
    if report.decoding is not None and report.decoding.fallback and windowed:
        # Loop figures are scored on the kept transcripts: say how many needed decoding again.
        unresolved = f", {report.unresolved} failed at every temperature" * bool(report.unresolved)
        print(
            f"  temperature fallback: {report.fallbacks} of {windowed} utterance(s) decoded again "
            f"(looping or unlikely at temperature {report.decoding.temperatures[0]:g}){unresolved}"
        )
    if report.silenced:
        # A speech set's deletions may come from here: say how many clips read as silence.
        print(
            f"  no speech: {report.silenced} of {windowed} utterance(s) judged silence and "
            f"given no text (--no-speech-threshold {report.decoding.no_speech_threshold:g})"
        )
