"""Offline text-to-speech with espeak-ng, for the demo and the tests.

Two ways to reach the same engine: the `espeak-ng` program when it is on PATH (Debian's
package), else the `libespeak-ng` that the PyPI package `espeakng-loader` ships, driven through
ctypes. Both give 22.05 kHz speech, resampled here to Whisper's 16 kHz.

`make_speech_dataset` writes an audiofolder (WAVs + `metadata.csv`) of random word lists spoken
by several voices. Without sentence context tiny.en gets roughly every second word wrong, which
leaves fine-tuning plenty to improve.
"""

from __future__ import annotations

import csv
import ctypes
import functools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
from importlib import resources
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

from whisper_train.audio import SAMPLE_RATE
from whisper_train.errors import UserError

# espeak-ng voice file names (both engines accept them; the library does not take language tags
# such as en-gb): `en` is British English, `+f3`/`+m3` pick a female or male variant.
DEFAULT_VOICES = ("en-us", "en-us+f3", "en", "en-us+m3", "en-gb-x-rp+f2", "en-029+m7")
WORDS_PER_UTTERANCE = (4, 9)  # inclusive range
SPEED_WPM_RANGE = (135, 185)  # espeak-ng's default is 175 words per minute
PITCH_RANGE = (35, 65)  # 0..100, default 50
METADATA_FILE = "metadata.csv"
_INSTALL_HINT = (
    "install espeak-ng (apt-get install espeak-ng) or pip install 'whisper-train[synth]'"
)


def synthesize(
    text: str,
    *,
    voice: str = "en-us",
    speed_wpm: int = 160,
    pitch: int = 50,
    engine: str = "auto",
) -> np.ndarray:
    """Speak `text`; returns float32 mono samples at 16 kHz, shape [n_samples], in [-1, 1].

    `voice` is an espeak-ng voice, optionally with a variant (`en-us+f3`). `engine` is `auto`
    (the program if on PATH, else the library), `program` or `library`.
    """
    if not text.strip():
        raise UserError("nothing to synthesise: the text is empty")
    if engine == "auto":
        engine = "program" if shutil.which("espeak-ng") else "library"
    if engine == "program":
        samples, rate = _speak_with_program(text, voice, speed_wpm, pitch)
    elif engine == "library":
        samples, rate = _LIBRARY.speak(text, voice, speed_wpm, pitch)
    else:
        raise ValueError(f"engine must be auto, program or library, not {engine!r}")
    return soxr.resample(samples, rate, SAMPLE_RATE).astype(np.float32)


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


def word_list() -> list[str]:
    """The built-in vocabulary for random utterances (a few hundred common English words)."""
    text = resources.files("whisper_train").joinpath("resources/words.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


def make_speech_dataset(
    output_dir: str | Path,
    *,
    n_utterances: int,
    seed: int,
    voices: tuple[str, ...] = DEFAULT_VOICES,
    engine: str = "auto",
) -> Path:
    """Write an audiofolder of `n_utterances` synthetic random-word sentences; returns the folder.

    Files: `utt_00000.wav` ... (16 kHz, 16-bit PCM) and `metadata.csv` with the columns
    `file_name,transcription`. Words, voice, speed and pitch are drawn from `seed`, and the
    speech is made in a fresh Python process: libespeak-ng carries pitch-jitter state from one
    utterance to the next that no API resets, so only a fresh process gives the same audio for
    the same seed whatever the caller synthesised before.
    """
    if n_utterances < 1:
        raise UserError(f"n_utterances must be at least 1, not {n_utterances}")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    words = word_list()
    rng = random.Random(seed)
    utterances = []
    for index in range(n_utterances):
        chosen = rng.sample(words, rng.randint(*WORDS_PER_UTTERANCE))
        utterances.append(
            {
                "file_name": f"utt_{index:05d}.wav",
                # Written like a sentence so that orthographic WER is not dominated by style.
                "text": " ".join(chosen).capitalize() + ".",
                "voice": rng.choice(voices),
                "speed_wpm": rng.randint(*SPEED_WPM_RANGE),
                "pitch": rng.randint(*PITCH_RANGE),
            }
        )
    job = {"output_dir": str(output_dir), "engine": engine, "utterances": utterances}
    _run_in_fresh_process(job)
    with (output_dir / METADATA_FILE).open("w", newline="", encoding="utf-8") as stream:
        writer = csv.writer(stream)
        writer.writerow(["file_name", "transcription"])
        writer.writerows((u["file_name"], u["text"]) for u in utterances)
    return output_dir


def _run_in_fresh_process(job: dict) -> None:
    """Run `_write_utterances(job)` in `python -m whisper_train.synth`; UserError on failure."""
    # The package's parent folder on PYTHONPATH lets the child import it from a source checkout.
    package_parent = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "whisper_train.synth"],
        input=json.dumps(job).encode("utf-8"),
        capture_output=True,
        env=env,
        check=False,
    )
    if result.returncode != 0:
        lines = result.stderr.decode(errors="replace").strip().splitlines()
        raise UserError(lines[-1] if lines else f"speech synthesis failed ({result.returncode})")


def _write_utterances(job: dict) -> None:
    """Synthesise each planned utterance of `job` into `job["output_dir"]` as 16-bit WAV."""
    output_dir = Path(job["output_dir"])
    for utterance in job["utterances"]:
        samples = synthesize(
            utterance["text"],
            voice=utterance["voice"],
            speed_wpm=utterance["speed_wpm"],
            pitch=utterance["pitch"],
            engine=job["engine"],
        )
        sf.write(output_dir / utterance["file_name"], samples, SAMPLE_RATE, subtype="PCM_16")


if __name__ == "__main__":
    # The worker of make_speech_dataset: a JSON job on stdin, one line on stderr if it fails.
    try:
        _write_utterances(json.load(sys.stdin))
    except UserError as error:
        print(error, file=sys.stderr)
        sys.exit(2)
