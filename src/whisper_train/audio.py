"""Reading audio: any file soundfile or PyAV decodes → float32 mono at Whisper's 16 kHz.

soundfile (libsndfile) decodes WAV (PCM of any width, float, u-law, A-law, ADPCM, GSM 6.10),
FLAC, OGG/Vorbis/Opus, MP3 and AIFF and can seek, so a window of a long recording is read
without decoding the rest. What libsndfile cannot open (M4A/AAC from phones, MP4 and WebM from
video and browsers, AMR, WMA...) is decoded by PyAV, which bundles FFmpeg's decoders. soxr
resamples (its "HQ" quality is transparent for speech and much faster than a polyphase filter in
numpy).

Every reader takes a file's path or its encoded bytes (a streamed shard's sample, a dataset's
embedded audio): the same two decoders, so a format that trains from a folder trains from a
shard.
"""

from __future__ import annotations

import io
import itertools
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import av
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
ENCODER_POSITIONS = N_FRAMES // 2  # 1500: the encoder's second convolution has stride 2

# File names a folder of audio is searched for (lower case): libsndfile's formats, then the
# containers PyAV reads (phones record M4A, browsers WebM, video is MP4/MKV).
AUDIO_SUFFIXES = (
    ".wav", ".flac", ".mp3", ".ogg", ".oga", ".opus", ".aiff", ".aif", ".au", ".caf",
    ".m4a", ".aac", ".mp4", ".webm", ".mka", ".mkv", ".amr", ".wma",
)  # fmt: skip

# soxr's "HQ" preset: 20-bit precision, passband to 95% of Nyquist; "VHQ" costs more for no
# audible gain on speech.
_RESAMPLE_QUALITY = "HQ"
# A window starting this far into a file PyAV decodes is reached by a seek to the packet before
# it; nearer the start, decoding from the beginning costs less than the seek's uncertainty.
_PYAV_SEEK_AFTER_SECONDS = 10.0
_REMEDY = "convert it to WAV or FLAC"
# libsndfile subtypes whose samples are stored as floats: the only formats whose samples may be
# NaN or infinite (an integer PCM or a codec's decoder gives finite numbers), which no header
# tells: such files are decoded wherever the data is checked whole.
FLOAT_SUBTYPES = ("FLOAT", "DOUBLE")

# A file's path, or the encoded bytes of one (WAV, FLAC, M4A... as stored in a shard).
AudioSource = str | Path | bytes


@dataclass(frozen=True)
class AudioHeader:
    """What a file says about itself, without decoding it (PyAV files with no stated duration
    are decoded once to count their samples)."""

    frames: int
    sample_rate: int
    channels: int
    format: str  # "WAV/GSM610", "FLAC/PCM_16", "mov,mp4,m4a,3gp,3g2,mj2/aac", ...

    @property
    def seconds(self) -> float:
        return self.frames / self.sample_rate if self.sample_rate else 0.0

    @property
    def float_samples(self) -> bool:
        """Whether the samples are stored as floats (and so may be NaN or infinite)."""
        return self.format.endswith(tuple(f"/{subtype}" for subtype in FLOAT_SUBTYPES))


class NonFiniteAudio(AudioError):
    """Samples that are NaN or infinite (a float WAV can hold them): one such sample makes the
    clip's log-mel, and so its batch's loss, NaN. Skipped like a clip that does not decode."""


def read_header(source: AudioSource, *, origin: str | None = None) -> AudioHeader:
    """The header of `source` (a path, or encoded bytes named `origin` in errors); AudioError
    when the file is missing or neither soundfile nor PyAV can read it (the message gives both
    reasons)."""
    source, name = _checked(source, origin)
    try:
        with soundfile.SoundFile(_readable(source)) as audio:
            return AudioHeader(
                audio.frames, audio.samplerate, audio.channels, f"{audio.format}/{audio.subtype}"
            )
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as exc:
        libsndfile_reason = _first_line(exc)
    return _pyav_header(source, name, libsndfile_reason)


def _header(path: str | Path) -> tuple[int, int, bool]:
    """(frames, sample rate, whether the samples are floats) from the file's header; AudioError
    when the file is missing or not audio soundfile or PyAV can read. (`SoundFile` rather than
    `soundfile.info`, and no pathlib: this runs once per clip at start-up, and they cost 76 and
    5 us of the ~115 us a read took.)"""
    path = _existing_file(path)
    try:
        with soundfile.SoundFile(path) as header:
            return header.frames, header.samplerate, header.subtype in FLOAT_SUBTYPES
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as exc:
        libsndfile_reason = _first_line(exc)
    header = _pyav_header(path, path, libsndfile_reason)
    return header.frames, header.sample_rate, False


def _existing_file(path: str | Path) -> str:
    path = os.fspath(path)
    problem = not_a_file(path)
    if problem is not None:
        raise AudioError(path, problem)
    return path


def not_a_file(path: str | Path) -> str | None:
    """Why `path` is no file audio can be read from, named as what it is (None: a file). A
    FIFO or a device would hang or never end a read; a folder is no clip."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "file not found; check the path in your data"
    except OSError as exc:
        return f"cannot be opened ({exc.strerror or exc}); check the path and its permissions"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder, not an audio file; name the audio file itself"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO), not an audio file; save the audio to a file first"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device, not an audio file; pass an audio file"
    return "not a regular file (a socket?); pass an audio file"


def _checked(source: AudioSource, origin: str | None) -> tuple[str | bytes, str]:
    """(the source as the readers take it, its name in errors): a path must exist; bytes are
    named by `origin`."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), origin or "<audio bytes>"
    path = _existing_file(source)
    return path, origin or path


def _readable(source: str | bytes):
    """What soundfile and PyAV open: the path, or a fresh file-like over the bytes (each reader
    consumes its own)."""
    return io.BytesIO(source) if isinstance(source, bytes) else source


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def audio_duration(path: str | Path) -> float:
    """Length of the whole file in seconds, read from its header (no decoding)."""
    return audio_length(path)[0]


def audio_length(path: str | Path) -> tuple[float, bool]:
    """(length of the whole file in seconds, whether its samples are stored as floats), read
    from its header (no decoding)."""
    frames, sample_rate, float_samples = _header(path)
    return (frames / sample_rate if sample_rate else 0.0), float_samples


def load_audio(
    source: AudioSource,
    *,
    start: float | None = None,
    end: float | None = None,
    origin: str | None = None,
) -> np.ndarray:
    """Decode `source` (a path or encoded bytes; the window [start, end) seconds of it) to mono
    16 kHz. `origin` names bytes in errors (a shard's key).

    Returns a float32 array of shape (n_samples,) in [-1, 1]. Channels are averaged. Only the
    frames of the window are read from disk (PyAV files: decoded from the packet before the
    window). Raises AudioError when the file is missing, cannot be decoded, or the (window of
    the) audio holds no samples; NonFiniteAudio when a sample is NaN or infinite.
    """
    source, name = _checked(source, origin)
    try:
        audio = soundfile.SoundFile(_readable(source))
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as exc:
        samples, source_rate = _pyav_decode(source, name, start, end, _first_line(exc))
    else:
        try:
            with audio:
                samples, source_rate = _soundfile_decode(audio, start, end)
        except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
            raise AudioError(name, f"cannot decode audio ({_first_line(exc)}); {_REMEDY}") from None
    if samples.size == 0:
        where = "" if start is None and end is None else f" in the window {start}-{end} s"
        raise AudioError(name, f"no audio samples{where}; remove it from your data")

    mono = samples.mean(axis=1, dtype=np.float32)
    _check_finite(mono, name, source_rate, start)
    if source_rate != SAMPLE_RATE:
        mono = soxr.resample(mono, source_rate, SAMPLE_RATE, quality=_RESAMPLE_QUALITY)
    return np.ascontiguousarray(mono, dtype=np.float32)


def audio_pieces(
    source: str | Path,
    piece_seconds: float,
    *,
    start: float | None = None,
    end: float | None = None,
) -> Iterator[np.ndarray]:
    """`load_audio`'s samples of the file `source` (its window [start, end) seconds), in
    consecutive pieces of `piece_seconds` (the last may be shorter): a recording of any length
    read holding about one piece at a time, never the whole. Decoded as it is read (soundfile's
    blocks, else PyAV's frames), resampled by one streaming resampler (no seam between pieces).
    AudioError and NonFiniteAudio as `load_audio` raises them, from the piece where met."""
    path, name = _checked(source, None)
    pieces = _Pieces(round(piece_seconds * SAMPLE_RATE))
    try:
        audio = soundfile.SoundFile(path)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as exc:
        blocks, rate = _pyav_blocks(path, name, start, end, _first_line(exc))
    else:
        blocks, rate = _soundfile_blocks(audio, name, start, end, piece_seconds)
    resampler = None
    if rate != SAMPLE_RATE:
        resampler = soxr.ResampleStream(
            rate, SAMPLE_RATE, 1, dtype="float32", quality=_RESAMPLE_QUALITY
        )
    read = 0
    for block in blocks:
        mono = block.mean(axis=1, dtype=np.float32)
        _check_finite(mono, name, rate, (start or 0.0) + read / rate)
        read += len(mono)
        yield from pieces.add(mono if resampler is None else resampler.resample_chunk(mono))
    if resampler is not None:
        yield from pieces.add(resampler.resample_chunk(np.zeros(0, np.float32), last=True))
    if not read:
        where = "" if start is None and end is None else f" in the window {start}-{end} s"
        raise AudioError(name, f"no audio samples{where}; remove it from your data")
    yield from pieces.rest()


class _Pieces:
    """Samples gathered into pieces of `size` (one piece's worth held at most, plus a block)."""

    def __init__(self, size: int):
        self.size, self.held, self.count = size, [], 0

    def add(self, samples: np.ndarray) -> Iterator[np.ndarray]:
        self.held.append(samples)
        self.count += len(samples)
        while self.count >= self.size:
            joined = np.concatenate(self.held)
            yield np.ascontiguousarray(joined[: self.size], dtype=np.float32)
            rest = joined[self.size :]
            self.held, self.count = [rest], len(rest)

    def rest(self) -> Iterator[np.ndarray]:
        if self.count:
            yield np.ascontiguousarray(np.concatenate(self.held), dtype=np.float32)


def _soundfile_blocks(
    audio: soundfile.SoundFile,
    name: str,
    start: float | None,
    end: float | None,
    piece_seconds: float,
) -> tuple[Iterator[np.ndarray], int]:
    """((frames, channels) float32 blocks of the window, of about `piece_seconds` each, read as
    they are asked for), the file's rate."""
    rate = audio.samplerate
    first = 0 if start is None else max(0, round(start * rate))
    stop = None if end is None else max(first, round(end * rate))
    size = max(1, round(piece_seconds * rate))

    def blocks() -> Iterator[np.ndarray]:
        with audio:
            try:
                if first and audio.seekable():
                    audio.seek(min(first, audio.frames))
                    position = first
                else:
                    position = 0  # read from the start and drop what precedes the window
                while stop is None or position < stop:
                    wanted = size if stop is None else min(size, stop - position)
                    block = audio.read(wanted, dtype="float32", always_2d=True)
                    if not len(block):
                        return
                    lo, position = position, position + len(block)
                    if position > first:
                        yield block[max(0, first - lo) :]
            except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
                raise AudioError(
                    name, f"cannot decode audio ({_first_line(exc)}); {_REMEDY}"
                ) from None

    return blocks(), rate


def _pyav_blocks(
    source: str, name: str, start: float | None, end: float | None, libsndfile_reason: str
) -> tuple[Iterator[np.ndarray], int]:
    """`_pyav_decode`'s window as (frames, channels) float32 blocks, decoded as they are asked
    for (from the start: a seek's uncertainty is not worth it once per recording), the rate."""
    container, stream = _pyav_open(source, name, libsndfile_reason)
    rate = stream.codec_context.sample_rate
    first = 0 if start is None else max(0, round(start * rate))
    stop = None if end is None else max(first, round(end * rate))

    def blocks() -> Iterator[np.ndarray]:
        to_float = av.AudioResampler(format="fltp", rate=rate)
        position = 0
        with container:
            try:
                frames = (f for frame in container.decode(stream) for f in to_float.resample(frame))
                for converted in itertools.chain(frames, to_float.resample(None)):
                    block = converted.to_ndarray()  # (channels, samples)
                    lo, position = position, position + block.shape[1]
                    if position > first:
                        hi = block.shape[1] if stop is None else min(stop - lo, block.shape[1])
                        yield block[:, max(0, first - lo) : hi].T.astype(np.float32, copy=False)
                    if stop is not None and position >= stop:
                        return
            except (av.FFmpegError, ValueError) as exc:
                raise AudioError(
                    name, f"cannot decode audio ({_first_line(exc)}); {_REMEDY}"
                ) from None

    return blocks(), rate


def _check_finite(samples: np.ndarray, name: str, rate: int, start: float | None) -> None:
    """NonFiniteAudio when a sample is NaN or infinite (checked before resampling, which would
    spread it). 0.24 ms for 30 s, against 27 ms to decode 30 s of FLAC (2 shared CPU cores)."""
    finite = np.isfinite(samples)
    if finite.all():
        return
    first = int(np.argmin(finite))
    at = (start or 0.0) + first / rate
    raise NonFiniteAudio(
        name,
        f"{finite.size - int(np.count_nonzero(finite))} samples are NaN or infinite (the first "
        f"at {at:.2f} s); re-export the audio with finite samples or remove it from your data",
    )


def _soundfile_decode(
    audio: soundfile.SoundFile, start: float | None, end: float | None
) -> tuple[np.ndarray, int]:
    """(frames, channels) float32 of the window, and the file's rate. A file that cannot seek
    (GSM 6.10 and G.721 WAVs) is read with a frame count: libsndfile refuses `read(-1)` on it."""
    source_rate = audio.samplerate
    first_frame = 0 if start is None else max(0, round(start * source_rate))
    stop_frame = audio.frames if end is None else max(first_frame, round(end * source_rate))
    skip = 0
    if first_frame and audio.seekable():
        audio.seek(min(first_frame, audio.frames))
    else:
        skip = first_frame  # read from the start and drop what precedes the window
    n_frames = max(0, min(stop_frame, audio.frames) - first_frame) + skip
    if end is None and audio.seekable():
        n_frames = -1  # to the end of the data, whatever a header that lies says
    # always_2d gives (frames, channels) for mono and multichannel alike.
    samples = audio.read(n_frames, dtype="float32", always_2d=True)
    return samples[skip:], source_rate


# -- PyAV (FFmpeg) for what libsndfile cannot open --------------------------------------------


def _pyav_open(source: str | bytes, name: str, libsndfile_reason: str):
    """(container, its first audio stream); AudioError naming both decoders' reasons."""
    try:
        container = av.open(_readable(source))
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise AudioError(
            name,
            f"cannot decode audio (libsndfile: {libsndfile_reason}; FFmpeg: {_first_line(exc)}); "
            f"{_REMEDY}",
        ) from None
    if not container.streams.audio:
        container.close()
        raise AudioError(name, f"no audio stream in this file; {_REMEDY}")
    return container, container.streams.audio[0]


def _pyav_header(source: str | bytes, name: str, libsndfile_reason: str) -> AudioHeader:
    container, stream = _pyav_open(source, name, libsndfile_reason)
    with container:
        rate = stream.codec_context.sample_rate or stream.sample_rate or 0
        channels = stream.codec_context.channels or 1
        if stream.duration is not None and stream.time_base is not None:
            seconds = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            seconds = container.duration / av.time_base
        else:
            seconds = None
        fmt = f"{container.format.name}/{stream.codec_context.name}"
    if seconds is None:  # live recordings (browser WebM) often state no duration: count
        samples, rate = _pyav_decode(source, name, None, None, libsndfile_reason)
        return AudioHeader(len(samples), rate, channels, fmt)
    return AudioHeader(round(seconds * rate), rate, channels, fmt)


def _pyav_decode(
    source: str | bytes,
    name: str,
    start: float | None,
    end: float | None,
    libsndfile_reason: str,
) -> tuple[np.ndarray, int]:
    """(frames, channels) float32 of the window [start, end) and the stream's rate."""
    container, stream = _pyav_open(source, name, libsndfile_reason)
    with container:
        rate = stream.codec_context.sample_rate
        first = 0 if start is None else max(0, round(start * rate))
        stop = None if end is None else max(first, round(end * rate))
        # Sample formats differ per codec (s16, fltp, s32p...): one float-planar conversion at
        # the stream's own rate and layout, so channels are averaged here as for soundfile.
        to_float = av.AudioResampler(format="fltp", rate=rate)
        position = 0  # index in the stream of the next decoded sample
        if start is not None and start >= _PYAV_SEEK_AFTER_SECONDS and stream.time_base:
            container.seek(int(start / stream.time_base), stream=stream)
            position = None  # taken from the first decoded frame's time
        pieces = []
        try:
            for frame in container.decode(stream):
                if position is None:
                    position = round(frame.time * rate) if frame.time is not None else 0
                for converted in to_float.resample(frame):
                    block = converted.to_ndarray()  # (channels, samples)
                    lo, hi = position, position + block.shape[1]
                    position = hi
                    if hi > first and (stop is None or lo < stop):
                        a = max(first - lo, 0)
                        b = block.shape[1] if stop is None else min(stop - lo, block.shape[1])
                        pieces.append(block[:, a:b])
                if stop is not None and position is not None and position >= stop:
                    break
            else:
                for converted in to_float.resample(None):  # what the converter still holds
                    pieces.append(
                        converted.to_ndarray()[:, : None if stop is None else stop - position]
                    )
        except (av.FFmpegError, ValueError) as exc:
            raise AudioError(name, f"cannot decode audio ({_first_line(exc)}); {_REMEDY}") from None
    if not pieces:
        return np.zeros((0, 1), dtype=np.float32), rate
    return np.concatenate(pieces, axis=1).T.astype(np.float32, copy=False), rate
