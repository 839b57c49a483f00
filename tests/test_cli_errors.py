"""A mistake a user can make gets one line naming the input and the remedy, and exit code 2."""

from __future__ import annotations

import argparse
import logging
import re
import subprocess
import sys
from dataclasses import fields

import numpy as np
import pytest
import soundfile as sf
import torch

from whisper_train.cli import build_parser, main
from whisper_train.commands.distill import distill_config
from whisper_train.commands.evaluate import decoding_from_args
from whisper_train.commands.flags import config_from_args
from whisper_train.config import GROUPS
from whisper_train.errors import UserError
from whisper_train.formats import runtimes
from whisper_train.transcription import transcribe as transcribe_module


def _one_line_error(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1, err
    assert "Traceback" not in "\n".join(err)
    return errors[0]


# A bad --model or --data for `train`: each case builds its inputs in tmp_path (given the tiny
# model and the tone dataset for the other of the two) and returns (--model, --data, further
# flags, what the one error line must contain).


def _missing_model_path(tmp_path, model, data):
    return tmp_path / "nope", data, [], [str(tmp_path / "nope"), "no such folder"]


def _model_folder_with_neither_format(tmp_path, model, data):
    (tmp_path / "empty-model").mkdir()
    return tmp_path / "empty-model", data, [], ["neither", "CTranslate2"]


def _missing_data_path(tmp_path, model, data):
    return model, tmp_path / "nodata", [], [str(tmp_path / "nodata")]


def _data_folder_with_no_layout(tmp_path, model, data):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("hello")
    return model, tmp_path / "d", [], ["metadata.csv"]


def _manifest_without_text_column(tmp_path, model, data):
    manifest = tmp_path / "m.csv"
    manifest.write_text("audio,speaker\nx.wav,1\n")
    return model, manifest, [], ["text", "speaker"]  # what it found and what it accepts


def _empty_after_screening(tmp_path, model, data):
    folder = tmp_path / "long"
    folder.mkdir()
    sf.write(folder / "a.wav", np.zeros(16_000 * 31, dtype=np.float32), 16_000)  # over 30 s
    (folder / "metadata.csv").write_text("file_name,text\na.wav,too long\n")
    return model, folder, ["--only-train"], ["no usable training utterances", "check-data"]


def _strict_turns_a_skip_into_an_error(tmp_path, model, data):
    folder = tmp_path / "mixed"
    folder.mkdir()
    sf.write(folder / "ok.wav", np.zeros(16_000, dtype=np.float32), 16_000)
    (folder / "bad.wav").write_bytes(b"garbage")
    (folder / "metadata.csv").write_text("file_name,text\nok.wav,fine\nbad.wav,broken\n")
    return model, folder, ["--only-train", "--strict"], ["bad.wav"]


@pytest.mark.parametrize(
    "case",
    [
        _missing_model_path,
        _model_folder_with_neither_format,
        _missing_data_path,
        _data_folder_with_no_layout,
        _manifest_without_text_column,
        _empty_after_screening,
        _strict_turns_a_skip_into_an_error,
    ],
    ids=lambda case: case.__name__.lstrip("_"),
)
def test_bad_model_or_data_is_named(capsys, tmp_path, tiny_whisper_dir, tone_dataset, case):
    model, data, flags, expected = case(tmp_path, tiny_whisper_dir, tone_dataset)
    argv = ["train", "--model", str(model), "--data", str(data)]
    line = _one_line_error(capsys, [*argv, "--output-dir", str(tmp_path / "o"), *flags])
    for fragment in expected:
        assert fragment in line


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--mode", "partial"], "--mode partial"),
        (["--gradient-checkpointing", "sometimes"], "--gradient-checkpointing sometimes"),
        (["--gradient-checkpointing", "auto"], "--max-memory"),
        (["--offload-activations"], "--offload-activations needs gradient checkpointing"),
        (["--mode", "full", "--cache-encoder"], "--cache-encoder needs a frozen encoder"),
        (["--batch-size", "0"], "--batch-size 0"),
        (["--batch-size", "two"], "--batch-size 'two'"),
    ],
)
def test_illegal_flags_name_the_flag(capsys, flags, expected):
    line = _one_line_error(capsys, ["train", "--data", "x", *flags])
    assert expected in line


def test_real_process_exit_code_and_no_traceback(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "whisper_train",
            "train",
            "--data",
            str(tmp_path / "missing"),
            "--model",
            str(tmp_path / "missing-model"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --model")


def _parse_error(capsys, argv) -> str:
    """The one line argparse's side answers with (before anything loads), and exit code 2."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # not train's 50-line usage block first
    return err[0]


def test_a_typo_of_an_option_never_starts_a_run(capsys):
    """`--epoch 2` used to be taken for `--epochs 2` (argparse's abbreviations) and start a run."""
    line = _parse_error(capsys, ["train", "--data", "d", "--epoch", "2"])
    assert "--epoch" in line and "did you mean --epochs?" in line
    assert line.startswith("whisper-train train: error:")  # train's answer, not the top level's


def test_an_unknown_option_is_answered_by_its_command(capsys):
    line = _parse_error(capsys, ["transcribe", "a.wav", "--modle", "m"])
    assert line.startswith("whisper-train transcribe: error:") and "did you mean --model?" in line
    assert "whisper-train transcribe --help" in line


@pytest.mark.parametrize("value", ["-1e-5", "-2E+3", "-.5"])
def test_a_negative_number_is_a_value_and_refused_in_the_flags_words(capsys, value):
    """`--learning-rate -1e-5` was 51 lines of usage and "expected one argument"."""
    line = _one_line_error(capsys, ["train", "--data", "d", "--learning-rate", value])
    assert "--learning-rate" in line and "above 0" in line


def test_a_value_that_is_not_a_number_is_said_in_the_users_words(capsys):
    """Not "is not a valid float | None": what the flag expects, with an example."""
    line = _one_line_error(capsys, ["train", "--data", "d", "--learning-rate", "abc"])
    assert "--learning-rate 'abc': expected a number" in line and "float" not in line
    line = _one_line_error(capsys, ["train", "--data", "d", "--batch-size", "2.5"])
    assert "--batch-size '2.5': expected a whole number" in line and "int" not in line


# -- every option of every command, given a bad value -------------------------------------------

PARSER = build_parser()
TRAIN_FIELDS = {f.name: f for group in GROUPS.values() for f in fields(group)}
# Free text, checked where it is used (a path, a model, a name, a language), each by its own
# test: the walk below gives every other option a value it must refuse.
FREE_TEXT = {
    "config", "data", "eval_data", "data_format", "language", "model", "output_dir",
    "encoder_cache_dir", "resume", "output", "baseline", "check_data", "find_alignment_heads",
    "alignment_reference", "png", "model_key", "lora_targets", "nonspeech",
    "new_language", "new_language_init",  # a code of the user's choosing, a language as --language
    "teacher", "student", "assistant",  # models, read as --model is
}  # fmt: skip
DECODING = {"temperatures", "compression_ratio_threshold", "logprob_threshold"}


def _commands(parser=PARSER, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*prefix, name))
    if prefix and not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
        yield prefix, parser


def _numeric(action) -> bool:
    field = TRAIN_FIELDS.get(action.dest)
    typed = getattr(action.type, "__name__", "") in ("whole number", "number")
    return typed or (field is not None and str(field.type).startswith(("int", "float")))


def _bad_values():
    for words, parser in _commands():
        required = {
            "evaluate": ["--model", "m", "--data", "d"],
            "export": ["--model", "m"],
            "distill": ["--teacher", "t", "--decoder-layers", "2", "--mode", "full"],
            "pseudo-label": ["--model", "m", "--data", "d", "--output", "o.jsonl"],
        }
        base = [*words, *required.get(words[0], [])]
        base += ["--output", "o"] if words[0] == "export" else []
        base += ["a.wav"] if words[0] == "transcribe" else []
        base += ["d"] if words[0] == "check-data" else []
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or action.dest in FREE_TEXT:
                continue
            for value in ("abc", "-5") if _numeric(action) else ("abc",):
                yield pytest.param(
                    base, action, value, id=f"{' '.join(words)} {action.dest}={value}"
                )


def _refusal(capsys, argv, action) -> str:
    """The line a bad value gets: argparse's (before anything runs), or the configuration's
    (train and doctor), or the decoding options' (evaluate, transcribe)."""
    try:
        args = PARSER.parse_args(argv)
        if argv[0] in ("train", "doctor"):
            config_from_args(args)
        elif argv[0] == "distill":
            distill_config(args)
        elif action.dest in DECODING or action.dest == "no_speech_threshold":
            decoding_from_args(args)
    except SystemExit:
        return capsys.readouterr().err.strip()
    except UserError as exc:
        return str(exc)
    raise AssertionError(f"{argv}: accepted")


@pytest.mark.parametrize(("base", "action", "value"), list(_bad_values()))
def test_a_bad_value_is_refused_in_the_flags_words(capsys, base, action, value):
    """`demo --train-utterances -5` said "n_utterances must be at least 1"; every option that
    takes a number or a word from a list says, as typed, which flag and what it takes."""
    flag = action.option_strings[0]
    line = _refusal(capsys, [*base, flag, value], action)
    assert len(line.splitlines()) == 1, line
    assert flag in line and value in line, line
    accepted = ("expected", "choose from", "at least", "the sets are")
    assert any(words in line for words in accepted), line
    assert not re.search(r"\b(float|int|str|NoneType|None|invalid)\b|Error", line), line
    assert "_" not in action.dest or action.dest not in line, line


def test_a_demo_count_below_one_names_the_flag(capsys):
    line = _parse_error(capsys, ["demo", "--train-utterances", "-5"])
    assert "--train-utterances" in line and "at least 1" in line and "n_utterances" not in line


# -- the cheap checks before anything loads -----------------------------------------------------


def test_transcribing_a_missing_file_loads_no_model(capsys, tmp_path, monkeypatch):
    def load_backend(*args, **kwargs):
        raise AssertionError("the model loaded before the inputs were checked")

    monkeypatch.setattr(transcribe_module, "load_backend", load_backend)
    line = _one_line_error(capsys, ["transcribe", str(tmp_path / "nope.wav")])
    assert str(tmp_path / "nope.wav") in line and "no such file" in line


def test_export_of_a_missing_model_says_only_that(capsys, caplog, tmp_path):
    caplog.set_level(logging.INFO)
    line = _one_line_error(
        capsys, ["export", "--model", str(tmp_path / "nope"), "--output", str(tmp_path / "o")]
    )
    assert "--model" in line and "no such folder" in line
    assert not [r.getMessage() for r in caplog.records if "quantization" in r.getMessage()]


def test_check_data_on_one_recording_says_what_to_pass(capsys, tmp_path):
    sf.write(tmp_path / "one.wav", np.zeros(16_000, dtype=np.float32), 16_000)
    line = _one_line_error(capsys, ["check-data", str(tmp_path / "one.wav")])
    assert "one recording" in line and "folder" in line and "manifest" in line
    assert "commonvoice" not in line  # not every layout listed


def test_a_cpu_transcription_prints_no_library_chatter(capfd, tmp_path):
    """CTranslate2 warned that float16 is computed in float32 on a CPU, and faster-whisper
    said "Processing audio with duration ..." on every transcription with the default model."""
    sf.write(tmp_path / "a.wav", np.zeros(16_000, dtype=np.float32), 16_000)
    assert main(["transcribe", str(tmp_path / "a.wav")]) == 0
    err = capfd.readouterr().err
    assert "compute type" not in err and "Processing audio" not in err, err


@pytest.mark.parametrize(
    ("stored", "supported", "chosen"),
    [
        ({torch.float16}, {"float32", "int8", "int8_float32", "int16"}, "float32"),  # a CPU
        ({torch.float16}, {"float32", "float16", "int8_float16"}, "float16"),  # a GPU
        ({torch.int8, torch.float16}, {"float32", "int8", "int8_float32"}, "int8_float32"),
        ({torch.int8, torch.float32}, {"float32", "int8", "int8_float32"}, "int8_float32"),
        ({torch.float32}, {"float32", "float16"}, "float32"),
    ],
)
def test_the_ct2_compute_type_is_the_models_where_the_device_has_it(
    monkeypatch, stored, supported, chosen
):
    monkeypatch.setattr(runtimes.ct2, "weight_dtypes", lambda model_dir: stored)
    monkeypatch.setattr("ctranslate2.get_supported_compute_types", lambda d: supported)
    assert runtimes.ct2_compute_type("model", "cpu") == chosen
