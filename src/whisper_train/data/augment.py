"""Data augmentation: waveform perturbations here, SpecAugment through the model config.

`WaveformAugmenter` changes the audio before features are computed (`--audio-augment`):
speed (resampling with soxr, which shifts pitch too, like Kaldi's speed perturbation), gain,
and white noise at a drawn signal-to-noise ratio. Each is applied with probability `p`, drawn
from the `random.Random` the dataset passes per clip and epoch, so a run repeats exactly for a
given seed.

SpecAugment (`--spec-augment`) needs no code of ours: transformers' Whisper encoder masks
time steps and mel channels itself while training when `config.apply_spec_augment` is set;
`spec_augment_overrides()` gives the settings to copy onto the model config.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import soxr

from whisper_train.audio import SAMPLE_RATE


def spec_augment_overrides() -> dict[str, float | int | bool]:
    """Model-config fields that switch on SpecAugment in transformers' Whisper encoder.

    Masks are drawn only in training mode. Time masks: about 5% of frames start a 10-frame
    (100 ms) mask, at least 2 per clip; frequency masks: about 5% of the 80/128 mel channels
    start a 10-channel mask. These are the transformers defaults for time masking (as used for
    the Whisper fine-tuning event) plus the same for frequency, which is mild enough not to slow
    convergence on small datasets.
    """
    return {
        "apply_spec_augment": True,
        "mask_time_prob": 0.05,
        "mask_time_length": 10,
        "mask_time_min_masks": 2,
        "mask_feature_prob": 0.05,
        "mask_feature_length": 10,
        "mask_feature_min_masks": 0,
    }


@dataclass(frozen=True)
class WaveformAugmenter:
    """Random speed, gain and noise for one 16 kHz mono clip at a time.

    `audio` in and out: float32 (n_samples,); speed changes the length to about
    n_samples / speed.
    """

    seed: int = 0  # used only when no per-clip `rng` is given
    noise_snr_db: tuple[float, float] = (10.0, 40.0)  # white noise this far below the speech
    speed: tuple[float, float] = (0.9, 1.1)  # playback-rate factor; 1.1 is 10% faster
    gain_db: tuple[float, float] = (-6.0, 6.0)  # loudness change; results clip to [-1, 1]
    p: float = 0.5  # chance of each perturbation, drawn independently

    def __post_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"p={self.p}: must be in [0, 1]")
        if not 0.0 < self.speed[0] <= self.speed[1]:
            raise ValueError(f"speed={self.speed}: expected 0 < low <= high, e.g. (0.9, 1.1)")

    def __call__(self, audio: np.ndarray, rng: random.Random | None = None) -> np.ndarray:
        """Apply speed, then gain, then noise, each with probability `p`."""
        rng = rng or random.Random(self.seed)
        audio = np.asarray(audio, dtype=np.float32)
        if rng.random() < self.p:
            audio = change_speed(audio, rng.uniform(*self.speed))
        if rng.random() < self.p:
            audio = change_gain(audio, rng.uniform(*self.gain_db))
        if rng.random() < self.p:
            # numpy draws the noise samples; its generator is seeded from `rng` to stay in step.
            noise_rng = np.random.default_rng(rng.getrandbits(64))
            audio = add_noise(audio, rng.uniform(*self.noise_snr_db), noise_rng)
        return audio


def change_speed(audio: np.ndarray, factor: float) -> np.ndarray:
    """Play `factor` times faster: (n,) → (≈ n / factor,) samples, pitch shifted with it.

    Reading the clip as if it had been recorded at `factor * 16 kHz` and resampling that to
    16 kHz is exactly a change of playback rate.
    """
    resampled = soxr.resample(audio, SAMPLE_RATE * factor, SAMPLE_RATE, quality="HQ")
    return resampled.astype(np.float32, copy=False)


def change_gain(audio: np.ndarray, gain_db: float) -> np.ndarray:
    """Scale by `gain_db` decibels, clipping to [-1, 1] as a recording would."""
    return np.clip(audio * np.float32(10.0 ** (gain_db / 20.0)), -1.0, 1.0).astype(np.float32)


def add_noise(audio: np.ndarray, snr_db: float, rng: np.random.Generator) -> np.ndarray:
    """Add white Gaussian noise `snr_db` decibels below the clip's mean power.

    A silent clip has no power to measure against and is returned unchanged.
    """
    signal_power = float(np.mean(np.square(audio, dtype=np.float64))) if audio.size else 0.0
    if signal_power == 0.0:
        return audio
    noise_power = signal_power / 10.0 ** (snr_db / 10.0)
    noise = rng.normal(0.0, np.sqrt(noise_power), size=audio.shape)
    return (audio + noise).astype(np.float32)
