"""From examples to model inputs: batched log-mel features and the training dataset.

Whisper's log-mel spectrogram (`WhisperFeatureExtractor`) is computed here in one batched torch
call instead of one numpy call per clip: the same numbers (max abs difference ~1e-5 on log-mel),
several times faster on a CPU, and it runs on the GPU when handed a GPU tensor.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from whisper_train.audio import load_audio
from whisper_train.data import Example
from whisper_train.errors import AudioError

log = logging.getLogger(__name__)


class LogMel:
    """Batched Whisper log-mel features matching a `WhisperFeatureExtractor`.

    Audio is zero-padded (or cut) to the extractor's window, `n_samples` (30 s x 16 kHz =
    480,000 samples), giving `n_samples // hop_length` frames (3000).
    """

    def __init__(self, feature_extractor, device: torch.device | str | None = None):
        self.n_fft = feature_extractor.n_fft  # 400 samples = 25 ms
        self.hop_length = feature_extractor.hop_length  # 160 samples = 10 ms
        self.n_samples = feature_extractor.n_samples  # chunk_length * 16 kHz
        self.device = torch.device(device or "cpu")
        self.window = torch.hann_window(self.n_fft, device=self.device)
        # (n_freq=201, n_mels) in the extractor; stored transposed for mel = filters @ power.
        self.mel_filters = torch.as_tensor(
            np.asarray(feature_extractor.mel_filters).T, dtype=torch.float32, device=self.device
        )

    def pad(self, clips: Sequence[np.ndarray]) -> torch.Tensor:
        """list of 1-D float32 arrays → (batch, n_samples), zero-padded or cut."""
        batch = torch.zeros(len(clips), self.n_samples, dtype=torch.float32)
        for row, clip in enumerate(clips):
            n = min(len(clip), self.n_samples)
            batch[row, :n] = torch.from_numpy(np.ascontiguousarray(clip[:n], dtype=np.float32))
        return batch

    @torch.no_grad()
    def __call__(self, audio: torch.Tensor | Sequence[np.ndarray]) -> torch.Tensor:
        """(batch, n_samples) waveforms (or a list of clips) → (batch, n_mels, n_frames)."""
        if not isinstance(audio, torch.Tensor):
            audio = self.pad(audio)
        audio = audio.to(self.device, torch.float32)
        stft = torch.stft(
            audio, self.n_fft, self.hop_length, window=self.window, return_complex=True
        )
        stft = stft[..., :-1]  # drop the last frame, as Whisper does
        # |z|^2 without the square root inside abs(): the same values, half the time.
        power = stft.real.square() + stft.imag.square()
        log_spec = torch.clamp(self.mel_filters @ power, min=1e-10).log10()
        # Dynamic range of 80 dB below each clip's loudest bin, then scale to about [-1, 1].
        peak = log_spec.amax(dim=(1, 2), keepdim=True)
        log_spec = torch.maximum(log_spec, peak - 8.0)
        return (log_spec + 4.0) / 4.0


@dataclass
class Skipped:
    """A clip that could not be used, carried through the loader so the loop can count it."""

    origin: str
    reason: str


class SpeechDataset(Dataset):
    """Examples → {"audio", "tokens", "n_prefix", "text", "index"}; a bad clip → `Skipped`.

    Audio is decoded here (in data-loader workers when there are any); features are computed per
    batch by the collator or on the accelerator, which is far cheaper than per clip.
    """

    def __init__(
        self, examples: Sequence[Example], label_encoder, *, augmenter=None, seed: int = 0
    ):
        self.examples = list(examples)
        self.label_encoder = label_encoder
        self.augmenter = augmenter
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Timestamp mixing and augmentation differ per epoch but repeat for a given seed."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict | Skipped:
        example = self.examples[index]
        rng = random.Random(f"{self.seed}:{self.epoch}:{index}")
        try:
            audio = load_audio(example.audio, start=example.start, end=example.end)
        except AudioError as exc:
            return Skipped(example.origin or example.audio, exc.reason)
        if self.augmenter is not None:
            audio = self.augmenter(audio, rng)
        tokens, n_prefix = self.label_encoder.encode(example, rng=rng)
        return {
            "audio": audio,
            "tokens": tokens,
            "n_prefix": n_prefix,
            "text": example.text,
            "index": index,
        }
