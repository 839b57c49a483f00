"""Splitting examples into training and held-out sets, and cheap screening of every clip
(headers read, lengths and labels checked, results cached) before training starts."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from whisper_train import runfolder
from whisper_train.audio import (
    CHUNK_LENGTH,
    audio_length,
    load_audio,
)
from whisper_train.data.examples import Example, Skip, decode_skip, is_nonspeech
from whisper_train.data.labels import MAX_DECODER_TOKENS, LabelEncoder
from whisper_train.data.subtitles import OVERLAP_TOLERANCE
from whisper_train.errors import AudioError, UserError
from whisper_train.files import write_atomically

# Audio headers are read by one thread: on local disks threads made it slower (20,000 files on
# 2 cores: 116 us a file with 1 thread, 154 with 2, 225 with 16), since soundfile's Python side
# holds the GIL for most of a read. File hashing (check-data) releases it and uses threads.
HEADER_THREADS = 1
HASH_THREADS = 16
HEADER_SLICE = 256  # items one thread task handles
# Screening results kept in the cache folder (a few MB each at 200,000 rows); bump the version
# whenever what screening decides or stores changes.
SCREENINGS_KEPT = 16
# --eval-split holds out whole recordings only when they make up the share asked for within this
# fraction of it (10% asked: 7.5% to 12.5% of the clips); else a time range of each recording.
SPLIT_TOLERANCE = 0.25
SCREENING_VERSION = 4  # 4: each result carries its key, its size and a checksum
EMPTY_TRANSCRIPT = "empty transcript"  # a Skip's reason: a clip with nothing to score or learn

log = logging.getLogger(__name__)


# -- split and screen -----------------------------------------------------------------------
def split_examples(
    examples: Sequence[Example], fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """Hold out about `fraction` of the examples for evaluation, seeded and deterministic.

    Windows of one recording are kept on one side where whole recordings can make up the
    share asked for (within SPLIT_TOLERANCE of it): adjacent windows share a speaker, a room
    and a topic, and evaluation should not score what training heard. With too few recordings
    for that (two long recordings cut into windows by their subtitles would hold out half the
    data), each recording gives a contiguous time range of about `fraction` of its windows
    instead, and a training window that overlaps a held-out one in time is left out of both.
    Which of the two was done is logged in one line. Both lists keep the input order. Raises
    UserError when no example would be left for training.
    """
    examples = list(examples)
    if fraction <= 0 or not examples:
        return examples, []
    n_eval = max(1, round(fraction * len(examples)))
    if n_eval >= len(examples):
        raise UserError(
            f"only {len(examples)} examples: too few to hold out {fraction:g} for evaluation "
            "and still train; add data, lower --eval-split, or pass --eval-data"
        )
    groups: dict[str, list[int]] = defaultdict(list)
    for index, example in enumerate(examples):
        groups[example.audio].append(index)
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    held_out = _whole_recordings(groups, keys, n_eval, len(examples))
    left_out: set[int] = set()
    if held_out is not None:
        how = f"{len(held_out)} of {len(examples)} clips held out for evaluation"
        if len(groups) < len(examples):  # else every clip is its own recording: nothing to say
            how += f" as whole recordings ({len(groups)} recordings)"
    else:
        held_out, left_out = _time_ranges(examples, groups, keys, n_eval, seed)
        how = (
            f"{len(held_out)} of {len(examples)} clips held out for evaluation as a time range "
            f"of each recording: {len(groups)} recordings are too few to hold out "
            f"{fraction:g} as whole ones"
        )
        if left_out:
            how += f"; {len(left_out)} training clips that overlap a held-out one left out"
    train = [e for i, e in enumerate(examples) if i not in held_out and i not in left_out]
    if not train:  # every training window overlapped a held-out one
        raise UserError(
            f"{len(examples)} examples of {len(groups)} recordings: holding out {fraction:g} "
            "for evaluation leaves no training window that does not overlap a held-out one; "
            "lower --eval-split, or pass --eval-data"
        )
    log.info("--eval-split %g: %s", fraction, how)
    evaluation = [e for i, e in enumerate(examples) if i in held_out]
    return train, evaluation


def _whole_recordings(
    groups: dict[str, list[int]], keys: Sequence[str], n_eval: int, n_total: int
) -> set[int] | None:
    """Whole recordings (taken in `keys`' order, skipping one that would overshoot) making up
    n_eval clips within SPLIT_TOLERANCE, or None when they cannot."""
    slack = int(SPLIT_TOLERANCE * n_eval)
    held_out: set[int] = set()
    for key in keys:
        size = len(groups[key])
        if len(held_out) >= n_eval:
            break
        if len(held_out) + size <= n_eval + slack and len(held_out) + size < n_total:
            held_out.update(groups[key])
    return held_out if abs(len(held_out) - n_eval) <= slack else None


def _time_ranges(
    examples: Sequence[Example],
    groups: dict[str, list[int]],
    keys: Sequence[str],
    n_eval: int,
    seed: int,
) -> tuple[set[int], set[int]]:
    """(held out, left out of training): a contiguous run of each recording's windows, in time
    order, of its share of n_eval (largest remainders), at a seeded place; and the training
    windows whose times overlap a held-out window of their recording."""
    n_total = len(examples)
    exact = {key: n_eval * len(groups[key]) / n_total for key in keys}
    shares = {key: int(exact[key]) for key in keys}
    by_remainder = sorted(keys, key=lambda key: exact[key] - shares[key], reverse=True)
    for key in by_remainder[: n_eval - sum(shares.values())]:
        shares[key] += 1
    rng = random.Random(seed)
    held_out: set[int] = set()
    left_out: set[int] = set()
    for key in keys:
        share = shares[key]
        if not share:
            continue
        ordered = sorted(groups[key], key=lambda i: (examples[i].start or 0.0, i))
        first = rng.randrange(len(ordered) - share + 1)
        block = ordered[first : first + share]
        held_out.update(block)
        timed = [examples[i] for i in block if examples[i].end is not None]
        for index in ordered[:first] + ordered[first + share :]:
            example = examples[index]
            if example.end is not None and any(
                (example.start or 0.0) < other.end - OVERLAP_TOLERANCE
                and (other.start or 0.0) < example.end - OVERLAP_TOLERANCE
                for other in timed
            ):
                left_out.add(index)
    return held_out, left_out


def screen_examples(
    examples: Sequence[Example],
    *,
    count_tokens: Callable[[Example], int] | None = None,
    count_all: Callable[[Sequence[Example]], Sequence[int]] | None = None,
    max_label_tokens: int = MAX_DECODER_TOKENS,
    max_seconds: float = CHUNK_LENGTH,
    strict: bool = False,
) -> tuple[list[Example], list[Skip]]:
    """Cheap checks before training; returns (kept examples, skips with reasons).

    Reads only audio headers (each file once): the file exists and its header reads; the
    duration (of the window, if any) is > 0 and <= max_seconds and the window lies inside the
    file; the text is not empty; the label's decoder positions (`count_all` of a list of
    examples, or `count_tokens` of one: `LabelEncoder.decoder_tokens`) are at most
    `max_label_tokens`, the model's `max_target_positions`. `strict=True` raises UserError on
    the first problem.
    """
    screening = screen(
        examples,
        count_all=_count_all(count_tokens, count_all),
        max_label_tokens=max_label_tokens,
        max_seconds=max_seconds,
    )
    if strict:
        raise_first_skip(screening.skips)
    return [examples[index] for index in screening.kept], screening.skips


@dataclass(frozen=True)
class Screening:
    """What `screen` found: the examples kept (indices into its input, in order), their label
    lengths as counted, and the skips with reasons."""

    kept: list[int]
    label_tokens: list[int]  # one per kept example, as `count_all` counted it
    skips: list[Skip]


def screen(
    examples: Sequence[Example],
    *,
    count_all: Callable[[Sequence[Example]], Sequence[int]],
    max_label_tokens: int = MAX_DECODER_TOKENS,
    max_seconds: float = CHUNK_LENGTH,
    read_headers: bool = True,
    cache_folder: str | os.PathLike | None = None,
    cache_salt: str = "",
) -> Screening:
    """`screen_examples`' checks, with labels counted in one call.

    Labels are counted (`count_all`) only for examples whose audio passed, as train has always
    done. `read_headers=False` leaves the audio checks that need the file (it exists, decodes,
    lasts at most `max_seconds`, holds the window) to `SpeechDataset`, which makes them as it
    reads each clip: start-up then costs no file access per row. A duration the data states is
    still checked here.

    With `cache_folder`, the result is stored there under a key of everything it depends on
    (every example's fields, the limits, `cache_salt`: the label encoder's fingerprint, and,
    when headers are read, every audio file's size and modification time) and read back by any
    later call with the same key: the other processes of a multi-process run and later runs on
    the same data. The first process to arrive screens while the others wait for its file (a
    file lock), so the work is done once per machine however many ranks start.
    """
    if cache_folder is None:
        return _screen(examples, count_all, max_label_tokens, max_seconds, read_headers)
    key = _screening_key(examples, max_label_tokens, max_seconds, read_headers, cache_salt)
    folder = Path(cache_folder)
    target = folder / f"{key}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(target) + ".lock")
        lock.acquire()
    except OSError as exc:  # a read-only cache folder costs time, never the run
        log.info("screening cache %s unusable (%s): screening without it", folder, exc)
        return _screen(examples, count_all, max_label_tokens, max_seconds, read_headers)
    try:
        cached = _read_screening(target, key, len(examples))
        if isinstance(cached, Screening):
            log.info("screening: %d clips, as screened before (cached)", len(examples))
            log.debug("screening: read from %s", target)
            return cached
        if cached is not None:  # never trusted: its indices would pick the clips trained on
            log.warning("screening: %s does not verify (%s); screening again", target, cached)
        screening = _screen(examples, count_all, max_label_tokens, max_seconds, read_headers)
        _write_screening(target, screening, key, len(examples))
        _prune_screenings(folder)
        return screening
    finally:
        lock.release()


def screen_set(
    examples: Sequence[Example],
    label_encoder: LabelEncoder,
    max_label_tokens: int,
    *,
    strict: bool,
    read_headers: bool,
    max_seconds: float = CHUNK_LENGTH,
) -> Screening:
    """One set's screening for a training run, shared through the screening cache by every
    process and later runs; labels counted in batches as check-data counts them
    (`LabelEncoder.decoder_tokens_batch`). `strict` (--strict): its first problem stops the
    run, in one line."""
    screening = screen(
        examples,
        count_all=label_encoder.decoder_tokens_batch,
        max_label_tokens=max_label_tokens,
        max_seconds=max_seconds,
        read_headers=read_headers,
        cache_folder=screening_cache_folder(),
        cache_salt=label_encoder.fingerprint(),
    )
    if strict:
        raise_first_skip(screening.skips)
    return screening


def raise_first_skip(skips: Sequence[Skip]) -> None:
    """--strict: the first problem screening found, as a UserError."""
    if skips:
        skip = skips[0]
        raise UserError(
            f"{skip.origin}: {skip.reason} ({skip.detail}); fix or remove it, or run without "
            "--strict to skip it"
        )


def screening_cache_folder() -> Path:
    """Where screening results are kept, shared by ranks and later runs."""
    return runfolder.user_cache_dir("screening")


def read_audio_seconds(
    paths: Iterable[str], *, threads: int = HEADER_THREADS
) -> dict[str, float | AudioError]:
    """{path: length in seconds, or the AudioError reading its header raised} for each path
    (`threads` > 1 can hide the round trips of network storage; see HEADER_THREADS)."""
    return {
        path: length if isinstance(length, AudioError) else length[0]
        for path, length in read_audio_lengths(paths, threads=threads).items()
    }


def read_audio_lengths(
    paths: Iterable[str], *, threads: int = HEADER_THREADS
) -> dict[str, tuple[float, bool] | AudioError]:
    """`read_audio_seconds` with, for each readable file, whether its samples are stored as
    floats (`audio.audio_length`)."""

    def length(path: str) -> tuple[float, bool] | AudioError:
        try:
            return audio_length(path)
        except AudioError as exc:
            return exc

    unique = list(dict.fromkeys(paths))
    lengths = map_in_threads(length, unique, threads=threads)
    return dict(zip(unique, lengths, strict=True))


def map_in_threads(
    function: Callable[[Any], Any], items: Sequence[Any], *, threads: int
) -> list[Any]:
    """[function(item) for item in items], run by `threads` threads on slices of the items (a
    task per slice, not per item: a future costs as much as a warm header read)."""
    if threads <= 1 or len(items) < 2 * threads:
        return [function(item) for item in items]
    size = max(1, min(HEADER_SLICE, len(items) // threads))
    slices = [items[begin : begin + size] for begin in range(0, len(items), size)]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        done = pool.map(lambda part: [function(item) for item in part], slices)
        return [result for part in done for result in part]


def _count_all(
    count_tokens: Callable[[Example], int] | None,
    count_all: Callable[[Sequence[Example]], Sequence[int]] | None,
) -> Callable[[Sequence[Example]], Sequence[int]]:
    if count_all is not None:
        return count_all
    if count_tokens is None:
        raise TypeError("screen_examples needs count_tokens or count_all")
    return lambda examples: [count_tokens(example) for example in examples]


def _screen(
    examples: Sequence[Example],
    count_all: Callable[[Sequence[Example]], Sequence[int]],
    max_label_tokens: int,
    max_seconds: float,
    read_headers: bool,
) -> Screening:
    if read_headers:
        lengths = read_audio_lengths(example.audio for example in examples)
        audio_skips = [
            audio_problem(example, _seconds_of(lengths[example.audio]), max_seconds)
            for example in examples
        ]
        # A float file's samples may be NaN or infinite, which its header does not tell: such
        # clips are decoded (an integer PCM or compressed file's samples are always finite).
        for index, example in enumerate(examples):
            length = lengths[example.audio]
            if audio_skips[index] is None and not isinstance(length, AudioError) and length[1]:
                audio_skips[index] = samples_problem(example)
    else:
        audio_skips = [_stated_problem(example, max_seconds) for example in examples]
    candidates = [index for index, skip in enumerate(audio_skips) if skip is None]
    counted = dict(zip(candidates, count_all([examples[i] for i in candidates]), strict=True))
    kept, label_tokens, skips = [], [], []
    for index, skip in enumerate(audio_skips):
        if skip is None:
            n_tokens = int(counted[index])
            if n_tokens <= max_label_tokens:
                kept.append(index)
                label_tokens.append(n_tokens)
                continue
            example = examples[index]
            skip = Skip(
                example.origin or example.audio,
                f"label longer than {max_label_tokens} tokens",
                f"{n_tokens} tokens",
            )
        skips.append(skip)
    return Screening(kept, label_tokens, skips)


def audio_problem(
    example: Example, length: float | AudioError, max_seconds: float = CHUNK_LENGTH
) -> Skip | None:
    """Why `example` cannot be trained on, given its audio file's length in seconds (or the
    AudioError its header raised), or None: the audio, window, duration and empty-text checks
    that screening makes before step 1 and `SpeechDataset` makes as it reads a clip."""
    origin = example.origin or example.audio
    if isinstance(length, AudioError):
        reason = "unreadable audio"
        if "not found" in length.reason:
            reason = "audio file not found"
        elif "not an audio file" in length.reason:  # a folder, a FIFO, a device
            reason = f"audio path is {length.reason.split(',')[0]}"
        return Skip(origin, reason, example.audio)
    start = example.start or 0.0
    end = example.end if example.end is not None else length
    if end > length + 0.05:  # 50 ms slack: headers and subtitle times round differently
        return Skip(origin, "window ends after the audio", f"{end:.2f} s > {length:.2f} s")
    seconds = end - start
    if seconds <= 0:
        return Skip(origin, "empty audio", f"{seconds:.2f} s")
    if seconds > max_seconds:
        return Skip(origin, f"longer than {max_seconds:g} s", f"{seconds:.1f} s")
    if not example.text.strip() and not is_nonspeech(example):  # its empty text is its label
        return Skip(origin, EMPTY_TRANSCRIPT, example.audio)
    return None


def _seconds_of(length: tuple[float, bool] | AudioError) -> float | AudioError:
    return length if isinstance(length, AudioError) else length[0]


def samples_problem(example: Example) -> Skip | None:
    """Why `example`'s audio (its window) cannot be used once decoded, or None: it does not
    decode, or a sample is NaN or infinite."""
    try:
        load_audio(example.audio, start=example.start, end=example.end)
    except AudioError as exc:
        return decode_skip(example.origin or example.audio, exc)
    return None


def unusable_until_one_passes(
    examples: Sequence[Example], max_seconds: float = CHUNK_LENGTH
) -> list[Skip]:
    """Reads headers in order until a clip passes `audio_problem`: [] once one does, else every
    example's Skip. Before step 1 of a run whose loader checks each clip, this costs one header
    read, and a set of which nothing can be read is still refused before training starts."""
    skips = []
    for example in examples:
        problem = clip_problem(example, max_seconds)
        if problem is None:
            return []
        skips.append(problem)
    return skips


def clip_problem(example: Example, max_seconds: float = CHUNK_LENGTH) -> Skip | None:
    """`audio_problem` of one example, its file's header read now."""
    try:
        length: float | AudioError = audio_length(example.audio)[0]
    except AudioError as exc:
        length = exc
    return audio_problem(example, length, max_seconds)


def _stated_problem(example: Example, max_seconds: float) -> Skip | None:
    """`audio_problem`'s checks that need no audio file: the stated duration and the text."""
    origin = example.origin or example.audio
    if example.duration is not None and example.duration > max_seconds:
        return Skip(origin, f"longer than {max_seconds:g} s", f"{example.duration:.1f} s")
    if not example.text.strip():
        return Skip(origin, EMPTY_TRANSCRIPT, example.audio)
    return None


def _screening_key(
    examples: Sequence[Example],
    max_label_tokens: int,
    max_seconds: float,
    read_headers: bool,
    salt: str,
) -> str:
    """A digest of the examples, the limits and `salt`, and with `read_headers` of their audio
    files' sizes and times (what the header checks depend on)."""
    digest = hashlib.blake2b(digest_size=20)
    settings = [SCREENING_VERSION, max_label_tokens, max_seconds, read_headers, salt]
    digest.update(json.dumps(settings).encode())
    for example in examples:
        fields = (example.audio, example.text, example.language, example.start, example.end)
        digest.update(repr((fields, example.duration, example.segments, example.origin)).encode())
    if read_headers:
        for path in dict.fromkeys(example.audio for example in examples):
            try:
                stat = os.stat(path)
                digest.update(f"{stat.st_size}:{stat.st_mtime_ns}\n".encode())
            except OSError:
                digest.update(b"missing\n")
    return digest.hexdigest()


def _read_screening(target: Path, key: str, n_examples: int) -> Screening | str | None:
    """The result stored at `target` when it verifies: computed for `key` from `n_examples`
    examples, its checksum intact, its indices each an example's, in order, once. None when
    there is none; what is wrong with it otherwise (it is then screened again, and rewritten)."""
    try:
        stored = json.loads(target.read_text(encoding="utf-8"))
        payload = {name: stored[name] for name in _STORED}
        checksum = stored["checksum"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return "not the JSON a screening writes"
    if checksum != _checksum(payload):
        return "its checksum does not match its contents"
    if payload["key"] != key or payload["examples"] != n_examples:
        return f"computed from other data ({payload['examples']} examples)"
    kept, tokens = payload["kept"], payload["label_tokens"]
    indices = all(isinstance(i, int) and not isinstance(i, bool) for i in kept)
    if (
        not indices
        or kept != sorted(set(kept))
        or (kept and not 0 <= kept[0] <= kept[-1] < n_examples)
    ):
        return "its kept indices are not the examples' own, in order, once each"
    if len(tokens) != len(kept) or not all(isinstance(n, int) and n >= 0 for n in tokens):
        return "its label lengths do not match its kept examples"
    try:
        skips = [Skip(*skip) for skip in payload["skips"]]
    except TypeError:
        return "its skips are not (origin, reason, detail)"
    return Screening(kept=kept, label_tokens=tokens, skips=skips)


# What a stored screening holds besides its checksum.
_STORED = ("key", "examples", "kept", "label_tokens", "skips")


def _checksum(payload: dict) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _write_screening(target: Path, screening: Screening, key: str, n_examples: int) -> None:
    payload = {
        "key": key,
        "examples": n_examples,
        "kept": screening.kept,
        "label_tokens": screening.label_tokens,
        "skips": [[skip.origin, skip.reason, skip.detail] for skip in screening.skips],
    }
    stored = {**payload, "checksum": _checksum(payload)}
    try:
        write_atomically(target, json.dumps(stored, separators=(",", ":")))
    except OSError as exc:  # the cache saves time, never the run
        log.info("screening cache %s not written (%s)", target, exc)


def _prune_screenings(folder: Path) -> None:
    """Keep the SCREENINGS_KEPT most recently written results; older data sets' go."""
    try:
        results = sorted(folder.glob("*.json"), key=lambda path: path.stat().st_mtime, reverse=True)
        for stale in results[SCREENINGS_KEPT:]:
            stale.unlink(missing_ok=True)
            Path(str(stale) + ".lock").unlink(missing_ok=True)
    except OSError:  # another process pruned first
        pass


def summarize_skips(skips: Sequence[Skip], *, examples_per_reason: int = 3) -> str:
    """Lines such as '12 skipped: longer than 30 s (train.jsonl:4, ...)', commonest first."""
    if not skips:
        return "0 skipped"
    by_reason: dict[str, list[Skip]] = defaultdict(list)
    for skip in skips:
        by_reason[skip.reason].append(skip)
    counts = Counter({reason: len(items) for reason, items in by_reason.items()})
    lines = [f"{len(skips)} skipped"]
    for reason, count in counts.most_common():
        shown = by_reason[reason][:examples_per_reason]
        listed = ", ".join(f"{s.origin} [{s.detail}]" if s.detail else s.origin for s in shown)
        more = f", and {count - len(shown)} more" if count > len(shown) else ""
        lines.append(f"  {count} {reason}: {listed}{more}")
    return "\n".join(lines)


__all__ = [
    "audio_problem",
    "clip_problem",
    "unusable_until_one_passes",
    "map_in_threads",
    "Screening",
    "read_audio_lengths",
    "read_audio_seconds",
    "samples_problem",
    "screen",
    "screen_examples",
    "screening_cache_folder",
    "split_examples",
    "summarize_skips",
]
