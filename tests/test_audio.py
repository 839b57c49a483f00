"""Audio reading: any rate and channel count in, float32 mono 16 kHz out; clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile

from whisper_train.audio import SAMPLE_RATE, audio_duration, load_audio
from whisper_train.errors import AudioError


def sine(seconds: float, rate: int, hz: float = 440.0) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def peak_hz(samples: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.argmax(spectrum) * SAMPLE_RATE / len(samples))


@pytest.mark.parametrize("rate", [8_000, 22_050, 44_100, 16_000])
def test_any_rate_becomes_16k_float32_mono_with_pitch_kept(tmp_path, rate):
    path = tmp_path / f"tone_{rate}.wav"
    soundfile.write(path, sine(1.5, rate), rate)

    audio = load_audio(path)

    assert audio.dtype == np.float32 and audio.ndim == 1
    assert abs(len(audio) - 1.5 * SAMPLE_RATE) <= 1
    assert abs(peak_hz(audio) - 440.0) < 2.0  # resampling must not shift the pitch
    assert 0.45 < np.abs(audio).max() < 0.55


def test_channels_are_averaged(tmp_path):
    left, right = sine(1.0, SAMPLE_RATE, 300), sine(1.0, SAMPLE_RATE, 700)
    path = tmp_path / "stereo.wav"
    soundfile.write(path, np.stack([left, right], axis=1), SAMPLE_RATE, subtype="FLOAT")

    np.testing.assert_allclose(load_audio(path), (left + right) / 2, atol=1e-6)


def test_six_channel_flac_at_22k(tmp_path):
    channels = np.stack([sine(0.5, 22_050, 200 * (i + 1)) for i in range(6)], axis=1)
    path = tmp_path / "surround.flac"
    soundfile.write(path, channels, 22_050)

    audio = load_audio(path)

    assert audio.shape == (8_000,)


def test_integer_pcm_is_scaled_to_unit_range(tmp_path):
    path = tmp_path / "pcm16.wav"
    soundfile.write(path, np.full(1600, 16384, dtype=np.int16), SAMPLE_RATE, subtype="PCM_16")

    np.testing.assert_allclose(load_audio(path), 0.5, atol=1e-4)


def test_window_reads_exactly_that_part(tmp_path):
    ramp = np.linspace(-1, 1, 3 * SAMPLE_RATE, dtype=np.float32)
    path = tmp_path / "ramp.wav"
    soundfile.write(path, ramp, SAMPLE_RATE, subtype="FLOAT")

    window = load_audio(path, start=1.0, end=1.5)

    np.testing.assert_array_equal(window, ramp[SAMPLE_RATE : SAMPLE_RATE + SAMPLE_RATE // 2])
    assert len(load_audio(path, start=2.0)) == SAMPLE_RATE  # to the end of the file
    assert len(load_audio(path, end=0.25)) == SAMPLE_RATE // 4  # from the start


def test_window_of_a_44k_file_is_resampled(tmp_path):
    path = tmp_path / "long.wav"
    soundfile.write(path, sine(4.0, 44_100), 44_100)

    assert abs(len(load_audio(path, start=1.25, end=3.25)) - 2 * SAMPLE_RATE) <= 1


def test_duration_comes_from_the_header(tmp_path):
    path = tmp_path / "tone.wav"
    soundfile.write(path, sine(2.5, 22_050), 22_050)

    assert audio_duration(path) == pytest.approx(2.5, abs=1e-4)


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.wav"
    for read in (load_audio, audio_duration):
        with pytest.raises(AudioError, match="not found") as caught:
            read(missing)
        assert caught.value.path == str(missing)


def test_undecodable_file_is_an_audio_error(tmp_path):
    path = tmp_path / "notes.wav"
    path.write_text("this is not audio")

    with pytest.raises(AudioError, match="cannot decode audio.*convert it") as caught:
        load_audio(path)
    assert str(path) in str(caught.value)


def test_empty_audio_and_empty_window_are_errors(tmp_path):
    empty = tmp_path / "empty.wav"
    soundfile.write(empty, np.zeros(0, np.float32), SAMPLE_RATE)
    short = tmp_path / "short.wav"
    soundfile.write(short, sine(1.0, SAMPLE_RATE), SAMPLE_RATE)

    with pytest.raises(AudioError, match="no audio samples"):
        load_audio(empty)
    with pytest.raises(AudioError, match="no audio samples in the window 5.0-6.0 s"):
        load_audio(short, start=5.0, end=6.0)
