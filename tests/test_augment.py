"""Waveform augmentation (speed, gain, noise) and SpecAugment through the model config."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from whisper_train.data.augment import (
    WaveformAugmenter,
    add_noise,
    change_gain,
    change_speed,
    spec_augment_overrides,
)

RATE = 16_000


def tone(hz: float = 440.0, seconds: float = 2.0, amplitude: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def dominant_hz(audio: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(audio))
    return float(np.fft.rfftfreq(len(audio), 1 / RATE)[spectrum.argmax()])


def snr_db(clean: np.ndarray, noisy: np.ndarray) -> float:
    noise = noisy.astype(np.float64) - clean
    return 10 * np.log10(np.mean(clean.astype(np.float64) ** 2) / np.mean(noise**2))


def test_the_same_seed_gives_the_same_audio_and_another_seed_does_not():
    augmenter = WaveformAugmenter(p=1.0)
    audio = tone()
    first = augmenter(audio, random.Random("42:0:7"))
    again = augmenter(audio, random.Random("42:0:7"))
    other = augmenter(audio, random.Random("42:1:7"))  # next epoch, same clip

    assert np.array_equal(first, again)
    assert first.dtype == np.float32
    assert len(first) != len(other) or not np.array_equal(first, other)


@pytest.mark.parametrize("factor", [0.9, 1.1, 1.25])
def test_speed_changes_length_and_pitch_by_the_factor(factor):
    audio = tone(440.0)
    faster = change_speed(audio, factor)

    assert len(faster) == pytest.approx(len(audio) / factor, rel=0.005)
    assert dominant_hz(faster) == pytest.approx(440.0 * factor, abs=2.0)


def test_augmenter_speed_range_bounds_the_new_length():
    augmenter = WaveformAugmenter(p=1.0, speed=(0.9, 1.1), noise_snr_db=(60, 60), gain_db=(0, 0))
    audio = tone(seconds=1.0)
    lengths = {len(augmenter(audio, random.Random(seed))) for seed in range(20)}

    assert all(len(audio) / 1.1 - 2 <= n <= len(audio) / 0.9 + 2 for n in lengths)
    assert len(lengths) > 10  # the factor is drawn per clip, not fixed


@pytest.mark.parametrize("target", [5.0, 20.0])
def test_noise_is_added_at_roughly_the_requested_snr(target):
    audio = tone()
    noisy = add_noise(audio, target, np.random.default_rng(0))
    assert snr_db(audio, noisy) == pytest.approx(target, abs=0.3)


def test_augmenter_noise_stays_within_the_configured_snr_range():
    augmenter = WaveformAugmenter(p=1.0, speed=(1.0, 1.0), gain_db=(0, 0), noise_snr_db=(15, 25))
    audio = tone()
    measured = [snr_db(audio, augmenter(audio, random.Random(seed))) for seed in range(10)]
    assert all(14.5 < value < 25.5 for value in measured)


def test_gain_scales_in_decibels_and_clips_at_full_scale():
    audio = tone(amplitude=0.3)
    assert np.max(np.abs(change_gain(audio, 6.0))) == pytest.approx(0.3 * 10 ** (6 / 20), rel=1e-3)
    assert np.max(np.abs(change_gain(audio, 20.0))) == 1.0


def test_probability_zero_leaves_audio_untouched_and_silence_gets_no_noise():
    audio = tone()
    assert np.array_equal(WaveformAugmenter(p=0.0)(audio, random.Random(1)), audio)
    silence = np.zeros(RATE, dtype=np.float32)
    assert not add_noise(silence, 10.0, np.random.default_rng(0)).any()


def test_spec_augment_overrides_make_the_model_mask_only_while_training(tiny_whisper):
    model, _ = tiny_whisper
    features = torch.randn(2, 80, 3000, generator=torch.Generator().manual_seed(0))
    start = torch.full((2, 1), model.config.decoder_start_token_id)

    def logits(training: bool) -> torch.Tensor:
        model.train(training)
        with torch.no_grad():
            # A copy: transformers zeroes the masked frames of its input in place.
            return model(input_features=features.clone(), decoder_input_ids=start).logits

    # Dropout is off in the tiny model: without SpecAugment, training mode changes nothing.
    assert torch.equal(logits(True), logits(False))
    for key, value in spec_augment_overrides().items():
        setattr(model.config, key, value)
    torch.manual_seed(0)
    assert not torch.equal(logits(True), logits(False))
    assert torch.equal(logits(False), logits(False))  # evaluation is never masked
