"""Hugging Face `datasets` → examples: a dataset saved with save_to_disk (DIR or DIR:split) or a
hub id name:config:split, read without decoding; audio held as bytes is stored once as a file
of its own format in the user cache.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from whisper_train import runfolder
from whisper_train.audio import read_header
from whisper_train.data.examples import Example
from whisper_train.data.manifests import (
    AUDIO_COLUMNS,
    LANGUAGE_COLUMNS,
    TEXT_COLUMNS,
    pick_column,
)
from whisper_train.errors import AudioError, UserError
from whisper_train.files import write_atomically

DATASETS_EXTRA = "pip install 'whisper-train[datasets]'"


def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"reading Hugging Face datasets needs the `datasets` package: {DATASETS_EXTRA}"
        ) from None
    return datasets


def detect_hf(path: Path) -> bool:
    return path.is_dir() and any(
        (path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def read_hf_disk(path: Path, split: str | None = None) -> list[Example]:
    datasets = _import_datasets()
    try:
        dataset = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"{path}: not a dataset saved with save_to_disk ({reason[:200]}); save it with "
            "Dataset.save_to_disk or pick another --data-format"
        ) from None
    if isinstance(dataset, datasets.DatasetDict):
        name = split or "train"
        if name not in dataset:
            raise UserError(
                f"{path}: no split '{name}'; splits found: {', '.join(dataset)} (choose one as "
                f"{path}:SPLIT)"
            )
        dataset = dataset[name]
    return _hf_examples(dataset, str(path), _cache_dir() / dataset._fingerprint)


def read_hf_hub(dataset_id: str) -> list[Example]:
    """`name`, `name:config` or `name:config:split` (default split: train) from the hub."""
    datasets = _import_datasets()
    name, config, split = ([*dataset_id.split(":"), None, None])[:3]
    try:
        dataset = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as exc:  # noqa: BLE001 - any failure here means "not loadable", one line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"{dataset_id}: not a local file or folder, and loading it as a Hugging Face hub "
            f"dataset (name:config:split) failed: {reason[:200]}; check the path or id"
        ) from None
    return _hf_examples(dataset, dataset_id, _cache_dir() / dataset._fingerprint)


def _cache_dir() -> Path:
    """Where audio bytes from datasets are stored as files (`_cached_audio`)."""
    return runfolder.user_cache_dir("hf-audio")


def _hf_examples(dataset: Any, origin: str, cache: Path) -> list[Example]:
    datasets = _import_datasets()
    columns = list(dataset.column_names)
    audio_column = pick_column(Path(origin), columns, AUDIO_COLUMNS, "audio")
    text_column = pick_column(Path(origin), columns, TEXT_COLUMNS, "text")
    language_column = next((c for c in LANGUAGE_COLUMNS if c in columns), None)
    if isinstance(dataset.features[audio_column], datasets.Audio):
        # Decoding in `datasets` needs torchcodec; read the stored bytes/paths instead.
        dataset = dataset.cast_column(audio_column, datasets.Audio(decode=False))
    examples = []
    for index, row in enumerate(dataset):
        audio = row[audio_column]
        where = f"{origin}[{index}]"
        if isinstance(audio, dict) and audio.get("bytes"):
            path = _cached_audio(audio["bytes"], cache, where)
        elif isinstance(audio, dict) and audio.get("path"):
            path = os.path.abspath(audio["path"])
        elif isinstance(audio, str):
            path = os.path.abspath(audio)
        else:
            raise UserError(f"{where}: malformed row: no audio bytes or path in '{audio_column}'")
        language = row.get(language_column) if language_column else None
        examples.append(
            Example(
                audio=path,
                text=str(row[text_column] or "").strip(),
                language=language or None,
                origin=where,
            )
        )
    return examples


def _cached_audio(data: bytes, cache: Path, where: str) -> str:
    """Store encoded audio bytes once, unchanged, as `cache/<sha1>.<format>`; return that path.

    The bytes are checked to be audio soundfile or PyAV reads, and kept as they are: a FLAC
    stays a FLAC (decoding to float32 WAV made 11 MB of FLAC 43 MB on disk), an M4A an M4A.
    `--streaming` reads a hub dataset without any copy."""
    try:
        # "FLAC/PCM_16", "WAV/GSM610", "MPEG/MPEG_LAYER_III" (soundfile) or FFmpeg's
        # "mov,mp4,m4a,3gp,3g2,mj2/aac", "matroska,webm/opus" (PyAV)
        container = read_header(data, origin=where).format.split("/")[0].split(",")[0].lower()
    except AudioError as exc:
        raise AudioError(where, f"cannot decode the audio bytes ({exc.reason})") from None
    suffix = {"mpeg": "mp3", "wavex": "wav", "mov": "m4a", "matroska": "webm"}.get(
        container, container
    )
    target = cache / f"{hashlib.sha1(data).hexdigest()}.{suffix}"
    if not target.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        write_atomically(target, data)  # a parallel reader never sees half a file
    return str(target)
