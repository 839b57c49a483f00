"""Silence: the no-speech probability and the test that empties a window's text
(whisper_train.transcription.decoding), everywhere whisper-train decodes."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from tiny_models import NO_TIMESTAMPS, SOT

from whisper_train.commands import evaluate as evaluate_command
from whisper_train.data.features import LogMel
from whisper_train.evaluation.evaluate import generate_texts
from whisper_train.transcription.decoding import (
    Decoded,
    DecodingOptions,
    decode_with_fallback,
    no_speech_probabilities,
    sot_logits,
)
from whisper_train.transcription.longform import _fallback_arguments

NO_SPEECH = NO_TIMESTAMPS - 1  # <|nocaptions|>, openai-whisper's <|nospeech|>


def _batch(processor, n=2):
    rng = np.random.default_rng(0)
    clips = [(0.1 * rng.standard_normal(16_000 * (i + 1))).astype(np.float32) for i in range(n)]
    return {"input_features": LogMel(processor.feature_extractor)(clips), "size": n}


def force_no_speech(model, rows=None, boost=40.0):
    """Raise the <|nospeech|> logit at the <|startoftranscript|> position only (of `rows`, or
    every row): what a model that hears silence does there. Every later position, the ones
    generate reads, is left alone."""

    def hook(module, args, kwargs, output):
        ids = kwargs.get("decoder_input_ids")
        if ids is None:
            return output
        at_sot = ids == SOT
        if rows is not None:
            keep = torch.zeros_like(at_sot)
            keep[rows] = True
            at_sot &= keep
        output.logits[..., NO_SPEECH] += boost * at_sot.to(output.logits.dtype)
        return output

    return model.register_forward_hook(hook, with_kwargs=True)


def test_the_no_speech_probability_is_the_softmax_at_the_start_of_transcript(tiny_whisper):
    """openai-whisper's `probs_at_sot`: one full decoder pass over its prompt, position 0."""
    model, processor = tiny_whisper
    force_no_speech(model, rows=[1], boost=14.0)
    inputs = {"input_features": _batch(processor)["input_features"]}
    ours = no_speech_probabilities(model, sot_logits(model, inputs))
    prompt = torch.tensor([[SOT, NO_TIMESTAMPS]] * 2)
    with torch.no_grad():
        logits = model(**inputs, decoder_input_ids=prompt).logits
    direct = torch.softmax(logits[:, 0].double(), dim=-1)[:, NO_SPEECH]
    # float32 softmax of logits of size ~10: agreement to float32's resolution of a probability.
    torch.testing.assert_close(
        torch.tensor(ours, dtype=torch.float64), direct, atol=1e-6, rtol=1e-5
    )
    assert ours[0] < 0.01 < 0.5 < ours[1]  # the forced row is the one that reads as silence


def test_a_clip_that_sounds_like_silence_gets_no_text_and_is_not_decoded_again(
    tiny_whisper, monkeypatch
):
    model, processor = tiny_whisper
    batch = _batch(processor)
    # One fallback temperature keeps it short (the random model's every decode is unlikely).
    options = DecodingOptions(temperatures=(0.0, 1.0))
    off = DecodingOptions(temperatures=(0.0, 1.0), no_speech_threshold=None)
    plain = generate_texts(model, processor, [batch], max_length=8, decoding=off)
    assert all(plain), "the random model writes text on noise"
    force_no_speech(model, rows=[0])
    calls = []
    generate = model.generate

    def counting(**kwargs):
        rows = kwargs["encoder_outputs"].last_hidden_state.shape[0]  # encoded once, reused
        calls.append((kwargs.get("temperature"), rows))
        return generate(**kwargs)

    monkeypatch.setattr(model, "generate", counting)
    details: list[Decoded] = []
    texts = generate_texts(
        model, processor, [batch], max_length=8, decoding=options, details=details
    )
    assert texts[0] == "" and texts[1]
    assert details[0].no_speech and details[0].no_speech_prob > 0.99
    assert details[0].tokens == () and details[0].passed
    assert not details[1].no_speech and details[1].no_speech_prob < 0.6
    # The random model's row 1 is unlikely and falls back; the silent row 0 is never decoded
    # again: every sampled call carries the one row.
    assert calls == [(None, 2), (1.0, 1)]
    assert details[0].temperature == 0.0 and not details[0].fallback and details[1].fallback
    report = details[0].report()
    assert report["no_speech"] is True and report["no_speech_prob"] > 0.99

    # Off: the same clip gets its text back, as before the test existed.
    monkeypatch.undo()
    assert generate_texts(model, processor, [batch], max_length=8, decoding=off)[0]


def _candidate(no_speech_prob, avg_logprob, text="thank you"):
    return Decoded(text, (1,), avg_logprob, 1.0, 0.0, no_speech_prob=no_speech_prob)


@pytest.mark.parametrize(
    ("no_speech_prob", "avg_logprob", "options", "silent"),
    [
        (0.9, -2.0, DecodingOptions(), True),
        (0.9, -0.2, DecodingOptions(), False),  # confident text despite the no-speech token
        (0.5, -2.0, DecodingOptions(), False),  # unlikely text, but speech: the fallback's case
        (0.9, -0.2, DecodingOptions(logprob_threshold=None), True),  # the probability alone
        (0.9, -2.0, DecodingOptions(no_speech_threshold=None), False),
        (0.7, -2.0, DecodingOptions(no_speech_threshold=0.8), False),
    ],
)
def test_silence_needs_both_tests_as_in_faster_whisper(
    no_speech_prob, avg_logprob, options, silent
):
    tries = []

    def decode(rows, temperature):
        tries.append(temperature)
        return [_candidate(no_speech_prob, avg_logprob)] * len(rows)

    (kept,) = decode_with_fallback(decode, 1, options)
    assert kept.no_speech is silent
    assert (kept.text == "") is silent
    if silent:
        assert tries == [0.0], "silence is not decoded again"


def test_the_flag_parses_and_turns_off():
    parser = argparse.ArgumentParser()
    evaluate_command.add_decoding_arguments(parser)
    assert evaluate_command.decoding_from_args(parser.parse_args([])).no_speech_threshold == 0.6
    args = parser.parse_args(["--no-speech-threshold", "off"])
    assert evaluate_command.decoding_from_args(args).no_speech_threshold is None
    args = parser.parse_args(["--no-speech-threshold", "0.8"])
    assert evaluate_command.decoding_from_args(args).no_speech_threshold == 0.8


def test_long_form_decoding_hands_the_same_test_to_generate():
    assert _fallback_arguments(DecodingOptions())["no_speech_threshold"] == 0.6
    greedy = _fallback_arguments(DecodingOptions(temperatures=(0.0,)))
    assert greedy == {"no_speech_threshold": 0.6, "logprob_threshold": -1.0}
    assert "no_speech_threshold" not in _fallback_arguments(
        DecodingOptions(no_speech_threshold=None)
    )
