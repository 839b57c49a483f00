"""espeak-ng, the offline text-to-speech engine behind synthesised speech, and its voices.

Two ways to reach the same engine: the `espeak-ng` program when it is on PATH (Debian's
package), else the `libespeak-ng` that the PyPI package `espeakng-loader` ships, driven through
ctypes; the environment variable WHISPER_TRAIN_ESPEAK (auto, program or library) chooses one.
Both give 22.05 kHz speech, resampled here to Whisper's 16 kHz, and each leaves its own silence
after the speech (the program 1.51 about 0.35 s, the library a few ms): it is cut to at most
15 ms, what the library leaves, so that both give clips of the same shape.

`synthesize` speaks one text. The voices here are the disjoint training, held-out and guard sets
the demo draws from, in English and in Spanish. What the voices say is `synth_sentences`'s;
datasets of it are `synth`'s.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

from whisper_train.audio import SAMPLE_RATE
from whisper_train.errors import UserError

# espeak-ng voices: an accent (its voice file: `en-us`, `en` is British) with an optional variant
# (`+f3`, `+m3`: a speaker's pitch, formants and breathiness). Both engines take these names;
# the library does not take language tags such as en-gb. The demo trains on TRAIN_VOICES and
# scores HELD_OUT_VOICES, which share neither an accent nor a variant with them, and the guard
# set in GUARD_VOICE, espeak-ng's default voice, which no training utterance uses either.
TRAIN_ACCENTS = ("en-us", "en", "en-029", "en-gb-scotland", "en-gb-x-gbcwmd")
# Many speakers in training: the numbered variants and espeak-ng's named ones, less those with
# effects (whisper, croak, robots, klatt).
TRAIN_VARIANTS = ("m1", "m3", "m5", "m6", "m7", "m8", "f1", "f2", "f4", "Alex", "Andy", "Annie",
                  "Denis", "Gene", "Hugo", "Jacky", "Lee", "Michael", "Mike", "adam", "anika",
                  "announcer", "aunty", "belinda", "benjamin", "boris", "caleb", "david", "ed",
                  "edward", "iven", "john", "linda", "max", "norbert", "paul", "quincy", "rob",
                  "robert", "steph", "travis", "victor", "zac")  # fmt: skip
HELD_OUT_ACCENTS = ("en-us-nyc", "en-gb-x-rp", "en-gb-x-gbclan")
HELD_OUT_VARIANTS = ("m2", "m4", "f3", "f5")
TRAIN_VOICES = tuple(f"{a}+{v}" for a in TRAIN_ACCENTS for v in TRAIN_VARIANTS)
HELD_OUT_VOICES = tuple(f"{a}+{v}" for a in HELD_OUT_ACCENTS for v in HELD_OUT_VARIANTS)
GUARD_VOICE = "en-us"
DEFAULT_SPEED_WPM = 160  # words per minute (espeak-ng's own default is 175)
DEFAULT_PITCH = 50  # 0..100, espeak-ng's default
# Spanish (the second demo): espeak-ng speaks it well. Castilian (es) voices train, Latin
# American (es-419) ones are held out.
SPANISH_TRAIN_VOICES = tuple(f"es+{v}" for v in TRAIN_VARIANTS)
SPANISH_HELD_OUT_VOICES = tuple(f"es-419+{v}" for v in HELD_OUT_VARIANTS)
SPANISH_TRAIN_ACCENTS, SPANISH_HELD_OUT_ACCENTS = ("es",), ("es-419",)
_INSTALL_HINT = (
    "install espeak-ng (apt-get install espeak-ng) or pip install 'whisper-train[synth]'"
)
# Which engine `synthesize(engine="auto")` uses: auto (the program if on PATH, else the
# library), program or library. CI runs the tests marked `speech` with each.
ENGINE_VARIABLE = "WHISPER_TRAIN_ESPEAK"
ENGINE_CHOICES = ("auto", "program", "library")
# The trailing silence: what follows the last sample within 60 dB of the clip's peak is cut to
# at most 15 ms. Measured at 16 kHz, after that sample: the program 1.51 leaves 281 ms (median
# of 81 clips: en-us, 50 TRAIN_VOICES, the 12 HELD_OUT_VOICES, 16 Spanish; 140-220 words a
# minute; 9-431 ms, longer at slower speeds), the library 7.6 ms (median of 320 clips as the
# demo plans them; at most 14 ms over those and the 81, 15.4 ms seen once). So the cut leaves
# the library's clips as they were (or a rare one short of under a millisecond below -60 dB)
# and gives the program's the library's ending: in the voices without an echo (51 of
# the 81 clips) the two engines' clips then differ in length by 8 ms (median; at most 21 ms,
# with the jitter) instead of 0.34 s. The variants with an echo (f2-f5, m2, announcer) or the
# Klatt 6 source (adam, benjamin, caleb, david) still differ at the end: the program speaks the
# decay of their last sound into its end pause, which the library cuts off (108 ms longer,
# median; at most 263 ms).
TRIM_BELOW_PEAK_DB = 60.0
TAIL_S = 0.015


def synthesize(
    text: str,
    *,
    voice: str = "en-us",
    speed_wpm: int = DEFAULT_SPEED_WPM,
    pitch: int = DEFAULT_PITCH,
    engine: str = "auto",
) -> np.ndarray:
    """Speak `text`; returns float32 mono samples at 16 kHz, shape [n_samples], in [-1, 1],
    ending at most TAIL_S after the last sample within TRIM_BELOW_PEAK_DB of the peak.

    `voice` is an espeak-ng voice, optionally with a variant (`en-us+f3`). `engine` is `auto`
    (what WHISPER_TRAIN_ESPEAK says; by default the program if on PATH, else the library),
    `program` or `library`.
    """
    if not text.strip():
        raise UserError("nothing to synthesise: the text is empty")
    engine = resolve_engine(engine)
    if engine == "program":
        samples, rate = _speak_with_program(text, voice, speed_wpm, pitch)
    else:
        samples, rate = _LIBRARY.speak(text, voice, speed_wpm, pitch)
    return trim_trailing_silence(soxr.resample(samples, rate, SAMPLE_RATE).astype(np.float32))


def resolve_engine(engine: str = "auto") -> str:
    """`program` or `library`: `engine` itself, or for `auto` what WHISPER_TRAIN_ESPEAK names
    (unset, empty or auto: the program if on PATH, else the library)."""
    if engine == "auto":
        chosen = os.environ.get(ENGINE_VARIABLE, "").strip().lower() or "auto"
        if chosen not in ENGINE_CHOICES:
            raise UserError(
                f"{ENGINE_VARIABLE}={os.environ[ENGINE_VARIABLE]!r}: use "
                f"{', '.join(ENGINE_CHOICES[:-1])} or {ENGINE_CHOICES[-1]}"
            )
        engine = chosen
    if engine == "auto":
        return "program" if shutil.which("espeak-ng") else "library"
    if engine not in ENGINE_CHOICES:
        raise ValueError(f"engine must be auto, program or library, not {engine!r}")
    return engine


def trim_trailing_silence(samples: np.ndarray, *, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """`samples` up to at most TAIL_S after the last one within TRIM_BELOW_PEAK_DB of the peak
    (a clip that ends sooner is kept whole): the same end whichever engine spoke."""
    level = np.abs(samples)
    peak = float(level.max()) if len(samples) else 0.0
    audible = np.flatnonzero(level > peak * 10 ** (-TRIM_BELOW_PEAK_DB / 20))
    end = (int(audible[-1]) + 1 if len(audible) else 0) + round(TAIL_S * sample_rate)
    return samples[:end]


def _speak_with_program(
    text: str, voice: str, speed_wpm: int, pitch: int
) -> tuple[np.ndarray, int]:
    """Run the espeak-ng program; returns (float32 samples, sample rate)."""
    program = shutil.which("espeak-ng")
    if program is None:
        raise UserError(f"the espeak-ng program is not on PATH: {_INSTALL_HINT}")
    # The program speaks an unknown voice with its default one and exits 0: check first.
    base, _, variant = voice.lower().partition("+")
    voices, variants = _program_voices(program)
    if base not in voices or (variant and variant not in variants):
        raise UserError(f"unknown espeak-ng voice {voice!r}: try en-us, en (British) or en-us+f3")
    # A file rather than --stdout: a WAV streamed to a pipe has no valid length in its header.
    with tempfile.TemporaryDirectory() as tmp:
        wav_path = Path(tmp) / "speech.wav"
        command = [program, "-v", voice, "-s", str(speed_wpm), "-p", str(pitch)]
        # Text goes through stdin so that text starting with "-" is never read as an option.
        result = subprocess.run(
            [*command, "-w", str(wav_path), "--stdin"],
            input=text.encode("utf-8"),
            capture_output=True,
            check=False,
        )
        if result.returncode != 0 or not wav_path.is_file():
            message = result.stderr.decode(errors="replace").strip()
            raise UserError(f"espeak-ng could not speak with voice {voice!r}: {message}")
        samples, rate = sf.read(wav_path, dtype="float32")
    return samples, rate


@functools.cache
def _program_voices(program: str) -> tuple[frozenset[str], frozenset[str]]:
    """(voice names, variant names) the espeak-ng program accepts, lower case.

    A voice is named by its language (`en-gb`), its name or its file (`en-us`); a variant by
    its file under `!v/` (`f3`). Columns of `--voices`: Pty Language Age/Gender VoiceName File.
    """
    listings = []
    for option in ("--voices", "--voices=variant"):
        output = subprocess.run([program, option], capture_output=True, text=True, check=False)
        rows = [line.split() for line in output.stdout.lower().splitlines()[1:]]
        listings.append([row for row in rows if len(row) >= 5])
    voices = {name for row in listings[0] for name in (row[1], row[3], row[4].split("/")[-1])}
    variants = {row[4].split("/")[-1] for row in listings[1]}
    return frozenset(voices), frozenset(variants)


class _EspeakLibrary:
    """libespeak-ng from espeakng-loader through ctypes, initialised once per process.

    The library keeps one global state (voice, rate, output callback), so every call holds a
    lock; in synchronous mode `espeak_Synth` returns only after the callback has received all
    samples of the utterance.
    """

    _AUDIO_OUTPUT_SYNCHRONOUS = 2
    _CHARS_UTF8 = 1
    _POS_CHARACTER = 1
    _PARAM_RATE = 1
    _PARAM_PITCH = 3
    _RANDOM_SEED = 0
    # int callback(short *samples, int n_samples, espeak_EVENT *events); non-zero aborts.
    _CALLBACK_TYPE = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._sample_rate = 0
        self._chunks: list[np.ndarray] = []
        # Kept on the instance: ctypes would free a callback that Python no longer references.
        self._callback = self._CALLBACK_TYPE(self._collect)

    def _collect(self, samples, n_samples: int, _events) -> int:
        if n_samples > 0 and samples:
            self._chunks.append(np.ctypeslib.as_array(samples, shape=(n_samples,)).copy())
        return 0

    def _load(self) -> ctypes.CDLL:
        if self._lib is not None:
            return self._lib
        try:
            import espeakng_loader
        except ImportError as error:
            raise UserError(f"no espeak-ng found: {_INSTALL_HINT}") from error
        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetSynthCallback.argtypes = [self._CALLBACK_TYPE]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        if hasattr(lib, "espeak_ng_SetRandSeed"):
            lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
        lib.espeak_Synth.argtypes = [
            ctypes.c_char_p,  # text
            ctypes.c_size_t,  # size in bytes, including the NUL
            ctypes.c_uint,  # start position
            ctypes.c_int,  # position type
            ctypes.c_uint,  # end position (0: none)
            ctypes.c_uint,  # flags
            ctypes.POINTER(ctypes.c_uint),  # unique identifier (unused)
            ctypes.c_void_p,  # user data (unused)
        ]
        data_path = espeakng_loader.get_data_path().encode()
        rate = lib.espeak_Initialize(self._AUDIO_OUTPUT_SYNCHRONOUS, 0, data_path, 0)
        if rate <= 0:
            raise UserError(f"libespeak-ng failed to start (data in {data_path.decode()})")
        lib.espeak_SetSynthCallback(self._callback)
        self._lib, self._sample_rate = lib, rate
        return lib

    def speak(self, text: str, voice: str, speed_wpm: int, pitch: int) -> tuple[np.ndarray, int]:
        """Returns (float32 samples, sample rate)."""
        with self._lock:
            lib = self._load()
            if lib.espeak_SetVoiceByName(voice.encode()) != 0:
                raise UserError(
                    f"unknown espeak-ng voice {voice!r}: try en-us, en (British) or en-us+f3"
                )
            lib.espeak_SetParameter(self._PARAM_RATE, int(speed_wpm), 0)
            lib.espeak_SetParameter(self._PARAM_PITCH, int(pitch), 0)
            # espeak-ng jitters pitch and noise with rand(); a fixed seed per utterance makes
            # the same call give the same samples (libespeak-ng >= 1.52 has the function).
            if hasattr(lib, "espeak_ng_SetRandSeed"):
                lib.espeak_ng_SetRandSeed(self._RANDOM_SEED)
            encoded = text.encode("utf-8")
            self._chunks = []
            status = lib.espeak_Synth(
                encoded, len(encoded) + 1, 0, self._POS_CHARACTER, 0, self._CHARS_UTF8, None, None
            )
            chunks, self._chunks = self._chunks, []
        if status != 0:
            raise UserError(f"libespeak-ng could not speak {text[:40]!r} (error {status})")
        samples = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)
        return samples.astype(np.float32) / 32768.0, self._sample_rate


_LIBRARY = _EspeakLibrary()
