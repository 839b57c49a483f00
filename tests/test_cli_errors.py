"""A mistake a user can make gets one line naming the input and the remedy, and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from whisper_train.cli import main


def _one_line_error(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1, err
    assert "Traceback" not in "\n".join(err)
    return errors[0]


def test_missing_model_path(capsys, tmp_path, tone_dataset):
    line = _one_line_error(
        capsys,
        [
            "train",
            "--model",
            str(tmp_path / "nope"),
            "--data",
            str(tone_dataset),
            "--output-dir",
            str(tmp_path / "o"),
        ],
    )
    assert str(tmp_path / "nope") in line and "no such folder" in line


def test_model_folder_with_neither_format(capsys, tmp_path, tone_dataset):
    (tmp_path / "empty-model").mkdir()
    line = _one_line_error(
        capsys,
        [
            "train",
            "--model",
            str(tmp_path / "empty-model"),
            "--data",
            str(tone_dataset),
            "--output-dir",
            str(tmp_path / "o"),
        ],
    )
    assert "neither" in line and "CTranslate2" in line


def test_missing_data_path(capsys, tmp_path, tiny_whisper_dir):
    line = _one_line_error(
        capsys,
        [
            "train",
            "--model",
            str(tiny_whisper_dir),
            "--data",
            str(tmp_path / "nodata"),
            "--output-dir",
            str(tmp_path / "o"),
        ],
    )
    assert str(tmp_path / "nodata") in line


def test_data_folder_with_no_layout(capsys, tmp_path, tiny_whisper_dir):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("hello")
    line = _one_line_error(
        capsys,
        [
            "train",
            "--model",
            str(tiny_whisper_dir),
            "--data",
            str(tmp_path / "d"),
            "--output-dir",
            str(tmp_path / "o"),
        ],
    )
    assert "metadata.csv" in line


def test_manifest_without_text_column(capsys, tmp_path, tiny_whisper_dir):
    manifest = tmp_path / "m.csv"
    manifest.write_text("audio,speaker\nx.wav,1\n")
    line = _one_line_error(
        capsys,
        [
            "train",
            "--model",
            str(tiny_whisper_dir),
            "--data",
            str(manifest),
            "--output-dir",
            str(tmp_path / "o"),
        ],
    )
    assert "text" in line and "speaker" in line  # names what it found and what it accepts


def test_empty_after_screening(capsys, tmp_path, tiny_whisper_dir):
    import numpy as np
    import soundfile as sf

    folder = tmp_path / "long"
    folder.mkdir()
    sf.write(folder / "a.wav", np.zeros(16_000 * 31, dtype=np.float32), 16_000)  # over 30 s
    (folder / "metadata.csv").write_text("file_name,text\na.wav,too long\n")
    line = _one_line_error(
        capsys,
        [
            "train",
            "--model",
            str(tiny_whisper_dir),
            "--data",
            str(folder),
            "--output-dir",
            str(tmp_path / "o"),
            "--only-train",
        ],
    )
    assert "no usable training utterances" in line and "check-data" in line


def test_strict_turns_a_skip_into_an_error(capsys, tmp_path, tiny_whisper_dir):
    import numpy as np
    import soundfile as sf

    folder = tmp_path / "mixed"
    folder.mkdir()
    sf.write(folder / "ok.wav", np.zeros(16_000, dtype=np.float32), 16_000)
    (folder / "bad.wav").write_bytes(b"garbage")
    (folder / "metadata.csv").write_text("file_name,text\nok.wav,fine\nbad.wav,broken\n")
    line = _one_line_error(
        capsys,
        [
            "train",
            "--model",
            str(tiny_whisper_dir),
            "--data",
            str(folder),
            "--output-dir",
            str(tmp_path / "o"),
            "--only-train",
            "--strict",
        ],
    )
    assert "bad.wav" in line


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
