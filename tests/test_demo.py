"""The demo's data: three sets, held-out speakers and words unseen in training, reused when the
plan is the same. (The whole demo takes minutes: `make demo`, not the test suite.)"""

from __future__ import annotations

import argparse
import csv
import inspect
import sys
from dataclasses import astuple
from pathlib import Path
from types import SimpleNamespace

import pytest

from whisper_train import demo as demo_module
from whisper_train.cli import build_parser
from whisper_train.data import synth
from whisper_train.demo import DemoResult, prepare_demo_data, print_comparison, run_demo


def _rows(folder: Path) -> list[dict]:
    with (folder / synth.METADATA_FILE).open(newline="", encoding="utf-8") as stream:
        return list(csv.DictReader(stream))


@pytest.mark.speech
def test_demo_data_holds_out_speakers_and_words(tmp_path):
    dirs = prepare_demo_data(
        tmp_path, train_utterances=4, eval_utterances=3, guard_utterances=2, seed=5
    )
    rows = {name: _rows(dirs[name]) for name in demo_module.SETS}
    assert {name: len(r) for name, r in rows.items()} == {"train": 4, "held-out": 3, "guard": 2}
    for name in demo_module.SETS:
        assert all((dirs[name] / row["file_name"]).is_file() for row in rows[name])
    # Where nobody speaks: six clips of the built-in non-speech set, no transcript.
    assert len(list(dirs["nonspeech"].glob("*.wav"))) == len(demo_module.NONSPEECH_CLIPS) == 6

    voices = {name: {row["voice"] for row in r} for name, r in rows.items()}
    assert voices["train"] <= set(synth.TRAIN_VOICES)
    assert voices["held-out"] <= set(synth.HELD_OUT_VOICES)
    assert voices["guard"] == {synth.GUARD_VOICE}

    train_words, held_out_words = synth.split_vocabulary()

    def content(name: str) -> set[str]:
        return set().union(*(synth.content_words(row["transcription"]) for row in rows[name]))

    assert content("train") <= train_words.words()
    assert content("held-out") <= held_out_words.words()
    assert content("held-out") and not content("held-out") & train_words.words()
    guard_texts = {row["transcription"] for row in rows["guard"]}
    assert not guard_texts & {row["transcription"] for row in rows["train"]}


@pytest.mark.speech
def test_spanish_demo_data_holds_out_voices_and_words_and_states_its_language(tmp_path):
    dirs = prepare_demo_data(
        tmp_path,
        train_utterances=4,
        eval_utterances=3,
        guard_utterances=2,
        seed=5,
        language="es",
    )
    rows = {name: _rows(dirs[name]) for name in demo_module.SETS}
    assert {row["language"] for name in ("train", "held-out") for row in rows[name]} == {"es"}
    assert "language" not in rows["guard"][0]  # English, stated by the demo as guard:en=
    assert {row["voice"] for row in rows["train"]} <= set(synth.SPANISH_TRAIN_VOICES)
    assert {row["voice"] for row in rows["held-out"]} <= set(synth.SPANISH_HELD_OUT_VOICES)
    train_words, held_out_words = synth.split_spanish_words()
    held_out_phrases = [w for words in astuple(held_out_words) for w in words]
    train_phrases = [w for words in astuple(train_words) for w in words]
    for row in rows["held-out"]:  # every held-out sentence holds a phrase training never says
        assert any(phrase in row["transcription"].lower() for phrase in held_out_phrases)
    assert not set(held_out_phrases) & set(train_phrases)
    assert dirs["guard"] == tmp_path / "guard"  # the English guard is shared with the en demo


@pytest.mark.speech
def test_demo_data_is_reused_only_for_the_same_plan(tmp_path):
    dirs = prepare_demo_data(
        tmp_path, train_utterances=2, eval_utterances=1, guard_utterances=1, seed=0
    )
    first_clip = dirs["train"] / "utt_00000.wav"
    written = first_clip.stat().st_mtime_ns
    again = prepare_demo_data(
        tmp_path, train_utterances=2, eval_utterances=1, guard_utterances=1, seed=0
    )
    assert again == dirs and first_clip.stat().st_mtime_ns == written  # not synthesised again
    prepare_demo_data(tmp_path, train_utterances=3, eval_utterances=1, guard_utterances=1, seed=0)
    assert len(_rows(dirs["train"])) == 3


def test_command_defaults_are_the_library_defaults():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    demo = subparsers.choices["demo"]
    defaults = {a.dest: a.default for a in demo._actions if a.option_strings and a.dest != "help"}
    signature = inspect.signature(run_demo).parameters
    assert defaults == {name: signature[name].default for name in defaults}


def test_printout_says_what_was_unseen_and_shows_before_and_after(tmp_path, capsys):
    def row(step, name, wer, loops):
        return {"step": step, "set": name, "wer": wer, "repeated_ngram_rate": loops}

    data_dirs = {}
    for name in ("held-out", "guard"):
        data_dirs[name] = tmp_path / name
        data_dirs[name].mkdir()
        lines = ["file_name,transcription,voice"] + [f"{i}.wav,a,en" for i in range(48)]
        (data_dirs[name] / synth.METADATA_FILE).write_text("\n".join(lines) + "\n")
    evaluations = [
        row(0, "held-out", 0.6, 0.02),
        row(0, "guard", 0.25, 0.0),
        {"step": 0, "set": "nonspeech", "words_per_minute": 12.5},
        row(32, "held-out", 0.3, 0.01),
        row(32, "guard", 0.26, 0.0),
        {"step": 32, "set": "nonspeech", "words_per_minute": 40.0},
    ]
    result = SimpleNamespace(
        evaluations=evaluations,
        final_step=32,
        steps=32,
        final_reason="best held-out WER",
        train_examples=256,
        final_dir=Path("run/final"),
    )
    demo = DemoResult(result, data_dirs, seconds=300.0)
    print_comparison(demo, model="tiny.en", mode="lora")
    out = capsys.readouterr().out
    assert "held-out WER (48 utterances)" in out and "60.0%" in out and "30.0%" in out
    assert "-30.0" in out and "+1.0" in out  # points of change, guard included
    assert "repeated 3-grams" in out
    nonspeech = next(line for line in out.splitlines() if "where nobody speaks (24 s)" in line)
    assert nonspeech.split()[-3:] == ["12.5", "40.0", "+27.5"]  # words per minute, not %
    assert "content words that training never saw" in out
    assert all(accent in out for accent in synth.HELD_OUT_ACCENTS)
    assert all(variant in out for variant in synth.HELD_OUT_VARIANTS)
    assert synth.GUARD_VOICE in out


def test_the_advice_printed_runs_as_pasted(tmp_path, monkeypatch):
    """The demo's closing `try it:` line names whisper-train as it was started: the Quickstart's
    `.venv/bin/whisper-train` is not on PATH, so a bare `whisper-train` would not be found."""
    script = tmp_path / "venv" / "bin" / "whisper-train"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), "demo"])
    monkeypatch.setenv("PATH", "/nonexistent")
    assert demo_module.this_command() == "venv/bin/whisper-train"
    monkeypatch.setenv("PATH", str(script.parent))
    assert demo_module.this_command() == "whisper-train"
    monkeypatch.setattr(sys, "argv", ["/x/whisper_train/__main__.py", "demo"])
    assert demo_module.this_command().endswith(" -m whisper_train")
