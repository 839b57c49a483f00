"""Languages on a multilingual Whisper, with seeded tiny models: one decode per window (the
fallback's crash on transformers 5.24), language detection per clip, per-set languages.

The same behaviour on OpenAI's real multilingual base is in tests/test_multilingual_base.py.
"""

from __future__ import annotations

import torch
from multilingual import EOT, TIMESTAMP_BEGIN, make_tiny_multilingual_whisper
from transformers.modeling_outputs import BaseModelOutput

from whisper_train.decoding import DecodingOptions, generate_decoded

CHUNK_SECONDS = 2  # a 2 s window: 200 mel frames, 100 encoder positions


def timestamp_loving_whisper():
    """A tiny multilingual Whisper whose decoder says the same thing at every step, whatever it
    hears: 'a' (logit 2), <|1.00|> (1.8), <|endoftext|> (1.5), anything else -10.

    Greedy decoding writes 'a' until max_length (a loop: the fallback must decode again); at
    temperatures near 1 some rows sample a pair of time tokens mid-text, which transformers'
    generate reads as a segment that ends at 1.00 s, and others end at once.
    """
    model, processor = make_tiny_multilingual_whisper(seed=0, chunk_seconds=CHUNK_SECONDS)
    letter = processor.tokenizer.convert_tokens_to_ids("a")
    one_second = TIMESTAMP_BEGIN + 50
    with torch.no_grad():
        decoder = model.model.decoder
        decoder.layer_norm.weight.zero_()  # every position's output is the bias: e0
        decoder.layer_norm.bias.zero_()
        decoder.layer_norm.bias[0] = 1.0
        embeddings = decoder.embed_tokens.weight  # tied with proj_out: logit i = E[i, 0]
        embeddings[:, 0] = -10.0
        embeddings[letter, 0], embeddings[one_second, 0], embeddings[EOT, 0] = 2.0, 1.8, 1.5
    model.generation_config.language = "en"
    model.generation_config.task = "transcribe"
    return model, processor


def test_the_fallback_decodes_one_window_per_call_from_encoder_outputs():
    """Issue 24's crash: the fallback passes encoder outputs to generate; when a sampled
    decode held a time-token pair, transformers 5.24 went on to a second window, dropped the
    finished rows from `input_features` (None) and raised TypeError in _maybe_reduce_batch.
    Each call is one 30 s window here: every row comes back, decoded once."""
    model, processor = timestamp_loving_whisper()
    letter = processor.tokenizer.convert_tokens_to_ids("a")
    features = torch.randn(6, 80, 100 * CHUNK_SECONDS)
    options = DecodingOptions(temperatures=(0.0, 0.6, 0.8, 1.0), logprob_threshold=None)
    for inputs in (
        {"input_features": features},
        {"encoder_outputs": BaseModelOutput(last_hidden_state=model.get_encoder()(features)[0])},
    ):
        decoded = generate_decoded(
            model, inputs, processor.tokenizer, max_length=60, options=options
        )
        assert len(decoded) == 6
        assert all(item.fallback for item in decoded)  # greedy looped: 'aaaa...'
        assert all(item.temperature > 0 for item in decoded)
        one_second = TIMESTAMP_BEGIN + 50
        assert any(one_second in item.tokens for item in decoded)  # the case that crashed
        # Each row's whole decode, time tokens and all, with every 'a' in its text.
        assert all(item.text == "a" * item.tokens.count(letter) for item in decoded)
