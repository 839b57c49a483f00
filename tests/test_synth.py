"""Offline speech synthesis: the pip-only path (libespeak-ng from espeakng-loader) must work,
and the espeak-ng program gives clips of the same shape."""

from __future__ import annotations

import csv
import shutil
import sys

import numpy as np
import pytest

from whisper_train.audio import SAMPLE_RATE, load_audio
from whisper_train.data import espeak
from whisper_train.data.layouts import load_examples
from whisper_train.data.synth import (
    FUNCTION_WORDS,
    GUARD_VOICE,
    HELD_OUT_VOICES,
    TRAIN_VOICES,
    content_words,
    make_sentences,
    make_speech_dataset,
    plan_utterances,
    split_vocabulary,
    synthesize,
    vocabulary,
    word_family,
)
from whisper_train.errors import UserError

SENTENCE = "The quick brown fox jumps over the lazy dog."


@pytest.mark.speech
def test_library_speaks_a_sentence_as_16khz_float32_speech():
    audio = synthesize(SENTENCE, engine="library")
    assert audio.dtype == np.float32 and audio.ndim == 1
    seconds = len(audio) / SAMPLE_RATE
    # Nine words at 160 words per minute is about 3.4 s; allow espeak's pauses either way.
    assert 2.0 < seconds < 6.0
    assert np.abs(audio).max() <= 1.0
    assert np.sqrt(np.mean(audio**2)) > 0.02  # clearly not silence


@pytest.mark.speech
def test_speed_and_voice_change_the_speech():
    normal = synthesize(SENTENCE, speed_wpm=160, engine="library")
    fast = synthesize(SENTENCE, speed_wpm=320, engine="library")
    assert len(fast) < 0.75 * len(normal)
    other_voice = synthesize(SENTENCE, voice="en-us+f3", speed_wpm=160, engine="library")
    assert len(other_voice) != len(normal) or not np.allclose(other_voice, normal)


@pytest.mark.speech
def test_bad_requests_are_user_errors():
    with pytest.raises(UserError, match="unknown espeak-ng voice"):
        synthesize("hello", voice="no-such-voice", engine="library")
    with pytest.raises(UserError, match="empty"):
        synthesize("   ")
    with pytest.raises(UserError, match="at least 1"):
        make_speech_dataset("unused", n_utterances=0, seed=0)


def test_without_any_espeak_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.delenv(espeak.ENGINE_VARIABLE, raising=False)  # auto: the library, here
    monkeypatch.setattr(espeak.shutil, "which", lambda _name: None)
    with pytest.raises(UserError, match="apt-get install espeak-ng"):
        synthesize("hello", engine="program")
    # A fresh library wrapper whose import of espeakng-loader fails, as without the extra.
    monkeypatch.setitem(sys.modules, "espeakng_loader", None)
    monkeypatch.setattr(espeak, "_LIBRARY", espeak._EspeakLibrary())
    with pytest.raises(UserError, match=r"whisper-train\[synth\]"):
        synthesize("hello")


def test_whisper_train_espeak_chooses_the_engine(monkeypatch):
    monkeypatch.setattr(espeak.shutil, "which", lambda _name: "/usr/bin/espeak-ng")
    monkeypatch.delenv(espeak.ENGINE_VARIABLE, raising=False)
    assert espeak.resolve_engine() == "program"  # unset: the program, where it is on PATH
    for value, engine in [("library", "library"), ("program", "program"), ("auto", "program"),
                          ("", "program"), (" Library ", "library")]:  # fmt: skip
        monkeypatch.setenv(espeak.ENGINE_VARIABLE, value)
        assert espeak.resolve_engine() == engine, value
    assert espeak.resolve_engine("program") == "program"  # an engine asked for by name wins
    monkeypatch.setattr(espeak.shutil, "which", lambda _name: None)
    monkeypatch.setenv(espeak.ENGINE_VARIABLE, "auto")
    assert espeak.resolve_engine() == "library"

    # synthesize(engine="auto") speaks with the engine named, and only with it.
    def program(text, voice, speed_wpm, pitch):
        return np.full(22050, 0.5, dtype=np.float32), 22050  # 1 s, then no silence at all

    def refused(*_args):
        raise AssertionError("the other engine was used")

    monkeypatch.setattr(espeak, "_speak_with_program", program)
    monkeypatch.setattr(espeak._LIBRARY, "speak", refused)
    monkeypatch.setenv(espeak.ENGINE_VARIABLE, "program")
    assert len(synthesize("hello")) == SAMPLE_RATE
    monkeypatch.setenv(espeak.ENGINE_VARIABLE, "library")
    with pytest.raises(AssertionError, match="other engine"):
        synthesize("hello")


def test_an_unknown_whisper_train_espeak_is_one_line_naming_the_choices(monkeypatch, tmp_path):
    monkeypatch.setenv(espeak.ENGINE_VARIABLE, "festival")
    with pytest.raises(UserError) as error:
        synthesize("hello")
    message = str(error.value)
    assert message == "WHISPER_TRAIN_ESPEAK='festival': use auto, program or library"
    # The same line from the process that synthesises a dataset (the demo's).
    with pytest.raises(UserError) as error:
        make_speech_dataset(tmp_path / "speech", n_utterances=1, seed=0)
    assert str(error.value) == message


def test_trailing_silence_is_cut_to_what_the_library_leaves():
    """The program 1.51 leaves ~0.35 s after the speech, the library 8 ms (measured: median;
    14 ms at most in 401 clips but one of 15.4; none where it cuts an echo off): a clip ends
    at most TAIL_S after its last sample within 60 dB of its peak, and the library's clips
    stay as they were."""
    tail = round(espeak.TAIL_S * SAMPLE_RATE)
    speech = (0.5 * np.sin(np.arange(SAMPLE_RATE) / 3)).astype(np.float32)
    speech[-400:] *= np.linspace(1, 1e-4, 400, dtype=np.float32)  # a decay to -86 dB
    audible = int(np.flatnonzero(np.abs(speech) > np.abs(speech).max() * 1e-3).max()) + 1
    program = np.concatenate([speech, np.zeros(5600, np.float32)])
    assert np.array_equal(espeak.trim_trailing_silence(program), program[: audible + tail])
    library = np.concatenate([speech[:audible], np.zeros(130, np.float32)])  # 8 ms after
    assert np.array_equal(espeak.trim_trailing_silence(library), library)
    echo_cut_off = speech[:audible]
    assert np.array_equal(espeak.trim_trailing_silence(echo_cut_off), echo_cut_off)


@pytest.mark.speech
def test_synthesised_speech_ends_at_most_a_tail_after_its_last_audible_sample():
    audio = synthesize(SENTENCE)  # the engine WHISPER_TRAIN_ESPEAK chooses (CI: each of them)
    level = np.abs(audio)
    last = int(np.flatnonzero(level > level.max() * 1e-3)[-1])
    assert len(audio) - 1 - last <= round(espeak.TAIL_S * SAMPLE_RATE)


@pytest.mark.speech
@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="the espeak-ng program is absent")
def test_the_program_and_the_library_give_clips_of_the_same_length():
    """Before the trim the program's clips were ~0.34 s longer (its end pause). Measured after
    it, in voices without an echo: 8 ms apart (median), 21 ms at most over 51 clips, from the
    trim's 15 ms and the jitter libespeak-ng carries from one utterance to the next; the
    tolerance is 50 ms."""
    for voice in ("en-us", "en-gb-scotland+Alex", "es+m3"):
        program = synthesize(SENTENCE, voice=voice, engine="program")
        library = synthesize(SENTENCE, voice=voice, engine="library")
        assert abs(len(program) - len(library)) <= 0.05 * SAMPLE_RATE, voice


@pytest.mark.speech
def test_speech_dataset_is_a_readable_audiofolder(tmp_path):
    folder = make_speech_dataset(tmp_path / "speech", n_utterances=5, seed=7)

    with (folder / "metadata.csv").open(newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert [row["file_name"] for row in rows] == [f"utt_{i:05d}.wav" for i in range(5)]
    known = vocabulary().words() | FUNCTION_WORDS
    for row in rows:
        words = row["transcription"].rstrip(".?").replace(",", "").lower().split()
        assert len(words) >= 4 and set(words) <= known
        assert row["voice"] in TRAIN_VOICES  # the default voices

    examples = load_examples(folder)
    assert [e.text for e in examples] == [row["transcription"] for row in rows]
    for example in examples:
        audio = load_audio(example.audio)
        assert len(audio) > SAMPLE_RATE  # 4+ words last well over a second
        assert np.sqrt(np.mean(audio**2)) > 0.02


@pytest.mark.speech
def test_speech_dataset_is_the_same_for_the_same_seed(tmp_path):
    # Synthesise something first: the dataset must not depend on what this process did before.
    synthesize("unrelated words first", engine="library")
    first = make_speech_dataset(tmp_path / "a", n_utterances=3, seed=11)
    second = make_speech_dataset(tmp_path / "b", n_utterances=3, seed=11)
    other = make_speech_dataset(tmp_path / "c", n_utterances=3, seed=12)

    names = sorted(path.name for path in first.iterdir())
    assert names == sorted(path.name for path in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (other / "metadata.csv").read_text() != (first / "metadata.csv").read_text()


def test_vocabulary_is_broad_and_clean():
    words = vocabulary()
    assert len(words.words()) >= 3000
    assert len(words.nouns) >= 2000 and len(words.verbs) >= 500
    assert len(words.adjectives) >= 300 and len(words.adverbs) >= 50
    for part in (words.nouns, words.verbs, words.adjectives, words.adverbs):
        assert list(part) == sorted(set(part))
        assert all(word.isalpha() and word.islower() for word in part)
    assert not words.words() & FUNCTION_WORDS  # function words belong to the templates
    assert not set(words.nouns) & set(words.adjectives)  # "chemical" reads as an adjective


def test_sentences_are_seeded_and_reproducible():
    words = vocabulary()
    first = make_sentences(words, 40, seed=3)
    assert first == make_sentences(words, 40, seed=3)
    assert first != make_sentences(words, 40, seed=4)
    assert len(set(first)) == 40
    assert all(s[0].isupper() and s[-1] in ".?" for s in first)
    # Grammatical-looking: function words between the content words, a/an as said.
    assert sum(len(content_words(s)) for s in first) < sum(len(s.split()) for s in first)
    assert "a apple" not in " ".join(first).lower()
    plan = plan_utterances(6, seed=9, voices=HELD_OUT_VOICES)
    assert plan == plan_utterances(6, seed=9, voices=HELD_OUT_VOICES)
    assert {u["voice"] for u in plan} <= set(HELD_OUT_VOICES)


def test_held_out_words_are_never_in_training_sentences():
    train_words, held_out_words = split_vocabulary()
    assert not train_words.words() & held_out_words.words()
    # Whole word families: no held-out word is a suffix away from a training word.
    train_families = {word_family(w) for w in train_words.words()}
    assert not train_families & {word_family(w) for w in held_out_words.words()}
    assert word_family("carefully") == word_family("care") == word_family("careful")
    assert 0.1 < len(held_out_words.words()) / len(vocabulary().words()) < 0.3

    training = make_sentences(train_words, 300, seed=0)
    held_out = make_sentences(held_out_words, 100, seed=1)
    seen_in_training = set().union(*map(content_words, training))
    held_out_content = set().union(*map(content_words, held_out))
    assert held_out_content and not held_out_content & seen_in_training
    assert held_out_content <= held_out_words.words()
    # Function words are what the two share.
    shared = set(" ".join(training).lower().split()) & set(" ".join(held_out).lower().split())
    assert {"the", "will"} <= shared


@pytest.mark.speech
def test_training_and_held_out_voices_are_disjoint_and_speak():
    def accent_and_variant(voice):
        accent, _, variant = voice.partition("+")
        return accent, variant

    train = [accent_and_variant(v) for v in TRAIN_VOICES]
    held_out = [accent_and_variant(v) for v in HELD_OUT_VOICES]
    assert not {a for a, _ in train} & {a for a, _ in held_out}  # no accent shared
    assert not {v for _, v in train} & {v for _, v in held_out}  # no speaker variant shared
    assert GUARD_VOICE not in (*TRAIN_VOICES, *HELD_OUT_VOICES)
    for voice in (*TRAIN_VOICES, *HELD_OUT_VOICES, GUARD_VOICE):
        assert len(synthesize("Hello there.", voice=voice, engine="library")) > SAMPLE_RATE // 4
