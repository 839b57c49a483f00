"""Offline speech synthesis: the pip-only path (libespeak-ng from espeakng-loader) must work."""

from __future__ import annotations

import csv
import sys

import numpy as np
import pytest

from whisper_train import synth
from whisper_train.audio import SAMPLE_RATE, load_audio
from whisper_train.data import load_examples
from whisper_train.errors import UserError
from whisper_train.synth import make_speech_dataset, synthesize, word_list

SENTENCE = "The quick brown fox jumps over the lazy dog."


def test_library_speaks_a_sentence_as_16khz_float32_speech():
    audio = synthesize(SENTENCE, engine="library")
    assert audio.dtype == np.float32 and audio.ndim == 1
    seconds = len(audio) / SAMPLE_RATE
    # Nine words at 160 words per minute is about 3.4 s; allow espeak's pauses either way.
    assert 2.0 < seconds < 6.0
    assert np.abs(audio).max() <= 1.0
    assert np.sqrt(np.mean(audio**2)) > 0.02  # clearly not silence


def test_speed_and_voice_change_the_speech():
    normal = synthesize(SENTENCE, speed_wpm=160, engine="library")
    fast = synthesize(SENTENCE, speed_wpm=320, engine="library")
    assert len(fast) < 0.75 * len(normal)
    other_voice = synthesize(SENTENCE, voice="en-us+f3", speed_wpm=160, engine="library")
    assert len(other_voice) != len(normal) or not np.allclose(other_voice, normal)


def test_bad_requests_are_user_errors():
    with pytest.raises(UserError, match="unknown espeak-ng voice"):
        synthesize("hello", voice="no-such-voice", engine="library")
    with pytest.raises(UserError, match="empty"):
        synthesize("   ")
    with pytest.raises(UserError, match="at least 1"):
        make_speech_dataset("unused", n_utterances=0, seed=0)


def test_without_any_espeak_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(synth.shutil, "which", lambda _name: None)
    with pytest.raises(UserError, match="apt-get install espeak-ng"):
        synthesize("hello", engine="program")
    # A fresh library wrapper whose import of espeakng-loader fails, as without the extra.
    monkeypatch.setitem(sys.modules, "espeakng_loader", None)
    monkeypatch.setattr(synth, "_LIBRARY", synth._EspeakLibrary())
    with pytest.raises(UserError, match=r"whisper-train\[synth\]"):
        synthesize("hello")


def test_speech_dataset_is_a_readable_audiofolder(tmp_path):
    folder = make_speech_dataset(tmp_path / "speech", n_utterances=5, seed=7)

    with (folder / "metadata.csv").open(newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert [row["file_name"] for row in rows] == [f"utt_{i:05d}.wav" for i in range(5)]
    vocabulary = set(word_list())
    for row in rows:
        words = row["transcription"].rstrip(".").lower().split()
        assert 4 <= len(words) <= 9 and set(words) <= vocabulary

    examples = load_examples(folder)
    assert [e.text for e in examples] == [row["transcription"] for row in rows]
    for example in examples:
        audio = load_audio(example.audio)
        assert len(audio) > SAMPLE_RATE  # 4+ words last well over a second
        assert np.sqrt(np.mean(audio**2)) > 0.02


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


def test_word_list_is_large_and_clean():
    words = word_list()
    assert len(words) >= 300
    assert len(set(words)) == len(words)
    assert all(word.isalpha() and word.islower() for word in words)
