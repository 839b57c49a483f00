"""A tiny multilingual Whisper built offline: tokenizer, model, processor, generation config.

The hub's multilingual tokenizers cannot be downloaded here, so this one is built from
scratch with the same special-token layout as OpenAI's (only the BPE is trivial: one token per
byte, no merges):

    0-255       the 256 byte tokens
    256         <|endoftext|>
    257         <|startoftranscript|>
    258-357     the 100 language tokens, in transformers' LANGUAGES order (the order matters:
                transformers computes a language id as SOT + 1 + its index there)
    358, 359    <|translate|>, <|transcribe|>
    360-362     <|startoflm|>, <|startofprev|>, <|nocaptions|>
    363         <|notimestamps|>
    364-1864    <|0.00|> ... <|30.00|>

Time tokens are ordinary added tokens after the last special one, as in the hub's files, so
transformers' timestamp decoding (`timestamp_begin = last special id + 1`) finds them.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from tiny_models import tiny_whisper_config
from tokenizers.pre_tokenizers import ByteLevel
from transformers import (
    GenerationConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
    WhisperTokenizer,
)
from transformers.models.whisper.tokenization_whisper import LANGUAGES

EOT = 256
SOT = 257
TRANSLATE, TRANSCRIBE = 358, 359
NO_TIMESTAMPS = 363
TIMESTAMP_BEGIN = 364
N_TIME_TOKENS = 1501  # <|0.00|> ... <|30.00|> in 20 ms steps
MULTILINGUAL_VOCAB = TIMESTAMP_BEGIN + N_TIME_TOKENS  # 1865

SPECIAL_TOKENS = [
    "<|startoftranscript|>",
    *[f"<|{code}|>" for code in LANGUAGES],
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nocaptions|>",
    "<|notimestamps|>",
]


def multilingual_tokenizer() -> WhisperTokenizer:
    """A byte-level Whisper tokenizer with the multilingual special tokens (vocab 1865)."""
    byte_tokens = sorted(ByteLevel.alphabet())
    vocab = {token: index for index, token in enumerate(byte_tokens)}
    vocab["<|endoftext|>"] = EOT
    with tempfile.TemporaryDirectory() as folder:
        # Written as files and read back with from_pretrained: the constructor's arguments
        # differ between transformers 4.x (file paths) and 5.x (in-memory vocab).
        Path(folder, "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
        Path(folder, "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
        tokenizer = WhisperTokenizer.from_pretrained(folder, pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.add_tokens([f"<|{index * 0.02:.2f}|>" for index in range(N_TIME_TOKENS)])
    assert len(tokenizer) == MULTILINGUAL_VOCAB
    assert tokenizer.convert_tokens_to_ids("<|de|>") == SOT + 1 + list(LANGUAGES).index("de")
    return tokenizer


def multilingual_generation_config(max_length: int = 448) -> GenerationConfig:
    """What the hub's multilingual checkpoints ship: language/task maps, timestamp settings."""
    return GenerationConfig(
        decoder_start_token_id=SOT,
        eos_token_id=EOT,
        pad_token_id=EOT,
        bos_token_id=EOT,
        no_timestamps_token_id=NO_TIMESTAMPS,
        is_multilingual=True,
        lang_to_id={f"<|{code}|>": SOT + 1 + index for index, code in enumerate(LANGUAGES)},
        task_to_id={"translate": TRANSLATE, "transcribe": TRANSCRIBE},
        max_initial_timestamp_index=50,
        max_length=max_length,
        begin_suppress_tokens=[220, EOT],
        suppress_tokens=[],
    )


def make_tiny_multilingual_whisper(
    *,
    seed: int = 0,
    d_model: int = 64,
    encoder_layers: int = 2,
    decoder_layers: int = 2,
    chunk_seconds: int = 30,
) -> tuple[WhisperForConditionalGeneration, WhisperProcessor]:
    """A seeded random multilingual Whisper (d_model 64, 2+2 layers, dropout off).

    `chunk_seconds` below 30 shrinks the audio window (and the encoder's work) for fast tests;
    the encoder takes exactly 100 frames a second, i.e. 50 positions a second after its stride-2
    convolution.
    """
    config = tiny_whisper_config(
        vocab_size=MULTILINGUAL_VOCAB,
        end_of_text_id=EOT,
        start_of_transcript_id=SOT,
        d_model=d_model,
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        max_source_positions=50 * chunk_seconds,
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config)
    model.generation_config = multilingual_generation_config()
    processor = WhisperProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=80, chunk_length=chunk_seconds),
        tokenizer=multilingual_tokenizer(),
    )
    return model.eval(), processor
