"""Batching: pad labels per batch, mask what the model must not be trained to predict.

A token sequence from `LabelEncoder.encode` runs from <|startoftranscript|> to <|endoftext|>:

    tokens            SOT  <|en|>  <|transcribe|>  <|notimestamps|>  " Hello"  " world"  EOT
    decoder_input_ids SOT  <|en|>  <|transcribe|>  <|notimestamps|>  " Hello"  " world"
    labels            -100 -100    -100            " Hello"          " world"  EOT

Position i of the decoder input predicts label i. The prefix (language, task, timestamp mode)
is given at inference time, never predicted, so its labels are masked with -100 and carry no
loss; padding is masked too. Labels are padded to the longest in the batch, not to 448.
A prompted label (`prompts`, --prompt-probability) starts with <|startofprev|> and the previous
text before SOT, and its prefix length counts them: given, never predicted, they are masked too.

Two exceptions. `language_targets`: a run that adds a language (--new-language) must teach the
decoder to name it after SOT, which is all language detection reads, so there the language
token is a target (as in Whisper's own pretraining), for every clip's language alike (the
others' keep their detection calibrated against the new one); the rest of the prefix stays
masked. `nospeech_target`: a clip where nobody speaks (--nonspeech), whose label is the
prefix and <|endoftext|>, is taught <|nospeech|> after SOT as well, the probability the
no-speech test reads (`labels.BOTH_FORM`):

    tokens            SOT  <|notimestamps|>  EOT
    decoder_input_ids SOT  <|notimestamps|>
    labels            <|nospeech|>  EOT
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import torch

from whisper_train.audio import CHUNK_LENGTH, ENCODER_POSITIONS
from whisper_train.data.examples import Skip
from whisper_train.data.features import LogMel, content_frames
from whisper_train.data.labels import decoder_positions

IGNORE_INDEX = -100  # ignored by torch's cross-entropy
ENCODER_POSITIONS_PER_SECOND = ENCODER_POSITIONS / CHUNK_LENGTH  # 50: one per 2 mel frames


def encoder_positions(start: float, end: float) -> tuple[int, int]:
    """The encoder positions [first, last + 1) that hold audio from `start` to `end` seconds of
    a window: every position a sample of the clip reaches, none beyond the window's."""
    first = math.floor(start * ENCODER_POSITIONS_PER_SECOND)
    last = math.ceil(end * ENCODER_POSITIONS_PER_SECOND)
    return first, max(first + 1, min(last, ENCODER_POSITIONS))


class SpeechCollator:
    """Items from `SpeechDataset` → a batch dict; `Skip` items are dropped and reported, as
    are the clips a packed window lists under `skipped`.

    The batch holds `decoder_input_ids`, `labels` (batch, max_len), `texts`, `indices`,
    `skipped` (list of `Skip`), and `input_features` (batch, n_mels, n_frames) when given a
    `LogMel`, else the `audio` arrays.
    """

    def __init__(
        self,
        pad_token_id: int,
        *,
        log_mel: LogMel | None = None,
        language_targets: Collection[int] = (),
        nospeech_target: int | None = None,
    ):
        self.pad_token_id = pad_token_id
        # The target after SOT of a label whose body is empty (a clip where nobody speaks,
        # never prompted: SOT is its first token); None: masked like any prefix.
        self.nospeech_target = nospeech_target
        self.log_mel = log_mel
        # The ids of the language tokens predicted after SOT, not masked (none: all masked).
        self.language_targets = frozenset(language_targets)

    def __call__(self, items: Sequence[dict | Skip]) -> dict:
        skipped = [item for item in items if isinstance(item, Skip)]
        good = [item for item in items if not isinstance(item, Skip)]
        # A packed window lists the clips it lost; one that lost them all holds nothing else.
        skipped += [skip for item in good for skip in item.get("skipped", ())]
        good = [item for item in good if "tokens" in item or "clips" in item]
        batch: dict = {"skipped": skipped, "size": len(good)}
        if not good:
            return batch
        if "clips" in good[0]:  # packed windows whose clips are decoded one by one
            return self._per_clip(batch, good)
        batch.update(
            self.pad_labels([item["tokens"] for item in good], [item["n_prefix"] for item in good])
        )
        batch["texts"] = [item["text"] for item in good]
        batch["indices"] = torch.tensor([item["index"] for item in good])
        audio = [item["audio"] for item in good]
        if self.log_mel is not None:
            batch["input_features"] = self.log_mel(audio)
            batch["content_frames"] = content_frames(audio)
        else:
            batch["audio"] = audio
        return batch

    def _per_clip(self, batch: dict, windows: list[dict]) -> dict:
        """Packed windows decoded clip by clip (`memory.clip_attention`): the windows' features,
        and each clip's own label with the window it is in and its encoder positions there."""
        clips = [clip for window in windows for clip in window["clips"]]
        batch.update(self.pad_labels([c["tokens"] for c in clips], [c["n_prefix"] for c in clips]))
        batch["texts"] = [clip["text"] for clip in clips]
        batch["indices"] = torch.tensor([clip["index"] for clip in clips])
        batch["clip_windows"] = torch.tensor(
            [row for row, window in enumerate(windows) for _ in window["clips"]]
        )
        batch["clip_positions"] = torch.tensor(
            [encoder_positions(*clip["seconds"]) for clip in clips], dtype=torch.long
        )
        audio = [window["audio"] for window in windows]
        if self.log_mel is not None:
            batch["input_features"] = self.log_mel(audio)
        else:
            batch["audio"] = audio
        return batch

    def pad_labels(self, sequences: Sequence[list[int]], n_prefix: Sequence[int]) -> dict:
        """Token sequences → right-padded `decoder_input_ids` and masked `labels`."""
        width = max(decoder_positions(len(tokens)) for tokens in sequences)
        decoder_input_ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(sequences), width), IGNORE_INDEX, dtype=torch.long)
        for row, (tokens, prefix) in enumerate(zip(sequences, n_prefix, strict=True)):
            tokens = torch.as_tensor(tokens, dtype=torch.long)
            decoder_input_ids[row, : len(tokens) - 1] = tokens[:-1]
            labels[row, : len(tokens) - 1] = tokens[1:]
            # labels[j] is tokens[j + 1]: the prefix after SOT sits at labels[: prefix - 1].
            labels[row, : prefix - 1] = IGNORE_INDEX
            for j in range(prefix - 1) if self.language_targets else ():
                if int(tokens[j + 1]) in self.language_targets:
                    labels[row, j] = tokens[j + 1]
            if self.nospeech_target is not None and len(tokens) == prefix + 1:
                labels[row, 0] = self.nospeech_target
        return {"decoder_input_ids": decoder_input_ids, "labels": labels}
