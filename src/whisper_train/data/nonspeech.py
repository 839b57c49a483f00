"""Clips where nobody speaks: a set of them read from disk, or the built-in one synthesised.

A non-speech set (`--data NAME:nonspeech=PATH`) is what a model must write nothing on: silence,
noise, music, tones. PATH is any layout `load_examples` reads, or a plain folder of audio; a
clip there with a transcript is speech, and the set is refused (its words would be counted as
invented). PATH `builtin` is made on the spot (`write_builtin_set`): digital silence, dither,
white/pink/brown noise at several levels, mains hum, tones and beeps, clicks and chords, all
synthesised with numpy from fixed seeds, so every machine scores the same samples.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import soundfile

from whisper_train.audio import AUDIO_SUFFIXES, CHUNK_LENGTH, SAMPLE_RATE, audio_length
from whisper_train.choices import BUILTIN_SET
from whisper_train.data.examples import NONSPEECH_ORIGIN, Example
from whisper_train.data.layouts import load_examples
from whisper_train.errors import AudioError, UserError
from whisper_train.runfolder import user_cache_dir

# Long enough for a model to start a loop, short enough that the set decodes in seconds.
BUILTIN_SECONDS = 4.0
_LSB = 1.0 / 32768  # one step of the 16-bit files the set is written as


def _dbfs(signal: np.ndarray, level_db: float) -> np.ndarray:
    """`signal` scaled to an RMS of `level_db` dB below full scale."""
    rms = float(np.sqrt(np.mean(signal**2))) or 1.0
    return signal * (10 ** (level_db / 20) / rms)


def _coloured(rng: np.random.Generator, n: int, exponent: float) -> np.ndarray:
    """Noise whose power falls as 1/f**exponent (0 white, 1 pink, 2 brown), by shaping the
    spectrum of white noise; the DC bin is zeroed so brown noise does not drift off centre."""
    spectrum = np.fft.rfft(rng.standard_normal(n))
    frequencies = np.fft.rfftfreq(n)
    frequencies[0] = 1.0
    spectrum /= frequencies ** (exponent / 2)
    spectrum[0] = 0.0
    return np.fft.irfft(spectrum, n)


def _tones(t: np.ndarray, frequencies: tuple[float, ...], harmonics: int = 1) -> np.ndarray:
    return sum(
        np.sin(2 * np.pi * f * k * t) / k for f in frequencies for k in range(1, harmonics + 1)
    )


def _gated(t: np.ndarray, on: float, period: float) -> np.ndarray:
    """1 for the first `on` seconds of every `period`, else 0: beeps and telephone cadences."""
    return ((t % period) < on).astype(np.float64)


def _clicks(rng: np.random.Generator, n: int) -> np.ndarray:
    """A few sharp clicks (short decaying impulses) at random places."""
    out = np.zeros(n)
    decay = np.exp(-np.arange(80) / 8.0)
    for start in rng.integers(0, n - len(decay), size=12):
        out[start : start + len(decay)] += rng.choice([-1.0, 1.0]) * decay
    return out


def _chords(t: np.ndarray) -> np.ndarray:
    """C major then A minor, one a second, each note with overtones and a piano-like decay."""
    notes = ((261.63, 329.63, 392.0), (220.0, 261.63, 329.63))
    envelope = np.exp(-3.0 * (t % 1.0))
    which = (t // 1.0).astype(int) % 2
    return (
        sum(
            np.where(which == i, _tones(t, chord, harmonics=4), 0.0)
            for i, chord in enumerate(notes)
        )
        * envelope
    )


# name → its samples from (an rng seeded by its place here, n samples, times in s); a changed
# clip gets a new name, so that scores of the same name compare.
_CLIPS: dict[str, Callable[[np.random.Generator, int, np.ndarray], np.ndarray]] = {
    "digital-silence": lambda rng, n, t: np.zeros(n),
    "dither": lambda rng, n, t: (rng.random(n) - rng.random(n)) * _LSB,  # +-1 LSB, triangular
    **{
        f"{colour}-noise-{-level}dB": (
            lambda rng, n, t, e=exponent, level=level: _dbfs(_coloured(rng, n, e), level)
        )
        for colour, exponent in (("white", 0.0), ("pink", 1.0), ("brown", 2.0))
        for level in (-60, -40, -20)
    },
    "hum-50Hz": lambda rng, n, t: _dbfs(_tones(t, (50.0,), harmonics=5), -30),
    "hum-60Hz": lambda rng, n, t: _dbfs(_tones(t, (60.0,), harmonics=5), -30),
    "tone-425Hz-hold": lambda rng, n, t: _dbfs(_tones(t, (425.0,)), -15),
    "tone-1kHz": lambda rng, n, t: _dbfs(_tones(t, (1000.0,)), -10),
    "beeps-1kHz": lambda rng, n, t: _dbfs(_tones(t, (1000.0,)), -15) * _gated(t, 0.2, 1.0),
    "busy-tone": lambda rng, n, t: _dbfs(_tones(t, (480.0, 620.0)), -20) * _gated(t, 0.5, 1.0),
    "clicks": lambda rng, n, t: 0.5 * _clicks(rng, n),
    "chords": lambda rng, n, t: _dbfs(_chords(t), -20),
}


# builtin_clips(draw=D > 0): other samples of the same sounds, from seeds of their own (neither
# the set's, 0 on, nor --nonspeech builtin's, TRAINING_SEED on): a larger set for a finer
# measurement (bench/nonspeech.py --draws). Silence, hum, tones and chords draw alike each time.
DRAW_SEED = 5000


def builtin_clips(seconds: float = BUILTIN_SECONDS, draw: int = 0) -> dict[str, np.ndarray]:
    """{name: float32 16 kHz samples} of the built-in set (or its `draw`th other samples), the
    same on every call."""
    n = int(seconds * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    clips = {}
    for index, (name, make) in enumerate(_CLIPS.items()):
        seed = index if draw == 0 else DRAW_SEED + draw * len(_CLIPS) + index
        samples = make(np.random.default_rng(seed), n, t)
        clips[name] = np.clip(samples, -1.0, 1.0).astype(np.float32)
    return clips


def write_builtin_set(folder: Path | None = None, names: Sequence[str] | None = None) -> Path:
    """Write the built-in set (or its clips `names`) as 16-bit WAV files into `folder`
    (default: the user cache) and return it. Each file is written beside its name, then
    renamed: a reader never sees half."""
    folder = Path(folder) if folder is not None else user_cache_dir("nonspeech") / BUILTIN_SET
    folder.mkdir(parents=True, exist_ok=True)
    for index, (name, samples) in enumerate(builtin_clips().items()):
        if names is not None and name not in names:
            continue
        path = folder / f"{index:02d}-{name}.wav"
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        soundfile.write(partial, samples, SAMPLE_RATE, subtype="PCM_16", format="WAV")
        os.replace(partial, path)
    return folder


# --nonspeech builtin: the same kinds of sound as the evaluation set, other samples (seeds
# from TRAINING_SEED on) and other lengths, so that a model trained on it and scored on the
# built-in set is scored on clips it never heard.
TRAINING_SEED = 1000
TRAINING_SECONDS = (2.5, 6.0, 11.0)


def write_builtin_training_set(folder: Path | None = None) -> Path:
    """Write --nonspeech builtin's clips (`_CLIPS` at each of TRAINING_SECONDS) into `folder`
    (default: the user cache), each written beside its name, then renamed; one already there
    is kept (the same samples: every run of the default --nonspeech auto reads them)."""
    folder = Path(folder) if folder is not None else user_cache_dir("nonspeech") / "builtin-train"
    folder.mkdir(parents=True, exist_ok=True)
    for length, seconds in enumerate(TRAINING_SECONDS):
        n = int(seconds * SAMPLE_RATE)
        t = np.arange(n) / SAMPLE_RATE
        for index, (name, make) in enumerate(_CLIPS.items()):
            path = folder / f"{length}-{index:02d}-{name}.wav"
            if path.is_file():
                continue
            rng = np.random.default_rng(TRAINING_SEED + length * len(_CLIPS) + index)
            samples = np.clip(make(rng, n, t), -1.0, 1.0).astype(np.float32)
            partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
            soundfile.write(partial, samples, SAMPLE_RATE, subtype="PCM_16", format="WAV")
            os.replace(partial, path)
    return folder


def training_nonspeech(source: str, count: int, max_seconds: float = CHUNK_LENGTH) -> list[Example]:
    """`count` clips of --nonspeech `source` (a folder of audio, any layout with empty
    transcripts, or `builtin`) to mix into training: files over `max_seconds` cut into windows
    of it, repeated in order to fill `count`. Each is marked (`examples.NONSPEECH_ORIGIN`) so
    that its empty transcript is its label. UserError, in one line, for a clip that cannot be
    read or a source with speech in it."""
    path = write_builtin_training_set() if source == BUILTIN_SET else Path(source)
    if not Path(path).exists():
        raise UserError(f"--nonspeech {source}: not found; give a folder of audio, or builtin")
    clips = []
    for example in load_nonspeech(path):
        try:
            seconds = audio_length(example.audio)[0]
        except AudioError as exc:
            raise UserError(
                f"--nonspeech {source}: {example.audio} cannot be read ({exc.reason}); repair "
                "or remove it"
            ) from None
        start = example.start or 0.0
        end = example.end if example.end is not None else seconds
        while end - start > 0.1:  # windows of at most max_seconds; a last sliver is dropped
            piece = min(end, start + max_seconds)
            clips.append((example.audio, start, piece))
            start = piece
    if not clips:
        raise UserError(f"--nonspeech {source}: no audio found; give a folder of audio, or builtin")
    return [
        Example(audio=audio, text="", start=start, end=end, origin=f"{NONSPEECH_ORIGIN}{audio}")
        for audio, start, end in (clips[i % len(clips)] for i in range(count))
    ]


def in_speech_languages(noise: list[Example], speech: Sequence[Example]) -> list[Example]:
    """`noise` with each clip labelled in the language of a speech clip of `speech`, taken at
    even spaces through it, so that the noise comes in each language in the share the speech
    does. Its label's prefix names that language (`LabelEncoder.nonspeech_label`), and the
    decoder learns to write nothing after the prefix transcribing gives it: a German run's noise
    taught under <|en|> alone left <|de|>'s prefix untaught on noise. Clips whose speech states
    no language keep none (the run's --language, or English, is then stated)."""
    if not speech:
        return noise
    return [
        replace(clip, language=speech[(2 * i + 1) * len(speech) // (2 * len(noise))].language)
        for i, clip in enumerate(noise)
    ]


def nonspeech_count(speech_clips: int, share: float) -> int:
    """Clips of --nonspeech that make `share` of an epoch of `speech_clips` and them (one at
    least)."""
    return max(1, round(speech_clips * share / (1 - share)))


def _audio_files(folder: Path) -> list[Path]:
    return sorted(
        p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in AUDIO_SUFFIXES
    )


def load_nonspeech(path: str | Path, *, data_format: str | None = None) -> list[Example]:
    """The clips of a non-speech set: `builtin`, a plain folder of audio, or any layout (whose
    transcripts must be empty). UserError, in one line, for a set with speech in it."""
    if str(path) == BUILTIN_SET:
        path = write_builtin_set()
    location = Path(path)
    try:
        examples = load_examples(path, data_format=data_format)
    except UserError:
        if data_format is not None or not location.is_dir() or not _audio_files(location):
            raise
        # No layout (no transcripts at all): every audio file under the folder is a clip.
        return [Example(audio=str(p.resolve()), text="") for p in _audio_files(location)]
    spoken = [example for example in examples if example.text.strip()]
    if spoken:
        raise UserError(
            f"{path}: {len(spoken)} of {len(examples)} clips have a transcript (the first, "
            f"{spoken[0].audio}: {spoken[0].text[:40]!r}); a non-speech set is clips where "
            "nobody speaks: give it a folder of audio alone, or score speech as NAME=PATH"
        )
    return examples


def require_readable(examples: list[Example], name: str) -> list[Example]:
    """`examples`, each clip's audio header read: a non-speech set is scored on every clip or
    not at all (a rate over the readable ones would flatter), so one that cannot be read
    refuses the set, in one line, before training starts."""
    for example in examples:
        try:
            audio_length(example.audio)
        except AudioError as exc:
            raise UserError(
                f"--eval-data {name}: {example.audio} cannot be read ({exc.reason}); a "
                "non-speech set is scored on every clip: repair or remove it"
            ) from None
    return examples
