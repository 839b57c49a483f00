"""From examples to model inputs: batched log-mel features and the training dataset.

Whisper's log-mel spectrogram (`WhisperFeatureExtractor`) is computed here with torch, skipping
the STFT of the silence that pads every clip to 30 s: the same numbers (max abs difference ~1e-5
on log-mel), several times faster on a CPU, and on the GPU when training runs there.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from whisper_train.audio import HOP_LENGTH, N_FRAMES, load_audio
from whisper_train.data.examples import Example, PackedExamples, Skip, decode_skip, is_nonspeech
from whisper_train.data.packing import PackedWindow
from whisper_train.data.screening import clip_problem
from whisper_train.errors import AudioError

log = logging.getLogger(__name__)


class LogMel:
    """Whisper log-mel features, equal to a `WhisperFeatureExtractor`'s (max abs diff ~1e-5).

    Audio is zero-padded (or cut) to the extractor's window, `n_samples` (30 s x 16 kHz =
    480,000 samples), giving `n_samples // hop_length` frames (3000). Two things make this
    faster than the extractor without changing a number:

    - Padding is silence, and silence has a known spectrogram: a frame whose 25 ms window lies
      wholly after a clip's last non-zero sample has zero power, so its log-mel is the floor
      value. Only the frames that see audio go through the STFT (a 5 s clip: 1/6 of them).
    - On a CPU, clips go through the STFT one at a time and no 30 s padded copy is made: one
      clip's spectrum (~5 MB) stays in cache where a batch's does not. On a GPU the batch is
      one call, padding and all.
    """

    def __init__(self, feature_extractor, device: torch.device | str | None = None):
        self.n_fft = feature_extractor.n_fft  # 400 samples = 25 ms
        self.hop_length = feature_extractor.hop_length  # 160 samples = 10 ms
        self.n_samples = feature_extractor.n_samples  # chunk_length * 16 kHz
        self.n_frames = self.n_samples // self.hop_length
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
        n_mels = self.mel_filters.shape[0]
        if self.device.type != "cpu":
            if not isinstance(audio, torch.Tensor):
                audio = self.pad(audio)
            audio = audio.to(self.device, torch.float32)
            features = torch.empty(len(audio), n_mels, self.n_frames, device=self.device)
            return self._log_mel_into(features, audio, self.n_frames)
        features = torch.empty(len(audio), n_mels, self.n_frames)
        for row, clip in enumerate(audio):
            clip = torch.as_tensor(clip[: self.n_samples], dtype=torch.float32)
            n_active = self._frames_with_audio(_audio_end(clip.numpy()))
            self._log_mel_into(features[row : row + 1], clip[None], n_active)
        return features

    def _frames_with_audio(self, end: int) -> int:
        """How many leading frames see a sample before `end`; every later frame is silence.

        Frame t is centred on sample t * hop and sees [t*hop - n_fft/2, t*hop + n_fft/2).
        """
        if end == 0:
            return 0
        return min(self.n_frames, -(-(end + self.n_fft // 2) // self.hop_length))

    def _log_mel_into(self, out: torch.Tensor, audio: torch.Tensor, n_active: int) -> torch.Tensor:
        """Log-mel of (batch, samples) waveforms into `out` (batch, n_mels, n_frames), with the
        STFT run on the first `n_active` frames only: the rest are silence."""
        # log10 of the mel power clamped at 1e-10: what a silent frame comes to.
        out.fill_(-10.0)
        if n_active > 0:
            # Samples for frames [0, n_active): the last one ends before (n_active - 1) * hop +
            # n_fft / 2, so the STFT's reflection at the right-hand end never reaches them.
            n_samples = min(self.n_samples, (n_active - 1) * self.hop_length + self.n_fft)
            audio = audio[:, :n_samples]
            audio = torch.nn.functional.pad(audio, (0, n_samples - audio.shape[1]))
            stft = torch.stft(
                audio, self.n_fft, self.hop_length, window=self.window, return_complex=True
            )
            # Whisper drops the STFT's last frame (3001 → 3000); n_active <= n_frames does too.
            stft = stft[..., :n_active]
            # |z|^2 without the square root inside abs(): the same values, half the time.
            power = stft.real.square() + stft.imag.square()
            out[..., :n_active] = torch.clamp(self.mel_filters @ power, min=1e-10).log10()
        # Dynamic range of 80 dB below each clip's loudest bin, then scale to about [-1, 1].
        peak = out.amax(dim=(1, 2), keepdim=True)
        torch.maximum(out, peak - 8.0, out=out)
        return out.add_(4.0).div_(4.0)


def content_frames(clips: Sequence) -> list[int]:
    """The frames of each clip's own audio in its window: len // hop, at most the window's 3000
    (openai-whisper's `content_frames`), the log-mel frames the runtimes keep before padding."""
    return [min(N_FRAMES, len(clip) // HOP_LENGTH) for clip in clips]


def runtime_padded(features: torch.Tensor, frames: Sequence[int]) -> torch.Tensor:
    """`features` (batch, n_mels, 3000) with every frame past row i's `frames[i]` set to 0: the
    padding openai-whisper and faster-whisper give a window (their `pad_or_trim` of the log-mel),
    where transformers' feature extractor, and so training, pads the audio with zeros (those
    frames at the log-mel's floor). A new tensor; `features` is left alone."""
    padded = features.clone()
    for row, end in enumerate(frames):
        padded[row, :, end:] = 0.0
    return padded


def _audio_end(samples: np.ndarray, block: int = 16_000) -> int:
    """One past the last non-zero sample (0 for silence), scanning back one second at a time:
    trailing padding can be long, and this allocates no index array for the whole clip."""
    for stop in range(len(samples), 0, -block):
        nonzero = np.flatnonzero(samples[max(0, stop - block) : stop])
        if len(nonzero):
            return max(0, stop - block) + int(nonzero[-1]) + 1
    return 0


class SpeechDataset(Dataset):
    """Examples → {"audio", "tokens", "n_prefix", "text", "index"}; a bad clip → a `Skip`.

    Audio is decoded here (in data-loader workers when there are any); features are computed per
    batch by the collator or on the accelerator, which is far cheaper than per clip. Each clip's
    header is checked first (`data.clip_problem`: it exists, decodes, lasts at most 30 s, holds
    its window): a corpus screened without reading headers is checked here, clip by clip, and a
    missing or two-hour file is skipped before anything is decoded.

    An index is a clip's position, or `(epoch, item)` where item is a clip's position or a tuple
    of them: a packed window (`packing`), its clips joined by `gap_seconds` of silence and its
    label their transcripts in order (`packing.PackedWindow`). The epoch
    travels with the index because the training data source's batch sampler runs in the main
    process: loader workers (persistent or not) then
    draw augmentation and timestamp forms from (seed, epoch, clip), never from a stale copy.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        label_encoder,
        *,
        augmenter=None,
        seed: int = 0,
        gap_seconds: float = 0.3,
        padding_stride: int = 0,
        riders: bool = False,
        cached=None,
        packing_timestamps: bool = False,
        per_clip: bool = False,
        prompter=None,
    ):
        # Packed: the forked loader workers read it without each copying it (PackedExamples).
        self.examples = (
            examples if isinstance(examples, PackedExamples) else PackedExamples(examples)
        )
        self.label_encoder = label_encoder
        self.augmenter = augmenter
        self.seed = seed
        self.epoch = 0
        self.gap_seconds = gap_seconds
        self.padding_stride = padding_stride  # packing.own_padding_seconds
        # --nonspeech's clips ride in the windows, their padding coarser (`packing.plan_windows`)
        self.riders = riders
        # --packing-timestamps on: a packed window of 2+ clips is always labelled with times
        self.packing_timestamps = packing_timestamps
        # --packing per-clip: a window's clips keep their own labels (`memory.clip_attention`)
        self.per_clip = per_clip
        # example → whether the frozen encoder's output for it is on disk (`encoder_cache`):
        # such a clip needs neither its header read nor its audio decoded.
        self.cached = cached
        # --prompt-probability: a `prompts.Prompter` puts previous text before some labels
        self.prompter = prompter

    def set_epoch(self, epoch: int) -> None:
        """The epoch of plain integer indices (evaluation); training indices carry their own."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index) -> dict | Skip:
        epoch = self.epoch
        if isinstance(index, tuple):
            epoch, index = index
        if isinstance(index, tuple):
            return self._window(index, epoch)
        if self.cached is not None and self.augmenter is None and self.cached(self.examples[index]):
            example = self.examples[index]
            rng = random.Random(f"{self.seed}:{epoch}:{index}")
            tokens, n_prefix = self._label(index, epoch, rng)
            return {
                "audio": None,  # the collator reads the encoder's output instead
                "tokens": tokens,
                "n_prefix": n_prefix,
                "text": example.text,
                "index": index,
            }
        clip = self._clip(index, epoch)
        if isinstance(clip, Skip):
            return clip
        audio, rng = clip
        tokens, n_prefix = self._label(index, epoch, rng)
        return {
            "audio": audio,
            "tokens": tokens,
            "n_prefix": n_prefix,
            "text": self.examples[index].text,
            "index": index,
        }

    def _label(self, index: int, epoch: int, rng: random.Random) -> tuple[list[int], int]:
        """(tokens, n_prefix) of clip `index`: its label, prompted with its previous text when
        the prompter draws it."""
        example = self.examples[index]
        tokens, n_prefix = self.label_encoder.encode(example, rng=rng)
        if self.prompter is None:
            return tokens, n_prefix
        return self.prompter.prompted(
            tokens, n_prefix, example.previous_text, index=index, epoch=epoch
        )

    def _clip(self, index: int, epoch: int) -> tuple[np.ndarray, random.Random] | Skip:
        """One clip's audio, augmented, and the random draws it seeds; or why it is unusable."""
        example = self.examples[index]
        rng = random.Random(f"{self.seed}:{epoch}:{index}")
        problem = clip_problem(example)
        if problem is not None:
            return problem
        try:
            audio = load_audio(example.audio, start=example.start, end=example.end)
        except AudioError as exc:  # undecodable, or NaN/inf samples that would poison a batch
            return decode_skip(example.origin or example.audio, exc)
        if self.augmenter is not None:
            audio = self.augmenter(audio, rng)
        return audio, rng

    def _window(self, indices: tuple[int, ...], epoch: int) -> dict:
        """A packed window: the usable clips of `indices` (each augmented on its own) joined by
        silence, labelled with their transcripts in order; `skipped` lists the others."""
        if len(indices) == 1 and not self.per_clip:  # that clip, label and all
            item = self[(epoch, indices[0])]
            return item if isinstance(item, Skip) else {**item, "skipped": []}
        window, skipped, rng, first = (
            PackedWindow(self.gap_seconds, self.padding_stride),
            [],
            None,
            None,
        )
        clips = []  # per clip: its own label, as unpacked (--packing per-clip)
        for index in indices:
            clip = self._clip(index, epoch)
            if isinstance(clip, Skip):
                skipped.append(clip)
                continue
            audio, clip_rng = clip
            rider = self.riders and is_nonspeech(self.examples[index])
            if not window.fits(audio, rider=rider):  # planned lengths are headers': a guard
                skipped.append(
                    Skip(self.examples[index].origin, "no room left in its packed window")
                )
                continue
            window.add(audio, self.examples[index].text, rider=rider)
            rng = rng or clip_rng
            first = index if first is None else first
            if self.per_clip:
                tokens, n_prefix = self._label(index, epoch, clip_rng)
                clips.append(
                    {
                        "tokens": tokens,
                        "n_prefix": n_prefix,
                        "text": self.examples[index].text,
                        "index": index,
                        "seconds": window.spans[-1],
                    }
                )
        if not len(window):
            return {"skipped": skipped}
        if self.per_clip:
            return {
                "audio": window.audio(),
                "clips": clips,
                "index": indices[0],
                "skipped": skipped,
            }
        item = window.item(
            self.label_encoder,
            language=self.examples[indices[0]].language,
            rng=rng,
            packing_timestamps=self.packing_timestamps,
        )
        if self.prompter is not None:  # what precedes the window: its first clip's previous text
            item["tokens"], item["n_prefix"] = self.prompter.prompted(
                item["tokens"],
                item["n_prefix"],
                self.examples[first].previous_text,
                index=first,
                epoch=epoch,
            )
        return {**item, "index": indices[0], "skipped": skipped}
