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

Exit codes for the CLI: 0 clean (notes allowed), 1 problems found under --strict (without it
they are warnings and the exit is 0), 2 unusable input (the data cannot be read at all).
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
import unicodedata
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from whisper_train.audio import CHUNK_LENGTH, AudioHeader, NonFiniteAudio, load_audio, read_header
from whisper_train.config import DataConfig
from whisper_train.data.examples import Example
from whisper_train.data.labels import MAX_DECODER_TOKENS, LabelEncoder
from whisper_train.data.layouts import load_examples
from whisper_train.data.screening import HASH_THREADS, HEADER_THREADS, map_in_threads
from whisper_train.data.streaming import (
    StreamSource,
    audio_header,
    decode_audio,
    open_stream,
    read_row,
    stream_source,
)
from whisper_train.errors import AudioError, UserError

# Without a tokenizer, labels are measured in characters: English BPE averages ~4 characters a
# token, so 2 characters a token is a cautious bound for "probably over 448 tokens".
CHARS_PER_TOKEN_ESTIMATE = 2
# check-data has no --language, --task or --timestamps: with a model, labels are counted as
# `train` counts them under its defaults for those options (a row's own language still wins);
# `check_data` takes them as arguments.
_TRAIN_DEFAULTS = DataConfig()
# Histogram bins: round widths (1, 2, 2.5 or 5 times a power of ten) spanning the data, at most
# HISTOGRAM_MAX_BINS of them; bins are sized as if the data spanned at least
# HISTOGRAM_MIN_SPAN_SECONDS, so they are never narrower than a tenth of a second (finer bins
# only scatter clips of the same length over several bars).
HISTOGRAM_MAX_BINS = 12
HISTOGRAM_MIN_SPAN_SECONDS = 1.0
BAR_WIDTH = 40
# A character used in this few rows of a dataset at least RARE_MIN_ROWS long is likely a typo.
RARE_MAX_ROWS = 2
RARE_MIN_ROWS = 50
# Unicode categories that never belong in a transcript: control, format (zero-width joiners,
# bidi marks), private use, surrogates, unassigned.
BAD_CATEGORIES = {"Cc", "Cf", "Co", "Cs", "Cn"}
LISTED_PER_KIND = 5  # rows named per problem kind in the text report
# Duplicate audio: files of the same size are compared by a hash of this many leading bytes
# (2 s of 16-bit 16 kHz audio: past a WAV header and most leading silence), and hashed whole
# only when those match too.
PREFIX_BYTES = 64 * 1024
# Without --strict, this many clips of each audio format (container/codec: "WAV/GSM610",
# "mov,mp4,m4a,3gp,3g2,mj2/aac") are decoded: a codec libsndfile or FFmpeg cannot decode fails
# on the first clip, and decoding every clip would cost as much as an epoch's audio reads.
DECODED_PER_FORMAT = 3

PROBLEM_KINDS = {
    "unreadable": "unreadable or missing audio",
    "non_finite": "audio with NaN or infinite samples",
    "too_long": f"clips over {CHUNK_LENGTH} s",
    "past_end": "windows past the end of the file",
    "empty_label": "empty transcripts",
    "long_label": f"labels over {MAX_DECODER_TOKENS} tokens",
    "duplicate_audio": "the same audio twice",
    "bad_characters": "characters the tokenizer handles badly",
}
NOTE_KINDS = {
    "duplicate_text": "transcripts that occur more than once",
    "rare_characters": "rare characters",
}


@dataclass(frozen=True)
class Finding:
    """One thing wrong (a problem) or worth a look (a note), tied to the row it came from."""

    kind: str  # a key of PROBLEM_KINDS or NOTE_KINDS
    origin: str  # "train.jsonl:12", or the audio path
    detail: str = ""


@dataclass
class DataReport:
    """Everything `check_data` found; `format_report` prints it, `to_dict` serialises it."""

    path: str
    clips: int = 0
    total_seconds: float = 0.0
    durations: list[float] = field(default_factory=list)  # seconds, one per readable clip
    sample_rates: dict[int, int] = field(default_factory=dict)  # Hz → files
    channels: dict[int, int] = field(default_factory=dict)  # channel count → files
    languages: dict[str, int] = field(default_factory=dict)  # code (or "unspecified") → clips
    # Clips with no language while --model is multilingual: `train` needs --language for them.
    without_language: int = 0
    tokenizer: str | None = None  # name of the tokenizer that measured labels, if any
    # Decoder positions per non-empty label, prefix included (`LabelEncoder.decoder_tokens`, as
    # train's screening counts them); empty without a tokenizer.
    label_tokens: list[int] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def hours(self) -> float:
        return self.total_seconds / 3600

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.kind in PROBLEM_KINDS]

    @property
    def notes(self) -> list[Finding]:
        return [f for f in self.findings if f.kind in NOTE_KINDS]

    def counts(self) -> dict[str, int]:
        """{kind: number of findings}, problems and notes alike."""
        return dict(Counter(f.kind for f in self.findings))

    def histogram(self) -> list[tuple[float, float, int]]:
        """[(bin start in s, bin end in s, clips)] over the shortest to the longest clip, in at
        most HISTOGRAM_MAX_BINS bins of a round width; empty bins inside the range included."""
        if not self.durations:
            return []
        edges = histogram_edges(min(self.durations), max(self.durations))
        counts, _ = np.histogram(self.durations, bins=edges)
        return [
            (float(start), float(end), int(count))
            for start, end, count in zip(edges[:-1], edges[1:], counts, strict=True)
        ]

    def label_summary(self) -> dict[str, Any] | None:
        """Label lengths in tokens (min, median, max, how many over the decoder's limit), or
        None when no tokenizer measured them."""
        if not self.label_tokens:
            return None
        return {
            "min": min(self.label_tokens),
            "median": statistics.median(self.label_tokens),
            "max": max(self.label_tokens),
            "over_limit": sum(n > MAX_DECODER_TOKENS for n in self.label_tokens),
            "limit": MAX_DECODER_TOKENS,
        }

    def to_dict(self) -> dict[str, Any]:
        result = asdict(self)
        result["durations"] = [round(seconds, 3) for seconds in self.durations]
        result["hours"] = round(self.hours, 4)
        result["histogram"] = [
            {"start_s": round(start, 6), "end_s": round(end, 6), "clips": n}
            for start, end, n in self.histogram()
        ]
        result["label_token_summary"] = self.label_summary()
        result["problem_count"] = len(self.problems)
        result["counts"] = self.counts()
        return result


def histogram_edges(shortest: float, longest: float) -> np.ndarray:
    """Bin edges of a round width from at or below `shortest` to at or above `longest`."""
    from matplotlib.ticker import MaxNLocator  # the axis-tick rule: round steps, bounded count

    high = max(longest, shortest + HISTOGRAM_MIN_SPAN_SECONDS)
    locator = MaxNLocator(nbins=HISTOGRAM_MAX_BINS, steps=[1, 2, 2.5, 5, 10])
    ticks = locator.tick_values(shortest, high)
    ticks = np.round(ticks, 9)  # 0.30000000000000004 → 0.3, so a clip of 0.3 s starts a bin
    # The locator may add ticks beyond the data (and the minimum span adds more): keep one edge
    # at or outside each end; numpy's last bin includes its right edge.
    first = max(i for i, tick in enumerate(ticks) if tick <= shortest)
    last = min(i for i, tick in enumerate(ticks) if tick >= longest and i > first)
    return ticks[first : last + 1]


def check_data(
    path: str | Path,
    *,
    data_format: str | None = None,
    model: Any = None,
    strict: bool = False,
    language: str | None = _TRAIN_DEFAULTS.language,
    task: str = _TRAIN_DEFAULTS.task,
    timestamps: bool = _TRAIN_DEFAULTS.timestamps,
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
        _check_audio(examples, report, decode_all=strict)
    else:  # shards: one pass through the stream
        examples = _check_stream_audio(source, report)
    report.clips = len(examples)
    report.tokenizer = getattr(tokenizer, "name_or_path", None) or (
        type(tokenizer).__name__ if tokenizer is not None else None
    )
    report.languages = dict(Counter(example.language or "unspecified" for example in examples))
    if encoder is not None and encoder.multilingual and encoder.language is None:
        report.without_language = report.languages.get("unspecified", 0)
    _check_labels(examples, encoder, report)
    _check_characters(examples, tokenizer, report)
    if spec is not None:
        report.tokenizer = f"--model {spec}'s tokenizer"
    return report


# -- audio ----------------------------------------------------------------------------------
def _check_audio(examples: Sequence[Example], report: DataReport, *, decode_all: bool) -> None:
    # Threads overlap the reads, which wait on storage (see data.read_audio_seconds).
    paths = list(dict.fromkeys(example.audio for example in examples))
    headers = dict(
        zip(paths, map_in_threads(_read_header, paths, threads=HEADER_THREADS), strict=True)
    )
    for header in headers.values():
        if not isinstance(header, str):
            report.sample_rates[header.sample_rate] = (
                report.sample_rates.get(header.sample_rate, 0) + 1
            )
            report.channels[header.channels] = report.channels.get(header.channels, 0) + 1

    undecodable = _decode_sample(examples, headers, decode_all=decode_all)
    for example in examples:
        origin = example.origin or example.audio
        header = headers[example.audio]
        if isinstance(header, str):
            report.findings.append(Finding("unreadable", origin, f"{example.audio}: {header}"))
            continue
        if example in undecodable:
            kind, detail = undecodable[example]
            report.findings.append(Finding(kind, origin, detail))
            continue
        file_seconds = header.seconds
        start = example.start or 0.0
        end = example.end if example.end is not None else file_seconds
        if end > file_seconds + 0.05:  # headers and subtitle times round differently
            report.findings.append(
                Finding("past_end", origin, f"ends at {end:.2f} s, file is {file_seconds:.2f} s")
            )
        seconds = max(0.0, min(end, file_seconds) - start)
        report.durations.append(seconds)
        report.total_seconds += seconds
        if seconds > CHUNK_LENGTH:
            report.findings.append(Finding("too_long", origin, f"{seconds:.1f} s"))

    _find_duplicate_audio(examples, headers, report)


def _check_stream_audio(source: StreamSource, report: DataReport) -> list[Example]:
    """`_check_audio` for shards, in one pass: headers read from the bytes in memory (nothing
    decoded, nothing written); the same bytes under two keys are duplicates. Returns the rows
    as `Example`s (origin shard:key) for the label checks."""
    dataset, columns = open_stream(source)
    examples, first_seen = [], {}
    for index, row in enumerate(dataset):
        clip = read_row(row, columns, f"{source.spec}[{index}]")
        examples.append(Example(clip.origin, clip.text or "", clip.language, origin=clip.origin))
        header = audio_header(clip.audio)
        if isinstance(header, str):
            report.findings.append(Finding("unreadable", clip.origin, header))
            continue
        if header.float_samples:  # NaN or inf samples show only once decoded
            try:
                decode_audio(clip.audio, clip.origin)
            except AudioError as exc:
                report.findings.append(Finding(_decode_kind(exc), clip.origin, exc.reason))
                continue
        report.sample_rates[header.sample_rate] = report.sample_rates.get(header.sample_rate, 0) + 1
        report.channels[header.channels] = report.channels.get(header.channels, 0) + 1
        seconds = header.seconds
        report.durations.append(seconds)
        report.total_seconds += seconds
        if seconds > CHUNK_LENGTH:
            report.findings.append(Finding("too_long", clip.origin, f"{seconds:.1f} s"))
        data = clip.audio.get("bytes") if isinstance(clip.audio, dict) else None
        if data:
            digest = hashlib.blake2b(data, digest_size=16).hexdigest()
            if digest in first_seen:
                detail = f"same bytes as {first_seen[digest]}"
                report.findings.append(Finding("duplicate_audio", clip.origin, detail))
            first_seen.setdefault(digest, clip.origin)
    return examples


def _read_header(path: str) -> AudioHeader | str:
    """The file's header, or why there is none (a short reason)."""
    if not Path(path).is_file():
        return "file not found"
    try:
        return read_header(path)
    except AudioError as exc:
        return exc.reason


def _decode_kind(error: AudioError) -> str:
    return "non_finite" if isinstance(error, NonFiniteAudio) else "unreadable"


def _decode_sample(
    examples: Sequence[Example], headers: dict[str, Any], *, decode_all: bool
) -> dict[Example, tuple[str, str]]:
    """{example: (finding kind, why its audio cannot be used)} for the clips decoded: all of
    them with `decode_all`, else every clip of a float file (NaN or infinite samples show only
    once decoded) and the first DECODED_PER_FORMAT of each other audio format."""
    chosen, per_format = [], Counter()
    for example in examples:
        header = headers[example.audio]
        if isinstance(header, str):
            continue
        if decode_all or header.float_samples or per_format[header.format] < DECODED_PER_FORMAT:
            per_format[header.format] += 1
            chosen.append(example)

    def problem(example: Example) -> tuple[str, str] | None:
        try:
            load_audio(example.audio, start=example.start, end=example.end)
        except AudioError as exc:
            return _decode_kind(exc), f"{example.audio}: {exc.reason}"
        return None

    # Decoders release the GIL for most of a decode: threads overlap them.
    found = map_in_threads(problem, chosen, threads=HASH_THREADS)
    return {e: reason for e, reason in zip(chosen, found, strict=True) if reason is not None}


def _find_duplicate_audio(
    examples: Sequence[Example], headers: dict[str, Any], report: DataReport
) -> None:
    """The same window listed twice, or files with identical bytes under different names."""
    first_seen: dict[tuple[str, float | None, float | None], str] = {}
    for example in examples:
        key = (example.audio, example.start, example.end)
        origin = example.origin or example.audio
        if key in first_seen:
            report.findings.append(
                Finding("duplicate_audio", origin, f"same audio as {first_seen[key]}")
            )
        else:
            first_seen[key] = origin

    readable = [path for path, header in headers.items() if not isinstance(header, str)]
    by_hash: dict[Any, list[str]] = defaultdict(list)
    for path, identity in zip(readable, _content_identities(readable), strict=True):
        by_hash[identity].append(path)
    for paths in by_hash.values():
        for path in paths[1:]:
            report.findings.append(Finding("duplicate_audio", path, f"same bytes as {paths[0]}"))


def _content_identities(paths: Sequence[str]) -> list[Any]:
    """A value per file, equal for two files exactly when their bytes are, reading only what
    telling them apart needs: a file of a size no other file has is unique unread; files that
    share a size are told apart by a hash of their first PREFIX_BYTES; only files that share
    size and prefix are hashed whole."""
    sizes = [os.path.getsize(path) for path in paths]
    identities: list[Any] = [("size", size) for size in sizes]
    same_size = Counter(sizes)
    candidates = [i for i, size in enumerate(sizes) if same_size[size] > 1]
    prefixes = map_in_threads(
        lambda i: _file_hash(paths[i], PREFIX_BYTES), candidates, threads=HASH_THREADS
    )
    for i, prefix in zip(candidates, prefixes, strict=True):
        identities[i] = ("prefix", sizes[i], prefix)
    same_prefix = Counter(identities[i] for i in candidates)
    # A file no longer than the prefix was hashed whole already.
    colliding = [
        i for i in candidates if same_prefix[identities[i]] > 1 and sizes[i] > PREFIX_BYTES
    ]
    digests = map_in_threads(lambda i: _file_hash(paths[i]), colliding, threads=HASH_THREADS)
    for i, digest in zip(colliding, digests, strict=True):
        identities[i] = ("whole", sizes[i], digest)
    return identities


def _file_hash(path: str, limit: int | None = None) -> str:
    """blake2b of the file's bytes, or of its first `limit` bytes."""
    digest = hashlib.blake2b(digest_size=16)
    left = math.inf if limit is None else limit
    with open(path, "rb") as file:
        while left > 0 and (chunk := file.read(int(min(1 << 20, left)))):
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


# -- labels ---------------------------------------------------------------------------------
def _check_labels(
    examples: Sequence[Example], encoder: LabelEncoder | None, report: DataReport
) -> None:
    texts: dict[str, list[str]] = defaultdict(list)
    for example in examples:
        origin = example.origin or example.audio
        text = example.text.strip()
        if not text:
            report.findings.append(Finding("empty_label", origin, example.audio))
            continue
        texts[" ".join(text.casefold().split())].append(origin)
        if encoder is not None:
            n_tokens = _decoder_tokens(encoder, example)
            report.label_tokens.append(n_tokens)
            if n_tokens > MAX_DECODER_TOKENS:
                report.findings.append(Finding("long_label", origin, f"{n_tokens} tokens"))
        elif len(text) > MAX_DECODER_TOKENS * CHARS_PER_TOKEN_ESTIMATE:
            report.findings.append(
                Finding(
                    "long_label", origin, f"{len(text)} characters (pass --model to count tokens)"
                )
            )
    for text, origins in texts.items():
        if len(origins) > 1:
            shown = text if len(text) <= 40 else text[:37] + "..."
            report.findings.append(
                Finding(
                    "duplicate_text",
                    origins[0],
                    f"{shown!r} x{len(origins)}: {', '.join(origins[1:4])}",
                )
            )


def _decoder_tokens(encoder: LabelEncoder, example: Example) -> int:
    """The decoder positions of `example`'s label, as train's screening counts them.

    A row train would refuse outright for its language (none for a multilingual model, or one
    an English-only model cannot write) is counted with English instead: a multilingual prefix
    holds one language token whichever it is, an English-only one none.
    """
    try:
        return encoder.decoder_tokens(example)
    except UserError:
        return encoder.decoder_tokens(replace(example, language="en"))


def _check_characters(examples: Sequence[Example], tokenizer: Any, report: DataReport) -> None:
    """Control/format characters, tokenizer round-trip failures, and characters used rarely."""
    rows_with: dict[str, list[str]] = defaultdict(list)
    for example in examples:
        for char in set(example.text):
            rows_with[char].append(example.origin or example.audio)
    for char, origins in sorted(rows_with.items()):
        name = _describe(char)
        if unicodedata.category(char) in BAD_CATEGORIES:
            report.findings.append(
                Finding("bad_characters", origins[0], f"{name} in {len(origins)} rows")
            )
        elif tokenizer is not None and not _round_trips(tokenizer, char):
            report.findings.append(
                Finding("bad_characters", origins[0], f"{name} does not survive the tokenizer")
            )
        elif (
            len(examples) >= RARE_MIN_ROWS
            and len(origins) <= RARE_MAX_ROWS
            and not (char.isascii() and char.isprintable())
        ):
            report.findings.append(
                Finding("rare_characters", origins[0], f"{name} in {len(origins)} rows")
            )


def _describe(char: str) -> str:
    label = unicodedata.name(char, f"U+{ord(char):04X}")
    return f"{char!r} ({label})" if char.isprintable() else f"U+{ord(char):04X} ({label})"


def _round_trips(tokenizer: Any, char: str) -> bool:
    ids = tokenizer.encode(char, add_special_tokens=False)
    return tokenizer.decode(ids) == char


# -- text report ------------------------------------------------------------------------------
def format_report(report: DataReport) -> str:
    """A plain-text report: totals, histogram bars, formats, then problems and notes."""
    lines = [
        f"{report.path}: {report.clips} clips, {report.hours:.2f} h ({report.total_seconds:.1f} s)",
    ]
    if report.durations:
        lines.append(
            f"durations: min {min(report.durations):.1f} s, median "
            f"{sorted(report.durations)[len(report.durations) // 2]:.1f} s, "
            f"max {max(report.durations):.1f} s"
        )
        histogram = report.histogram()
        peak = max(count for _, _, count in histogram)
        # As many decimals as the bin width needs (0.1 → 1, 2.5 → 1, 50 → 0), aligned.
        decimals = max(len(f"{end:g}".partition(".")[2]) for _, end, _ in histogram)
        width = len(f"{histogram[-1][1]:.{decimals}f}")
        for start, end, count in histogram:
            bar = "#" * math.ceil(BAR_WIDTH * count / peak) if count else ""
            span = f"{start:{width}.{decimals}f}-{end:{width}.{decimals}f} s"
            lines.append(f"  {span} {count:6d} {bar}")
    lines.append("sample rates: " + _counts(report.sample_rates, " Hz") + " (files)")
    lines.append("channels: " + _counts(report.channels, "") + " (files)")
    lines.append("languages: " + _counts(report.languages, ""))
    if report.without_language:
        lines.append(
            f"  {report.without_language} clip(s) state no language and --model is "
            "multilingual: set one with `train --language CODE` (e.g. --language es) or a "
            "`language` column; `train` stops on them without it"
        )
    lines.append(_label_line(report))

    for title, kinds in (("problems", PROBLEM_KINDS), ("notes", NOTE_KINDS)):
        found = [f for f in report.findings if f.kind in kinds]
        lines.append(f"{len(found)} {title}" + (":" if found else ""))
        for kind, description in kinds.items():
            of_kind = [f for f in found if f.kind == kind]
            if not of_kind:
                continue
            lines.append(f"  {len(of_kind)} {description}")
            for finding in of_kind[:LISTED_PER_KIND]:
                lines.append(f"    {finding.origin}: {finding.detail}")
            if len(of_kind) > LISTED_PER_KIND:
                lines.append(
                    f"    ... and {len(of_kind) - LISTED_PER_KIND} more (--json lists all)"
                )
    return "\n".join(lines)


def _label_line(report: DataReport) -> str:
    if not report.tokenizer:
        return "labels measured in characters (pass --model to count tokens)"
    summary = report.label_summary()
    if summary is None:
        return f"labels measured with {report.tokenizer}: no non-empty labels"
    return (
        f"labels measured with {report.tokenizer}: min {summary['min']}, median "
        f"{summary['median']:g}, max {summary['max']} tokens (decoder positions, prefix "
        f"included, as train counts them), {summary['over_limit']} over {MAX_DECODER_TOKENS}"
    )


def _counts(counts: dict[Any, int], unit: str) -> str:
    if not counts:
        return "none"
    ordered = sorted(counts.items(), key=lambda item: (-item[1], str(item[0])))
    return ", ".join(f"{key}{unit}: {count}" for key, count in ordered)


def write_histogram_png(report: DataReport, path: str | Path) -> Path:
    """Save the duration histogram as a PNG (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot's import
    import matplotlib.pyplot as plt

    histogram = report.histogram()
    figure, axes = plt.subplots(figsize=(7, 3.5))
    axes.bar(
        [start for start, _, _ in histogram],
        [count for _, _, count in histogram],
        width=[end - start for start, end, _ in histogram],
        align="edge",
        edgecolor="black",
    )
    axes.axvline(CHUNK_LENGTH, color="red", linestyle="--", label=f"{CHUNK_LENGTH} s window")
    axes.set_xlabel("clip duration (s)")
    axes.set_ylabel("clips")
    axes.set_title(f"{Path(report.path).name}: {report.clips} clips, {report.hours:.2f} h")
    axes.legend()
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def label_encoder_for(
    model: Any,
    *,
    language: str | None = _TRAIN_DEFAULTS.language,
    task: str = _TRAIN_DEFAULTS.task,
    timestamps: bool = _TRAIN_DEFAULTS.timestamps,
) -> LabelEncoder:
    """The `LabelEncoder` that `train --model` builds, for counting labels as its screening does.

    `model`: a `--model` spec (its tokenizer and whether it is multilingual, as `load_model`
    and `is_multilingual` would say), or a bare Whisper tokenizer (multilingual when its
    vocabulary's size says so: there is no model to ask).
    """
    from whisper_train.formats.ct2 import is_multilingual_vocab

    if isinstance(model, (str, Path)):
        tokenizer, multilingual = load_tokenizer(str(model))
    else:
        tokenizer, multilingual = model, is_multilingual_vocab(len(model))
    return LabelEncoder(
        tokenizer, language=language, task=task, timestamps=timestamps, multilingual=multilingual
    )


def load_tokenizer(spec: str) -> tuple[Any, bool]:
    """`--model`'s tokenizer and whether its model is multilingual, as `train` loads them, from
    the small files where they tell (no weights read), else from the loaded model (a hub id)."""
    from transformers import WhisperTokenizerFast

    from whisper_train.formats import ct2
    from whisper_train.models import (
        folder_is_multilingual,
        is_multilingual,
        load_model,
        model_folder,
    )

    folder = model_folder(spec)  # a whisper-train run folder: its final/ model
    multilingual = folder_is_multilingual(folder)
    tokenizer = None
    if ct2.is_ct2_model_dir(folder):
        vocab_size = ct2.vocabulary_size(folder)
        if vocab_size is not None:
            tokenizer = ct2.load_tokenizer(folder, vocab_size)  # as load_ct2_whisper reads it
    elif (folder / "tokenizer_config.json").is_file():
        tokenizer = WhisperTokenizerFast.from_pretrained(str(folder))
    elif (folder / "tokenizer.json").is_file():  # tokenizer.json alone
        tokenizer = WhisperTokenizerFast(
            tokenizer_file=str(folder / "tokenizer.json"), pad_token="<|endoftext|>"
        )
    if tokenizer is not None and multilingual is None and not (folder / "config.json").is_file():
        multilingual = ct2.is_multilingual_vocab(len(tokenizer))  # tokenizer files, no model to ask
    if tokenizer is None or multilingual is None:
        model, processor = load_model(spec)  # a hub id, or files that do not tell
        return processor.tokenizer, is_multilingual(model)
    return tokenizer, multilingual
