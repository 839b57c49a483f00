"""The real tiny.en, read from its CTranslate2 folder by our own reader, understands speech.

A reader that put one tensor in the wrong place would still load; only transcribing real speech
shows that the model works. Measured here (espeak-ng voice en-us, these three sentences):
normalised WER 0.094 (3 errors in 32 words, all in the first sentence), identical greedy tokens
from ctranslate2. `pytest tests/test_tiny_en.py -s` prints the measured figures again.
"""

from __future__ import annotations

import ctranslate2
import jiwer
import pytest
import torch
from tiny_models import tiny_en_dir
from whisper_normalizer.english import EnglishTextNormalizer

from whisper_train.audio import SAMPLE_RATE
from whisper_train.ct2 import load_ct2_whisper
from whisper_train.synth import synthesize

SENTENCES = (
    "The weather is nice today, so we will walk to the park.",
    "Please bring me a cup of coffee and two slices of bread.",
    "The children are playing football in the garden.",
)
# About three times the measured 0.094; a wrongly imported model scores near 1.0.
MAX_WER = 0.30


@pytest.fixture(scope="module")
def transcribed():
    """(input features [3, 80, 3000], HF greedy token ids per sentence, processor)."""
    model, processor = load_ct2_whisper(tiny_en_dir())
    audio = [synthesize(sentence, voice="en-us") for sentence in SENTENCES]
    features = processor.feature_extractor(
        audio, sampling_rate=SAMPLE_RATE, return_tensors="pt"
    ).input_features
    with torch.no_grad():
        generated = model.generate(features)
    eot = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    # transformers returns the new tokens only, padded with <|endoftext|> in a batch.
    token_ids = [[t for t in row.tolist() if t != eot] for row in generated]
    return features, token_ids, processor


def test_tiny_en_transcribes_synthesised_english(transcribed):
    _, token_ids, processor = transcribed
    hypotheses = processor.tokenizer.batch_decode(token_ids, skip_special_tokens=True)
    normalise = EnglishTextNormalizer()
    wer = jiwer.wer([normalise(s) for s in SENTENCES], [normalise(h) for h in hypotheses])
    print(f"tiny.en on espeak-ng en-us: WER {wer:.3f}", hypotheses)
    assert wer <= MAX_WER


def test_greedy_transcripts_match_ctranslate2_on_the_same_features(transcribed):
    features, token_ids, processor = transcribed
    tokenizer = processor.tokenizer
    prompt = tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|notimestamps|>"])
    # ctranslate2 runs the same float16 weights in float32 on a CPU, as our import does.
    reference = ctranslate2.models.Whisper(str(tiny_en_dir()), device="cpu", compute_type="float32")
    results = reference.generate(
        ctranslate2.StorageView.from_array(features.numpy()),
        [prompt] * len(SENTENCES),
        beam_size=1,
    )
    assert token_ids == [result.sequences_ids[0] for result in results]
