"""A frozen encoder's outputs on disk: computed once per clip, reused by every epoch, every
evaluation and every later run with the same encoder.

With the encoder frozen and the audio not augmented, the encoder maps each clip to the same
(1500, d_model) tensor every time, and it is ~84% of Whisper's training FLOPs
(docs/compute.md). Caching it turns each later epoch into decoder-only work.

Layout: ROOT/<model key>/<2 hex digits>/<clip key>.safetensors, one float16 tensor a clip
(tiny 1.15 MB ... large-v3 3.84 MB), and ROOT/<model key>/info.json (what `cache ls` shows).

- ROOT: `--encoder-cache-dir`, default `runfolder.encoder_cache_dir` (a user cache folder).
- model key: a hash of the encoder's weights, the log-mel settings, the compute precision and
  `FORMAT_VERSION`: another model, fine-tuned encoder or precision never reads these outputs.
- clip key: a hash of the audio file's path, size and modification time and the window
  [start, end): an edited or replaced file is a new clip.

Lazy: `EncoderCacheCollator` (in the data-loader workers) reads the clips already stored and
computes log-mel features only for the missing ones; the training loop hands each batch to
`EncoderCache.complete`, which encodes those on the accelerator, stores them and fills the
batch. Step 1 waits for one batch, not for the whole set.

Bounded: a process writes a file only while (a) the whole ROOT stays within
`--encoder-cache-max-size` (its share of the room left when the run started: the room divided
by the number of processes) and (b) the disk keeps `reserve_bytes` + `MIN_FREE_BYTES` free
after the real bytes of that file (`shutil.disk_usage`, checked before every write). Past
either, it stops writing, says so once with the numbers, and encodes the remaining clips on
the fly every time. Files are written whole, never preallocated or sparse.

Shared safely: each process stores only the clips of its own batches (its shard). A file is
written to a temporary name unique to its writer in the same folder and renamed into place
(`files.write_atomically`, atomic on POSIX): a reader sees no file or a whole one. Two
processes can meet on one clip only when accelerate repeats a few clips to even out the last
batch of a sharded loader; they write the same bytes from the same weights, and whichever
rename lands last leaves a whole, valid file.

Values: a batch uses the float16 values on every path (read back, freshly encoded, or encoded
on the fly past the limit), so a run's numbers do not depend on what the cache held.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from whisper_train.audio import load_audio
from whisper_train.data.collate import SpeechCollator
from whisper_train.errors import UserError
from whisper_train.files import write_atomically
from whisper_train.units import format_bytes

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when what a stored file means changes: old entries are then ignored
STORAGE_DTYPE = torch.float16  # LayerNorm-ed outputs: |x| far below float16's 65504
MIN_FREE_BYTES = 2**30  # left free on the disk beyond the caller's own reserve
INFO_FILE = "info.json"
TENSOR_NAME = "encoder_hidden_states"
MODEL_KEY_PATTERN = re.compile(r"[0-9a-f]{16}")
FILE_SUFFIX = ".safetensors"


def clip_key(example) -> str | None:
    """A clip's identity: its audio file (path, size, modification time) and window; None for
    audio that is not a file here (such clips are encoded on the fly)."""
    try:
        stat = os.stat(example.audio)
    except (OSError, TypeError, ValueError):
        return None
    identity = f"{os.path.abspath(example.audio)}\0{stat.st_size}\0{stat.st_mtime_ns}"
    identity += f"\0{example.start}\0{example.end}"
    return hashlib.blake2b(identity.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def model_key(encoder: torch.nn.Module, feature_extractor, *, compute: str) -> str:
    """16 hex digits naming (encoder weights, log-mel settings, compute precision, format)."""
    digest = hashlib.sha256(f"whisper-train encoder cache {FORMAT_VERSION}\0{compute}".encode())
    for name in ("feature_size", "n_fft", "hop_length", "n_samples", "sampling_rate"):
        digest.update(f"\0{name}={getattr(feature_extractor, name, None)}".encode())
    for name, tensor in sorted(encoder.state_dict().items()):
        tensor = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"\0{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().data)
    return digest.hexdigest()[:16]


def _tree_size(folder: Path) -> tuple[int, int]:
    """(clip files, bytes of all files) under `folder`; (0, 0) when it does not exist."""
    n_clips = n_bytes = 0
    for dirpath, _, filenames in os.walk(folder):
        for filename in filenames:
            try:
                n_bytes += os.stat(os.path.join(dirpath, filename)).st_size
            except OSError:
                continue  # removed meanwhile (another run's temporary file)
            n_clips += filename.endswith(FILE_SUFFIX)
    return n_clips, n_bytes


class EncoderCache:
    """The stored outputs of one encoder (ROOT/<model key>/), and this process's right to
    write more of them. `load` runs anywhere (data-loader workers too); `complete` and `store`
    run in the training process, which owns the budget."""

    def __init__(
        self,
        root: Path,
        key: str,
        shape: tuple[int, int],
        *,
        limit_bytes: int,
        reserve_bytes: int = 0,
        processes: int = 1,
    ):
        self.root = Path(root)
        self.key = key
        self.folder = self.root / key
        self.shape = tuple(shape)  # (positions, d_model)
        self.clip_bytes = shape[0] * shape[1] * torch.finfo(STORAGE_DTYPE).bits // 8
        self.limit_bytes = limit_bytes
        self.reserve_bytes = reserve_bytes + MIN_FREE_BYTES
        self.processes = processes
        self.clips_at_start, self.used_at_start = 0, 0  # this model key's entries
        self.root_used_at_start = _tree_size(self.root)[1]
        # This process's room: its share of what the limit leaves, so that N processes writing
        # at once stay within it together.
        self.room = max(0, limit_bytes - self.root_used_at_start) // max(1, processes)
        self.written_bytes = 0
        self.refused = False  # stopped writing (limit, free space or a write error): for good
        self.found = self.encoded = self.stored = 0  # clips read back, encoded, written
        # Clips this process meets once each, for the "needed" of a refusal (0: unknown).
        self.expected_clips = 0

    @classmethod
    def open(
        cls,
        root: Path,
        encoder: torch.nn.Module,
        feature_extractor,
        *,
        compute: str,
        model_name: str,
        shape: tuple[int, int],
        limit_bytes: int,
        reserve_bytes: int = 0,
        processes: int = 1,
    ) -> EncoderCache:
        """The cache of `encoder`'s outputs, (positions, d_model) = `shape` a clip, under
        `root` (created, with its info.json)."""
        key = model_key(encoder, feature_extractor, compute=compute)
        cache = cls(
            root,
            key,
            shape,
            limit_bytes=limit_bytes,
            reserve_bytes=reserve_bytes,
            processes=processes,
        )
        info = {
            "model": model_name,
            "shape": list(shape),
            "compute": compute,
            "dtype": str(STORAGE_DTYPE).removeprefix("torch."),
            "format": FORMAT_VERSION,
        }
        try:
            cache.folder.mkdir(parents=True, exist_ok=True)
            if not (cache.folder / INFO_FILE).exists():
                write_atomically(cache.folder / INFO_FILE, json.dumps(info, indent=1).encode())
        except OSError as exc:
            raise UserError(
                f"--encoder-cache-dir {root}: cannot write in {cache.folder} ({exc.strerror}); "
                "choose a writable folder, or --no-cache-encoder"
            ) from None
        cache.clips_at_start, cache.used_at_start = _tree_size(cache.folder)
        return cache

    def summary(self, n_clips: int) -> str:
        """The start-up line: where the cache lives, what it holds, what this run may add
        (`details`: the rest, printed with -v)."""
        return (
            f"encoder cache: {self.folder} holds {self.clips_at_start} clips; this run's "
            f"{n_clips} take up to {format_bytes(n_clips * self.clip_bytes)}"
        )

    def details(self) -> str:
        """The start-up line's detail: the sizes, the limit and the free space."""
        free = shutil.disk_usage(self.folder).free
        return (
            f"encoder cache: this folder {format_bytes(self.used_at_start)}, the whole cache "
            f"{format_bytes(self.root_used_at_start)} of its {format_bytes(self.limit_bytes)} "
            f"limit (--encoder-cache-max-size), {format_bytes(free)} free; outputs in 16 bits, "
            "each encoded when training first meets its clip"
        )

    # -- files ---------------------------------------------------------------------------------

    def path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}{FILE_SUFFIX}"

    def load(self, key: str) -> torch.Tensor | None:
        """The stored (positions, d_model) outputs of clip `key`, or None (absent, unreadable
        or of another shape: it is encoded again and overwritten)."""
        try:
            data = self.path(key).read_bytes()
            tensor = load_safetensors(data)[TENSOR_NAME]
        except (OSError, SafetensorError, KeyError):
            return None
        if tuple(tensor.shape) != self.shape or tensor.dtype != STORAGE_DTYPE:
            return None
        return tensor

    def store(self, key: str, hidden: torch.Tensor) -> bool:
        """Write clip `key`'s outputs if the limit and the free space allow; True if written."""
        if self.refused:
            return False
        data = save_safetensors({TENSOR_NAME: hidden.to("cpu", STORAGE_DTYPE).contiguous()})
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(path.parent).free
            if self.written_bytes + len(data) > self.room or free - len(data) < self.reserve_bytes:
                self._refuse(len(data), free)
                return False
            write_atomically(path, data)
        except OSError as exc:
            self.refused = True
            log.warning(
                "%sencoder cache: writing %s failed (%s); the remaining clips are encoded on the "
                "fly",
                self._who(),
                path,
                exc.strerror or exc,
            )
            return False
        self.written_bytes += len(data)
        self.stored += 1
        return True

    def _refuse(self, n_bytes: int, free: int) -> None:
        """Stop writing for good, and say why once, with the numbers."""
        self.refused = True
        used = self.root_used_at_start + self.written_bytes
        remaining = max(0, self.expected_clips - self.found - self.encoded)
        needed = max(n_bytes, remaining * self.clip_bytes)
        reason = (
            "the size limit"
            if self.written_bytes + n_bytes > self.room
            else f"the free space (keeping {format_bytes(self.reserve_bytes)} free)"
        )
        log.warning(
            "%sencoder cache: stopped writing at %s: limit %s (--encoder-cache-max-size), used "
            "%s, needed about %s more, free %s in %s; clips not cached are encoded on the fly "
            "every epoch (slower). Raise the limit, free space, choose --encoder-cache-dir, or "
            "remove old entries with `whisper-train cache clear`",
            self._who(),
            reason,
            format_bytes(self.limit_bytes),
            format_bytes(used),
            format_bytes(needed),
            format_bytes(free),
            self.root,
        )

    def _who(self) -> str:
        return f"process {os.getpid()}: " if self.processes > 1 else ""

    # -- the training process ------------------------------------------------------------------

    @torch.no_grad()
    def complete(
        self,
        batch: dict,
        encoder: torch.nn.Module,
        *,
        autocast_dtype: torch.dtype | None = None,
    ) -> dict:
        """A batch from `EncoderCacheCollator` with every row's `encoder_hidden_states`: the
        clips it could not read are encoded with `encoder` (on the features' device), stored
        within the budget and filled in. Other batches pass through."""
        rows = batch.pop("encoder_missing", None)
        if rows is None:
            self.found += batch.get("size", 0)
            return batch
        features, keys = batch.pop("input_features"), batch.pop("encoder_keys")
        device = features.device
        was_training = encoder.training
        encoder.eval()  # no dropout: the output a clip always maps to
        try:
            with torch.autocast(
                device.type,
                dtype=autocast_dtype or torch.float32,
                enabled=autocast_dtype is not None,
            ):
                hidden = encoder(features).last_hidden_state
        finally:
            encoder.train(was_training)
        limit = torch.finfo(STORAGE_DTYPE).max
        hidden = hidden.float().clamp(-limit, limit).to(STORAGE_DTYPE)
        states = batch["encoder_hidden_states"]
        states[rows.to(states.device)] = hidden.to(states.device)
        self.found += batch["size"] - len(keys)
        for key, clip_hidden in zip(keys, hidden, strict=True):
            if key is not None:
                self.store(key, clip_hidden)
            self.encoded += 1  # after the store: a refusal counts this clip as still needed
        return batch


class EncoderCacheCollator:
    """`SpeechCollator`'s batches, with `encoder_hidden_states` (batch, positions, d_model,
    float16) read from `cache` instead of `input_features`. Rows not in the cache are zero,
    listed in `encoder_missing` (their keys in `encoder_keys`), and their log-mel features are
    in `input_features`, for `EncoderCache.complete` to encode. Runs in loader workers."""

    def __init__(
        self,
        pad_token_id: int,
        log_mel,
        cache: EncoderCache,
        examples: Sequence,
        language_targets: Collection[int] = (),
        nospeech_target: int | None = None,
    ):
        # No LogMel: it hands the waveforms over.
        self.collator = SpeechCollator(
            pad_token_id, language_targets=language_targets, nospeech_target=nospeech_target
        )
        self.log_mel = log_mel
        self.cache = cache
        self.examples = examples

    @staticmethod
    def _decode(example):
        return load_audio(example.audio, start=example.start, end=example.end)

    def __call__(self, items: Sequence) -> dict:
        batch = self.collator(items)
        if not batch["size"]:
            return batch
        audio = batch.pop("audio")
        keys = [clip_key(self.examples[i]) for i in batch["indices"].tolist()]
        states = torch.zeros((len(keys), *self.cache.shape), dtype=STORAGE_DTYPE)
        missing = []
        for row, key in enumerate(keys):
            stored = None if key is None else self.cache.load(key)
            if stored is None:
                missing.append(row)
            else:
                states[row] = stored
        batch["encoder_hidden_states"] = states
        if missing:
            # A clip the dataset found cached but that is gone now (another run cleared the
            # cache) is decoded here after all.
            clips = [
                audio[row] if audio[row] is not None else self._decode(self.examples[index])
                for row, index in ((row, batch["indices"][row].item()) for row in missing)
            ]
            batch["input_features"] = self.log_mel(clips)
            batch["encoder_missing"] = torch.tensor(missing, dtype=torch.long)
            batch["encoder_keys"] = [keys[row] for row in missing]
        return batch


class CachedClip:
    """example → whether `cache` holds its encoder output (a file exists under its key): the
    dataset then skips decoding its audio. Picklable, for loader workers."""

    def __init__(self, cache: EncoderCache):
        self.cache = cache

    def __call__(self, example) -> bool:
        key = clip_key(example)
        return key is not None and self.cache.path(key).is_file()


# -- `whisper-train cache ls | clear` -----------------------------------------------------------


@dataclass(frozen=True)
class CacheEntry:
    """One model key's folder: its clips and bytes, and what info.json says about it."""

    key: str
    folder: Path
    clips: int
    bytes: int
    info: dict


def list_cache(root: Path) -> list[CacheEntry]:
    """Every model key under `root`, largest first; [] when the folder does not exist."""
    if not root.is_dir():
        return []
    entries = []
    for folder in sorted(root.iterdir()):
        if not (folder.is_dir() and MODEL_KEY_PATTERN.fullmatch(folder.name)):
            continue
        try:
            info = json.loads((folder / INFO_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            info = {}
        clips, n_bytes = _tree_size(folder)
        entries.append(CacheEntry(folder.name, folder, clips, n_bytes, info))
    return sorted(entries, key=lambda e: (-e.bytes, e.key))


def clear_cache(
    root: Path, *, key: str | None = None, everything: bool = False
) -> list[CacheEntry]:
    """Remove one model key's entries (`key`, or a unique prefix of it) or all of them; returns
    what was removed. Only model-key folders are touched, never other files under `root`."""
    if (key is None) == (not everything):
        raise UserError("cache clear: name what to remove: --model-key KEY or --all")
    entries = list_cache(root)
    if everything:
        chosen = entries
    else:
        chosen = [e for e in entries if e.key.startswith(key.strip().lower())]
        if len(chosen) != 1:
            known = ", ".join(e.key for e in entries) or "none"
            problem = "matches no model key" if not chosen else "matches several model keys"
            raise UserError(
                f"--model-key {key}: {problem} in {root} (keys: {known}); see `whisper-train "
                "cache ls`"
            )
    for entry in chosen:
        shutil.rmtree(entry.folder)
    return chosen


__all__ = [
    "CacheEntry",
    "EncoderCache",
    "EncoderCacheCollator",
    "clear_cache",
    "clip_key",
    "format_bytes",
    "list_cache",
    "model_key",
]
