"""lhotse `CutSet` manifests → examples: `cuts.jsonl.gz` (or `.jsonl`), or a folder of them.

lhotse reads the manifest (`open_best`, `deserialize_item`: the optional `lhotse` extra); each
cut becomes one `Example`, a window [cut.start, cut.start + cut.duration) of its recording's
file, which whisper-train's own readers decode (soundfile, else PyAV; soxr to 16 kHz), as for
every other layout. So screening, check-data, packing and the held-out split by recording treat
cuts like any manifest's rows, and no cut needs scipy, which lhotse's own resampler imports.

What a cut may be:
- one supervision: its text and language;
- several (a window that `cut_into_windows` made, a turn of a conversation): ONE example of the
  cut's audio whose text is the supervisions' texts in time order, as icefall and NeMo's lhotse
  readers train on them. One example per supervision would train each text against audio that
  holds its neighbours' speech too, since the audio is the cut's;
- none: an example with an empty transcript, which screening and check-data count and skip as
  any empty transcript;
- a MonoCut of one audio file read whole (every channel, averaged to mono as any file is), with
  no transform but resampling. A MixedCut, a cut of some channels only, a speed-perturbed
  recording, or audio lhotse fetches from a URL, a command or a Shar tar is refused in one line
  naming `CutSet.save_audios`, which writes such cuts as plain files first: whisper-train would
  otherwise train on other audio than the cut describes.

A recording missing on disk is a clip the screening, the loader and check-data report and skip,
as in any layout. Relative recording paths are resolved as lhotse recipes write them: against
the folder of the manifest or one of its two parents (a recipe's data/manifests/ sits two levels
below the folder it ran in), else the current folder, whichever holds the first recording.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from whisper_train.data.examples import Example
from whisper_train.data.labels import language_code
from whisper_train.data.manifests import resolve_path
from whisper_train.errors import UserError

LHOTSE_EXTRA = "pip install 'whisper-train[lhotse]'"
CUT_SUFFIXES = (".jsonl.gz", ".jsonl")
# The "type" of a serialised cut ("Cut" is MonoCut's name before lhotse 0.8).
CUT_TYPES = ("MonoCut", "MixedCut", "MultiCut", "Cut")
# Rows of a streamed manifest are split over the processes and loader workers in this many
# parts (row number modulo it), or one a row when it has fewer: `datasets` deals each process
# and worker whole parts, as it deals shards, so up to this many read the manifest at once.
# Fixed for a given manifest: a resumed run splits it the same way.
STREAM_PARTS = 64
_SAVE_AUDIOS = "write such cuts as audio files first (cuts.save_audios(DIR) returns cuts of them)"


def import_lhotse():
    try:
        import lhotse
    except ImportError:
        raise UserError(f"reading lhotse cuts needs the `lhotse` package: {LHOTSE_EXTRA}") from None
    return lhotse


# -- detection (no lhotse needed: a user without it is told to install it) ----------------------
def _first_row(path: Path) -> dict | None:
    """The first JSON object of a (gzipped) JSONL file; None when it has none or is no JSONL."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as lines:
            for line in lines:
                if line.strip():
                    row = json.loads(line)
                    return row if isinstance(row, dict) else None
    except (OSError, EOFError, UnicodeDecodeError, ValueError):
        return None
    return None


def is_cut_row(row: dict | None) -> bool:
    """A serialised lhotse cut: its `type`, or (before types were written) a recording and a
    list of supervisions. A NeMo or HF manifest row has neither."""
    if row is None:
        return False
    return row.get("type") in CUT_TYPES or (
        isinstance(row.get("supervisions"), list) and "recording" in row
    )


def _is_cut_file(path: Path) -> bool:
    name = path.name.lower()
    if not path.is_file() or not name.endswith(CUT_SUFFIXES):
        return False
    # A .jsonl.gz is lhotse's (no other layout reads gzip), so a damaged or non-cut one is
    # read by `read_cuts` and refused with its reason; a .jsonl is a cut manifest by content.
    return name.endswith(".gz") or is_cut_row(_first_row(path))


def cut_manifests(folder: Path) -> list[Path]:
    """The cut manifests directly in `folder` (a recipe's recordings and supervisions
    manifests beside them are not cuts)."""
    return sorted(
        path
        for path in folder.iterdir()
        if path.name.lower().endswith(CUT_SUFFIXES) and is_cut_row(_first_row(path))
    )


def detect_cuts(path: Path) -> bool:
    if path.is_dir():
        return bool(cut_manifests(path))
    return _is_cut_file(path)


def cut_manifest(path: Path, split: str | None = None) -> Path:
    """The manifest `path` names: the file itself, or in a folder the only cut manifest, or the
    one whose name holds `split` (DIR:dev-clean)."""
    if path.is_file():
        return path
    found = cut_manifests(path)
    chosen = [m for m in found if split in m.name] if split else found
    if len(chosen) != 1:
        names = ", ".join(m.name for m in found) or "none"
        what = f"no cut manifest named *{split}*" if split and not chosen else "several"
        raise UserError(
            f"{path}: {what} among the cut manifests found ({names}); choose one as "
            f"{path}:NAME, NAME a part of its file name (e.g. {path}:train)"
        )
    return chosen[0]


# -- reading ---------------------------------------------------------------------------------
def read_cuts(path: Path, split: str | None = None) -> list[Example]:
    """Every cut of the manifest at `path` (a file, or a folder: `cut_manifest`) as an example."""
    return list(cut_examples(cut_manifest(path, split)))


def cut_examples(
    manifest: Path, parts: frozenset[int] | None = None, n_parts: int = 1
) -> Iterator[Example]:
    """The examples of `manifest`'s cuts, read one at a time; with `parts`, only the cuts
    whose row number modulo `n_parts` is in it (a stream worker's share), the others skipped
    without being parsed."""
    import_lhotse()
    from lhotse.serialization import decode_json_line, deserialize_item, open_best

    root: str | None = None
    number = 0
    try:
        with open_best(manifest) as lines:
            for line in lines:
                if not line.strip():
                    continue
                number += 1
                if parts is not None and (number - 1) % n_parts not in parts:
                    continue
                origin = f"{manifest}:{number}"
                row = decode_json_line(line)
                if not is_cut_row(row):
                    raise UserError(
                        f"{origin}: not a lhotse cut (keys {', '.join(sorted(row)[:6])}); "
                        "make cuts of recordings and supervisions with CutSet.from_manifests "
                        "and save them with to_file"
                    )
                cut = deserialize_item(row)
                root = root or _recordings_root(manifest, cut)
                yield cut_example(cut, origin, root)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - gzip, JSON and lhotse's own errors: one line
        raise UserError(
            f"{manifest}:{number or 1}: cannot read it as a lhotse CutSet ({_first_line(exc)}); "
            "write it again with CutSet.to_file"
        ) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _source_path(cut: Any) -> str | None:
    recording = getattr(cut, "recording", None)
    if recording is None or len(recording.sources) != 1:
        return None
    return str(recording.sources[0].source)


def _recordings_root(manifest: Path, cut: Any) -> str:
    """The folder relative recording paths are resolved against (see the module docstring)."""
    folder = manifest.resolve().parent
    candidates = [folder, folder.parent, folder.parent.parent, Path.cwd()]
    first = _source_path(cut)
    if first is None or os.path.isabs(first):
        return os.fspath(folder)
    return os.fspath(next((c for c in candidates if (c / first).exists()), folder))


def cut_example(cut: Any, origin: str, root: str) -> Example:
    """One cut → one example (see the module docstring); UserError for a cut whose audio is not
    a window of one plain file."""
    from lhotse import MonoCut

    where = f"{origin} (cut {cut.id})"
    if not isinstance(cut, MonoCut):
        raise UserError(
            f"{where}: a {type(cut).__name__}, whose audio lhotse computes from several "
            f"tracks; whisper-train reads one recording a cut: {_SAVE_AUDIOS}"
        )
    if not cut.has_recording:
        raise UserError(f"{where}: has no recording (features only); attach its recording")
    recording = cut.recording
    problem = _unsupported_recording(cut, recording)
    if problem:
        raise UserError(f"{where}: {problem}; {_SAVE_AUDIOS}")
    supervisions = sorted(cut.supervisions, key=lambda s: s.start)
    texts = [s.text.strip() for s in supervisions if s.text]
    languages = [s.language for s in supervisions if s.language]
    if len(_spelled_alike(languages)) > 1:
        raise UserError(
            f"{where}: its supervisions are in {', '.join(sorted(set(languages)))}; a training "
            "example has one language: split it with cuts.trim_to_supervisions()"
        )
    return Example(
        audio=resolve_path(root, str(recording.sources[0].source)),
        text=" ".join(texts),
        language=languages[0] if languages else None,
        start=float(cut.start),
        end=float(cut.start + cut.duration),
        duration=float(cut.duration),
        origin=where,
    )


def _spelled_alike(languages: list[str]) -> set[str]:
    """The distinct languages of `languages`, "English" and "en" one (a name Whisper does not
    know stays as it is: the label encoder skips its clips, as in any layout)."""
    if len(set(languages)) < 2:
        return set(languages)

    def code(language: str) -> str:
        try:
            return language_code(language) or language
        except UserError:
            return language

    return {code(language) for language in languages}


def _unsupported_recording(cut: Any, recording: Any) -> str | None:
    """Why the cut's audio is not a window of one file read whole, or None."""
    if len(recording.sources) != 1:
        return f"recording {recording.id} has {len(recording.sources)} sources (one per channel)"
    source = recording.sources[0]
    if source.type != "file":
        return f"recording {recording.id} is read from a {source.type}, not a file"
    transforms = [t.get("name") if isinstance(t, dict) else type(t).__name__ for t in
                  recording.transforms or []]  # fmt: skip
    # Resampling alone changes nothing here: the file is resampled to 16 kHz anyway.
    changed = [name for name in transforms if name != "Resample"]
    if changed:
        return f"recording {recording.id} is transformed ({', '.join(changed)})"
    channels = cut.channel if isinstance(cut.channel, list) else [cut.channel]
    if recording.num_channels > 1 and sorted(channels) != sorted(recording.channel_ids):
        return (
            f"takes channel {', '.join(map(str, channels))} of the {recording.num_channels} of "
            f"recording {recording.id}, and whisper-train averages every channel"
        )
    return None


# -- as a stream -------------------------------------------------------------------------------
def stream_parts(manifest: Path) -> int:
    """How many parts a streamed manifest is split into: STREAM_PARTS, or its number of rows
    when it has fewer (an empty part would leave a process or worker without rows). Counts
    lines without parsing them."""
    import_lhotse()
    from lhotse.serialization import open_best

    rows = 0
    try:
        with open_best(manifest) as lines:
            for line in lines:
                rows += bool(line.strip())
                if rows >= STREAM_PARTS:
                    break
    except Exception as exc:  # noqa: BLE001 - gzip's and the file system's errors: one line
        raise UserError(
            f"{manifest}: cannot read it as a lhotse CutSet ({_first_line(exc)}); write it "
            "again with CutSet.to_file"
        ) from None
    return max(1, rows)


def stream_rows(manifest: str, parts: list[int], n_parts: int) -> Iterator[dict]:
    """The rows of a streamed cut manifest that belong to `parts` (a `datasets` generator: it
    hands each DataLoader worker some of the parts): audio path and window, text, language,
    origin."""
    for example in cut_examples(Path(manifest), frozenset(parts), n_parts):
        yield {
            "audio": example.audio,
            "start": example.start,
            "end": example.end,
            "text": example.text,
            "language": example.language,
            "origin": example.origin,
        }
