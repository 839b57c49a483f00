"""Log-mel features equal Whisper's; labels are masked exactly where no loss belongs."""

from __future__ import annotations

import numpy as np
import torch
from transformers import WhisperFeatureExtractor

from whisper_train.data.collate import IGNORE_INDEX, SpeechCollator
from whisper_train.data.examples import Example, Skip
from whisper_train.data.features import LogMel, SpeechDataset
from whisper_train.data.labels import LabelEncoder


def test_batched_log_mel_matches_whisper_feature_extractor():
    rng = np.random.default_rng(0)
    clips = [
        (0.3 * rng.standard_normal(n)).astype(np.float32)
        for n in (16_000, 5 * 16_000, 30 * 16_000, 31 * 16_000)  # short, medium, full, too long
    ]
    for n_mels in (80, 128):
        extractor = WhisperFeatureExtractor(feature_size=n_mels)
        expected = extractor(clips, sampling_rate=16_000, return_tensors="np").input_features
        ours = LogMel(extractor)(clips).numpy()
        assert ours.shape == expected.shape == (4, n_mels, 3000)
        assert np.abs(ours - expected).max() <= 1e-3


def test_log_mel_skips_silence_without_changing_a_number():
    """Frames after a clip's last non-zero sample skip the STFT; their values must still be the
    extractor's, at every boundary: audio ending on, just before and just after a frame edge,
    trailing digital silence inside the clip, a nearly full window, one sample, all zeros and
    a clip too quiet to reach the 80 dB floor."""
    rng = np.random.default_rng(1)

    def noise(n, scale=0.3):
        return (scale * rng.standard_normal(n)).astype(np.float32)

    clips = [
        noise(160 * 50),  # ends on a frame centre
        noise(160 * 50 - 1),
        noise(160 * 50 + 201),  # one sample past a window's half width
        np.concatenate([noise(16_000), np.zeros(32_000, np.float32)]),  # silence inside the clip
        noise(30 * 16_000 - 150),  # the last frames see audio through the reflection
        noise(1),
        np.zeros(16_000, np.float32),
        noise(16_000, scale=1e-7),  # quieter than the 1e-10 power floor
    ]
    extractor = WhisperFeatureExtractor(feature_size=80)
    expected = extractor(clips, sampling_rate=16_000, return_tensors="np").input_features
    log_mel = LogMel(extractor)
    from_clips = log_mel(clips).numpy()
    from_tensor = log_mel(log_mel.pad(clips)).numpy()
    for row, clip in enumerate(clips):
        assert np.abs(from_clips[row] - expected[row]).max() <= 1e-4, f"clip {row} ({len(clip)})"
    np.testing.assert_array_equal(from_tensor, from_clips)


def test_collator_masks_prefix_and_padding(tiny_whisper):
    _, processor = tiny_whisper
    tokenizer = processor.tokenizer
    encoder = LabelEncoder(tokenizer, multilingual=False)
    short = Example(audio="a.wav", text="hello")
    long = Example(audio="b.wav", text="hello there my friend")
    seqs = [encoder.encode(short), encoder.encode(long)]
    collator = SpeechCollator(tokenizer.pad_token_id)
    batch = collator.pad_labels([s[0] for s in seqs], [s[1] for s in seqs])
    ids_short, prefix = seqs[0]
    sot, notimestamps = tokenizer.convert_tokens_to_ids(
        ["<|startoftranscript|>", "<|notimestamps|>"]
    )
    assert ids_short[:2] == [sot, notimestamps] and prefix == 2
    labels, inputs = batch["labels"], batch["decoder_input_ids"]
    width = len(seqs[1][0]) - 1
    assert labels.shape == inputs.shape == (2, width)
    # Decoder input is the sequence without its last token; labels are it shifted by one.
    assert inputs[0, : len(ids_short) - 1].tolist() == ids_short[:-1]
    # The prefix after SOT (<|notimestamps|>) is masked; the text and <|endoftext|> are not.
    assert labels[0, 0].item() == IGNORE_INDEX
    assert labels[0, 1 : len(ids_short) - 1].tolist() == ids_short[2:]
    assert labels[0, len(ids_short) - 2].item() == tokenizer.eos_token_id
    # Padding: -100 in labels, the pad token in the decoder input.
    assert (labels[0, len(ids_short) - 1 :] == IGNORE_INDEX).all()
    assert (inputs[0, len(ids_short) - 1 :] == tokenizer.pad_token_id).all()
    assert (labels[1] != IGNORE_INDEX).sum().item() == len(seqs[1][0]) - 2


def test_bad_clip_becomes_a_counted_skip_not_a_crash(tmp_path, tiny_whisper):
    _, processor = tiny_whisper
    import soundfile as sf

    good = tmp_path / "good.wav"
    sf.write(good, np.zeros(8000, dtype=np.float32), 16_000)
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF not really a wav")
    examples = [
        Example(audio=str(good), text="one"),
        Example(audio=str(broken), text="two", origin="m.csv:3"),
    ]
    dataset = SpeechDataset(examples, LabelEncoder(processor.tokenizer, multilingual=False))
    collator = SpeechCollator(
        processor.tokenizer.pad_token_id, log_mel=LogMel(processor.feature_extractor)
    )
    batch = collator([dataset[0], dataset[1]])
    assert batch["size"] == 1 and batch["texts"] == ["one"]
    assert isinstance(batch["skipped"][0], Skip) and batch["skipped"][0].origin == "m.csv:3"
    assert batch["input_features"].shape == (1, 80, 3000)
    assert torch.isfinite(batch["input_features"]).all()
