"""Subtitle writers, long-form decoding (both backends) and the transcribe command."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import soundfile

from whisper_train.commands import transcribe as transcribe_command
from whisper_train.errors import UserError
from whisper_train.transcription.backends import CTranslate2Backend, TransformersBackend
from whisper_train.transcription.decoding import NO_FALLBACK, DecodingOptions
from whisper_train.transcription.transcribe import transcribe_paths
from whisper_train.transcription.transcripts import Segment, Transcript, to_json, to_srt, to_vtt

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
def long_recording(tmp_path_factory):
    """~40 s of synthesised speech (sentences with pauses) and its reference text."""
    from whisper_train.data.synth import synthesize

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


@pytest.fixture(scope="module")
def tiny_en_transformers():
    from whisper_train.models import load_model

    return load_model("tiny.en")


def _backend(name, tiny_en_ct2_dir, tiny_en_transformers, **options):
    if name == "faster-whisper":
        return CTranslate2Backend(tiny_en_ct2_dir, **options)
    return TransformersBackend(*tiny_en_transformers, **options)


@pytest.mark.speech
@pytest.mark.parametrize("backend", ["faster-whisper", "transformers"])
@pytest.mark.long
def test_long_form_covers_the_whole_recording(
    backend, tiny_en_ct2_dir, tiny_en_transformers, long_recording
):
    from whisper_train.audio import load_audio
    from whisper_train.evaluation.evaluate import score

    path, reference, duration = long_recording
    assert duration > 35, "the recording must need more than one 30 s window"
    transcriber = _backend(backend, tiny_en_ct2_dir, tiny_en_transformers)
    text, segments = transcriber.transcribe(load_audio(path))
    starts = [s.start for s in segments]
    assert starts == sorted(starts)
    assert all(s.start <= s.end <= duration for s in segments)
    assert segments[-1].start > 30.0, "speech after the first window must be transcribed"
    # espeak-ng speech, tiny.en: words across the window boundary must not be lost or doubled.
    assert score([reference], [text]).wer < 0.25


@pytest.mark.speech
def test_faster_whisper_gets_the_fallback_options_and_stays_offline(tiny_en_ct2_dir, monkeypatch):
    """The CTranslate2 backend is faster-whisper, run offline (its tokenizer.json read from the
    folder, nothing fetched), with our temperatures and thresholds."""
    import socket

    from whisper_train.data.synth import synthesize
    from whisper_train.transcription.decoding import NO_FALLBACK

    def no_network(*args, **kwargs):
        raise AssertionError(f"network access: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    audio = synthesize("open the door and turn on the light in the kitchen")
    for options, temperatures, ratio in (
        (None, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0], 2.4),
        (NO_FALLBACK, [0.0], 2.4),
        (DecodingOptions(compression_ratio_threshold=None), [0.0, 0.2, 0.4, 0.6, 0.8, 1.0], None),
    ):
        backend = CTranslate2Backend(tiny_en_ct2_dir, decoding=options)
        seen = {}
        real = backend.model.transcribe

        def spy(audio, real=real, seen=seen, **kwargs):
            seen.update(kwargs)
            return real(audio, **kwargs)

        backend.model.transcribe = spy
        text, segments = backend.transcribe(audio)
        assert "door" in text.lower() and segments
        assert seen["temperature"] == temperatures
        assert seen["compression_ratio_threshold"] == ratio
        assert seen["log_prob_threshold"] == -1.0
        assert seen["condition_on_previous_text"] is False


def test_a_ct2_folder_without_its_tokenizer_is_refused(tiny_en_ct2_dir, tmp_path):
    folder = tmp_path / "ct2"
    folder.mkdir()
    for name in ("model.bin", "config.json"):
        (folder / name).symlink_to(tiny_en_ct2_dir / name)
    with pytest.raises(UserError, match="tokenizer.json"):
        CTranslate2Backend(folder)


@pytest.mark.speech
def test_transformers_long_form_checks_the_text_compression_ratio(tiny_en_transformers):
    """transformers' own long-form fallback is pointed at openai-whisper's text compression
    ratio for the call (not its token-byte ratio), and given back afterwards."""
    from unittest import mock

    from whisper_train.data.synth import synthesize
    from whisper_train.transcription import longform  # where transcribe's generate is called

    backend = TransformersBackend(*tiny_en_transformers)
    model = backend.model
    audio = synthesize("please call stella and ask her to bring these things from the store")
    with mock.patch.object(
        longform, "compression_ratio", wraps=longform.compression_ratio
    ) as ratio:
        text, _ = backend.transcribe(audio)
    assert "call" in text.lower()
    checked = [call.args[0] for call in ratio.call_args_list]
    assert checked and "call" in checked[0], checked  # the decoded text, not token bytes
    assert "_retrieve_compression_ratio" not in vars(model)

    ratio_calls = []
    with mock.patch.object(longform, "compression_ratio", side_effect=ratio_calls.append):
        TransformersBackend(*tiny_en_transformers, decoding=NO_FALLBACK).transcribe(audio)
    assert ratio_calls == [], "with the fallback off, nothing is checked"


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
    off = ("--temperatures", "0", "--compression-ratio-threshold", "none")
    assert run(str(folder / "good.wav"), *off, "--logprob-threshold", "off") == 0
    with pytest.raises(UserError, match="--temperatures"):
        run(str(folder / "good.wav"), "--temperatures", "0,0.2,zero")


# -- long recordings in bounded memory --------------------------------------------------------
def test_a_long_recording_is_read_and_decoded_a_part_at_a_time_and_stitched_whole(
    tmp_path, monkeypatch
):
    """A 130 s recording, read 10 s at a time and decoded 40 s at a time: no read and no
    decode call holds more than that, and the parts' segments make the recording's, each once
    and at its own time. The audio is a time code (each sample is its time / 1000), so the
    fake runtime can say which second each of its segments starts at."""
    import whisper_train.transcription.longform as longform_module
    import whisper_train.transcription.transcribe as transcribe_module
    from whisper_train.audio import SAMPLE_RATE

    seconds = 130
    path = tmp_path / "long.wav"
    soundfile.write(
        path,
        np.arange(seconds * SAMPLE_RATE, dtype=np.float32) / SAMPLE_RATE / 1000,
        SAMPLE_RATE,
        subtype="FLOAT",
    )
    monkeypatch.setattr(transcribe_module, "PIECE_SECONDS", 10.0, raising=False)
    monkeypatch.setattr(longform_module, "DECODE_SECONDS", 40.0, raising=False)
    reads, calls = [], []
    real_read = soundfile.SoundFile.read

    def counted_read(self, frames=-1, *args, **kwargs):
        data = real_read(self, frames, *args, **kwargs)
        reads.append(len(data))
        return data

    class TimeCodeRuntime:  # a segment every 5 s of what it is given, named by its start
        def transcribe(self, audio):
            calls.append(len(audio))
            segments = []
            for start in range(0, len(audio), 5 * SAMPLE_RATE):
                at = round(float(audio[start]) * 1000)
                end = min(start + 5 * SAMPLE_RATE, len(audio))
                segments.append(Segment(start / SAMPLE_RATE, end / SAMPLE_RATE, f"{at}"))
            return " ".join(s.text for s in segments), segments

    monkeypatch.setattr(soundfile.SoundFile, "read", counted_read)
    monkeypatch.setattr(transcribe_module, "load_backend", lambda *a, **k: TimeCodeRuntime())
    [result] = transcribe_paths("any", [path], format="json", progress=False)

    assert result.error is None
    assert max(reads) <= 10 * SAMPLE_RATE  # the largest array read: a piece
    assert max(calls) <= (40 + 10) * SAMPLE_RATE and len(calls) > 3  # a part and a piece
    assert [s.text for s in result.segments] == [str(t) for t in range(0, seconds, 5)]
    assert [s.start for s in result.segments] == list(range(0, seconds, 5))
    assert result.segments[-1].end == seconds
    assert result.text == " ".join(str(t) for t in range(0, seconds, 5))
