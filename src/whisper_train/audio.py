"""Reading audio: any file soundfile decodes → float32 mono at Whisper's 16 kHz.

soundfile (libsndfile) decodes WAV, FLAC, OGG/Opus and MP3 and can seek, so a window of a long
recording is read without decoding the rest; soxr resamples (its "HQ" quality is transparent
for speech and much faster than a polyphase filter in numpy).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import soundfile
import soxr

from whisper_train.errors import AudioError

SAMPLE_RATE = 16_000  # Hz: the rate every Whisper model was trained on
N_FFT = 400  # samples per STFT window: 25 ms at 16 kHz
HOP_LENGTH = 160  # samples between STFT frames: 10 ms at 16 kHz
CHUNK_LENGTH = 30  # seconds: Whisper's encoder sees exactly one 30 s window
N_SAMPLES = CHUNK_LENGTH * SAMPLE_RATE  # 480000 samples in one window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 mel frames in one window

# soxr's "HQ" preset: 20-bit precision, passband to 95% of Nyquist; "VHQ" costs more for no
# audible gain on speech.
_RESAMPLE_QUALITY = "HQ"


def _header(path: str | Path) -> tuple[int, int]:
    """(frames, sample rate) from the file's header; AudioError when the file is missing or not
    audio soundfile can read. (`SoundFile` rather than `soundfile.info`, and no pathlib: this
    runs once per clip at start-up, and they cost 76 and 5 us of the ~115 us a read took.)"""
    path = _existing_file(path)
    try:
        with soundfile.SoundFile(path) as header:
            return header.frames, header.samplerate
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as exc:
        raise AudioError(
            path, f"cannot decode audio ({_first_line(exc)}); convert it to WAV or FLAC"
        ) from None


def _existing_file(path: str | Path) -> str:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise AudioError(path, "file not found; check the path in your data")
    return path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def audio_duration(path: str | Path) -> float:
    """Length of the whole file in seconds, read from its header (no decoding)."""
    frames, sample_rate = _header(path)
    return frames / sample_rate if sample_rate else 0.0


def load_audio(
    path: str | Path, *, start: float | None = None, end: float | None = None
) -> np.ndarray:
    """Decode `path` (or the window [start, end) seconds of it) to mono 16 kHz.

    Returns a float32 array of shape (n_samples,) in [-1, 1]. Channels are averaged. Only the
    frames of the window are read from disk. Raises AudioError when the file is missing, cannot
    be decoded, or the (window of the) audio holds no samples.
    """
    path = _existing_file(path)
    try:
        # One open for the rate, the seek and the read; always_2d gives (frames, channels) for
        # mono and multichannel alike.
        with soundfile.SoundFile(path) as audio:
            source_rate = audio.samplerate
            first_frame = 0 if start is None else max(0, round(start * source_rate))
            stop_frame = None if end is None else max(first_frame, round(end * source_rate))
            if first_frame:
                audio.seek(min(first_frame, audio.frames))
            n_frames = -1 if stop_frame is None else stop_frame - first_frame
            samples = audio.read(n_frames, dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise AudioError(
            path, f"cannot decode audio ({_first_line(exc)}); convert it to WAV or FLAC"
        ) from None
    if samples.size == 0:
        where = "" if start is None and end is None else f" in the window {start}-{end} s"
        raise AudioError(path, f"no audio samples{where}; remove it from your data")

    mono = samples.mean(axis=1, dtype=np.float32)
    if source_rate != SAMPLE_RATE:
        mono = soxr.resample(mono, source_rate, SAMPLE_RATE, quality=_RESAMPLE_QUALITY)
    return np.ascontiguousarray(mono, dtype=np.float32)
