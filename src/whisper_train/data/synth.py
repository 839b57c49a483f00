"""Offline text-to-speech with espeak-ng, for the demo and the tests.

Two ways to reach the same engine: the `espeak-ng` program when it is on PATH (Debian's
package), else the `libespeak-ng` that the PyPI package `espeakng-loader` ships, driven through
ctypes. Both give 22.05 kHz speech, resampled here to Whisper's 16 kHz.

`make_speech_dataset` writes an audiofolder (WAVs + `metadata.csv`) of sentences spoken by
several voices: grammatical templates (function words: articles, pronouns, modals, prepositions)
filled with content words from `resources/vocabulary.tsv`, about 3,400 common English nouns,
verbs, adjectives and adverbs. `split_vocabulary` splits the content words by word family into
a training part and a held-out part, and the voices come in disjoint training and held-out
sets, so that a held-out set can measure what a fine-tuned model learnt that carries over to
speakers and words it never saw (the demo, `demo.py`).
"""

from __future__ import annotations

import csv
import ctypes
import functools
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zlib
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from importlib import resources
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
SPEED_WPM_RANGE = (135, 185)
PITCH_RANGE = (35, 65)
HELD_OUT_WORDS_PERCENT = 20  # of the vocabulary's word families, never in training sentences
METADATA_FILE = "metadata.csv"
_INSTALL_HINT = (
    "install espeak-ng (apt-get install espeak-ng) or pip install 'whisper-train[synth]'"
)


def synthesize(
    text: str,
    *,
    voice: str = "en-us",
    speed_wpm: int = DEFAULT_SPEED_WPM,
    pitch: int = DEFAULT_PITCH,
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


# -- vocabulary and sentences ------------------------------------------------------------------


@dataclass(frozen=True)
class Vocabulary:
    """Content words by part of speech (sorted); a word may be in more than one list."""

    nouns: tuple[str, ...]  # that are not also adjectives
    verbs: tuple[str, ...]  # base forms: they follow a modal, `did not`, `please` ...
    adjectives: tuple[str, ...]
    adverbs: tuple[str, ...]

    def words(self) -> frozenset[str]:
        return frozenset((*self.nouns, *self.verbs, *self.adjectives, *self.adverbs))

    def only(self, keep) -> Vocabulary:
        """The words for which `keep(word)` is true, in every list."""
        return Vocabulary(*(tuple(w for w in ws if keep(w)) for ws in astuple(self)))


@functools.cache
def vocabulary() -> Vocabulary:
    """The built-in content words: about 3,400 common English nouns, verbs, adjectives and
    adverbs (`resources/vocabulary.tsv`, whose header says where they come from)."""
    text = resources.files("whisper_train").joinpath("resources/vocabulary.tsv").read_text()
    by_tag: dict[str, list[str]] = {tag: [] for tag in "nvar"}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            word, tags = line.split("\t")
            for tag in tags:
                by_tag[tag].append(word)
    # A word that is also an adjective (chemical, private) reads as one: not in the noun slot.
    by_tag["n"] = [word for word in by_tag["n"] if word not in set(by_tag["a"])]
    return Vocabulary(*(tuple(sorted(by_tag[tag])) for tag in "nvar"))


# Suffixes stripped, repeatedly, to find a word's family: careful, carefully and care land in
# one family, so a held-out word is never a suffix away from a training word.
_FAMILY_SUFFIXES = (
    "ization", "ation", "ition", "ness", "ment", "ship", "ably", "ibly", "ally", "ities", "ity",
    "ical", "ful", "less", "ous", "ive", "ist", "ism", "ers", "ies", "ing", "ion", "able",
    "ible", "ly", "er", "or", "es", "ed", "al", "ic", "en", "s", "e", "y",
)  # fmt: skip
_MIN_STEM = 3


def word_family(word: str) -> str:
    """A crude stem shared by a word's derived forms (`carefully` → `car`, as `care`)."""
    stripped = True
    while stripped:
        stripped = False
        for suffix in _FAMILY_SUFFIXES:
            if word.endswith(suffix) and len(word) - len(suffix) >= _MIN_STEM:
                word, stripped = word[: -len(suffix)], True
                break
    return word


def split_vocabulary(
    held_out_percent: int = HELD_OUT_WORDS_PERCENT,
) -> tuple[Vocabulary, Vocabulary]:
    """(training words, held-out words): whole word families by a fixed hash of the family, so
    the split is the same on every machine and Python, and no family is on both sides."""

    def held_out(word: str) -> bool:
        return zlib.crc32(word_family(word).encode()) % 100 < held_out_percent

    words = vocabulary()
    return words.only(lambda w: not held_out(w)), words.only(held_out)


# Function words: the templates' own, shared by every set. {S} subject, {O} object (a noun
# phrase), {N} noun, {V} verb, {A} adjective, {R} adverb, {M} modal, {P} preposition.
_TEMPLATES = (
    "{S} {M} {V} {O}.",
    "{S} {M} {V} {O} {P} {O}.",
    "{S} {M} {R} {V} {O}.",
    "{S} did not {V} {O} {P} {O}.",
    "Did {S} {V} {O}?",
    "Why would {S} {V} {O} {P} {O}?",
    "When {M} {S} {V} {O}?",
    "{NP} was {A} and {A}.",
    "{NP} is very {A} {P} {O}.",
    "There is {a} {A} {N} {P} {O}.",
    "Please {V} {O} {P} {O}.",
    "Do not {V} {O} {R}.",
    "Let us {V} {O} and {V} {O}.",
    "{S} {M} {V} {O} because {S} {M} {V} {O}.",
    "If {S} {M} {V} {O}, {S} {M} {V} {O}.",
    "{S} {M} not {V} {O} {P} {O} {R}.",
)
_PRONOUNS = ("I", "you", "we", "they", "he", "she")
_DETERMINERS = ("the", "the", "the", "a", "a", "this", "that", "my", "your", "our", "their",
                "his", "her", "every", "some")  # fmt: skip
_MODALS = ("will", "can", "could", "should", "would", "might", "must", "may")
_PREPOSITIONS = ("in", "on", "at", "with", "from", "into", "about", "under", "after", "before",
                 "behind", "near", "for", "over", "without", "through", "across", "like")  # fmt: skip
_ADJECTIVE_PROBABILITY = 0.35  # of an adjective before a noun phrase's noun
_PRONOUN_PROBABILITY = 0.4  # of a pronoun as subject rather than a noun phrase
# Words spelt with a vowel but said with a consonant (a university), and the reverse (an hour).
_A_NOT_AN = ("uni", "use", "usu", "uti", "eu", "one", "once")
_AN_NOT_A = ("hour", "honest", "honor", "heir")


def _article(word: str) -> str:
    vowel = word[0] in "aeiou" and not word.startswith(_A_NOT_AN)
    return "an" if vowel or word.startswith(_AN_NOT_A) else "a"


def make_sentence(words: Vocabulary, rng: random.Random) -> str:
    """One sentence from a random template, its content words drawn from `words` only."""

    def noun_phrase() -> str:
        noun = rng.choice(words.nouns)
        if rng.random() < _ADJECTIVE_PROBABILITY:
            noun = f"{rng.choice(words.adjectives)} {noun}"
        determiner = rng.choice(_DETERMINERS)
        return f"{_article(noun) if determiner == 'a' else determiner} {noun}"

    fillers = {
        "S": lambda: (
            rng.choice(_PRONOUNS) if rng.random() < _PRONOUN_PROBABILITY else noun_phrase()
        ),
        "O": noun_phrase,
        "NP": noun_phrase,
        "N": lambda: rng.choice(words.nouns),
        "V": lambda: rng.choice(words.verbs),
        "A": lambda: rng.choice(words.adjectives),
        "R": lambda: rng.choice(words.adverbs),
        "M": lambda: rng.choice(_MODALS),
        "P": lambda: rng.choice(_PREPOSITIONS),
    }
    # re.split alternates literal text and slot names; "{a}" is the article of what follows.
    parts = re.split(r"\{(\w+)\}", rng.choice(_TEMPLATES))
    filled = [
        part if index % 2 == 0 or part == "a" else fillers[part]()
        for index, part in enumerate(parts)
    ]
    for index in range(1, len(parts), 2):
        if parts[index] == "a":
            filled[index] = _article("".join(filled[index + 1 :]).lstrip())
    sentence = "".join(filled)
    return sentence[0].upper() + sentence[1:]


def make_sentences(words: Vocabulary, n: int, seed: int) -> list[str]:
    """`n` sentences from `words`, the same for the same seed (no repeats within the list)."""
    rng = random.Random(seed)
    sentences: list[str] = []
    seen: set[str] = set()
    while len(sentences) < n:
        sentence = make_sentence(words, rng)
        if sentence not in seen:
            seen.add(sentence)
            sentences.append(sentence)
    return sentences


# Every word a template writes itself: what sentences of every set share.
FUNCTION_WORDS = frozenset(
    word
    for text in (*_TEMPLATES, *_PRONOUNS, *_DETERMINERS, *_MODALS, *_PREPOSITIONS, "an")
    for word in re.findall(r"[a-z]+", re.sub(r"\{\w+\}", " ", text).lower())
)


def content_words(sentence: str) -> set[str]:
    """The words of `sentence` that are not the templates' function words (lower case)."""
    return set(re.findall(r"[a-z]+", sentence.lower())) - FUNCTION_WORDS


# -- Spanish (the second demo) -----------------------------------------------------------------
# espeak-ng speaks Spanish well. Castilian (es) voices train, Latin American (es-419) ones are
# held out; content words are split as the English ones are, by a fixed hash, so held-out
# sentences hold words training never heard. A small built-in lexicon (the articles agree with
# their nouns) in templates whose function words every set shares.

SPANISH_TRAIN_VOICES = tuple(f"es+{v}" for v in TRAIN_VARIANTS)
SPANISH_HELD_OUT_VOICES = tuple(f"es-419+{v}" for v in HELD_OUT_VARIANTS)
SPANISH_TRAIN_ACCENTS, SPANISH_HELD_OUT_ACCENTS = ("es",), ("es-419",)


@dataclass(frozen=True)
class SpanishWords:
    """Content words of the Spanish templates: subjects, verbs (3rd person present), objects
    (with their article), places and times."""

    subjects: tuple[str, ...]
    verbs: tuple[str, ...]
    objects: tuple[str, ...]
    places: tuple[str, ...]
    times: tuple[str, ...]

    def only(self, keep) -> SpanishWords:
        return SpanishWords(*(tuple(w for w in ws if keep(w)) for ws in astuple(self)))


SPANISH_WORDS = SpanishWords(
    subjects=("mi hermano", "la profesora", "el médico", "nuestra vecina", "tu amigo", "la niña",
              "el cocinero", "mi abuela", "el conductor", "la alcaldesa", "el pintor",
              "la enfermera", "mi primo", "la panadera", "el cartero", "su hija"),
    verbs=("compra", "prepara", "busca", "lleva", "vende", "limpia", "encuentra", "pinta",
           "guarda", "necesita", "mira", "trae", "abre", "cierra", "pide", "quiere", "rompe",
           "esconde", "arregla", "olvida"),
    objects=("el pan", "la leche", "el libro", "la carta", "el coche", "la mesa",
             "el periódico", "la fruta", "el café", "la camisa", "el regalo", "la llave",
             "el vino", "la silla", "el queso", "la maleta", "el sombrero", "la ventana",
             "el pescado", "la bicicleta", "el cuaderno", "la manzana", "el teléfono",
             "la puerta", "el paraguas", "la cuchara", "el espejo", "la almohada"),
    places=("en el mercado", "en la cocina", "cerca de la estación", "en el jardín",
            "detrás de la casa", "en la oficina", "junto al río", "en la plaza",
            "dentro del armario", "en la biblioteca", "sobre la montaña", "en el hospital"),
    times=("por la mañana", "después de la cena", "todos los domingos", "antes de las ocho",
           "cada tarde", "esta noche", "durante el verano", "el lunes"),
)  # fmt: skip
_SPANISH_TEMPLATES = (
    "{S} {V} {O} {L}.",
    "{T}, {S} {V} {O}.",
    "¿{S} {V} {O} {L}?",
    "{S} no {V} {O} {T}.",
    "{S} {V} {O} y {O} {L}.",
    "{T}, {S} {V} {O} {L}.",
)


def split_spanish_words(held_out_percent: int = 25) -> tuple[SpanishWords, SpanishWords]:
    """(training words, held-out words) by a fixed hash of each word, as `split_vocabulary`."""

    def held_out(word: str) -> bool:
        return zlib.crc32(word.encode()) % 100 < held_out_percent

    return SPANISH_WORDS.only(lambda w: not held_out(w)), SPANISH_WORDS.only(held_out)


def make_spanish_sentences(words: SpanishWords, n: int, seed: int) -> list[str]:
    """`n` different Spanish sentences from `words`, the same for the same seed."""
    rng = random.Random(seed)
    slots = {"S": words.subjects, "V": words.verbs, "O": words.objects, "L": words.places,
             "T": words.times}  # fmt: skip
    sentences: list[str] = []
    seen: set[str] = set()
    while len(sentences) < n:
        template = rng.choice(_SPANISH_TEMPLATES)
        sentence = re.sub(r"\{(\w)\}", lambda m: rng.choice(slots[m.group(1)]), template)
        start = 2 if sentence.startswith("¿") else 1  # capitalise after an opening ¿
        sentence = sentence[: start - 1] + sentence[start - 1].upper() + sentence[start:]
        if sentence not in seen:
            seen.add(sentence)
            sentences.append(sentence)
    return sentences


# -- speech datasets ----------------------------------------------------------------------------


def plan_utterances(
    n_utterances: int,
    *,
    seed: int,
    voices: Sequence[str],
    words: Vocabulary | SpanishWords | None = None,
    speed_wpm_range: tuple[int, int] = SPEED_WPM_RANGE,
    pitch_range: tuple[int, int] = PITCH_RANGE,
) -> list[dict]:
    """What `make_speech_dataset` will say, without saying it: one dict per utterance with
    `file_name`, `text`, `voice`, `speed_wpm` and `pitch`, all drawn from `seed`. Spanish
    `words` (`SpanishWords`) make Spanish sentences."""
    if n_utterances < 1:
        raise UserError(f"n_utterances must be at least 1, not {n_utterances}")
    if not voices:
        raise UserError("name at least one espeak-ng voice")
    rng = random.Random(seed)
    make = make_spanish_sentences if isinstance(words, SpanishWords) else make_sentences
    texts = make(words or vocabulary(), n_utterances, seed=rng.randrange(2**32))
    return [
        {
            "file_name": f"utt_{index:05d}.wav",
            "text": text,
            "voice": rng.choice(list(voices)),
            "speed_wpm": rng.randint(*speed_wpm_range),
            "pitch": rng.randint(*pitch_range),
        }
        for index, text in enumerate(texts)
    ]


def make_speech_dataset(
    output_dir: str | Path,
    *,
    n_utterances: int,
    seed: int,
    voices: Sequence[str] = TRAIN_VOICES,
    words: Vocabulary | SpanishWords | None = None,
    speed_wpm_range: tuple[int, int] = SPEED_WPM_RANGE,
    pitch_range: tuple[int, int] = PITCH_RANGE,
    engine: str = "auto",
    language: str | None = None,
) -> Path:
    """Write an audiofolder of `n_utterances` synthetic sentences; returns the folder.

    Files: `utt_00000.wav` ... (16 kHz, 16-bit PCM) and `metadata.csv` with the columns
    `file_name,transcription,voice` (and `language` when `language` is given). Sentences (content words from `words`, default: the whole
    vocabulary), voice, speed and pitch are drawn from `seed` (`plan_utterances`), and the
    speech is made in a fresh Python process: libespeak-ng carries pitch-jitter state from one
    utterance to the next that no API resets, so only a fresh process gives the same audio for
    the same seed whatever the caller synthesised before.
    """
    utterances = plan_utterances(
        n_utterances,
        seed=seed,
        voices=voices,
        words=words,
        speed_wpm_range=speed_wpm_range,
        pitch_range=pitch_range,
    )
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    job = {"output_dir": str(output_dir), "engine": engine, "utterances": utterances}
    _run_in_fresh_process(job)
    with (output_dir / METADATA_FILE).open("w", newline="", encoding="utf-8") as stream:
        writer = csv.writer(stream)
        writer.writerow(["file_name", "transcription", "voice"] + ["language"] * bool(language))
        writer.writerows(
            (u["file_name"], u["text"], u["voice"]) + (language,) * bool(language)
            for u in utterances
        )
    return output_dir


def _run_in_fresh_process(job: dict) -> None:
    """Run `_write_utterances(job)` in `python -m whisper_train.data.synth`; UserError on failure."""
    # The package's parent folder on PYTHONPATH lets the child import it from a source checkout.
    package_parent = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "whisper_train.data.synth"],
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
