"""`whisper-train check-data`: look at a dataset before spending GPU hours on it.

Reads the data in any layout `whisper_train.data` accepts, opens every audio header, decodes a
sample of the clips of each audio format it meets (every clip under --strict: a header that
opens does not prove the samples decode; every clip of a float file, whose samples may be NaN or
infinite) and reports: clips, hours, a duration histogram, sample rates and channel counts,
languages, and the problems that would cost a run: unreadable or missing audio, NaN or infinite
samples, clips over Whisper's 30 s window, windows past the end of their file, empty labels,
labels longer than the decoder's 448 positions, the same audio twice (same file, or same bytes
under two names), and characters a tokenizer handles badly (control characters, text that does not survive an
encode/decode round trip). Duplicate transcripts and rare characters are reported as notes:
common in real data ("yes", "no"), worth a look, no reason to stop.

This package: `check_data` here; the audio checks in `audio`, the transcript checks in
`transcripts`, the tokenizer that counts labels as `train` does in `tokenizer`, and the report
(findings, histogram, text and PNG) in `report`.

Exit codes for the CLI: 0 clean (notes allowed), 1 problems found under --strict (without it
they are warnings and the exit is 0), 2 unusable input (the data cannot be read at all).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from whisper_train.checkdata.audio import (
    DECODED_PER_FORMAT,
    PREFIX_BYTES,
    check_audio,
    check_stream_audio,
)
from whisper_train.checkdata.report import (
    NOTE_KINDS,
    PROBLEM_KINDS,
    DataReport,
    Finding,
    format_report,
    histogram_edges,
    write_histogram_png,
)
from whisper_train.checkdata.tokenizer import TRAIN_DEFAULTS, label_encoder_for, load_tokenizer
from whisper_train.checkdata.transcripts import (
    CHARS_PER_TOKEN_ESTIMATE,
    check_characters,
    check_labels,
)
from whisper_train.data.layouts import load_examples
from whisper_train.data.streaming import stream_source


def check_data(
    path: str | Path,
    *,
    data_format: str | None = None,
    model: Any = None,
    strict: bool = False,
    language: str | None = TRAIN_DEFAULTS.language,
    task: str = TRAIN_DEFAULTS.task,
    timestamps: bool = TRAIN_DEFAULTS.timestamps,
) -> DataReport:
    """Inspect the data at `path`. Labels are measured with `model`: a `--model` spec (folder,
    hub id, run folder or tiny.en) whose tokenizer is loaded, a Whisper tokenizer, or None
    (labels measured in characters). With a model, a label is too long exactly when `train
    --model` would skip it with the same `language`, `task` and `timestamps`.

    Raises UserError when the data cannot be read at all (no such path, unknown layout, bad
    rows). `strict` decodes every clip (without it, DECODED_PER_FORMAT of each audio format);
    the `check-data` command turns the report's problems into the exit code.
    """
    spec = str(model) if isinstance(model, (str, Path)) else None
    encoder = None
    if model is not None:
        encoder = label_encoder_for(model, language=language, task=task, timestamps=timestamps)
    tokenizer = encoder.tokenizer if encoder is not None else None
    report = DataReport(path=str(path))
    source = stream_source(path, data_format=data_format)
    if source is None:
        examples = load_examples(path, data_format=data_format)
        check_audio(examples, report, decode_all=strict)
    else:  # shards: one pass through the stream
        examples = check_stream_audio(source, report)
    report.clips = len(examples)
    report.tokenizer = getattr(tokenizer, "name_or_path", None) or (
        type(tokenizer).__name__ if tokenizer is not None else None
    )
    report.languages = dict(Counter(example.language or "unspecified" for example in examples))
    if encoder is not None and encoder.multilingual and encoder.language is None:
        report.without_language = report.languages.get("unspecified", 0)
    check_labels(examples, encoder, report)
    check_characters(examples, tokenizer, report)
    if spec is not None:
        report.tokenizer = f"--model {spec}'s tokenizer"
    return report


__all__ = [
    "CHARS_PER_TOKEN_ESTIMATE",
    "DECODED_PER_FORMAT",
    "NOTE_KINDS",
    "PREFIX_BYTES",
    "PROBLEM_KINDS",
    "DataReport",
    "Finding",
    "check_data",
    "format_report",
    "histogram_edges",
    "label_encoder_for",
    "load_tokenizer",
    "write_histogram_png",
]
