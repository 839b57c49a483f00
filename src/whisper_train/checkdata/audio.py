"""check-data's audio checks: every header read, a sample of the clips of each audio format
decoded (every clip under --strict, and every clip of a float file), durations against
Whisper's 30 s window and the end of the file, and the same audio twice (the same window, or
the same bytes under two names, found reading only the bytes that tell files apart). Shards are
checked in one pass over the stream.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from whisper_train.audio import (
    CHUNK_LENGTH,
    AudioHeader,
    NonFiniteAudio,
    load_audio,
    not_a_file,
    read_header,
)
from whisper_train.checkdata.report import DataReport, Finding
from whisper_train.data.examples import Example
from whisper_train.data.screening import HASH_THREADS, HEADER_THREADS, map_in_threads
from whisper_train.data.streaming import (
    StreamSource,
    audio_header,
    decode_audio,
    open_stream,
    read_row,
)
from whisper_train.errors import AudioError

# Duplicate audio: files of the same size are compared by a hash of this many leading bytes
# (2 s of 16-bit 16 kHz audio: past a WAV header and most leading silence), and hashed whole
# only when those match too.
PREFIX_BYTES = 64 * 1024
# Without --strict, this many clips of each audio format (container/codec: "WAV/GSM610",
# "mov,mp4,m4a,3gp,3g2,mj2/aac") are decoded: a codec libsndfile or FFmpeg cannot decode fails
# on the first clip, and decoding every clip would cost as much as an epoch's audio reads.
DECODED_PER_FORMAT = 3


def check_audio(examples: Sequence[Example], report: DataReport, *, decode_all: bool) -> None:
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


def check_stream_audio(source: StreamSource, report: DataReport) -> list[Example]:
    """`check_audio` for shards, in one pass: headers read from the bytes in memory (nothing
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
    problem = not_a_file(path)
    if problem is not None:
        return problem.split(";")[0]  # the report's short reason: what the path is
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
