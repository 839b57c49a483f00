"""Scoring, generation and the evaluate command (tiny seeded models; synthesised speech)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import soundfile
import torch

from whisper_train.commands import evaluate as evaluate_command
from whisper_train.data.examples import Example
from whisper_train.data.features import LogMel
from whisper_train.errors import UserError
from whisper_train.evaluation.evaluate import (
    evaluate_examples,
    generate_texts,
    get_normalizer,
    report_paths,
    score,
    write_report_json,
)
from whisper_train.evaluation.report import write_curves_png
from whisper_train.transcription.decoding import NO_FALLBACK

# -- scoring --------------------------------------------------------------------------------


def test_english_normaliser_ignores_case_punctuation_and_spelling():
    scores = score(["Hello, Mr. Smith! It's colour."], ["hello mister smith it is color"])
    assert scores.wer == 0.0
    assert scores.cer == 0.0
    # The raw text differs in case, punctuation and spelling: the orthographic WER shows it.
    assert scores.orthographic_wer > 0.5


def test_counts_substitutions_deletions_insertions():
    scores = score(["the cat sat", "a b c d"], ["the cat sat on", "a x c"], normalizer="none")
    assert (scores.substitutions, scores.deletions, scores.insertions) == (1, 1, 1)
    assert scores.reference_words == 7
    assert scores.wer == pytest.approx(3 / 7)
    assert scores.insertion_rate == pytest.approx(1 / 7)
    assert [row.errors for row in scores.rows] == [1, 2]
    assert scores.rows[1].wer == pytest.approx(2 / 4)


def test_empty_reference_counts_hypothesis_words_as_insertions():
    scores = score(["", "hello world"], ["thank you", "hello world"], normalizer="english")
    assert scores.rows[0].wer is None
    assert scores.insertions == 2
    assert scores.wer == pytest.approx(2 / 2)
    with pytest.raises(UserError, match="empty after normalisation"):
        score(["uh, um", ""], ["a", "b"])


def test_loops_and_empty_outputs_are_measured():
    looping = score(
        ["go on", "stop here now", "yes"],
        ["go on go on go on go on", "stop here now", ""],
        normalizer="none",
    )
    clean = score(
        ["go on", "stop here now", "yes"], ["go on", "stop here now", "yes"], normalizer="none"
    )
    assert looping.repeated_ngram_rate > 0.5
    assert clean.repeated_ngram_rate == 0.0
    assert looping.empty_output_rate == pytest.approx(1 / 3)
    assert clean.empty_output_rate == 0.0


def test_default_normaliser_depends_on_language():
    assert get_normalizer(language="en")("Mr. Smith") == "mister smith"
    assert get_normalizer(language="de")("Mr. Smith") == "mr smith"
    assert get_normalizer("none")("  Mr.   Smith ") == "Mr. Smith"
    with pytest.raises(UserError, match="--normalizer"):
        get_normalizer("french")


# -- generation -----------------------------------------------------------------------------


def _batch(processor, seconds=(1.0, 2.0)):
    rng = np.random.default_rng(0)
    clips = [(0.1 * rng.standard_normal(int(16_000 * s))).astype(np.float32) for s in seconds]
    return {
        "input_features": LogMel(processor.feature_extractor)(clips),
        "audio": clips,
        "texts": ["a", "b"],
    }


@pytest.mark.long
def test_generate_texts_restores_training_mode_and_matches_plain_generate(tiny_whisper):
    model, processor = tiny_whisper
    batch = _batch(processor)
    with torch.inference_mode():
        expected = processor.batch_decode(
            model.generate(input_features=batch["input_features"], max_length=20),
            skip_special_tokens=True,
        )
    model.train()
    # Without the fallback, one plain generate call: the random model's unlikely outputs are
    # kept as they are (with it, they would be sampled again: tests/test_decoding.py).
    texts = generate_texts(model, processor, [batch], max_length=20, decoding=NO_FALLBACK)
    assert model.training, "generate_texts must give the model back in training mode"
    assert texts == [text.strip() for text in expected]
    assert len(texts) == 2
    model.train()
    generate_texts(model, processor, [batch], max_length=20)
    assert model.training, "and with the fallback too"


@pytest.mark.long
def test_generate_texts_takes_waveforms_or_cached_encoder_outputs(tiny_whisper):
    # With the fallback on (the random model's outputs are all unlikely, so every row is
    # sampled again): the same seeded samples from features, waveforms or encoder outputs.
    model, processor = tiny_whisper
    batch = _batch(processor)
    from_features = generate_texts(model, processor, [batch], max_length=20)
    waveforms = {"audio": batch["audio"], "texts": batch["texts"]}
    assert generate_texts(model, processor, [waveforms], max_length=20) == from_features
    with torch.no_grad():
        hidden = model.model.encoder(batch["input_features"]).last_hidden_state
    cached = {"encoder_hidden_states": hidden, "texts": batch["texts"]}
    assert generate_texts(model, processor, [cached], max_length=20) == from_features


def test_generate_texts_works_on_a_peft_model(tiny_whisper):
    from peft import LoraConfig, get_peft_model

    model, processor = tiny_whisper
    batch = _batch(processor)
    base_texts = generate_texts(model, processor, [batch], max_length=20, decoding=NO_FALLBACK)
    # Fresh LoRA adapters start as a no-op (B = 0): transcripts must not change.
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft_texts = generate_texts(peft_model, processor, [batch], max_length=20, decoding=NO_FALLBACK)
    assert peft_texts == base_texts


# -- evaluate_examples, the JSON report, the CLI -------------------------------------------


def _write_clip(path, seconds, seed):
    rng = np.random.default_rng(seed)
    soundfile.write(
        path, (0.1 * rng.standard_normal(int(16_000 * seconds))).astype(np.float32), 16_000
    )
    return str(path)


def test_evaluate_examples_reports_every_clip_and_skips_unreadable(tiny_whisper, tmp_path):
    model, processor = tiny_whisper
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"not audio at all")
    examples = [
        Example(audio=_write_clip(tmp_path / "a.wav", 1.0, 0), text="hello there"),
        Example(audio=str(broken), text="never read"),
        Example(audio=_write_clip(tmp_path / "b.wav", 1.5, 1), text="good morning"),
    ]
    report = evaluate_examples(model, processor, examples, batch_size=2, max_length=20)
    assert report.scores.n == 2
    assert [s["audio"] for s in report.skipped] == [str(broken)]
    written = json.loads(write_report_json(report, tmp_path / "out" / "report.json").read_text())
    assert written["n"] == 2
    assert written["wer"] == pytest.approx(report.wer) and written["cer"] == pytest.approx(
        report.cer
    )
    assert [u["reference"] for u in written["utterances"]] == ["hello there", "good morning"]
    assert all({"hypothesis", "errors", "audio"} <= set(u) for u in written["utterances"])


def test_when_no_clip_reads_the_error_names_the_first_clip_and_why(tiny_whisper, tmp_path):
    model, processor = tiny_whisper
    examples = [Example(audio=str(tmp_path / f"gone{i}.wav"), text="lost") for i in range(2)]

    with pytest.raises(UserError) as caught:
        evaluate_examples(model, processor, examples, batch_size=2, max_length=20)

    message = str(caught.value)
    assert "none of the 2 clips could be read" in message
    assert f"{tmp_path / 'gone0.wav'}: file not found" in message


@pytest.mark.speech
def test_evaluate_command_with_baseline_writes_comparison(tiny_whisper_dir, tmp_path):
    from whisper_train.data.synth import synthesize

    sentences = [
        "the quick brown fox jumps over the lazy dog",
        "open the door and turn on the light",
    ]
    manifest = tmp_path / "data.jsonl"
    with manifest.open("w") as out:
        for i, text in enumerate(sentences):
            soundfile.write(tmp_path / f"s{i}.wav", synthesize(text), 16_000)
            out.write(json.dumps({"audio": f"s{i}.wav", "text": text}) + "\n")
    parser = argparse.ArgumentParser()
    evaluate_command.add_parser(parser.add_subparsers())
    report_json = tmp_path / "eval" / "report.json"
    # The real tiny.en is "after", the random tiny model the "baseline": tiny.en must win.
    args = parser.parse_args(
        [
            "evaluate",
            "--model",
            "tiny.en",
            "--data",
            str(manifest),
            "--output",
            str(report_json),
            "--baseline",
            str(tiny_whisper_dir),
            "--generation-max-length",
            "40",
        ]
    )
    assert args.handler(args) == 0
    after = json.loads(report_json.read_text())
    before = json.loads((tmp_path / "eval" / "report.baseline.json").read_text())
    assert after["wer"] < 0.35 < before["wer"]
    markdown = (tmp_path / "eval" / "report.md").read_text()
    assert "Got better" in markdown and "s0.wav" in markdown
    assert (tmp_path / "eval" / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_curves_png_from_metrics_jsonl(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [
        json.dumps({"step": s, "loss": 3.0 / s, "lr": 1e-5, "epoch": s / 10}) for s in range(1, 6)
    ]
    lines.append(json.dumps({"step": 5, "eval_loss": 0.9, "wer": 0.25}))
    metrics.write_text("\n".join(lines) + '\n{"step": 6, "lo')  # a run still writing
    png = write_curves_png(metrics, tmp_path / "curves.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(UserError, match="metrics"):
        write_curves_png(tmp_path / "missing.jsonl", tmp_path / "x.png")


def test_report_paths_follow_output_baseline_and_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = ["report.json", "report.baseline.json", "report.md", "report.png"]
    assert report_paths("some-model") == []  # nothing asked for: nothing written
    assert report_paths("m", output=tmp_path / "r.json") == [tmp_path / "r.json"]
    assert report_paths("m", output=f"{tmp_path}/new/") == [tmp_path / "new" / "report.json"]
    beside = report_paths("m", output=tmp_path / "r.json", baseline="b")
    assert [p.name for p in beside] == ["r.json", "r.baseline.json", "r.md", "r.png"]
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    in_run = report_paths(str(run), baseline="b")
    assert [p.name for p in in_run] == names and {p.parent for p in in_run} == {run / "evaluation"}
    assert report_paths("not-a-run", baseline="b")[0] == tmp_path / "report.json"


def _evaluate_argv(model, data, *extra) -> list[str]:
    return [
        "evaluate",
        "--model",
        str(model),
        "--data",
        str(data),
        "--eval-subset",
        "2",
        "--generation-max-length",
        "4",
        *extra,
    ]


def test_evaluate_refuses_to_replace_a_report_unless_overwrite(
    tiny_whisper_dir, tone_dataset, tmp_path, capsys
):
    from whisper_train.cli import main

    report = tmp_path / "report.json"
    report.write_text('{"wer": 0.05, "note": "last week"}')
    argv = _evaluate_argv(tiny_whisper_dir, tone_dataset, "--output", str(report))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(report) in err and "--overwrite" in err and "Traceback" not in err
    assert report.read_text() == '{"wer": 0.05, "note": "last week"}'

    assert main([*argv, "--overwrite"]) == 0
    assert json.loads(report.read_text())["n"] == 2
    captured = capsys.readouterr()
    assert f"wrote report.json to {tmp_path}" in captured.out
    assert "\r" not in captured.out + captured.err  # not a terminal: no progress bar


def test_evaluate_puts_a_comparison_of_a_run_into_the_run_folder(
    tiny_whisper_dir, tone_dataset, tmp_path, capsys, monkeypatch
):
    import shutil

    from whisper_train.cli import main

    run = tmp_path / "run"
    shutil.copytree(tiny_whisper_dir, run / "final")
    (run / "whisper-train.yaml").write_text("model: {}\n")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    names = ["report.json", "report.baseline.json", "report.md", "report.png"]

    for model in (run, run / "final"):  # the run folder, or its final model
        argv = _evaluate_argv(model, tone_dataset, "--baseline", str(tiny_whisper_dir))
        assert main([*argv, "--overwrite"]) == 0
        assert sorted(p.name for p in (run / "evaluation").iterdir()) == sorted(names)
        assert list(elsewhere.iterdir()) == []  # nothing silently in the current folder
        assert f"to {(run / 'evaluation').resolve()}" in capsys.readouterr().out
    assert main(argv) == 2  # and a second comparison does not silently replace the first
    assert "--overwrite" in capsys.readouterr().err

    # Not a run folder: the current folder, and the line says which one.
    argv = _evaluate_argv(tiny_whisper_dir, tone_dataset, "--baseline", str(tiny_whisper_dir))
    assert main(argv) == 0
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted(names)
    assert f"to {elsewhere.resolve()}" in capsys.readouterr().out


def test_evaluate_scores_several_named_sets_into_a_folder_each(
    tiny_whisper_dir, tone_dataset, tmp_path, capsys
):
    from conftest import write_tone_dataset

    from whisper_train.cli import main

    other = write_tone_dataset(tmp_path / "other", n=2, seed=3)
    argv = _evaluate_argv(tiny_whisper_dir, f"tones={tone_dataset}", "--output", str(tmp_path))
    argv += ["--data", f"other={other}"]
    assert main(argv) == 0
    tones = json.loads((tmp_path / "tones" / "report.json").read_text())
    others = json.loads((tmp_path / "other" / "report.json").read_text())
    assert (tones["n"], others["n"]) == (2, 2)  # --eval-subset 2 of each
    out = capsys.readouterr().out
    assert f"[tones] {tone_dataset}" in out and f"[other] {other}" in out


def test_a_set_of_empty_transcripts_is_refused_before_decoding_and_named_nonspeech(
    tiny_whisper_dir, tone_dataset, tmp_path, capsys, monkeypatch
):
    """Every transcript empty: WER is undefined. Refused in one line before any clip is
    decoded (not after the whole set is transcribed), pointing to the NAME:nonspeech=PATH
    kind that such a set is; given so, it is scored."""
    from whisper_train.cli import main
    from whisper_train.evaluation import evaluate as evaluate_module

    manifest = tmp_path / "quiet.jsonl"
    manifest.write_text(
        "".join(
            json.dumps({"audio": str(tone_dataset / f"clip{i:03d}.wav"), "text": ""}) + "\n"
            for i in range(2)
        )
    )

    def not_loaded(spec):
        raise AssertionError("the model was loaded to decode a set it then refused")

    with monkeypatch.context() as patch:
        patch.setattr(evaluate_module, "load_model", not_loaded)
        assert main(["evaluate", "--model", str(tiny_whisper_dir), "--data", str(manifest)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--data {manifest}: all 2 transcripts are empty" in err, err
    assert f"--data NAME:nonspeech={manifest}" in err and "\n" not in err, err
    nonspeech = ["--data", f"quiet:nonspeech={manifest}", "--generation-max-length", "2"]
    assert main(["evaluate", "--model", str(tiny_whisper_dir), *nonspeech]) == 0


def test_references_empty_after_normalisation_point_to_the_nonspeech_kind():
    with pytest.raises(UserError, match=r"NAME:nonspeech=PATH"):
        score(["uh, um", ""], ["thank you", "hi"])
