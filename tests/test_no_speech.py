"""Silence: the no-speech probability and the test that empties a window's text
(whisper_train.transcription.decoding), everywhere whisper-train decodes."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile
import torch
import yaml
from conftest import metric_rows, write_tone_dataset
from tiny_models import EOT, NO_TIMESTAMPS, SOT

import whisper_train.training.judge as judge_module
from whisper_train.commands import evaluate as evaluate_command
from whisper_train.data.features import LogMel, content_frames
from whisper_train.data.nonspeech import builtin_clips, load_nonspeech, write_builtin_set
from whisper_train.errors import UserError
from whisper_train.evaluation import nonspeech as nonspeech_module
from whisper_train.evaluation.evaluate import generate_texts
from whisper_train.evaluation.nonspeech import score_nonspeech
from whisper_train.models import load_model
from whisper_train.training.final import FinalRule, choose_final_step
from whisper_train.training.train import train
from whisper_train.transcription.decoding import (
    NO_FALLBACK,
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


WORD = 400  # a text token of the tiny model's vocabulary


def confident_unless_runtime_padded(model):
    """Make the model write WORD then <|endoftext|> with near-certainty (a mean log-prob ~0),
    except on a window padded as the runtimes pad it (its last frame exactly 0; training's
    padding there is the log-mel floor), where the random model's own unlikely text stays.
    Records each encoder input it sees."""
    seen: list[torch.Tensor] = []
    state = {"runtime": False}

    def encoder_hook(module, args, kwargs):
        features = args[0] if args else kwargs["input_features"]
        seen.append(features.detach().clone())
        state["runtime"] = bool((features[..., -1] == 0).all())

    def decoder_hook(module, args, kwargs, output):
        ids = kwargs.get("decoder_input_ids")
        if ids is None or state["runtime"]:
            return output
        boost = torch.zeros_like(output.logits)
        boost[..., WORD] += 60.0 * (ids == NO_TIMESTAMPS)
        boost[..., EOT] += 60.0 * (ids == WORD)
        output.logits.add_(boost)
        return output

    handles = [
        model.get_encoder().register_forward_pre_hook(encoder_hook, with_kwargs=True),
        model.register_forward_hook(decoder_hook, with_kwargs=True),
    ]
    return seen, handles


def test_a_window_believed_silent_is_judged_again_as_the_runtimes_pad_it(tiny_whisper):
    """A confident decode of a window the model believes silent (tiny.en's "you" on digital
    silence and hum) is decoded again with the log-mel padded with 0 past the clip, as
    openai-whisper and faster-whisper pad it, and emptied when that decode is unlikely; a row
    the model believes speech is never decoded again."""
    model, processor = tiny_whisper
    rng = np.random.default_rng(0)
    clips = [(0.1 * rng.standard_normal(16_000 * n)).astype(np.float32) for n in (1, 2)]
    features = LogMel(processor.feature_extractor)(clips)
    frames = content_frames(clips)
    assert frames == [100, 200]
    force_no_speech(model, rows=[0])
    seen, handles = confident_unless_runtime_padded(model)
    options = DecodingOptions(temperatures=(0.0,))
    details: list[Decoded] = []
    batch = {"input_features": features, "size": 2}
    # Without the clips' lengths (no second look), the confident text stays.
    texts = generate_texts(model, processor, [batch], max_length=8, decoding=options)
    assert texts[0] and texts[1]
    seen.clear()
    texts = generate_texts(
        model,
        processor,
        [{**batch, "content_frames": frames}],
        max_length=8,
        decoding=options,
        details=details,
    )
    assert texts == ["", texts[1]] and texts[1]
    assert details[0].no_speech and details[0].passed and not details[1].no_speech
    # The second look saw row 0 alone, its own frames as trained, zeros past them.
    (looked,) = [f for f in seen if (f[..., -1] == 0).all()]
    assert looked.shape[0] == 1
    torch.testing.assert_close(looked[0, :, :100], features[0, :, :100], rtol=0, atol=0)
    assert (looked[0, :, 100:] == 0).all() and (features[0, :, 100:] != 0).all()
    for handle in handles:
        handle.remove()


def test_a_window_of_digital_silence_gets_no_text(tiny_whisper):
    model, processor = tiny_whisper
    clips = [np.zeros(16_000, np.float32), 0.1 * np.ones(16_000, np.float32)]
    clips[1][::2] *= -1  # a loud 8 kHz square wave: not silence
    batch = {"input_features": LogMel(processor.feature_extractor)(clips), "size": 2}
    off = DecodingOptions(temperatures=(0.0,), no_speech_threshold=None)
    assert all(generate_texts(model, processor, [batch], max_length=8, decoding=off))
    # The random model's no-speech probability is low on both: the flat window alone decides.
    texts = generate_texts(model, processor, [batch], max_length=8, decoding=NO_FALLBACK)
    assert texts[0] == "" and texts[1]


def test_transcribe_writes_nothing_for_a_recording_of_digital_silence(tiny_whisper):
    """`transcribe` of a transformers folder: a recording without one non-zero sample gets no
    text, as faster-whisper, whisper.cpp and openai-whisper give it. Before, its long-form
    decoding kept tiny.en's confident "you" there (transformers' test needs a low log-prob)."""
    from whisper_train.transcription.backends import TransformersBackend

    model, processor = tiny_whisper
    silence = np.zeros(4 * 16_000, np.float32)
    # Before, the random model's long-form decoding wrote "Incredible powerful escaped ..." here.
    assert TransformersBackend(model, processor).transcribe(silence) == ("", [])


def test_tiny_en_writes_nothing_where_it_wrote_you(tmp_path):
    """The real tiny.en on the built-in clips it wrote a confident "you" on (BENCHMARKS.md, "Text
    where nobody speaks"): no word with the defaults; the same model without the clips'
    lengths (training's padding only) still writes one, so the runtimes' look is what helps."""
    model, processor = load_model("tiny.en")
    names = ["digital-silence", "dither", "hum-50Hz"]
    examples = load_nonspeech(write_builtin_set(tmp_path / "set", names=names))
    report = nonspeech_module.evaluate_nonspeech_examples(model, processor, examples)
    assert report.texts == [""] * len(names) and report.scores.words == 0
    log_mel = LogMel(processor.feature_extractor)
    clips = [nonspeech_module._read(example) for example in examples[1:]]  # no digital silence
    batch = {"input_features": log_mel(clips), "size": len(clips)}
    without = generate_texts(model, processor, [batch])
    assert all(nonspeech_module.words_in(text) for text in without)


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
    # Another draw (a finer measurement's extra clips): new noise at the same level, the same
    # on every call; the sounds without chance in them are the set's own.
    other, same = builtin_clips(draw=1), builtin_clips(draw=1)
    assert all(np.array_equal(other[name], same[name]) for name in clips)
    assert not np.array_equal(other["white-noise-20dB"], clips["white-noise-20dB"])
    rms = float(np.sqrt(np.mean(other["white-noise-20dB"].astype(np.float64) ** 2)))
    assert rms == pytest.approx(0.1, rel=1e-4)
    assert np.array_equal(other["hum-50Hz"], clips["hum-50Hz"])


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
    # The random model writes on the noise; digital silence, a window without one non-zero
    # sample, gets no text whatever the model.
    assert "words per minute where nobody speaks; text on 2 of 3 clips (67%)" in out
    written = json.loads(report.read_text())
    assert written["kind"] == "nonspeech" and written["clips"] == 3
    texts = {Path(row["audio"]).stem: row["text"] for row in written["utterances"]}
    assert texts["digital-silence"] == "" and texts["dither"] and texts["white-noise-60dB"]
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


# -- a non-speech set during training ----------------------------------------------------------


def test_training_scores_a_nonspeech_set_from_its_start_into_the_record_and_card(
    tiny_run_config, tmp_path, capsys
):
    """The tiny random model writes text on noise: training measures it at step 0 (its start)
    and at every evaluation, prints it, and keeps it in metrics, result.json and the card."""
    target = write_tone_dataset(tmp_path / "target", n=2, seed=1)
    folder = _nonspeech_folder(tmp_path)
    result = train(
        tiny_run_config(
            only_train=False,
            eval_data=[f"target={target}", f"noise:nonspeech={folder}"],
            eval_steps=2,
            generation_max_length=4,
            max_nonspeech_rise=1000.0,
        )
    )
    rows = [row for row in metric_rows(result.output_dir) if row.get("set") == "noise"]
    assert [row["step"] for row in rows] == [0, 2, 3]
    assert all(row["clips"] == 3 and row["audio_seconds"] == pytest.approx(3.0) for row in rows)
    assert rows[-1]["words"] > 0  # the trained random model invents words on noise
    assert rows[-1]["words_per_minute"] == pytest.approx(rows[-1]["words"] / (3.0 / 60))
    assert "words/min noise" in capsys.readouterr().out
    saved = json.loads((result.output_dir / "result.json").read_text())
    assert [r["step"] for r in saved["evaluations"] if r["set"] == "noise"] == [0, 2, 3]
    assert "non-speech set 'noise' within 1000 words per minute" in saved["final_reason"]
    assert saved["record"]["evaluation"]["max_nonspeech_rise"] == 1000.0
    card = (result.output_dir / "final" / "README.md").read_text()
    final_row = next(r for r in rows if r["step"] == result.final_step)
    assert (
        f"| `noise` | 3 | {rows[0]['words_per_minute']:.1f} → {final_row['words_per_minute']:.1f} |"
    ) in card


def test_a_step_that_invents_more_on_nonspeech_is_vetoed_and_said(
    tiny_run_config, tmp_path, monkeypatch, capsys
):
    """Scripted scores (a random model's cannot be steered): the target's WER falls at every
    step, the non-speech set's words per minute stay at step 2 and jump at step 3."""
    target = write_tone_dataset(tmp_path / "target", n=2, seed=1)
    folder = _nonspeech_folder(tmp_path)
    wer = iter([0.9, 0.5, 0.2])
    words = iter([3, 3, 9])  # on 3 s of audio: 60, 60, 180 words per minute

    def scripted_wer(model, loader, processor, accelerator, normalizer, max_length, step, *_, **__):
        return {"step": step, "eval_loss": 1.0, "wer": next(wer)}

    def scripted_nonspeech(model, processor, examples, **_):
        return score_nonspeech(["word " * next(words)] + [""] * 2, [1.0] * 3)

    monkeypatch.setattr(judge_module, "run_evaluation", scripted_wer)
    monkeypatch.setattr(
        judge_module,
        "evaluate_nonspeech_examples",
        lambda *a, **k: SimpleNamespace(scores=scripted_nonspeech(*a, **k)),
    )
    result = train(
        tiny_run_config(
            only_train=False,
            eval_data=[f"target={target}", f"noise:nonspeech={folder}"],
            eval_steps=2,
            save_steps=2,
        )
    )
    out = capsys.readouterr().out
    line = (
        "non-speech set noise: +120.0 words per minute over its start (step 0) at step 3, "
        "past --max-nonspeech-rise 1: this step will not go to final/"
    )
    assert line in out
    assert result.final_step == 2 and result.final_wer == 0.5
    assert "non-speech set 'noise' within 1 words per minute" in result.final_reason


def test_a_nonspeech_set_first_given_on_resume_is_held_to_the_resume_step():
    """Its start is the first step it was measured at; a step before it was never measured,
    and is not chosen."""
    rows = [{"step": s, "set": "target", "wer": w} for s, w in ((2, 0.2), (4, 0.5), (6, 0.4))]
    rows += [{"step": s, "set": "noise", "words_per_minute": w} for s, w in ((4, 10.0), (6, 10.5))]
    rule = FinalRule(primary_set="target", nonspeech_sets=("noise",), max_nonspeech_rise=1.0)
    choice = choose_final_step(rows, rule)
    assert choice.step == 6  # step 2's lower WER was never measured on the non-speech set
    rows.append({"step": 6, "set": "noise", "words_per_minute": 12.0})
    rows = [r for r in rows if not (r["step"] == 6 and r.get("words_per_minute") == 10.5)]
    choice = choose_final_step(rows, rule)
    assert choice.step == 4  # step 4 is its start: it holds; step 6 invented 2 more a minute


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"eval_data": ["noise:nonspeech=builtin"]}, "every evaluation set is non-speech"),
        (
            {"eval_data": ["t=t/", "noise:nonspeech=builtin"], "metric_for_best": "noise"},
            "--metric-for-best noise: a non-speech set has no WER",
        ),
        (
            {"eval_data": ["t=t/", "u=u/", "noise:nonspeech=builtin"], "guard": "noise"},
            "--guard noise: a non-speech set has no WER",
        ),
        ({"max_nonspeech_rise": -1.0}, "--max-nonspeech-rise -1: expected a finite number"),
    ],
)
def test_a_nonspeech_set_that_cannot_pick_or_guard_is_refused_in_one_line(
    tiny_run_config, overrides, message
):
    with pytest.raises(UserError, match=re.escape(message)) as refused:
        tiny_run_config(only_train=False, **overrides).validate()
    assert "\n" not in str(refused.value)


def test_a_damaged_nonspeech_clip_refuses_the_run_before_step_1(tiny_run_config, tmp_path):
    folder = _nonspeech_folder(tmp_path)
    (folder / "broken.wav").write_bytes(b"RIFF not a wave file")
    target = write_tone_dataset(tmp_path / "target", n=2, seed=1)
    config = tiny_run_config(
        only_train=False, eval_data=[f"t={target}", f"noise:nonspeech={folder}"]
    )
    with pytest.raises(UserError, match="--eval-data noise: .*broken.wav cannot be read"):
        train(config)
    assert not list((tmp_path / "out").glob("checkpoint-*"))


# -- training on clips where nobody speaks -----------------------------------------------------


def _labels_trained(
    monkeypatch, fed: list | None = None, no_speech: int = NO_SPEECH
) -> list[list[int]]:
    """Every label row the loss is given (its masked positions dropped), as the run trains;
    with `fed`, the decoder inputs of the rows that target <|nospeech|> (`no_speech`, tiny.en's
    by default) are put there."""
    import whisper_train.training.recipe as recipe_module

    real, seen = recipe_module.loss_terms, []

    def recording(model, batch, **kwargs):
        inputs = batch["decoder_input_ids"].tolist()
        for row, fed_row in zip(batch["labels"].tolist(), inputs, strict=True):
            seen.append([token for token in row if token != -100])
            if fed is not None and seen[-1][:1] == [no_speech]:
                fed.append(fed_row[: len(seen[-1])])
        return real(model, batch, **kwargs)

    monkeypatch.setattr(recipe_module, "loss_terms", recording)
    return seen


def test_length_grouped_batches_each_hold_their_share_of_noise(tiny_run_config, monkeypatch):
    """--group-by-length with --nonspeech: the noise labels, the shortest, were grouped into
    micro-batches of noise alone (here one of the four: every step but one without noise, and
    one step that trains nothing but <|nospeech|>). Spread, each holds one of its four."""
    import whisper_train.training.recipe as recipe_module

    real, batches = recipe_module.loss_terms, []

    def recording(model, batch, **kwargs):
        batches.append(sum(row[0] == NO_SPEECH for row in batch["labels"].tolist()))
        return real(model, batch, **kwargs)

    monkeypatch.setattr(recipe_module, "loss_terms", recording)
    config = tiny_run_config(
        nonspeech="builtin",
        nonspeech_share=0.25,
        packing="off",
        group_by_length=True,
        max_steps=4,
    )
    assert train(config).train_examples == 12 + 4
    assert batches == [1, 1, 1, 1]


def test_a_clip_where_nobody_speaks_is_taught_in_the_context_decoding_gives_it():
    """The default label of a clip of --nonspeech: the decoder is fed the prefix it is fed
    when transcribing (SOT, ..., <|notimestamps|>) and taught <|nospeech|> after SOT (the
    probability the runtimes' no-speech test reads) and <|endoftext|> after the prefix (what
    greedy decoding then writes: nothing). Before, it was fed SOT <|nospeech|>, a context no
    decoding ever gives: the multilingual base's fine-tunes still wrote digits on noise
    (BENCHMARKS.md "Text where nobody speaks"). A speech label keeps its prefix masked."""
    from whisper_train.data.collate import IGNORE_INDEX, SpeechCollator

    collator = SpeechCollator(EOT, nospeech_target=NO_SPEECH)
    speech, noise = [SOT, NO_TIMESTAMPS, 11, 12, EOT], [SOT, NO_TIMESTAMPS, EOT]
    batch = collator.pad_labels([speech, noise], [2, 2])
    assert batch["decoder_input_ids"].tolist() == [
        [SOT, NO_TIMESTAMPS, 11, 12],
        [SOT, NO_TIMESTAMPS, EOT, EOT],
    ]
    assert batch["labels"].tolist() == [
        [IGNORE_INDEX, 11, 12, EOT],
        [NO_SPEECH, EOT, IGNORE_INDEX, IGNORE_INDEX],
    ]
    plain = SpeechCollator(EOT).pad_labels([noise], [2])["labels"].tolist()
    assert plain == [[IGNORE_INDEX, EOT]]  # without the no-speech target: the empty transcript


def test_a_resume_keeps_the_checkpoints_share_unless_another_is_given(
    tiny_run_config, capsys, tmp_path
):
    """A checkpoint trained with --nonspeech-share 0.25 (or by the version whose default was
    0.1) resumes under the default share with its own, and says so in one line; before, the new
    default differed from the saved share and the default resume was refused. A share given on
    the command line must still equal the checkpoint's."""
    train(tiny_run_config(nonspeech="builtin", nonspeech_share=0.25, max_steps=1, save_steps=1))
    capsys.readouterr()
    resumed = train(tiny_run_config(nonspeech="auto", max_steps=2, resume="latest"))
    said = capsys.readouterr().out
    assert "nonspeech auto -> builtin: as the checkpoint trained; nonspeech share 0.25" in said
    assert resumed.train_examples == 12 + 4  # a quarter, as the checkpoint planned
    record = yaml.safe_load((tmp_path / "out" / "whisper-train.yaml").read_text())["record"]
    assert record["data"]["nonspeech_share"] == 0.25
    with pytest.raises(UserError, match="--nonspeech-share 0.2 differs from the checkpoint's 0.25"):
        train(tiny_run_config(nonspeech_share=0.2, nonspeech="auto", max_steps=3, resume="latest"))


def test_the_record_keeps_the_nonspeech_label_and_a_resume_continues_with_it(
    tiny_run_config, monkeypatch, capsys, tmp_path
):
    """The label noise clips train with is the run's record's, so a resume teaches them as the
    checkpoint did: a run of the old `<|nospeech|>`-alone label ($WHISPER_TRAIN_NONSPEECH_LABEL
    nospeech) resumed without the variable goes on feeding [SOT, <|nospeech|>], and says so in
    its record and card; with the variable naming another, it is refused in one line whose
    advice works. Before, the label was read from the environment at each start and recorded
    nowhere: a resume silently switched its noise clips to the new label."""
    fed: list[list[int]] = []
    _labels_trained(monkeypatch, fed)
    monkeypatch.setenv("WHISPER_TRAIN_NONSPEECH_LABEL", "nospeech")
    train(tiny_run_config(nonspeech="builtin", nonspeech_share=0.25, max_steps=1, save_steps=1))
    record = yaml.safe_load((tmp_path / "out" / "whisper-train.yaml").read_text())["record"]
    assert record["data"]["nonspeech_label"] == "nospeech"

    monkeypatch.setenv("WHISPER_TRAIN_NONSPEECH_LABEL", "both")
    with pytest.raises(UserError) as refused:
        train(tiny_run_config(nonspeech="builtin", max_steps=2, resume="latest"))
    assert str(refused.value).count("\n") == 0
    assert "label ($WHISPER_TRAIN_NONSPEECH_LABEL) both differs from the checkpoint's nospeech" in (
        str(refused.value)
    )
    assert "resume with $WHISPER_TRAIN_NONSPEECH_LABEL unset" in str(refused.value)

    monkeypatch.delenv("WHISPER_TRAIN_NONSPEECH_LABEL")  # the advice, followed
    fed.clear()
    train(tiny_run_config(nonspeech="builtin", max_steps=4, resume="latest"))
    assert fed and all(row == [SOT, NO_SPEECH] for row in fed), fed
    record = yaml.safe_load((tmp_path / "out" / "whisper-train.yaml").read_text())["record"]
    assert record["data"]["nonspeech_label"] == "nospeech"
    card = (tmp_path / "out" / "final" / "README.md").read_text()
    assert "25% of each epoch, taught <|nospeech|> alone" in card

    fed.clear()  # a new run takes the default: the prefix transcribing feeds
    train(tiny_run_config(nonspeech="builtin", max_steps=2, output_dir=str(tmp_path / "new")))
    assert fed and all(row == [SOT, NO_TIMESTAMPS] for row in fed), fed


def test_a_checkpoint_that_does_not_record_its_nonspeech_label_resumes_and_says_so(
    tiny_run_config, capsys, tmp_path
):
    """A checkpoint written before the label was recorded (its record lacks the field) is
    resumed, not refused, with this run's label, and the start says in one line that the
    checkpoint's may have differed; the record then holds the label the run goes on with."""
    train(tiny_run_config(nonspeech="builtin", max_steps=1, save_steps=1))
    checkpoint = tmp_path / "out" / "checkpoint-1" / "whisper-train.yaml"
    saved = yaml.safe_load(checkpoint.read_text())
    del saved["record"]["data"]["nonspeech_label"]
    checkpoint.write_text(yaml.safe_dump(saved, sort_keys=False))
    manifest = checkpoint.parent / "manifest.json"  # the sizes the checkpoint is checked by
    sizes = json.loads(manifest.read_text())
    sizes["files"][checkpoint.name] = checkpoint.stat().st_size
    manifest.write_text(json.dumps(sizes))
    capsys.readouterr()
    train(tiny_run_config(nonspeech="builtin", max_steps=2, resume="latest"))
    said = capsys.readouterr().out
    assert "nonspeech label both: the checkpoint does not record how its clips" in said
    record = yaml.safe_load((tmp_path / "out" / "whisper-train.yaml").read_text())["record"]
    assert record["data"]["nonspeech_label"] == "both"


def test_an_unknown_nonspeech_label_is_refused_in_one_line(tiny_run_config, monkeypatch):
    monkeypatch.setenv("WHISPER_TRAIN_NONSPEECH_LABEL", "silence")
    with pytest.raises(
        UserError, match=r"\$WHISPER_TRAIN_NONSPEECH_LABEL silence: expected one of "
    ):
        train(tiny_run_config(nonspeech="builtin", max_steps=1))


@pytest.mark.parametrize("packing", ["off", "on", "per-clip"])
def test_nonspeech_clips_train_with_the_no_speech_label_in_every_packing(
    tiny_run_config, monkeypatch, packing, capsys
):
    """--nonspeech builtin --nonspeech-share 0.25: a quarter of the clips are noise, each
    trained to predict <|nospeech|> after <|startoftranscript|> and nothing after the prefix,
    fed what transcribing feeds; a packed window's noise adds no text to its label. Before, an
    empty transcript was skipped as bad data."""
    fed: list[list[int]] = []
    seen = _labels_trained(monkeypatch, fed)
    config = tiny_run_config(
        nonspeech="builtin", nonspeech_share=0.25, packing=packing, max_steps=4
    )
    result = train(config)
    assert result.train_examples == 12 + 4  # the 12 tone clips and 4 of noise (a quarter)
    assert result.skipped_clips == 0
    no_speech = [NO_SPEECH, EOT]  # the targets after <|startoftranscript|>
    if packing == "on":  # the noise shares a window: its label holds the speech's text only
        assert no_speech not in seen
        assert all(row[-1] == EOT and NO_SPEECH not in row for row in seen)
    else:
        assert no_speech in seen  # its own label (or, per clip, its own decoder pass)
        assert all(row == no_speech or NO_SPEECH not in row for row in seen)
        assert fed and all(row == [SOT, NO_TIMESTAMPS] for row in fed), fed


def test_by_default_a_fifth_of_the_epoch_is_builtin_noise_and_the_start_says_so(
    tiny_run_config, monkeypatch, capsys, tmp_path
):
    """--nonspeech auto, the default: the built-in clips join data read whole (3 of 15: a
    fifth) with the no-speech label; the record says builtin and the start says why;
    `none` trains on the clips alone. Before, the default trained on speech alone and the
    demo's fine-tune wrote words on hum that tiny.en never wrote."""
    seen = _labels_trained(monkeypatch)
    result = train(tiny_run_config(nonspeech="auto", packing="off", max_steps=4))
    assert result.train_examples == 12 + 3
    assert [NO_SPEECH, EOT] in seen
    said = capsys.readouterr().out
    assert "nonspeech auto -> builtin: noise, hum and tones with empty targets, 20%" in said
    record = yaml.safe_load((tmp_path / "out" / "whisper-train.yaml").read_text())["record"]
    assert (record["data"]["nonspeech"], record["data"]["nonspeech_share"]) == ("builtin", 0.2)
    card = (tmp_path / "out" / "final" / "README.md").read_text()
    assert "clips where nobody speaks: --nonspeech builtin, 20% of each epoch" in card

    seen.clear()
    off = train(tiny_run_config(nonspeech="off", output_dir=str(tmp_path / "off")))
    assert off.train_examples == 12 and all(NO_SPEECH not in row for row in seen)
    record = yaml.safe_load((tmp_path / "off" / "whisper-train.yaml").read_text())["record"]
    assert record["data"]["nonspeech"] is None
    assert "--nonspeech" not in (tmp_path / "off" / "final" / "README.md").read_text()


def test_auto_resumes_as_the_checkpoint_trained_and_a_stream_trains_alone(
    tiny_run_config, capsys, tmp_path
):
    """A run saved without non-speech clips (`none`, or by a version whose default had none)
    resumes under the default auto without them, and says so, instead of being refused for a
    changed --nonspeech; a stream, whose rows cannot be mixed with others, trains on its own
    under auto, and says so, where --nonspeech builtin is refused."""
    from test_streaming import write_shards

    from whisper_train.config.resolve import NonspeechChoice, choose_nonspeech

    train(tiny_run_config(max_steps=1, save_steps=1))  # --nonspeech none
    capsys.readouterr()
    resumed = train(tiny_run_config(max_steps=2, resume="latest", nonspeech="auto"))
    assert "nonspeech auto -> none: as the checkpoint trained" in capsys.readouterr().out
    assert resumed.train_examples == 12

    shards = tmp_path / "shards"
    write_shards(shards, "webdataset", [3, 3])
    stream = tiny_run_config(data=str(shards), nonspeech="auto").validate()
    assert choose_nonspeech(stream) == NonspeechChoice(
        None, note="nonspeech auto -> none: --data is streamed, and no clips can be mixed in"
    )
    with pytest.raises(UserError, match="--nonspeech needs --data read whole"):
        tiny_run_config(data=str(shards), nonspeech="builtin").validate()


@pytest.mark.parametrize("packing", ["off", "on", "per-clip"])
def test_a_multilingual_run_whose_clips_state_their_languages_mixes_in_noise(
    tmp_path, tiny_run_config, monkeypatch, packing
):
    """No --language, each clip's language in a `language` column (German, then French): the
    noise (which speaks none) trains with <|nospeech|>, and with the empty transcript under the
    prefix of the speech's languages, in their shares, so that transcribing either language
    learns to write nothing on noise. Before, planning the packed windows asked for the noise's
    language and refused the run: --nonspeech builtin, and so the default, could not meet a
    multilingual model's data with a language column; then every noise clip was taught under
    <|en|>, a prefix this run never transcribes with."""
    from multilingual import make_tiny_multilingual_whisper

    model_dir = tmp_path / "multilingual"
    model, processor = make_tiny_multilingual_whisper()
    model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    data = write_tone_dataset(tmp_path / "data", layout="manifest")
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    languages = ["de"] * 8 + ["fr"] * 4
    labelled = zip(rows, languages, strict=True)
    data.write_text("".join(json.dumps({**row, "language": lang}) + "\n" for row, lang in labelled))
    ids = processor.tokenizer.convert_tokens_to_ids
    no_speech = ids("<|notimestamps|>") - 1  # <|nospeech|> (<|nocaptions|> in older vocabularies)
    fed: list[list[int]] = []
    seen = _labels_trained(monkeypatch, fed, no_speech)
    config = tiny_run_config(
        data=str(data),
        model=str(model_dir),
        nonspeech="auto",
        packing=packing,
        max_steps=None,
        epochs=1,
    )
    result = train(config)  # --nonspeech auto
    assert result.train_examples == 12 + 3
    if packing == "on":  # the noise shares a window: its label holds the speech's text only
        assert seen and all(no_speech not in row for row in seen)
    else:  # each noise clip its own label: fed its prefix, language and all
        sot = ids("<|startoftranscript|>")
        prefixes = sorted(tuple(row) for row in fed)
        assert prefixes == sorted([(sot, ids("<|de|>"))] * 2 + [(sot, ids("<|fr|>"))]), fed


def test_the_builtin_training_clips_are_written_once_and_a_damaged_one_is_named(
    tmp_path, monkeypatch
):
    """Every run of the default reads --nonspeech builtin's clips from the cache: written once
    (a clip already there is kept), the same samples each time; a damaged one is named in one
    line, and the advice (remove it) works: the next run writes it again."""
    from whisper_train.data.nonspeech import training_nonspeech, write_builtin_training_set

    monkeypatch.setenv("WHISPER_TRAIN_CACHE", str(tmp_path))
    folder = write_builtin_training_set()
    first = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
    assert len(first) == 57  # 19 kinds at 2.5, 6 and 11 s
    clip = folder / sorted(first)[0]
    stamp = clip.stat().st_mtime_ns
    assert len(training_nonspeech("builtin", 3)) == 3
    assert clip.stat().st_mtime_ns == stamp  # kept, not written again
    clip.write_bytes(b"RIFF not a wave file")
    with pytest.raises(UserError, match=f"--nonspeech builtin: .*{clip.name} cannot be read"):
        training_nonspeech("builtin", 3)
    clip.unlink()
    assert len(training_nonspeech("builtin", 3)) == 3
    assert clip.read_bytes() == first[clip.name]


def test_noise_in_a_packed_window_carries_no_text_nor_segment():
    """A --nonspeech clip packed between two spoken ones adds nothing to the window's label,
    not even an empty timestamped segment: like the gaps between clips, it is silence. A
    window of noise alone is labelled with the prefix and <|endoftext|>, <|nospeech|> the
    target the collator adds after <|startoftranscript|>."""
    from tiny_models import english_tokenizer

    from whisper_train.data.labels import LabelEncoder
    from whisper_train.data.packing import window_label

    encoder = LabelEncoder(english_tokenizer(), timestamps=True, multilingual=False)
    spans = [(0.0, 2.0), (2.3, 6.3), (6.6, 8.0)]
    tokens, n_prefix = window_label(
        encoder, ["hello there", "", "goodbye"], spans, language=None, timestamps=True
    )
    times = [t for t in tokens if t > NO_TIMESTAMPS]
    assert [encoder.time_token_id(s) for span in (spans[0], spans[2]) for s in span] == times
    assert encoder.tokenizer.decode(tokens[n_prefix:-1], skip_special_tokens=True).split() == [
        "hello",
        "there",
        "goodbye",
    ]
    alone = window_label(encoder, ["", ""], spans[:2], language=None, timestamps=True)
    assert alone == ([SOT, NO_TIMESTAMPS, EOT], 2)
    assert encoder.nospeech_target == NO_SPEECH


def test_a_nonspeech_source_that_cannot_be_read_is_refused_in_one_line(tmp_path):
    from whisper_train.data.nonspeech import training_nonspeech

    folder = _nonspeech_folder(tmp_path)
    clips = training_nonspeech(str(folder), 5)
    assert [c.text for c in clips] == [""] * 5 and clips[3].audio == clips[0].audio  # repeated
    (folder / "broken.wav").write_bytes(b"RIFF not a wave file")
    with pytest.raises(UserError, match="--nonspeech .*broken.wav cannot be read") as refused:
        training_nonspeech(str(folder), 5)
    assert "\n" not in str(refused.value)


def test_a_share_with_nonspeech_none_is_refused_and_a_share_is_printed_as_it_is(tmp_path, capsys):
    """--nonspeech none --nonspeech-share 0.3: the share was ignored unseen; refused at start
    in one line (exit 2). --nonspeech-share 0.999 was printed "100%" at start and in the model
    card: a share is printed with the decimals it needs."""
    from conftest import record_of

    from whisper_train.cli import main
    from whisper_train.config import RunConfig
    from whisper_train.config.resolve import choose_nonspeech
    from whisper_train.runlog import TrainResult
    from whisper_train.training.model_card import run_card
    from whisper_train.units import format_share

    for off in ("none", "off"):
        config = RunConfig()
        config.update({"data": "d", "model": "m", "nonspeech": off, "nonspeech_share": 0.3})
        with pytest.raises(UserError, match=r"^--nonspeech-share 0.3 with --nonspeech none: .*"):
            config.validate()
    argv = ["train", "--model", "m", "--data", str(tmp_path), "--output-dir", str(tmp_path / "o")]
    assert main([*argv, "--nonspeech", "none", "--nonspeech-share", "0.3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--nonspeech-share 0.3 with --nonspeech none" in err and "\n" not in err, err

    assert [format_share(s) for s in (0.2, 0.999, 0.001, 0.09)] == ["20%", "99.9%", "0.1%", "9%"]
    config = RunConfig()
    config.update({"data": "d", "model": "m", "output_dir": "o", "nonspeech_share": 0.999})
    assert "99.9% of each epoch" in choose_nonspeech(config.validate()).note
    result = TrainResult(tmp_path, None, 8, 360, 40, 0, [], final_step=8, final_reason="last")
    card = run_card(record_of(config), result)
    assert "--nonspeech builtin, 99.9% of each epoch" in card and "100%" not in card


def test_per_clip_noise_rides_alongside_and_an_older_checkpoint_resumes_as_it_trained(
    tiny_run_config, capsys, tmp_path
):
    """--packing per-clip: the noise clips ride in the speech's windows (no step counts them),
    in pieces of at most 2 s; the record says "alongside" and the start says so. Another packing
    places them as clips of the epoch dealt evenly through its steps ("spread"). A checkpoint
    whose record does not say (written before the placement was kept) resumes as it trained, as
    clips, its steps replayed as planned then."""
    result = train(
        tiny_run_config(nonspeech="builtin", nonspeech_share=0.25, packing="per-clip", max_steps=4)
    )
    assert result.train_examples == 12 + 4
    said = capsys.readouterr().out
    assert "data: 16 clips (4 of noise riding) packed into" in said
    record = yaml.safe_load((tmp_path / "out" / "whisper-train.yaml").read_text())["record"]
    assert record["data"]["nonspeech_placement"] == "alongside"

    train(
        tiny_run_config(
            nonspeech="builtin", packing="off", max_steps=1, output_dir=str(tmp_path / "off")
        )
    )
    record = yaml.safe_load((tmp_path / "off" / "whisper-train.yaml").read_text())["record"]
    assert record["data"]["nonspeech_placement"] == "spread"

    older = tmp_path / "older"
    train(
        tiny_run_config(
            nonspeech="builtin",
            packing="per-clip",
            max_steps=1,
            save_steps=1,
            output_dir=str(older),
        )
    )
    _forget_the_placement(older / "checkpoint-1")
    train(tiny_run_config(nonspeech="builtin", max_steps=2, resume="latest", output_dir=str(older)))
    record = yaml.safe_load((older / "whisper-train.yaml").read_text())["record"]
    assert record["data"]["nonspeech_placement"] == "as-clips"


def _forget_the_placement(checkpoint_dir) -> None:
    """Make `checkpoint_dir`'s record one written before the noise's placement was kept."""
    checkpoint = checkpoint_dir / "whisper-train.yaml"
    saved = yaml.safe_load(checkpoint.read_text())
    del saved["record"]["data"]["nonspeech_placement"]
    checkpoint.write_text(yaml.safe_dump(saved, sort_keys=False))
    manifest = checkpoint.parent / "manifest.json"
    sizes = json.loads(manifest.read_text())
    sizes["files"][checkpoint.name] = checkpoint.stat().st_size
    manifest.write_text(json.dumps(sizes))


@pytest.mark.parametrize("packing", ["off", "on"])
def test_unpacked_and_joined_noise_is_dealt_evenly_and_an_older_checkpoint_resumes_shuffled(
    packing, tiny_run_config, capsys, tmp_path
):
    """--packing off or on: the noise clips are dealt evenly through the steps; the record says
    "spread", the start line and the model card say so. A checkpoint written before (no
    placement in its record) resumes with its noise shuffled in as it trained: "as-clips",
    and its start line does not say the noise is dealt evenly."""
    common = {"nonspeech": "builtin", "nonspeech_share": 0.25, "packing": packing}
    train(tiny_run_config(**common, max_steps=1, save_steps=1))
    said = capsys.readouterr().out
    assert "data: 16 clips (4 of noise dealt evenly)" in said, said
    record = yaml.safe_load((tmp_path / "out" / "whisper-train.yaml").read_text())["record"]
    assert record["data"]["nonspeech_placement"] == "spread"
    card = (tmp_path / "out" / "final" / "README.md").read_text()
    assert "25% of each epoch, taught" in card and "dealt evenly through the steps" in card

    _forget_the_placement(tmp_path / "out" / "checkpoint-1")
    train(tiny_run_config(**common, max_steps=2, resume="latest"))
    said = capsys.readouterr().out
    assert "data: 16 clips" in said and "dealt evenly" not in said, said
    record = yaml.safe_load((tmp_path / "out" / "whisper-train.yaml").read_text())["record"]
    assert record["data"]["nonspeech_placement"] == "as-clips"


def test_the_card_says_the_noise_rode_alongside(tiny_run_config, tmp_path):
    """The model card says where the noise trained: in the room the speech's windows left."""
    train(
        tiny_run_config(nonspeech="builtin", nonspeech_share=0.25, packing="per-clip", max_steps=1)
    )
    card = (tmp_path / "out" / "final" / "README.md").read_text()
    assert "25% of each epoch, taught" in card
    assert "riding in the room the speech's windows left" in card
