"""Silence: the no-speech probability and the test that empties a window's text
(whisper_train.transcription.decoding), everywhere whisper-train decodes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import soundfile
import torch
from conftest import write_tone_dataset
from tiny_models import NO_TIMESTAMPS, SOT

from whisper_train.commands import evaluate as evaluate_command
from whisper_train.data.examples import Example
from whisper_train.data.features import LogMel
from whisper_train.data.nonspeech import builtin_clips, load_nonspeech, write_builtin_set
from whisper_train.errors import UserError
from whisper_train.evaluation import nonspeech as nonspeech_module
from whisper_train.evaluation.evaluate import evaluate_examples, generate_texts, write_report_json
from whisper_train.evaluation.nonspeech import score_nonspeech
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
    assert greedy == {"temperature": 0.0, "no_speech_threshold": 0.6, "logprob_threshold": -1.0}
    assert "no_speech_threshold" not in _fallback_arguments(
        DecodingOptions(no_speech_threshold=None)
    )


# -- non-speech sets ------------------------------------------------------------------------


def test_the_builtin_set_is_deterministic_and_covers_what_users_meet(tmp_path):
    first = write_builtin_set(tmp_path / "a")
    again = write_builtin_set(tmp_path / "b")
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (again / name).read_bytes()
    kinds = ("silence", "dither", "white", "pink", "brown", "hum", "tone", "beeps", "clicks")
    assert all(any(kind in name for name in names) for kind in (*kinds, "chords"))
    clips = builtin_clips()
    assert not clips["digital-silence"].any()
    # A level is the RMS asked for, in dB below full scale (float32 samples: 1e-6 relative).
    rms = float(np.sqrt(np.mean(clips["white-noise-20dB"].astype(np.float64) ** 2)))
    assert rms == pytest.approx(0.1, rel=1e-4)
    examples = load_nonspeech(first)
    assert len(examples) == len(names) and all(e.text == "" for e in examples)


def test_a_set_with_speech_in_it_is_refused_in_one_line(tmp_path):
    write_tone_dataset(tmp_path / "speech", n=3)
    with pytest.raises(UserError, match="3 of 3 clips have a transcript") as refused:
        load_nonspeech(tmp_path / "speech")
    assert "\n" not in str(refused.value)


def test_words_per_minute_and_the_share_of_clips_with_text():
    scores = score_nonspeech(["", "thank you", ".", "you you you you"], [30.0, 30.0, 30.0, 30.0])
    assert scores.words == 6 and scores.clips_with_text == 2  # "." is no word
    assert scores.words_per_minute == pytest.approx(3.0)  # 6 words in 2 minutes
    assert scores.share_with_text == pytest.approx(0.5)


def _nonspeech_folder(tmp_path):
    folder = tmp_path / "noise"
    folder.mkdir()
    for name, samples in list(builtin_clips(seconds=1.0).items())[:3]:
        soundfile.write(folder / f"{name}.wav", samples, 16_000)
    return folder


def _evaluate_argv(model, data, *extra):
    parser = argparse.ArgumentParser()
    evaluate_command.add_parser(parser.add_subparsers())
    return parser.parse_args(["evaluate", "--model", str(model), "--data", data, *extra])


def test_evaluate_scores_a_nonspeech_set_and_silence_lowers_it(
    tiny_whisper_dir, tmp_path, capsys, monkeypatch
):
    folder = _nonspeech_folder(tmp_path)
    report = tmp_path / "report.json"
    quick = ["--temperatures", "0", "--generation-max-length", "8"]
    args = _evaluate_argv(
        tiny_whisper_dir, f"noise:nonspeech={folder}", *quick, "--output", str(report)
    )
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert "words per minute where nobody speaks; text on 3 of 3 clips (100%)" in out
    written = json.loads(report.read_text())
    assert written["kind"] == "nonspeech" and written["clips"] == 3
    assert written["words_per_minute"] == pytest.approx(written["words"] / (3.0 / 60), rel=1e-3)
    assert written["decoding"]["no_speech_threshold"] == 0.6

    # A model that hears silence in every clip writes nothing on them.
    real_load = nonspeech_module.load_model

    def silent_model(spec):
        model, processor = real_load(spec)
        force_no_speech(model)
        return model, processor

    monkeypatch.setattr(nonspeech_module, "load_model", silent_model)
    args = _evaluate_argv(tiny_whisper_dir, f"noise:nonspeech={folder}", *quick)
    assert args.handler(args) == 0
    assert "0.0 words per minute where nobody speaks; text on 0 of 3 clips (0%)" in (
        capsys.readouterr().out
    )


def test_a_damaged_clip_or_speech_is_refused_with_exit_2(tiny_whisper_dir, tmp_path):
    folder = _nonspeech_folder(tmp_path)
    (folder / "broken.wav").write_bytes(b"RIFF not a wave file")
    result = subprocess.run(
        [sys.executable, "-m", "whisper_train", "evaluate", "--model", str(tiny_whisper_dir)]
        + ["--data", f"noise:nonspeech={folder}"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 2
    assert "broken.wav: cannot be read" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_training_says_a_nonspeech_set_is_for_evaluate(tiny_run_config):
    with pytest.raises(UserError, match="non-speech set is scored by `whisper-train evaluate"):
        tiny_run_config(eval_data=["noise:nonspeech=builtin"], only_train=False).validate()


def test_evaluate_says_how_many_utterances_were_judged_silence(tiny_whisper, tmp_path, capsys):
    model, processor = tiny_whisper
    force_no_speech(model)
    folder = _nonspeech_folder(tmp_path)
    examples = [Example(audio=str(p), text="hello there") for p in sorted(folder.iterdir())]
    greedy = DecodingOptions(temperatures=(0.0,))
    report = evaluate_examples(
        model, processor, examples, batch_size=3, max_length=8, decoding=greedy
    )
    assert report.silenced == 3 and report.wer == 1.0  # every reference word deleted
    written = json.loads(write_report_json(report, tmp_path / "r.json").read_text())
    assert written["no_speech_utterances"] == 3
    assert all(u["no_speech"] for u in written["utterances"])
    evaluate_command._print_scores("m", report)
    assert "no speech: 3 of 3 utterance(s) judged silence" in capsys.readouterr().out
