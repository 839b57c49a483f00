"""Loop-proof decoding: the compression ratio and mean log-prob tests, and the temperature
fallback that re-decodes only the utterances that fail them (whisper_train.transcription.decoding)."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import soundfile
import torch
from transformers.generation.utils import GenerateEncoderDecoderOutput

from whisper_train.commands import evaluate as evaluate_command
from whisper_train.data.examples import Example
from whisper_train.data.features import LogMel
from whisper_train.errors import UserError
from whisper_train.evaluation.evaluate import evaluate_examples, generate_texts, write_report_json
from whisper_train.transcription.decoding import (
    NO_FALLBACK,
    Decoded,
    DecodingOptions,
    choose,
    compression_ratio,
    decoded_from_output,
    parse_temperatures,
    parse_threshold,
)

CLEAN = "The weather today is cold and windy with a chance of rain in the afternoon."
LOOP = "nod " * 50

# -- the two tests --------------------------------------------------------------------------


def test_compression_ratio_of_known_strings():
    assert compression_ratio(CLEAN) < 2.4
    assert compression_ratio("Please call Stella.") < 2.4
    assert compression_ratio(LOOP) > 2.4
    # A repeated phrase, as a hallucinating model writes it.
    assert compression_ratio("Thank you for watching. " * 12) > 2.4
    assert compression_ratio("") == 0.0
    # On the text's bytes (openai-whisper), not on token ids: 200 bytes / what zlib leaves.
    data = LOOP.encode()
    import zlib

    assert compression_ratio(LOOP) == len(data) / len(zlib.compress(data))


def test_flags_parse_and_refuse_nonsense():
    assert parse_temperatures("0,0.2,0.4,0.6,0.8,1.0") == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert parse_temperatures("0") == (0.0,)
    for bad in ("", "0,hot", "0,-0.2", "0,0.2,0"):
        with pytest.raises(UserError, match="--temperatures"):
            parse_temperatures(bad)
    assert parse_threshold("2.4", "--x") == 2.4
    assert parse_threshold("-1.0", "--x") == -1.0
    assert parse_threshold("none", "--x") is None and parse_threshold("OFF", "--x") is None
    with pytest.raises(UserError, match="--logprob-threshold"):
        parse_threshold("low", "--logprob-threshold")
    assert DecodingOptions().fallback
    assert not NO_FALLBACK.fallback
    assert not DecodingOptions(compression_ratio_threshold=None, logprob_threshold=None).fallback


def _decoded(text, avg_logprob, temperature):
    return Decoded(text, (), avg_logprob, compression_ratio(text), temperature)


def test_when_every_temperature_fails_the_likeliest_non_looping_try_is_kept():
    options = DecodingOptions()
    tries = [
        _decoded(LOOP, -0.1, 0.0),  # loops (likely, but repetitive)
        _decoded("a guess", -1.5, 0.2),
        _decoded("a better guess", -1.2, 0.4),
        _decoded("noise", -3.0, 1.0),
    ]
    assert choose(tries, options).text == "a better guess"
    # Every try loops: the likeliest of all.
    assert (
        choose([_decoded(LOOP, -2.0, 0.0), _decoded(LOOP * 2, -1.5, 0.2)], options).temperature
        == 0.2
    )
    # The first that passes wins, whatever comes later.
    assert (
        choose([_decoded(CLEAN, -1.5, 0.0), _decoded(CLEAN, -0.2, 0.2)], options).temperature == 0.2
    )


def test_mean_logprob_counts_endoftext_and_divides_by_tokens_plus_one(tiny_whisper):
    """openai-whisper's avg_logprob: sum of the chosen tokens' log-softmax (EOT included) /
    (tokens before EOT + 1); at temperature T the scores are logits / T, scaled back."""
    _, processor = tiny_whisper
    tokenizer = processor.tokenizer
    eot = tokenizer.eos_token_id
    vocab = len(tokenizer)
    prompt = [50257, 50362]
    words = tokenizer.encode(" hello world", add_special_tokens=False)
    generated = [*words, eot, eot]  # padded with EOT after the end
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(len(generated), vocab, generator=generator)
    temperature = 0.4
    output = GenerateEncoderDecoderOutput(
        sequences=torch.tensor([prompt + generated]),
        scores=tuple(step[None] / temperature for step in logits),
    )
    (decoded,) = decoded_from_output(output, tokenizer, temperature)
    logprobs = torch.log_softmax(logits, dim=-1)
    expected = sum(float(logprobs[i, t]) for i, t in enumerate([*words, eot])) / (len(words) + 1)
    assert decoded.tokens == tuple(words)
    assert decoded.text == "hello world"
    assert decoded.avg_logprob == pytest.approx(expected, rel=1e-5)
    assert decoded.temperature == temperature


# -- the fallback on a planted loop ---------------------------------------------------------


def _token_ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


class PlantedGenerate:
    """Stands in for `model.generate`: greedy writes `greedy[i]` for row i, every sampled
    decode writes `sampled`, each token with near-certain scores (mean log-prob ~0) unless the
    text is listed in `unlikely` (flat scores: mean log-prob ~ -log(vocab))."""

    def __init__(self, tokenizer, greedy, sampled, unlikely=()):
        self.tokenizer = tokenizer
        self.greedy, self.sampled, self.unlikely = greedy, sampled, set(unlikely)
        self.calls = []  # (temperature or None, the rows' first feature value)

    def __call__(self, **kwargs):
        if "encoder_outputs" in kwargs:
            rows = kwargs["encoder_outputs"].last_hidden_state
        else:
            rows = kwargs["input_features"]
        temperature = kwargs.get("temperature")
        self.calls.append((temperature, rows))
        n = rows.shape[0]
        texts = self.greedy if temperature is None else [self.sampled] * n
        eot = self.tokenizer.eos_token_id
        ids = [[*_token_ids(self.tokenizer, " " + text), eot] for text in texts]
        steps = max(map(len, ids))
        ids = [row + [eot] * (steps - len(row)) for row in ids]
        vocab = len(self.tokenizer)
        scores = []
        for step in range(steps):
            score = torch.zeros(n, vocab)
            for i, row in enumerate(ids):
                if texts[i] not in self.unlikely:
                    score[i, row[step]] = 30.0 / (temperature or 1.0)
            scores.append(score)
        prompt = [[50257, 50362]] * n
        sequences = torch.tensor([p + row for p, row in zip(prompt, ids, strict=True)])
        if not kwargs.get("return_dict_in_generate"):
            return sequences
        return GenerateEncoderDecoderOutput(sequences=sequences, scores=tuple(scores))


def _batch(processor, n=2):
    rng = np.random.default_rng(0)
    clips = [(0.1 * rng.standard_normal(16_000 * (i + 1))).astype(np.float32) for i in range(n)]
    return {"input_features": LogMel(processor.feature_extractor)(clips), "size": n}


def test_only_the_looping_utterance_is_decoded_again_at_0_2(tiny_whisper, monkeypatch):
    model, processor = tiny_whisper
    planted = PlantedGenerate(
        processor.tokenizer, greedy=[LOOP.strip(), "open the door"], sampled="the cat sat"
    )
    monkeypatch.setattr(model, "generate", planted)
    batch = _batch(processor)
    details = []
    texts = generate_texts(model, processor, [batch], max_length=300, details=details)

    assert texts == ["the cat sat", "open the door"]
    assert [temperature for temperature, _ in planted.calls] == [None, 0.2]
    (_, greedy_rows), (_, fallback_rows) = planted.calls
    assert greedy_rows.shape[0] == 2 and fallback_rows.shape[0] == 1  # only the looping row
    # ... decoded again from its own audio (the encoder's output of row 0, computed once).
    with torch.no_grad():
        row0 = model.get_encoder()(batch["input_features"][:1]).last_hidden_state
    torch.testing.assert_close(fallback_rows, row0)
    assert [(d.fallback, d.temperature, d.passed) for d in details] == [
        (True, 0.2, True),
        (False, 0.0, True),
    ]
    assert details[0].compression_ratio < 2.4 and details[1].avg_logprob > -0.01


def test_an_unlikely_output_falls_back_too_and_clean_ones_do_not(tiny_whisper, monkeypatch):
    model, processor = tiny_whisper
    planted = PlantedGenerate(
        processor.tokenizer,
        greedy=["open the door", "mumble"],
        sampled="the cat sat",
        unlikely={"mumble"},
    )
    monkeypatch.setattr(model, "generate", planted)
    details = []
    texts = generate_texts(model, processor, [_batch(processor)], max_length=50, details=details)
    assert texts == ["open the door", "the cat sat"]
    assert details[1].fallback and not details[0].fallback
    assert details[1].temperature == 0.2
    assert [t for t, _ in planted.calls] == [None, 0.2]

    clean = PlantedGenerate(processor.tokenizer, greedy=["open the door", "hi"], sampled="x")
    monkeypatch.setattr(model, "generate", clean)
    assert generate_texts(model, processor, [_batch(processor)], max_length=50) == [
        "open the door",
        "hi",
    ]
    assert [t for t, _ in clean.calls] == [None], "nothing failed: one generate call"


@pytest.mark.parametrize(
    "options",
    [
        NO_FALLBACK,
        DecodingOptions(compression_ratio_threshold=None, logprob_threshold=None),
        parse_temperatures("0"),
    ],
    ids=["temperatures-0", "thresholds-off", "parsed-0"],
)
def test_a_disabled_fallback_never_decodes_again(tiny_whisper, monkeypatch, options):
    if isinstance(options, tuple):
        options = DecodingOptions(temperatures=options)
    model, processor = tiny_whisper
    planted = PlantedGenerate(
        processor.tokenizer, greedy=[LOOP.strip(), "mumble"], sampled="x", unlikely={"mumble"}
    )
    monkeypatch.setattr(model, "generate", planted)
    details = []
    texts = generate_texts(
        model, processor, [_batch(processor)], max_length=300, decoding=options, details=details
    )
    assert texts == [LOOP.strip(), "mumble"]
    assert [t for t, _ in planted.calls] == [None]
    assert not any(d.fallback for d in details)
    if options.compression_ratio_threshold is not None:
        assert not details[0].passed  # the loop is still seen, though not decoded again


def test_an_utterance_failing_at_every_temperature_keeps_its_best_try(tiny_whisper, monkeypatch):
    model, processor = tiny_whisper
    planted = PlantedGenerate(processor.tokenizer, greedy=[LOOP.strip()], sampled=LOOP.strip())
    monkeypatch.setattr(model, "generate", planted)
    details = []
    generate_texts(model, processor, [_batch(processor, n=1)], max_length=300, details=details)
    assert [t for t, _ in planted.calls] == [None, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert details[0].fallback and not details[0].passed


@pytest.mark.long
def test_sampling_is_seeded_and_leaves_the_callers_random_stream_alone(tiny_whisper):
    """The random tiny model's outputs are all unlikely: every row is sampled again."""
    model, processor = tiny_whisper
    batch = _batch(processor)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first, details = generate_texts(model, processor, [batch], max_length=12, details=[]), []
    assert torch.equal(torch.get_rng_state(), state), "evaluation must not move training's RNG"
    again = generate_texts(model, processor, [batch], max_length=12, details=details)
    assert again == first
    assert all(d.fallback for d in details)
    # A sampled decode (temperature 1 from the start) repeats with its seed, not with another.
    sampled = DecodingOptions(temperatures=(1.0,))
    samples = generate_texts(model, processor, [batch], max_length=12, decoding=sampled)
    assert generate_texts(model, processor, [batch], max_length=12, decoding=sampled) == samples
    reseeded = DecodingOptions(temperatures=(1.0,), seed=1)
    assert generate_texts(model, processor, [batch], max_length=12, decoding=reseeded) != samples
    assert torch.equal(torch.get_rng_state(), state)


# -- the evaluation report ------------------------------------------------------------------


def _write_clip(path, seconds, seed):
    rng = np.random.default_rng(seed)
    soundfile.write(
        path, (0.1 * rng.standard_normal(int(16_000 * seconds))).astype(np.float32), 16_000
    )
    return str(path)


def test_evaluate_reports_how_many_utterances_needed_the_fallback(
    tiny_whisper, monkeypatch, tmp_path, capsys
):
    model, processor = tiny_whisper
    planted = PlantedGenerate(
        processor.tokenizer, greedy=[LOOP.strip(), "good morning"], sampled="hello there"
    )
    monkeypatch.setattr(model, "generate", planted)
    examples = [
        Example(audio=_write_clip(tmp_path / "a.wav", 1.0, 0), text="hello there"),
        Example(audio=_write_clip(tmp_path / "b.wav", 1.5, 1), text="good morning"),
    ]
    report = evaluate_examples(model, processor, examples, batch_size=2, max_length=300)
    assert report.fallbacks == 1 and report.unresolved == 0
    assert report.wer == 0.0 and report.scores.repeated_ngram_rate == 0.0
    written = json.loads(write_report_json(report, tmp_path / "report.json").read_text())
    assert written["fallback_utterances"] == 1
    assert written["decoding"]["temperatures"] == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert written["decoding"]["compression_ratio_threshold"] == 2.4
    assert [u["fallback"] for u in written["utterances"]] == [True, False]
    assert [u["temperature"] for u in written["utterances"]] == [0.2, 0.0]

    evaluate_command._print_scores("planted", report)
    assert "temperature fallback: 1 of 2 utterance(s) decoded again" in capsys.readouterr().out

    # Without the fallback the loop stays in the transcript, and in the loop figures.
    monkeypatch.setattr(model, "generate", PlantedGenerate(planted.tokenizer, planted.greedy, "x"))
    looped = evaluate_examples(
        model, processor, examples, batch_size=2, max_length=300, decoding=NO_FALLBACK
    )
    assert looped.fallbacks == 0 and looped.scores.repeated_ngram_rate > 0.5
    assert (
        json.loads(write_report_json(looped, tmp_path / "r.json").read_text())[
            "fallback_utterances"
        ]
        == 0
    )


def test_evaluate_command_passes_the_decoding_flags(monkeypatch):
    seen = {}

    def fake_evaluate(model, data, **kwargs):
        seen.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr("whisper_train.evaluation.evaluate.evaluate", fake_evaluate)
    parser = argparse.ArgumentParser()
    evaluate_command.add_parser(parser.add_subparsers())
    argv = ["evaluate", "--model", "m", "--data", "d"]
    for extra, expected in (
        ([], DecodingOptions()),
        (["--temperatures", "0"], NO_FALLBACK),
        (
            ["--compression-ratio-threshold", "off", "--logprob-threshold", "-0.5"],
            DecodingOptions(compression_ratio_threshold=None, logprob_threshold=-0.5),
        ),
    ):
        args = parser.parse_args([*argv, *extra])
        with pytest.raises(SystemExit):
            args.handler(args)
        assert seen["decoding"] == expected
    assert math.isclose(DecodingOptions().logprob_threshold, -1.0)
