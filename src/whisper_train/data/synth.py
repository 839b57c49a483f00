"""Synthesised speech datasets, for the demo and the tests.

`make_speech_dataset` writes an audiofolder (WAVs + `metadata.csv`) of sentences spoken by
several voices, as `plan_utterances` draws them from a seed. The engine (espeak-ng) and its
voices are `espeak`'s; the sentences and their vocabulary are `synth_sentences`'s: their words
and voices come in disjoint training and held-out sets, so that a held-out set can measure what
a fine-tuned model learnt that carries over to speakers and words it never saw (the demo,
`demo.py`). Their public names import from here too.
"""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import soundfile as sf

from whisper_train.audio import SAMPLE_RATE
from whisper_train.data.espeak import (
    DEFAULT_PITCH,
    DEFAULT_SPEED_WPM,
    GUARD_VOICE,
    HELD_OUT_ACCENTS,
    HELD_OUT_VARIANTS,
    HELD_OUT_VOICES,
    SPANISH_HELD_OUT_ACCENTS,
    SPANISH_HELD_OUT_VOICES,
    SPANISH_TRAIN_ACCENTS,
    SPANISH_TRAIN_VOICES,
    TRAIN_ACCENTS,
    TRAIN_VARIANTS,
    TRAIN_VOICES,
    synthesize,
)
from whisper_train.data.synth_sentences import (
    FUNCTION_WORDS,
    HELD_OUT_WORDS_PERCENT,
    SPANISH_WORDS,
    SpanishWords,
    Vocabulary,
    content_words,
    make_sentence,
    make_sentences,
    make_spanish_sentences,
    split_spanish_words,
    split_vocabulary,
    vocabulary,
    word_family,
)
from whisper_train.errors import UserError

# What `plan_utterances` draws each utterance's speed (words per minute) and pitch from.
SPEED_WPM_RANGE = (135, 185)
PITCH_RANGE = (35, 65)
METADATA_FILE = "metadata.csv"


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


__all__ = [
    "DEFAULT_PITCH",
    "DEFAULT_SPEED_WPM",
    "FUNCTION_WORDS",
    "GUARD_VOICE",
    "HELD_OUT_ACCENTS",
    "HELD_OUT_VARIANTS",
    "HELD_OUT_VOICES",
    "HELD_OUT_WORDS_PERCENT",
    "METADATA_FILE",
    "PITCH_RANGE",
    "SPANISH_HELD_OUT_ACCENTS",
    "SPANISH_HELD_OUT_VOICES",
    "SPANISH_TRAIN_ACCENTS",
    "SPANISH_TRAIN_VOICES",
    "SPANISH_WORDS",
    "SPEED_WPM_RANGE",
    "TRAIN_ACCENTS",
    "TRAIN_VARIANTS",
    "TRAIN_VOICES",
    "SpanishWords",
    "Vocabulary",
    "content_words",
    "make_sentence",
    "make_sentences",
    "make_spanish_sentences",
    "make_speech_dataset",
    "plan_utterances",
    "split_spanish_words",
    "split_vocabulary",
    "synthesize",
    "vocabulary",
    "word_family",
]


if __name__ == "__main__":
    # The worker of make_speech_dataset: a JSON job on stdin, one line on stderr if it fails.
    try:
        _write_utterances(json.load(sys.stdin))
    except UserError as error:
        print(error, file=sys.stderr)
        sys.exit(2)
