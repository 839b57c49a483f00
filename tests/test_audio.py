"""Audio reading: any rate and channel count in, float32 mono 16 kHz out; clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile
import soxr
from conftest import fill_disk_on_write

from whisper_train.audio import SAMPLE_RATE, audio_duration, load_audio, read_header
from whisper_train.errors import AudioError

# `make test-compat` runs these on the lowest soundfile, soxr and PyAV pyproject allows.
pytestmark = pytest.mark.compat


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


# -- every codec users bring ----------------------------------------------------------------
# The test signal: two tones in the speech band, one of them amplitude-modulated, peak 0.5.
# Decoded audio is compared with the source by signal-to-noise ratio after the decoder's output
# is aligned to the source (the lag must be 0: a shifted clip puts every timestamp label off).
# Thresholds sit ~8-10 dB under what each codec gives (measured on this signal) and follow from
# the codec: 24/32-bit PCM is exact to the resampler's 20-bit precision (>100 dB); G.711 u-law
# and A-law are 8-bit logarithmic companding (~38 dB for speech levels); 8-bit linear PCM gives
# ~34 dB at half scale; 4-bit ADPCM 20-30 dB; GSM 6.10 (RPE-LTP, a vocoder-like coder at 13
# kbit/s) keeps the spectrum rather than the waveform (~17 dB); AAC, Opus and MP3 at their
# default bit rates 25-40 dB. Codecs are deterministic integer or float code: the margins cover
# SIMD differences between CPUs.
def speech_band_signal(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    modulated = 0.2 * np.sin(2 * np.pi * 1250 * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
    return (0.3 * np.sin(2 * np.pi * 300 * t) + modulated).astype(np.float32)


def aligned_snr_db(reference: np.ndarray, decoded: np.ndarray) -> tuple[int, float]:
    """(lag of `decoded` behind `reference` in samples, SNR in dB over their overlap)."""
    n = min(len(reference), len(decoded))
    correlation = np.correlate(decoded[:n], reference[:n], "full")
    lag = int(np.argmax(correlation)) - (n - 1)
    a, b = (
        (reference[: n - lag], decoded[lag:n])
        if lag >= 0
        else (reference[-lag:n], decoded[: n + lag])
    )
    return lag, float(10 * np.log10(np.sum(a**2) / (np.sum((a - b) ** 2) + 1e-30)))


@pytest.mark.parametrize(
    ("subtype", "min_snr_db"),
    [
        ("GSM610", 10.0),  # not seekable: read(-1) failed on these
        ("G721_32", 20.0),  # not seekable either
        ("ULAW", 30.0),
        ("ALAW", 30.0),
        ("IMA_ADPCM", 15.0),
        ("MS_ADPCM", 12.0),
        ("PCM_U8", 26.0),
        ("PCM_24", 100.0),
        ("PCM_32", 100.0),
    ],
)
def test_telephony_and_wide_pcm_wavs_at_8k_decode_to_their_samples(tmp_path, subtype, min_snr_db):
    source = speech_band_signal(2.0, 8_000)
    path = tmp_path / f"{subtype}.wav"
    soundfile.write(path, source, 8_000, subtype=subtype)

    decoded = load_audio(path)
    lag, snr = aligned_snr_db(soxr.resample(source, 8_000, SAMPLE_RATE), decoded)

    assert lag == 0 and snr >= min_snr_db, (lag, snr)
    # ADPCM and GSM pad to whole codec blocks: at most one block (20-40 ms) more.
    assert 2 * SAMPLE_RATE <= len(decoded) <= 2.05 * SAMPLE_RATE
    assert abs(audio_duration(path) - 2.0) <= 0.05


def test_window_of_a_gsm_wav_is_read_without_seeking(tmp_path):
    source = speech_band_signal(3.0, 8_000)
    path = tmp_path / "call.wav"
    soundfile.write(path, source, 8_000, subtype="GSM610")
    whole = load_audio(path)

    window = load_audio(path, start=1.0, end=2.0)

    assert len(window) == SAMPLE_RATE
    # The same samples, resampled alone: only the resampler's filter length at the window's
    # edges (under 10 ms) sees different neighbours.
    edge = SAMPLE_RATE // 100
    inner = slice(SAMPLE_RATE + edge, 2 * SAMPLE_RATE - edge)
    np.testing.assert_allclose(window[edge:-edge], whole[inner], atol=1e-4)


def encode_with_pyav(path, samples: np.ndarray, rate: int, container: str, codec: str) -> None:
    """Write mono float samples with FFmpeg's encoder `codec` into `container` (PyAV)."""
    import av

    with av.open(str(path), "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.layout = "mono"
        block = 960  # whole Opus frames at 48 kHz; AAC and others buffer what they need
        for first in range(0, len(samples), block):
            piece = np.ascontiguousarray(samples[None, first : first + block])
            frame = av.AudioFrame.from_ndarray(piece, format="fltp", layout="mono")
            frame.sample_rate, frame.pts = rate, first
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))


@pytest.mark.parametrize(
    ("name", "container", "codec", "rate"),
    [
        ("phone.m4a", "ipod", "aac", 16_000),
        ("video.mp4", "mp4", "aac", 44_100),
        ("browser.webm", "webm", "libopus", 48_000),
    ],
)
def test_m4a_mp4_and_webm_decode_through_pyav(tmp_path, name, container, codec, rate):
    source = speech_band_signal(2.0, SAMPLE_RATE)
    path = tmp_path / name
    encode_with_pyav(path, soxr.resample(source, SAMPLE_RATE, rate), rate, container, codec)

    decoded = load_audio(path)
    lag, snr = aligned_snr_db(source, decoded)

    assert decoded.dtype == np.float32 and lag == 0 and snr >= 15.0, (lag, snr)
    # the container trims the encoder's priming; one codec frame of padding may remain
    assert 2 * SAMPLE_RATE <= len(decoded) <= 2 * SAMPLE_RATE + 1024 * SAMPLE_RATE // rate + 1
    assert abs(audio_duration(path) - 2.0) <= 0.05


def test_late_window_of_an_m4a_seeks_and_matches_the_source(tmp_path):
    source = speech_band_signal(14.0, SAMPLE_RATE)
    path = tmp_path / "long.m4a"
    encode_with_pyav(path, source, SAMPLE_RATE, "ipod", "aac")

    window = load_audio(path, start=11.0, end=12.5)  # past _PYAV_SEEK_AFTER_SECONDS: a seek
    lag, snr = aligned_snr_db(source[11 * SAMPLE_RATE : int(12.5 * SAMPLE_RATE)], window)

    assert len(window) == int(1.5 * SAMPLE_RATE)
    assert lag == 0 and snr >= 15.0, (lag, snr)


def test_a_file_neither_decoder_reads_names_both_reasons(tmp_path):
    path = tmp_path / "notes.m4a"
    path.write_bytes(b"not audio at all" * 100)

    with pytest.raises(AudioError, match="libsndfile: .*FFmpeg: .*convert it to WAV or FLAC"):
        load_audio(path)
    with pytest.raises(AudioError, match="FFmpeg"):
        audio_duration(path)


def _recording(tmp_path, name: str):
    """A 2 s speech-band recording in the format `name`'s suffix says (GSM WAV, M4A, WebM)."""
    source = speech_band_signal(2.0, SAMPLE_RATE)
    path = tmp_path / name
    if name.endswith(".wav"):
        soundfile.write(path, soxr.resample(source, SAMPLE_RATE, 8_000), 8_000, subtype="GSM610")
    elif name.endswith(".m4a"):
        encode_with_pyav(path, source, SAMPLE_RATE, "ipod", "aac")
    else:
        encode_with_pyav(
            path, soxr.resample(source, SAMPLE_RATE, 48_000), 48_000, "webm", "libopus"
        )
    return path


@pytest.mark.parametrize("name", ["call.wav", "phone.m4a", "browser.webm"])
def test_encoded_bytes_decode_as_their_file_does(tmp_path, name):
    # A streamed shard or a dataset's embedded audio holds the file's bytes: the same decoders
    # run on them, so the samples are the file's exactly (same code, same input).
    from whisper_train.data.hf_datasets import _cached_audio
    from whisper_train.data.streaming import audio_header, decode_audio

    path = _recording(tmp_path, name)
    data = path.read_bytes()

    np.testing.assert_array_equal(load_audio(data, origin="shard-0.tar:clip"), load_audio(path))
    np.testing.assert_array_equal(
        decode_audio({"bytes": data, "path": None}, "k"), load_audio(path)
    )
    assert read_header(data) == read_header(path) == audio_header({"bytes": data})
    # A dataset's embedded bytes are stored once as a file of their own format.
    stored = _cached_audio(data, tmp_path / "cache", "dataset[0]")
    assert stored.endswith(path.suffix)
    np.testing.assert_array_equal(load_audio(stored), load_audio(path))


def test_a_full_disk_leaves_no_part_of_the_audio_in_the_cache(tmp_path, monkeypatch):
    from whisper_train.data.hf_datasets import _cached_audio

    data = _recording(tmp_path, "call.wav").read_bytes()
    cache = tmp_path / "cache"
    fill_disk_on_write(monkeypatch)
    with pytest.raises(OSError, match="No space"):
        _cached_audio(data, cache, "dataset[0]")
    monkeypatch.undo()
    assert list(cache.iterdir()) == []  # neither half a clip nor a temporary
    stored = _cached_audio(data, cache, "dataset[0]")  # room again: stored whole
    assert [path.name for path in cache.iterdir()] == [Path(stored).name]
    assert Path(stored).read_bytes() == data


def test_bytes_neither_decoder_reads_are_named_by_their_origin(tmp_path):
    from whisper_train.data.hf_datasets import _cached_audio
    from whisper_train.data.streaming import audio_header, decode_audio

    junk = b"not audio at all" * 100
    with pytest.raises(AudioError, match=r"^shard-3\.tar:clip7: cannot decode audio \(libsndfile"):
        decode_audio({"bytes": junk}, "shard-3.tar:clip7")
    assert "FFmpeg" in audio_header({"bytes": junk})
    with pytest.raises(AudioError, match=r"^dataset\[4\]: cannot decode the audio bytes"):
        _cached_audio(junk, tmp_path / "cache", "dataset[4]")
