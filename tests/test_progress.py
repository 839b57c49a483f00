"""What a training run prints: bars on a terminal, plain lines in a log file (--logging-steps)."""

from __future__ import annotations

import re

import pytest
from conftest import metric_rows, train_argv

import whisper_train.training.setup_phases as setup_phases
from whisper_train.cli import main

STEP_LINE = re.compile(r"^step (\d+)/(\d+)  loss (\S+)  lr (\S+)$")


def _train(tone_dataset, tiny_whisper_dir, out, *extra: str) -> int:
    return main(
        train_argv(
            tone_dataset,
            tiny_whisper_dir,
            out,
            "--mode",
            "freeze-encoder",  # the encoder cache has a progress bar of its own
            "--max-steps",
            "5",
            "--batch-size",
            "4",
            "--eval-split",
            "0.25",
            "--eval-steps",
            "2",
            "--generation-max-length",
            "4",
            "--seed",
            "0",
            "--temperatures",
            "0",  # decode once: a random model's outputs would all take the fallback
            *extra,
        )
    )


def test_a_log_file_gets_plain_lines_every_logging_steps(
    tmp_path, tone_dataset, tiny_whisper_dir, capfd
):
    out = tmp_path / "out"
    assert _train(tone_dataset, tiny_whisper_dir, out, "--logging-steps", "2") == 0
    stdout, stderr = capfd.readouterr()  # captured output is not a terminal, as a log file
    assert "\r" not in stdout + stderr
    lines = (stdout + stderr).splitlines()
    step_lines = [STEP_LINE.match(line) for line in lines if STEP_LINE.match(line)]
    # Every 2nd optimizer step, and the last one.
    assert [(int(m[1]), int(m[2])) for m in step_lines] == [(2, 5), (4, 5), (5, 5)]
    # Each reports the mean loss of the steps since the previous line; metrics.jsonl keeps
    # every step.
    losses = [row["loss"] for row in metric_rows(out) if "loss" in row]
    assert len(losses) == 5
    windows = [losses[0:2], losses[2:4], losses[4:5]]
    for match, window in zip(step_lines, windows, strict=True):
        assert float(match[3]) == pytest.approx(sum(window) / len(window), abs=1e-4)
    lrs = [row["lr"] for row in metric_rows(out) if "lr" in row]
    assert [float(m[4]) for m in step_lines] == pytest.approx([lrs[1], lrs[3], lrs[4]], rel=1e-2)
    # One table row per evaluation (steps 2, 4 and the closing one at 5).
    rows = [line for line in lines if re.match(r"^\s+\d+ \| ", line)]
    assert [int(row.split("|")[0]) for row in rows] == [2, 4, 5]
    # accelerate calls fp32 "no"; the user asked for fp32 (or auto on a CPU).
    assert "precision fp32" in stdout and "precision no" not in stdout


def test_a_terminal_gets_the_bar_instead_of_step_lines(
    tmp_path, tone_dataset, tiny_whisper_dir, capsys, monkeypatch
):
    monkeypatch.setattr(setup_phases, "progress_bars_wanted", lambda: True)
    out = tmp_path / "out"
    assert _train(tone_dataset, tiny_whisper_dir, out) == 0
    captured = capsys.readouterr()
    assert "training:" in captured.err and "\r" in captured.err  # tqdm's bar
    assert not any(STEP_LINE.match(line) for line in captured.out.splitlines())


@pytest.mark.parametrize(("rank", "shown"), [("0", True), ("1", False)])
def test_only_the_main_process_of_a_launched_run_prints_info_lines(
    rank, shown, monkeypatch, caplog
):
    # Under torchrun or accelerate launch every process runs `main`: an info line such as
    # "screening: N clips, as screened before (cached)" came once per process.
    import logging

    import whisper_train.cli as cli

    package = logging.getLogger("whisper_train")
    monkeypatch.setattr(package, "level", package.level)  # restored after the test
    monkeypatch.setenv("RANK", rank)

    def handled(_args):
        logging.getLogger("whisper_train.data.screening").info("screening: 4 clips (cached)")
        logging.getLogger("whisper_train.data.screening").warning("a clip was left out")
        return 0

    monkeypatch.setattr(cli, "_handled", handled)
    caplog.set_level(logging.INFO)
    assert cli.main(["doctor"]) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert ("screening: 4 clips (cached)" in messages) is shown
    assert "a clip was left out" in messages
