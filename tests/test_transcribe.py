"""Subtitle writers, timestamp parsing, long-form decoding and the transcribe command."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import soundfile

from whisper_train.commands import transcribe as transcribe_command
from whisper_train.transcribe import (
    CTranslate2Backend,
    Segment,
    Transcript,
    segments_from_tokens,
    to_json,
    to_srt,
    to_vtt,
    transcribe_paths,
)

SEGMENTS = [Segment(0.0, 2.5, "Hello there."), Segment(3661.5, 3662.02, "An hour later.")]


def test_srt_numbers_blocks_and_uses_comma_milliseconds():
    assert to_srt(SEGMENTS) == (
        "1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n"
        "2\n01:01:01,500 --> 01:01:02,020\nAn hour later.\n"
    )


def test_vtt_has_header_and_dot_milliseconds():
    assert to_vtt(SEGMENTS) == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello there.\n\n"
        "01:01:01.500 --> 01:01:02.020\nAn hour later.\n"
    )


def test_json_holds_text_and_timed_segments():
    payload = json.loads(to_json(Transcript("a.wav", "a", "Hello there.", SEGMENTS[:1])))
    assert payload == {
        "audio": "a.wav",
        "text": "Hello there.",
        "segments": [{"start": 0.0, "end": 2.5, "text": "Hello there."}],
    }


@pytest.fixture(scope="module")
def tokenizer():
    from tiny_models import english_tokenizer

    return english_tokenizer()


def _ts(tokenizer, seconds: float) -> int:
    return tokenizer.convert_tokens_to_ids("<|notimestamps|>") + 1 + round(seconds / 0.02)


def test_timestamp_tokens_become_offset_segments(tokenizer):
    ts = lambda s: _ts(tokenizer, s)  # noqa: E731
    words = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    tokens = [
        ts(0.0),
        *words(" Hello"),
        ts(1.0),
        ts(1.0),
        *words(" world"),
        ts(2.5),
        tokenizer.eos_token_id,
    ]
    parsed = segments_from_tokens(tokens, tokenizer, timestamp_begin=ts(0.0), offset=30.0)
    assert parsed.closed == [Segment(30.0, 31.0, "Hello"), Segment(31.0, 32.5, "world")]
    assert parsed.open_segment is None and not parsed.unfinished

    # Words cut by the window's end: an open segment to the window's end, unfinished.
    cut = segments_from_tokens(
        [ts(0.0), *words(" Hello"), ts(1.0), ts(1.0), *words(" wor")],
        tokenizer,
        timestamp_begin=ts(0.0),
    )
    assert cut.open_segment == Segment(1.0, 30.0, "wor") and cut.unfinished
    # A segment opened and left empty (<|t|><|t|> then the end) is unfinished too.
    opened = segments_from_tokens(
        [ts(0.0), *words(" Hello"), ts(1.0), ts(1.0), tokenizer.eos_token_id],
        tokenizer,
        timestamp_begin=ts(0.0),
    )
    assert opened.closed == [Segment(0.0, 1.0, "Hello")] and opened.unfinished


@pytest.fixture(scope="module")
def long_recording(tmp_path_factory):
    """~40 s of synthesised speech (sentences with pauses) and its reference text."""
    from whisper_train.synth import synthesize

    sentences = [
        "the weather today is cold and windy with a chance of rain",
        "please call stella and ask her to bring these things from the store",
        "we will meet at the station at seven in the morning",
        "open the door and turn on the light in the kitchen",
        "the quick brown fox jumps over the lazy dog",
        "she sells sea shells by the sea shore",
        "my brother plays football every saturday afternoon",
        "the train to london leaves from platform four",
        "turn left at the church and walk for five minutes",
        "there are twelve eggs in the box on the table",
    ]
    pause = np.zeros(16_000, dtype=np.float32)  # 1 s
    audio = np.concatenate([part for text in sentences for part in (synthesize(text), pause)])
    path = tmp_path_factory.mktemp("long") / "long.wav"
    soundfile.write(path, audio, 16_000)
    return path, " ".join(sentences), len(audio) / 16_000


def test_ctranslate2_long_form_covers_the_whole_recording(tiny_en_ct2_dir, long_recording):
    from whisper_train.audio import load_audio
    from whisper_train.evaluate import score

    path, reference, duration = long_recording
    assert duration > 35, "the recording must need more than one 30 s window"
    text, segments = CTranslate2Backend(tiny_en_ct2_dir).transcribe(load_audio(path))
    starts = [s.start for s in segments]
    assert starts == sorted(starts)
    assert all(s.start <= s.end <= duration for s in segments)
    assert segments[-1].start > 30.0, "speech after the first window must be transcribed"
    # espeak-ng speech, tiny.en: words across the window boundary must not be lost or doubled.
    assert score([reference], [text]).wer < 0.25


def _folder_with_a_bad_file(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "in"
    folder.mkdir()
    soundfile.write(
        folder / "good.wav", (0.1 * rng.standard_normal(16_000)).astype(np.float32), 16_000
    )
    (folder / "bad.wav").write_bytes(b"this is not a wav file")
    return folder


def test_bad_file_is_reported_and_the_rest_transcribed(tmp_path):
    from whisper_train.models import load_model

    folder = _folder_with_a_bad_file(tmp_path)
    # The transformers backend, with the real tiny.en: a random model's timestamps send
    # long-form decoding round the same window hundreds of times.
    results = transcribe_paths(
        load_model("tiny.en"), [folder], format="srt", output_dir=tmp_path / "out", progress=False
    )
    by_name = {r.name: r for r in results}
    assert by_name["bad"].error and "bad.wav" in by_name["bad"].error
    assert by_name["good"].error is None
    assert (tmp_path / "out" / "good.srt").is_file()
    assert not (tmp_path / "out" / "bad.srt").exists()


def test_transcribe_command_exit_codes(tmp_path):
    folder = _folder_with_a_bad_file(tmp_path)
    parser = argparse.ArgumentParser()
    transcribe_command.add_parser(parser.add_subparsers())

    def run(*argv):
        # tiny.en is a CTranslate2 folder: the CTranslate2 backend.
        args = parser.parse_args(["transcribe", "--model", "tiny.en", *argv])
        return args.handler(args)

    assert run(str(folder), "--output-dir", str(tmp_path / "out"), "--format", "vtt") == 1
    assert (tmp_path / "out" / "good.vtt").read_text().startswith("WEBVTT")
    assert run(str(folder / "bad.wav"), str(tmp_path / "missing.wav")) == 2
    assert run(str(folder / "good.wav")) == 0
