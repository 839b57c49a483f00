"""Training data in any common layout → a flat list of `Example`s.

Layouts (name: what is detected):
    audiofolder   a folder with metadata.csv / metadata.jsonl (`file_name` + a text column)
    jsonl/csv/tsv a manifest file, one utterance per row (NeMo, HF, Coqui and similar columns)
    commonvoice   a Common Voice release folder (train.tsv, dev.tsv, test.tsv + clips/); DIR:dev
    kaldi         a Kaldi data folder (wav.scp, text, optional segments)
    hf            a `datasets` dataset saved with save_to_disk (DIR or DIR:split), or a hub id
                  name:config:split when nothing local matches
    lhotse        a lhotse CutSet manifest (cuts.jsonl.gz, a .jsonl of cuts), or a folder of them
                  (DIR or DIR:NAME); one example a cut
    subtitles     a folder of long recordings with .srt/.vtt files of the same stem, or a manifest
                  whose rows are timed segments of long recordings; consecutive segments are
                  packed into windows of at most 30 s

This module holds the folder layouts (audiofolder, Common Voice, Kaldi), `LAYOUTS`, which maps
each format name to its detector and reader in detection order, and `load_examples`; manifests
are read by `manifests`, subtitles by `subtitles`, `datasets` by `hf_datasets` and lhotse cuts
by `lhotse_cuts`. A mistake in the data is a `UserError` of one line naming the file (and row)
and the remedy.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from whisper_train.audio import AUDIO_SUFFIXES
from whisper_train.data.examples import Example
from whisper_train.data.hf_datasets import DATASETS_EXTRA, detect_hf, read_hf_disk, read_hf_hub
from whisper_train.data.lhotse_cuts import LHOTSE_EXTRA, detect_cuts, read_cuts
from whisper_train.data.manifests import (
    AUDIO_COLUMNS,
    LANGUAGE_COLUMNS,
    TEXT_COLUMNS,
    is_manifest,
    manifest_examples,
    read_manifest,
    read_rows,
    read_text,
    resolve_path,
    seconds_field,
)
from whisper_train.data.subtitles import (
    OVERLAP_TOLERANCE,
    detect_subtitles,
    pack_segments,
    parse_subtitles,
    read_subtitles,
)
from whisper_train.errors import UserError

COMMONVOICE_SPLITS = ("train", "dev", "test", "validated", "other", "invalidated")


# -- audiofolder ----------------------------------------------------------------------------
def _audiofolder_metadata(folder: Path) -> Path | None:
    for name in ("metadata.csv", "metadata.jsonl"):
        if (folder / name).is_file():
            return folder / name
    return None


def _detect_audiofolder(path: Path) -> bool:
    return path.is_dir() and _audiofolder_metadata(path) is not None


def _read_audiofolder(folder: Path) -> list[Example]:
    metadata = _audiofolder_metadata(folder)
    if metadata is None:
        raise UserError(f"{folder}: no metadata.csv or metadata.jsonl; add one (file_name,text)")
    rows = read_rows(metadata, "," if metadata.suffix == ".csv" else None)
    return manifest_examples(metadata, rows, ("file_name",))


# -- Common Voice ---------------------------------------------------------------------------
def _commonvoice_tsv(folder: Path, split: str | None) -> Path:
    name = split or "train"
    tsv = folder / f"{name}.tsv"
    if not tsv.is_file():
        found = sorted(p.stem for p in folder.glob("*.tsv"))
        raise UserError(
            f"{folder}: no {name}.tsv in this Common Voice folder; splits found: "
            f"{', '.join(found) or 'none'} (choose one as {folder}:SPLIT)"
        )
    return tsv


def _detect_commonvoice(path: Path) -> bool:
    if path.is_file():  # e.g. cv-corpus/en/dev.tsv
        return path.suffix == ".tsv" and (path.parent / "clips").is_dir()
    return (path / "clips").is_dir() and any(
        (path / f"{name}.tsv").is_file() for name in COMMONVOICE_SPLITS
    )


def _read_commonvoice(path: Path, split: str | None = None) -> list[Example]:
    tsv = path if path.is_file() else _commonvoice_tsv(path, split)
    # `path` names a file in clips/ beside the TSV.
    rows = (
        (line, {**row, "path": f"clips/{row['path']}"} if row.get("path") else row)
        for line, row in read_rows(tsv, "\t")
    )
    return manifest_examples(tsv, rows, ("path",))


# -- Kaldi ----------------------------------------------------------------------------------
def _kaldi_table(path: Path) -> list[tuple[int, str, str]]:
    """(line, key, rest) for each non-empty line of a Kaldi table file."""
    entries = []
    for number, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        key, _, rest = line.strip().partition(" ")
        entries.append((number, key, rest.strip()))
    return entries


def _detect_kaldi(path: Path) -> bool:
    return path.is_dir() and (path / "wav.scp").is_file() and (path / "text").is_file()


def _read_kaldi(folder: Path) -> list[Example]:
    for name in ("wav.scp", "text"):
        if not (folder / name).is_file():
            raise UserError(f"{folder}: no {name}; a Kaldi data folder needs wav.scp and text")
    # Kaldi recipes write wav.scp paths relative to the recipe root, two levels above
    # data/<set>; take the first of these folders where the first file exists.
    recordings: dict[str, str] = {}
    for line, key, target in _kaldi_table(folder / "wav.scp"):
        if target.endswith("|") or not target:
            raise UserError(
                f"{folder / 'wav.scp'}:{line}: '{key}' is a piped command or empty; convert the "
                "audio to files (e.g. with sox) and list plain paths in wav.scp"
            )
        recordings[key] = target
    roots = [folder, folder.parent, folder.parent.parent, Path.cwd()]
    first = next(iter(recordings.values()), "")
    root = next((r for r in roots if (r / first).exists()), folder)
    texts = {key: (line, text) for line, key, text in _kaldi_table(folder / "text")}

    def example(utterance: str, recording: str, **window: float) -> Example:
        line, text = texts[utterance]
        if recording not in recordings:
            raise UserError(
                f"{folder}: recording '{recording}' of utterance '{utterance}' is not in "
                "wav.scp; add it or remove the utterance"
            )
        return Example(
            audio=resolve_path(os.fspath(root), recordings[recording]),
            text=text,
            origin=f"{folder / 'text'}:{line}",
            **window,
        )

    segments_file = folder / "segments"
    if not segments_file.is_file():
        return [example(key, key) for key in texts]
    examples = []
    for line, key, rest in _kaldi_table(segments_file):
        fields = rest.split()
        if len(fields) != 3:
            raise UserError(f"{segments_file}:{line}: malformed row: expected 'utt rec start end'")
        if key not in texts:
            continue  # Kaldi's fix_data_dir convention: segments without text are dropped
        start = seconds_field(segments_file, line, "start", fields[1]) or 0.0
        end = seconds_field(segments_file, line, "end", fields[2]) or 0.0
        examples.append(example(key, fields[0], start=start, end=end, duration=end - start))
    return examples


# -- the registry ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """A data layout: how to recognise it, how to read it, and what the detector looks for."""

    name: str
    detect: Callable[[Path], bool]
    read: Callable[..., list[Example]]
    looks_for: str
    has_splits: bool = False  # accepts PATH:SPLIT


# In detection order: folder layouts with a distinctive file first, plain manifests last.
LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout(
            "audiofolder", _detect_audiofolder, _read_audiofolder, "metadata.csv or metadata.jsonl"
        ),
        Layout(
            "commonvoice",
            _detect_commonvoice,
            _read_commonvoice,
            "clips/ with train.tsv/dev.tsv/test.tsv",
            has_splits=True,
        ),
        Layout("kaldi", _detect_kaldi, _read_kaldi, "wav.scp and text"),
        Layout(
            "hf",
            detect_hf,
            read_hf_disk,
            "dataset_info.json/state.json/dataset_dict.json (save_to_disk)",
            has_splits=True,
        ),
        # Before the manifests: a .jsonl of cuts is lhotse's (decided by its first row).
        Layout(
            "lhotse",
            detect_cuts,
            read_cuts,
            "a lhotse CutSet manifest (*.jsonl.gz, or *.jsonl of cuts)",
            has_splits=True,
        ),
        Layout(
            "subtitles",
            detect_subtitles,
            read_subtitles,
            "audio files with .srt/.vtt of the same name",
        ),
        Layout("jsonl", is_manifest((".jsonl", ".json")), read_manifest, "a .jsonl file"),
        Layout("csv", is_manifest((".csv",)), read_manifest, "a .csv file"),
        Layout("tsv", is_manifest((".tsv",)), read_manifest, "a .tsv file"),
    )
}

# A hub dataset id: `name` or `owner/name`, optionally `:config` and `:split`.
HUB_DATASET_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?(:[\w.-]*){0,2}$")


def _split_suffix(path: str) -> tuple[Path, str | None]:
    """`DIR:dev` → (DIR, "dev") when DIR exists and `DIR:dev` does not."""
    if not os.path.exists(path) and ":" in path:
        base, _, split = path.rpartition(":")
        if base and os.path.exists(base) and split and "/" not in split:
            return Path(base), split
    return Path(path), None


def load_examples(path: str | os.PathLike, *, data_format: str | None = None) -> list[Example]:
    """Read every example of the data at `path`, detecting its layout unless `data_format`.

    `path` may carry a split (`DIR:dev`) for Common Voice and saved HF DatasetDicts. A string
    that is no local path is tried as a hub dataset id `name:config:split`. Raises UserError
    for a missing path, an unrecognised layout, bad rows, and data with no examples.
    """
    if data_format is not None and data_format not in LAYOUTS:
        raise UserError(
            f"--data-format {data_format}: unknown format; choose one of {', '.join(LAYOUTS)}"
        )
    location, split = _split_suffix(str(path))
    if not location.exists():
        text = str(path)
        if (
            data_format in (None, "hf")
            and HUB_DATASET_ID.match(text)
            and not text.endswith((".jsonl", ".jsonl.gz", ".json", ".csv", ".tsv"))
        ):
            return _non_empty(text, read_hf_hub(text))
        raise UserError(f"{path}: no such file or folder; check the path")

    if data_format is not None:
        layout = LAYOUTS[data_format]
    else:
        layout = next((lay for lay in LAYOUTS.values() if lay.detect(location)), None)
        if layout is None and location.is_file() and location.suffix.lower() in AUDIO_SUFFIXES:
            raise UserError(
                f"{path}: one recording, not a data set; pass the folder of your clips with "
                "their transcripts (metadata.csv with file_name,text beside them) or a manifest "
                "(.csv/.jsonl with audio and text columns); `whisper-train transcribe` reads "
                "a single recording"
            )
        if layout is None:
            looked_for = "; ".join(f"{lay.name}: {lay.looks_for}" for lay in LAYOUTS.values())
            raise UserError(
                f"{path}: no recognised data layout (looked for {looked_for}); rename the "
                f"files to match one, or pass --data-format ({', '.join(LAYOUTS)})"
            )
    if split is not None and not layout.has_splits:
        raise UserError(
            f"{path}: ':{split}' selects a split, which the {layout.name} layout has "
            "not; drop the suffix"
        )
    if layout.name in ("jsonl", "csv", "tsv") and not location.is_file():
        raise UserError(f"{path}: the {layout.name} format needs a manifest file, not a folder")
    examples = layout.read(location, split) if layout.has_splits else layout.read(location)
    _check_some_audio_exists(str(path), examples)
    return _non_empty(str(path), examples)


def _non_empty(path: str, examples: list[Example]) -> list[Example]:
    if not examples:
        raise UserError(f"{path}: no examples found; add rows (audio + text) to the data")
    return examples


def _check_some_audio_exists(path: str, examples: list[Example]) -> None:
    """All audio missing means the paths are resolved against the wrong folder: say so now.

    Some missing files are left to `screen_examples`, which skips and counts them.
    """
    if examples and not any(os.path.isfile(example.audio) for example in examples):
        first = examples[0]
        raise UserError(
            f"{first.origin}: audio file {first.audio} not found, nor any other of the "
            f"{len(examples)} audio files in {path}; relative paths are resolved against the "
            "data file's folder"
        )


__all__ = [
    "AUDIO_COLUMNS",
    "DATASETS_EXTRA",
    "LHOTSE_EXTRA",
    "LANGUAGE_COLUMNS",
    "TEXT_COLUMNS",
    "LAYOUTS",
    "Layout",
    "load_examples",
    "pack_segments",
    "parse_subtitles",
    "OVERLAP_TOLERANCE",
]
