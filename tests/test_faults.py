"""Runs that survive: NaN steps, a full disk, an unwritable folder, SIGINT and SIGTERM."""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from conftest import (
    START_LINES,
    metric_rows,
    start_whisper_train,
    train_argv,
    write_tone_dataset,
)
from safetensors.torch import load_file

import whisper_train.data.features as features_module
import whisper_train.training.checkpoints as checkpoints_module
import whisper_train.training.checkpoints.save as checkpoint_save
import whisper_train.training.finish as finish_module
import whisper_train.training.recipe as recipe_module
import whisper_train.training.retention as retention_module
from whisper_train.cli import main
from whisper_train.errors import AudioError, UserError
from whisper_train.training.train import train


def _nan_on_calls(monkeypatch, bad_calls: set[int]) -> None:
    """The training loss turns NaN on the given forward calls (as an fp16 overflow would)."""
    real = recipe_module.loss_terms
    calls = {"n": 0}

    def poisoned(model, batch, **kwargs):
        calls["n"] += 1
        terms = real(model, batch, **kwargs)
        if calls["n"] not in bad_calls:
            return terms
        nan = float("nan")
        return terms._replace(loss=terms.loss * nan, cross_entropy=terms.cross_entropy * nan)

    monkeypatch.setattr(recipe_module, "loss_terms", poisoned)


def test_a_nan_step_is_skipped_and_training_goes_on(tiny_run_config, monkeypatch):
    _nan_on_calls(monkeypatch, {2})
    result = train(tiny_run_config(max_steps=4, save_steps=1, save_total_limit=10))
    rows = metric_rows(result.output_dir)
    assert result.steps == 4 and result.skipped_steps == 1
    assert rows[1]["loss"] is None and "skipped" in rows[1]
    assert all(row["loss"] is not None for i, row in enumerate(rows) if i != 1)
    # The skipped step left the weights as they were; the next one changed them again.
    out = result.output_dir
    key = "model.decoder.layers.0.self_attn.q_proj.weight"
    w = {s: load_file(out / f"checkpoint-{s}" / "trainable.safetensors")[key] for s in (1, 2, 3)}
    assert torch.equal(w[1], w[2]) and not torch.equal(w[2], w[3])
    assert all(torch.isfinite(t).all() for t in w.values())


def test_too_many_bad_steps_stop_with_a_checkpoint_and_advice(
    tmp_path, tiny_run_config, monkeypatch
):
    _nan_on_calls(monkeypatch, set(range(2, 100)))
    with pytest.raises(UserError, match=r"3 optimizer steps in a row.*holds the weights from"):
        train(tiny_run_config(max_steps=50, max_bad_steps=3))
    out = tmp_path / "out"
    # Step 1 trained; steps 2-4 were skipped; the checkpoint holds step 1's (finite) weights.
    assert [p.name for p in checkpoints_module.list_checkpoints(out)] == ["checkpoint-4"]
    weights = load_file(out / "checkpoint-4" / "trainable.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert [row["loss"] is None for row in metric_rows(out)] == [False, True, True, True]


def test_a_resume_after_a_bad_step_stop_gets_the_whole_allowance_again(
    tmp_path, tiny_run_config, monkeypatch
):
    # The remedy for a bad-step stop is a resume with another setting (fp16 -> bf16): the new
    # process must get --max-bad-steps fresh chances, not stop at its first bad step because
    # the checkpoint counted the stopped run's.
    unpoisoned = recipe_module.loss_terms
    _nan_on_calls(monkeypatch, set(range(2, 100)))
    with pytest.raises(UserError, match=r"3 optimizer steps in a row"):
        train(tiny_run_config(max_steps=50, max_bad_steps=3))
    monkeypatch.setattr(recipe_module, "loss_terms", unpoisoned)
    _nan_on_calls(monkeypatch, {1})  # the resumed run's first step is bad, the rest are not
    result = train(tiny_run_config(max_steps=7, max_bad_steps=3, resume="latest"))
    rows = metric_rows(result.output_dir)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert [row["loss"] is None for row in rows[4:]] == [True, False, False]


def test_full_disk_at_save_time_keeps_the_previous_checkpoint(
    tmp_path, tiny_run_config, monkeypatch
):
    real_save = checkpoint_save.save_file
    calls = {"n": 0}

    def disk_fills_up(tensors, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_save, "save_file", disk_fills_up)
    with pytest.raises(UserError, match=r"No space left.*checkpoint-1 is intact"):
        train(tiny_run_config(save_steps=1, save_total_limit=1))
    out = tmp_path / "out"
    assert [p.name for p in checkpoints_module.list_checkpoints(out)] == ["checkpoint-1"]
    assert not list(out.glob("*.tmp"))
    assert load_file(out / "checkpoint-1" / "trainable.safetensors")


def test_a_first_save_that_fails_advises_what_works_and_following_it_trains(
    tmp_path, tiny_run_config, monkeypatch
):
    real_save = checkpoint_save.save_file

    def disk_full(tensors, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint_save, "save_file", disk_full)
    with pytest.raises(UserError, match=r"no earlier checkpoint") as refused:
        train(tiny_run_config(save_steps=1, max_steps=2))
    # No checkpoint to resume from: "--resume latest" would fail; a fresh start works.
    assert "--resume" not in str(refused.value) and "--overwrite" in str(refused.value)
    monkeypatch.setattr(checkpoint_save, "save_file", real_save)
    result = train(tiny_run_config(save_steps=1, max_steps=2, overwrite=True))
    assert result.steps == 2


def test_too_little_free_space_is_refused_before_training(tmp_path, tiny_run_config, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(
        checkpoint_save.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 1000)
    )
    with pytest.raises(UserError, match=r"--output-dir .*1000|--output-dir .*free"):
        train(tiny_run_config())
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_an_output_dir_under_a_file_is_one_line_and_exit_2(tmp_path, tone_dataset, capsys):
    (tmp_path / "taken").write_text("a file, not a folder")
    code = main(
        ["train", "--data", str(tone_dataset), "--output-dir", str(tmp_path / "taken" / "run")]
    )
    assert code == 2
    assert "--output-dir" in capsys.readouterr().err


def test_a_cut_manifest_damaged_past_its_first_rows_stops_a_stream_with_one_line(
    tmp_path, tiny_whisper_dir, capsys
):
    """--max-steps skips the stream's up-front count, so the damage is met in a loader worker,
    mid-pass: still one line naming the file and the remedy, exit 2, no traceback."""
    import gzip

    from test_lhotse import write_cut_windows

    from whisper_train.data.lhotse_cuts import STREAM_PARTS

    manifest = write_cut_windows(tmp_path / "cuts", 2 * STREAM_PARTS, 0.3)
    packed = manifest.read_bytes()
    manifest.write_bytes(packed[: len(packed) * 9 // 10])
    with gzip.open(manifest, "rt") as lines, pytest.raises(EOFError):
        readable = 0
        for _ in lines:
            readable += 1
    # Past the rows the main process reads to split the manifest: a worker meets the damage.
    assert readable > STREAM_PARTS
    argv = train_argv(manifest, tiny_whisper_dir, tmp_path / "out", "--streaming")
    flags = ["--only-train", "--max-steps=4", "--batch-size=2", "--num-workers=2"]
    assert main([*argv, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: {manifest}"), err
    assert "cannot read it as a lhotse CutSet" in err and "CutSet.to_file" in err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_finishes_the_step_saves_and_prints_the_resume_command(
    tmp_path, tone_dataset, tiny_whisper_dir, signum
):
    out = tmp_path / "out"
    argv = train_argv(tone_dataset, tiny_whisper_dir, out)
    argv += ["--max-steps", "100000", "--batch-size", "2", "--only-train", "--seed", "0"]
    process = start_whisper_train(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 150
        metrics = out / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
            assert process.poll() is None, process.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signum, stderr[-2000:]
    found = checkpoints_module.list_checkpoints(out)
    assert len(found) == 1
    step = checkpoints_module.TrainerState.read(found[0]).step
    assert step >= 1 and [row["step"] for row in metric_rows(out)] == list(range(1, step + 1))
    assert f"--resume {found[0]}" in stdout + stderr


def test_bad_clips_are_skipped_as_they_are_read_and_named_once(
    tmp_path, tiny_run_config, capsys, caplog
):
    manifest = write_tone_dataset(tmp_path / "data", n=9, layout="jsonl")
    (manifest.parent / "broken.wav").write_bytes(b"RIFF, and then nothing audio")
    (manifest.parent / "empty.wav").write_bytes(b"")
    with manifest.open("a", encoding="utf-8") as rows:
        rows.write('{"audio": "gone.wav", "text": "alpha bravo"}\n')
        rows.write('{"audio": "broken.wav", "text": "charlie delta"}\n')
        rows.write('{"audio": "empty.wav", "text": "echo foxtrot"}\n')
    # 12 rows in batches of 4: 3 micro-batches an epoch; 6 steps read every bad clip twice
    # (unpacked: tests/test_packing.py skips a clip in packed windows).
    caplog.set_level(logging.DEBUG, logger="whisper_train")  # -v: the data line's detail too
    result = train(tiny_run_config(data=str(manifest), max_steps=6, packing="off"))

    assert result.steps == 6 and result.train_examples == 12
    assert result.skipped_clips == 3  # each bad clip counted once, not once an epoch
    out = capsys.readouterr().out
    assert "(training audio is checked as each clip is read;" in out  # said with -v
    report = out[out.index("epoch 0: clips skipped as they were read:") :].splitlines()
    assert report[0] == "epoch 0: clips skipped as they were read: 3 skipped"
    # One line a reason, commonest first; a reason's clips in the order the shuffle met them.
    unreadable = [
        f"{manifest}:{row} [{manifest.parent / name}]"
        for row, name in ((11, "broken.wav"), (12, "empty.wav"))
    ]
    assert report[1] in (
        f"  2 unreadable audio: {a}, {b}" for a, b in (unreadable, unreadable[::-1])
    )
    assert report[2] == f"  1 audio file not found: {manifest}:10 [{manifest.parent / 'gone.wav'}]"
    assert out.count("clips skipped as they were read") == 1  # named once, not every epoch
    assert "skipped 3 clips during training" in out


def test_an_epoch_of_clips_that_pass_their_header_but_never_decode_stops_with_one_line(
    tiny_run_config, monkeypatch
):
    def undecodable(path, **window):
        raise AudioError(str(path), "cannot decode audio (corrupt frames)")

    monkeypatch.setattr(features_module, "load_audio", undecodable)
    # 12 clips, all training (only_train). Without this stop the loop would start epoch after
    # epoch and never reach a step.
    with pytest.raises(
        UserError,
        match=r"no usable training utterances in a whole epoch \(12 skipped: 12 unreadable audio\)",
    ):
        train(tiny_run_config(max_steps=2))


# torch.save's error when the disk fills (PyTorchStreamWriter): a RuntimeError, not an OSError.
TORCH_SAVE_DISK_FULL = (
    "[enforce fail at inline_container.cc:664] . unexpected pos 1216 vs 1114\n"
    "PytorchStreamWriter failed writing file data/0: file write failed"
)


def test_a_runtime_error_in_torch_save_keeps_the_previous_checkpoint_and_says_why(
    tmp_path, tone_dataset, tiny_whisper_dir, monkeypatch, capsys
):
    real_save = torch.save
    calls = {"n": 0}

    def disk_fills_up(obj, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3:  # checkpoint-1: rng, optimizer, scheduler; checkpoint-2 fails
            raise RuntimeError(TORCH_SAVE_DISK_FULL)
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_save.torch, "save", disk_fills_up)
    out = tmp_path / "out"
    argv = train_argv(tone_dataset, tiny_whisper_dir, out, "--max-steps=3", "--save-steps=1")
    code = main([*argv, "--batch-size=4", "--only-train", "--eval-split=0.25"])

    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    [line] = [line for line in err.splitlines() if "could not write checkpoint" in line]
    assert "checkpoint-2" in line and "checkpoint-1 is intact" in line
    assert "disk full" in line and " free, a checkpoint needs about " in line
    assert [p.name for p in checkpoints_module.list_checkpoints(out)] == ["checkpoint-1"]
    assert not list(out.glob("*.tmp"))
    assert load_file(out / "checkpoint-1" / "trainable.safetensors")


def _evaluation_set_one_process_cannot_use(folder) -> Path:
    """Two evaluation clips, one a process at --batch-size 1: process 1's FLAC has a header that
    reads (it passes the check before step 1) but frames that do not decode, so its batch is
    empty."""
    import json

    import numpy as np
    import soundfile

    folder.mkdir()
    tone = (0.3 * np.sin(np.arange(16_000) / 5)).astype(np.float32)
    soundfile.write(folder / "good.wav", tone, 16_000)
    soundfile.write(folder / "zeroed.flac", tone, 16_000)
    data = (folder / "zeroed.flac").read_bytes()
    (folder / "zeroed.flac").write_bytes(data[:200] + bytes(len(data) - 200))
    rows = [{"audio": "good.wav", "text": "alpha"}, {"audio": "zeroed.flac", "text": "bravo"}]
    manifest = folder / "eval.jsonl"
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return manifest


def test_two_processes_evaluate_with_an_unusable_share_and_stop_together_on_a_failed_save(
    tmp_path, tone_dataset, tiny_whisper_dir
):
    # One two-process run meets two faults (a run apiece would double the cost):
    # 1. at steps 1 and 2 an evaluation where process 1's batch holds no usable clip: it must
    #    still join the gathers, or process 0 waits for it for ever;
    # 2. at step 2 process 1's torch.save fails (a full disk; its first call, checkpoint-1's
    #    rng file, succeeds): process 0, which wrote everything else, must learn of it at the
    #    save and stop with the same line, not wait at the next collective for ever.
    # A sitecustomize in the workers injects the save fault.
    hook = tmp_path / "fault"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import torch\n"
        "    real_save, calls = torch.save, []\n"
        "    def save(*args, **kwargs):\n"
        "        calls.append(1)\n"
        "        if len(calls) > 1:\n"
        f"            raise RuntimeError({TORCH_SAVE_DISK_FULL!r})\n"
        "        return real_save(*args, **kwargs)\n"
        "    torch.save = save\n"
    )
    manifest = _evaluation_set_one_process_cannot_use(tmp_path / "eval")
    out = tmp_path / "out"
    argv = train_argv(tone_dataset, tiny_whisper_dir, out, "--max-steps=3", "--save-steps=1")
    flags = ["--nproc=2", "--batch-size=1", "--eval-steps=1", f"--eval-data={manifest}"]
    flags += ["--generation-max-length=4", "--temperatures=0"]
    path = os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "whisper_train", *argv, *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )

    assert result.returncode == 2, result.stderr[-3000:]
    evaluations = [row for row in metric_rows(out) if "wer" in row]
    assert [row["step"] for row in evaluations] == [1, 2]
    assert all(math.isfinite(row["eval_loss"]) for row in evaluations)
    lines = [line for line in result.stderr.splitlines() if "could not write checkpoint" in line]
    # Process 0 names process 1's failure: it learned of it at the save and stopped (process 1
    # says it too, unless the launcher stops it first: both exit at the same moment).
    assert any("(process 1: disk full: RuntimeError: " in line for line in lines), lines
    assert all("file write failed" in line and "checkpoint-1 is intact" in line for line in lines)
    assert "Traceback" not in result.stderr
    # The processes' lines say why; the launching process adds none of its own.
    assert "could not write checkpoint" in result.stderr.splitlines()[-1]
    assert [p.name for p in checkpoints_module.list_checkpoints(out)] == ["checkpoint-1"]
    assert not list(out.glob("*.tmp"))


def test_sigterm_is_honoured_before_an_evaluation_that_is_due(
    tmp_path, tiny_run_config, monkeypatch
):
    # SIGTERM arrives during step 2, when an evaluation is due (--eval-steps 2): the run saves
    # and exits first, inside the grace period, instead of evaluating and then being killed.
    real = recipe_module.FineTuneRecipe._train_step

    def terminated_in_step_2(recipe, micro_batches):
        if recipe.state.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(recipe, micro_batches)

    monkeypatch.setattr(recipe_module.FineTuneRecipe, "_train_step", terminated_in_step_2)
    with pytest.raises(SystemExit) as stopped:
        train(tiny_run_config(max_steps=4, eval_steps=2, only_train=False))

    assert stopped.value.code == 128 + signal.SIGTERM
    out = tmp_path / "out"
    assert [p.name for p in checkpoints_module.list_checkpoints(out)] == ["checkpoint-2"]
    assert [row["step"] for row in metric_rows(out) if "wer" in row] == []


# -- non-finite audio samples ----------------------------------------------------------------
def _nan_float_wav(path: Path) -> None:
    """A float WAV whose header and frames read, with NaN samples: its log-mel is NaN."""
    import numpy as np
    import soundfile as sf

    samples = (0.2 * np.sin(np.arange(19_200) / 7)).astype(np.float32)
    samples[4000:4010] = np.nan
    sf.write(path, samples, 16_000, subtype="FLOAT")


def test_a_clip_with_nan_samples_is_skipped_and_named_not_a_lost_step(
    tmp_path, tiny_run_config, capsys
):
    manifest = write_tone_dataset(tmp_path / "data", n=7, layout="jsonl")
    _nan_float_wav(manifest.parent / "nan.wav")
    with manifest.open("a", encoding="utf-8") as rows:
        rows.write('{"audio": "nan.wav", "text": "alpha bravo"}\n')
    # 8 rows in batches of 4: 2 micro-batches an epoch, so step 1 or 2 meets the NaN clip;
    # step 3 is in the second epoch.
    result = train(tiny_run_config(data=str(manifest), max_steps=3))

    # Its batch trained on the other clips: no step's loss was NaN (a skipped step).
    assert [row.get("skipped") for row in metric_rows(result.output_dir)] == [None] * 3
    assert result.skipped_clips == 1  # one clip, whichever epochs read it
    out = capsys.readouterr().out
    report = out[out.index("epoch 0: clips skipped as they were read:") :].splitlines()
    assert report[1].startswith(
        f"  1 non-finite audio samples: {manifest}:8 [10 samples are NaN or infinite (the first "
        "at 0.25 s)"
    )


def test_an_evaluation_clip_with_nan_samples_is_set_aside_before_step_one(
    tmp_path, tiny_run_config, caplog
):
    train_data = write_tone_dataset(tmp_path / "train", n=4, layout="jsonl")
    eval_data = write_tone_dataset(tmp_path / "eval", n=3, layout="jsonl")
    _nan_float_wav(eval_data.parent / "nan.wav")
    with eval_data.open("a", encoding="utf-8") as rows:
        rows.write('{"audio": "nan.wav", "text": "alpha bravo"}\n')
    config = tiny_run_config(
        data=str(train_data), eval_data=str(eval_data), only_train=False, max_steps=1
    )
    with caplog.at_level("WARNING"):
        result = train(config)

    assert f"1 non-finite audio samples: {eval_data}:4" in caplog.text
    evaluations = [row for row in metric_rows(result.output_dir) if "wer" in row]
    assert evaluations and all(math.isfinite(row["eval_loss"]) for row in evaluations)


# == Checkpoints: disk space at the peak, SIGKILL during a save ===============================


def _bytes_under(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_the_free_space_check_counts_what_rotation_keeps_at_its_peak(
    tmp_path, tiny_run_config, monkeypatch
):
    # What the check asks for, and what the run's checkpoints and final/ took at their peak:
    # after each save, before rotation (the limit's checkpoints plus the new one), and after
    # final/ is written.
    out = tmp_path / "out"
    asked, peak = [], [0]
    real_check, real_rotate = (
        retention_module.check_free_space,
        retention_module.rotate_checkpoints,
    )
    real_final = finish_module.save_final

    def check(output_dir, needed, *, what):
        asked.append((needed, what))
        return real_check(output_dir, needed, what=what)

    def measure():
        peak[0] = max(peak[0], sum(_bytes_under(p) for p in out.glob("checkpoint-*")))
        if (out / "final").is_dir():
            peak[0] = max(
                peak[0],
                _bytes_under(out / "final")
                + sum(_bytes_under(p) for p in out.glob("checkpoint-*")),
            )

    def rotate(*args, **kwargs):
        measure()
        return real_rotate(*args, **kwargs)

    def save_final(*args, **kwargs):
        folder = real_final(*args, **kwargs)
        measure()
        return folder

    monkeypatch.setattr(retention_module, "check_free_space", check)
    monkeypatch.setattr(retention_module, "rotate_checkpoints", rotate)
    monkeypatch.setattr(finish_module, "save_final", save_final)
    train(tiny_run_config(max_steps=4, save_steps=1, save_total_limit=2))

    [(needed, what)] = asked
    # The estimate counts Adam's state in float32 and 1 MiB a checkpoint for the small files:
    # at least the peak, and within a few percent of it (3 MiB of ~130 MB here).
    assert peak[0] <= needed <= 1.05 * peak[0], (needed, peak[0])
    assert what == (
        "the 2 checkpoints rotation keeps (--save-total-limit 2), with one more being written or "
        "the final model,"
    )

    # With evaluations during the run, rotation also keeps the best step's checkpoint.
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(
        checkpoint_save.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 1000)
    )
    with pytest.raises(UserError) as refused:
        train(tiny_run_config(output_dir=str(tmp_path / "eval"), only_train=False, eval_steps=1))
    assert (
        "but the 3 checkpoints rotation keeps (--save-total-limit 2 + the best), with one more "
        "being written or the final model, need about " in str(refused.value)
    )


# Kills the process (SIGKILL: no handler, no clean-up, no `finally`) at the n-th file
# operation inside a checkpoint save or rotation: before it, after it, or with half a file
# written. Installed by a sitecustomize in a training subprocess; in this process, with
# kill_at 0, it only logs the operations, numbered, to count them.
KILL_HOOK = """
import io, os, pathlib, shutil, signal

import safetensors.torch
import torch

import whisper_train.training.checkpoints as checkpoints
import whisper_train.training.checkpoints.save as checkpoint_save
import whisper_train.training.retention as retention


def install(kill_at, mode, log, setattr=setattr):
    inside, count = [0], [0]

    def boundary(what, path, write_half=None):
        if not inside[0]:
            return
        count[0] += 1
        with open(log, "a") as file:
            file.write(f"{count[0]} {what} {path}\\n")
        if count[0] == kill_at:
            if mode == "half" and write_half is not None:
                write_half()
            os.kill(os.getpid(), signal.SIGKILL)

    def half(path, data):
        return lambda: pathlib.Path(path).write_bytes(data[: len(data) // 2]) and None

    def wrap(owner, name, what, make_bytes=None, path_at=0):
        real = getattr(owner, name)

        def wrapped(*args, **kwargs):
            path = args[path_at]
            if kill_at and make_bytes is not None and mode == "half":
                boundary(what, path, half(path, make_bytes(*args, **kwargs)))
            elif mode != "after":
                boundary(what, path)
            result = real(*args, **kwargs)
            if mode == "after":
                boundary(what, path)
            return result

        setattr(owner, name, wrapped)

    def torch_bytes(obj, path, *args, **kwargs):
        buffer = io.BytesIO()
        real_torch_save(obj, buffer)
        return buffer.getvalue()

    real_torch_save = torch.save
    wrap(torch, "save", "torch.save", torch_bytes, path_at=1)
    tensor_bytes = lambda tensors, *args, **kwargs: safetensors.torch.save(tensors)
    wrap(checkpoint_save, "save_file", "save_file", tensor_bytes, path_at=1)
    wrap(pathlib.Path, "write_text", "write_text", lambda self, text, **k: text.encode())
    wrap(pathlib.Path, "rename", "rename")
    wrap(pathlib.Path, "unlink", "unlink")
    wrap(shutil, "rmtree", "rmtree")

    def counted(real):
        def call(*args, **kwargs):
            inside[0] += 1
            with open(log, "a") as file:
                file.write(f"{real.__name__} {args[0]}\\n")
            try:
                return real(*args, **kwargs)
            finally:
                inside[0] -= 1

        return call

    setattr(checkpoint_save, "save_checkpoint", counted(checkpoint_save.save_checkpoint))
    setattr(retention, "rotate_checkpoints", counted(retention.rotate_checkpoints))
"""


# A distillation (--teacher, a student of 1 of the tiny model's 2 decoder layers) writes the same
# files, and its resume rebuilds the student from the teacher before restoring it.
@pytest.mark.parametrize(
    "distill", [False, pytest.param(True, marks=pytest.mark.long)], ids=["train", "distill"]
)
def test_sigkill_during_checkpoint_saves_resumes_exactly_from_an_intact_checkpoint(
    distill, tmp_path, tiny_run_config, tone_dataset, tiny_whisper_dir, monkeypatch, capsys
):
    import importlib
    import random

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "killhook.py").write_text(KILL_HOOK)
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('KILL_AT'):\n"
        "    import killhook\n"
        "    killhook.install(int(os.environ['KILL_AT']), os.environ['KILL_MODE'], "
        "os.environ['KILL_LOG'])\n"
    )
    options = {"max_steps": 3, "save_steps": 1, "save_total_limit": 1}
    if distill:
        options.update(teacher=str(tiny_whisper_dir), decoder_layers=1)
    # This process trains on one thread, as the subprocess does (OMP_NUM_THREADS=1): the same
    # kernels in the same order, so the losses must be equal to the last bit.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # The uninterrupted run, here, counting the file operations of its saves.
        monkeypatch.syspath_prepend(str(hook))
        killhook = importlib.import_module("killhook")
        counting = tmp_path / "operations.log"
        with monkeypatch.context() as patch:
            killhook.install(0, "before", str(counting), setattr=patch.setattr)
            train(tiny_run_config(output_dir=str(tmp_path / "reference"), **options))
        reference = metric_rows(tmp_path / "reference")
        log = counting.read_text().splitlines()
        numbered = [int(line.split()[0]) for line in log if line.split()[0].isdigit()]
        saves = [i for i, line in enumerate(log) if line.startswith("save_checkpoint")]
        # Kill points after the first save is complete (before it there is nothing to resume).
        first_after = max(int(line.split()[0]) for line in log[: saves[1]] if line[0].isdigit())
        assert len(saves) == 3 and len(numbered) > first_after + 10

        argv = train_argv(tone_dataset, tiny_whisper_dir, tmp_path / "x")[:-2]
        flags = ["--max-steps=3", "--save-steps=1", "--save-total-limit=1", "--batch-size=4"]
        flags += ["--learning-rate=1e-3", "--seed=0", "--eval-split=0.25", "--only-train"]
        flags += ["--nonspeech=none"]  # as tiny_run_config's resume
        if distill:
            flags += [f"--teacher={tiny_whisper_dir}", "--decoder-layers=1"]
        chance = random.Random(20261125)
        for attempt in range(3):
            out = tmp_path / f"killed-{attempt}"
            kill_at = chance.randint(first_after + 1, max(numbered))
            mode = chance.choice(["before", "half", "after"])
            path = os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])
            env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
            env.update(OMP_NUM_THREADS="1", KILL_AT=str(kill_at), KILL_MODE=mode)
            env["KILL_LOG"] = str(tmp_path / f"killed-{attempt}.log")
            killed = subprocess.run(
                [sys.executable, "-m", "whisper_train", *argv, f"--output-dir={out}", *flags],
                env=env,
                capture_output=True,
                text=True,
                timeout=240,
            )
            operations = Path(env["KILL_LOG"]).read_text().splitlines()
            where = f"killed at operation {kill_at} ({mode}): {operations[-1]}"
            assert killed.returncode == -signal.SIGKILL, (where, killed.stderr[-2000:])
            # The newest checkpoint whose rename (its publication) was complete at the kill.
            published = [
                line.split()[2].removesuffix(".tmp")
                for line in operations
                if line.split()[1] == "rename"
                and (int(line.split()[0]) < kill_at or mode == "after")
            ]
            capsys.readouterr()

            train(tiny_run_config(output_dir=str(out), resume="latest", **options))

            said = capsys.readouterr().out
            assert f"resuming from {published[-1]} at step" in said, where
            assert metric_rows(out) == reference, where
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# Stopping a multi-process run: the processes agree on the exit code, an interrupted
# --nproc run prints only its stop and resume lines, a full disk at the metrics writer, a killed
# process, process 0's work at the end.


# Each of two gloo processes catches the given signal (0: none) and asks for the shared stop;
# it prints the answers (stop?, exit code) of its cases, one a line. The cases run in order in
# the same two processes: the same collective, once each.
_STOP_CASES = [
    (signal.SIGINT, signal.SIGINT),  # Ctrl-C passed on to both: 130, not 128 + 2 + 2
    (signal.SIGTERM, signal.SIGTERM),  # a scheduler's SIGTERM to every process: 143
    (0, signal.SIGTERM),  # only one caught it yet: both stop after this step, 143
    (0, 0),  # no signal: no stop
]
_AGREE_ON_STOP = """
import sys
from accelerate import Accelerator
from whisper_train.runlog import StopRequest
accelerator = Accelerator(cpu=True)  # gloo, as a --nproc run on CPUs
for signals in eval(sys.argv[1]):
    stop = StopRequest(accelerator)
    stop.signum = signals[accelerator.process_index]
    print(stop.requested(), stop.exit_code)
accelerator.end_training()
"""


def test_the_processes_agree_on_the_stop_and_its_exit_code(tmp_path):
    import socket

    with socket.socket() as probe:  # a free port for the two processes to meet on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cases = repr([tuple(int(s) for s in case) for case in _STOP_CASES])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(port)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _AGREE_ON_STOP, cases],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    answers = [rank.communicate(timeout=120)[0].split("\n")[:-1] for rank in ranks]
    expected = ["True 130", "True 143", "True 143", "False 128"]
    assert answers == [expected, expected]


def test_ctrl_c_on_a_two_process_run_saves_and_prints_only_the_resume_command(
    tmp_path, tone_dataset, tiny_whisper_dir, capsys
):
    # Ctrl-C at a terminal: SIGINT to the whole foreground process group (here: the launcher's
    # own session). The workers finish the step and save; what is printed from the signal on is
    # the stop line, the checkpoint and the resume command, no torchrun logs or traceback.
    import socket

    out = tmp_path / "out"
    argv = train_argv(tone_dataset, tiny_whisper_dir, out, "--max-steps=100000", "--nproc=2")
    argv += ["--batch-size=2", "--only-train", "--seed=0", "--logging-steps=100000"]
    process = start_whisper_train(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 200
        metrics = out / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
            assert process.poll() is None, process.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        # The run's folder is held by the launcher for both processes.
        assert main([*argv[:7], "--overwrite"]) == 2
        refusal = capsys.readouterr().err
        assert f"in use by another whisper-train run (PID {process.pid} on" in refusal
        assert socket.gethostname() in refusal
        os.killpg(process.pid, signal.SIGINT)
        output, _ = process.communicate(timeout=150)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    assert process.returncode == 130, output[-3000:]
    (checkpoint,) = checkpoints_module.list_checkpoints(out)
    step = checkpoints_module.TrainerState.read(checkpoint).step
    assert [row["step"] for row in metric_rows(out)] == list(range(1, step + 1))
    lines = [line for line in output.splitlines() if line.strip()]
    stop = next(i for i, line in enumerate(lines) if line.startswith("SIGINT: saving a checkpoint"))
    assert all(line.startswith(START_LINES) for line in lines[:stop]), lines
    config = out / "whisper-train.yaml"
    assert lines[stop + 1 :] == [
        f"interrupted: saved {checkpoint}",
        f"to continue: whisper-train train --config {config} --resume {checkpoint}",
    ], lines


def test_a_killed_process_stops_the_other_and_the_launcher_with_one_line_each(
    tmp_path, tone_dataset, tiny_whisper_dir
):
    # Process 1 is killed outright (SIGKILL, as the out-of-memory killer does): process 0 must
    # not wait for it for ever at the next collective, and nobody prints a traceback.
    import psutil

    out = tmp_path / "out"
    argv = train_argv(tone_dataset, tiny_whisper_dir, out, "--max-steps=100000", "--nproc=2")
    argv += ["--batch-size=2", "--only-train", "--seed=0", "--logging-steps=100000"]
    argv += ["--save-steps=1"]
    process = start_whisper_train(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 200
        while not checkpoints_module.list_checkpoints(out):
            assert process.poll() is None, process.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        workers = psutil.Process(process.pid).children(recursive=True)
        (rank1,) = [w for w in workers if w.environ().get("RANK") == "1"]
        rank1.kill()
        killed_at = time.monotonic()
        output, _ = process.communicate(timeout=120)
        stopped_after = time.monotonic() - killed_at
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    assert process.returncode == 2 and stopped_after < 60, (stopped_after, output[-3000:])
    lines = [line for line in output.splitlines() if line.strip()]
    assert "Traceback" not in output, output[-3000:]
    # Before the kill: the start-up lines and the checkpoints; after it, one line a process.
    said = [line for line in lines if not line.startswith(START_LINES)]
    said = [line for line in said if not line.startswith("checkpoint: saved ")]
    assert len(said) == 2, said
    assert said[0].startswith("error: process 0: another process of this run stopped or was")
    assert said[1].startswith("error: --nproc 2: a training process was killed by SIGKILL")
    assert "continue from " in said[1] and "--resume latest" in said[1]


def _train_into_a_disk_that_fills(tone_dataset, tiny_whisper_dir, out, capsys) -> tuple[str, str]:
    """A 5-step run whose disk fills at step 3 (the caller injects where): (its error line, its
    resume command); asserts exit code 2, nothing else on stderr, and checkpoint-3."""
    argv = train_argv(tone_dataset, tiny_whisper_dir, out, "--max-steps=5", "--batch-size=4")
    assert main([*argv, "--only-train", "--seed=0", "--eval-split=0.25"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    [line] = err.strip().splitlines()
    assert line.startswith("error: could not write ") and "No space left on device" in line
    assert [p.name for p in checkpoints_module.list_checkpoints(out)] == ["checkpoint-3"]
    command = line.split("free some space, then continue with: ")[1]
    assert command.endswith(f"--resume {out / 'checkpoint-3'}")
    return line, command


def test_a_disk_that_fills_at_the_metrics_file_stops_with_a_checkpoint_and_one_line(
    tmp_path, tone_dataset, tiny_whisper_dir, monkeypatch, capsys
):
    import whisper_train.runlog as runlog_module

    real_write = runlog_module.os.write
    full = {"at": None}

    def disk_fills_at_step_3(fd, data):
        # Step 3's row: half of it reaches the file, then the disk is full. Once: the space
        # is back when the row is tried again after the checkpoint.
        if b'"step": 3, "loss"' in bytes(data) and full["at"] is None:
            full["at"] = real_write(fd, bytes(data)[: len(data) // 2])
            return full["at"]
        if full["at"] is not None and full["at"] > 0 and len(data) < 200:
            full["at"] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(runlog_module.os, "write", disk_fills_at_step_3)
    out = tmp_path / "out"
    line, command = _train_into_a_disk_that_fills(tone_dataset, tiny_whisper_dir, out, capsys)
    assert f"could not write {out / 'metrics.jsonl'} (No space left on device)" in line
    # Whole lines only (the half row was cut back), and step 3's row written after the save.
    assert [row["step"] for row in metric_rows(out)] == [1, 2, 3]
    monkeypatch.undo()

    # The advice works: the printed command finishes the run.
    assert main(command.split()[1:]) == 0
    assert [row["step"] for row in metric_rows(out)] == [1, 2, 3, 4, 5]


def test_a_disk_that_fills_under_tensorboards_writer_thread_stops_with_one_line(
    tmp_path, tone_dataset, tiny_whisper_dir, monkeypatch, capsys
):
    from tensorboard.compat.tensorflow_stub.io import gfile

    real_append = gfile.LocalFileSystem.append
    events = {"n": 0}

    def disk_full_after_two_steps(self, filename, file_content, binary_mode=False):
        events["n"] += 1  # step rows log 4 scalars (loss, lr, grad_norm, epoch)
        if events["n"] > 8:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_append(self, filename, file_content, binary_mode)

    monkeypatch.setattr(gfile.LocalFileSystem, "append", disk_full_after_two_steps)
    out = tmp_path / "out"
    line, _ = _train_into_a_disk_that_fills(tone_dataset, tiny_whisper_dir, out, capsys)
    assert f"could not write {out / 'tensorboard'} (No space left on device)" in line
    assert [row["step"] for row in metric_rows(out)] == [1, 2, 3]


@pytest.mark.long
def test_the_main_process_final_work_outlasts_the_collective_timeout(
    tmp_path, tone_dataset, tiny_whisper_dir
):
    # Process 0 alone writes final/ and compares with the baseline: on a large model that takes
    # longer than a collective may wait (NCCL: 10 minutes). Here the workers' process group
    # times out after 15 s and process 0's final/ takes 25 s: process 1 must not be waiting.
    hook = tmp_path / "slow"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') is not None:\n"
        "    import datetime, time\n"
        "    import torch.distributed as dist\n"
        "    real_init = dist.init_process_group\n"
        "    def init(*args, **kwargs):\n"
        "        kwargs['timeout'] = datetime.timedelta(seconds=15)\n"
        "        return real_init(*args, **kwargs)\n"
        "    dist.init_process_group = init\n"
        "    if os.environ['RANK'] == '0':\n"
        "        import whisper_train.training.finish as finish\n"
        "        real_save_final = finish.save_final\n"
        "        def slow_save_final(*args, **kwargs):\n"
        "            time.sleep(25)\n"
        "            return real_save_final(*args, **kwargs)\n"
        "        finish.save_final = slow_save_final\n"
    )
    out = tmp_path / "out"
    argv = train_argv(tone_dataset, tiny_whisper_dir, out, "--max-steps=2", "--nproc=2")
    argv += ["--batch-size=2", "--only-train", "--seed=0"]
    path = os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "whisper_train", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "final" / "model.safetensors").is_file() and (out / "result.json").is_file()


# -- non-finite weights: never final/, never a checkpoint; advice that works when followed --


def _train_cli(*args: str) -> tuple[int, str]:
    """`whisper-train ARGS` in this process: (exit code, the one `error:` line or "")."""
    import io
    from contextlib import redirect_stderr

    err = io.StringIO()
    with redirect_stderr(err):
        code = main(list(args))
    lines = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
    assert len(lines) <= 1 and "Traceback" not in err.getvalue(), err.getvalue()[-3000:]
    return code, lines[0] if lines else ""


def _advised_command(line: str) -> list[str]:
    """The `whisper-train train ...` command an error line advises, as arguments."""
    import shlex

    assert "whisper-train train " in line, line
    return shlex.split(line[line.index("whisper-train train ") :])[1:]


def _tiny_run_argv(out, tone_dataset, tiny_whisper_dir, *flags):
    return train_argv(tone_dataset, tiny_whisper_dir, out, "--batch-size=4", "--only-train") + [
        "--eval-split=0.25",
        "--seed=0",
        *flags,
    ]


def _all_finite(file) -> bool:
    return all(torch.isfinite(t).all() for t in load_file(file).values())


def test_a_learning_rate_that_overflows_the_weights_stops_at_step_1_without_final(
    tmp_path, tone_dataset, tiny_whisper_dir
):
    # --learning-rate 1e308 once finished with exit 0 and a final/ whose tensors were NaN.
    # (1e307 here: full fine-tuning's encoder takes 2.5x, and 2.5e308 is refused at start.)
    out = tmp_path / "out"
    argv = _tiny_run_argv(out, tone_dataset, tiny_whisper_dir, "--max-steps=3")
    code, line = _train_cli(*argv, "--learning-rate=1e307", "--save-steps=1")

    assert code == 2
    assert re.search(r"stopped at step 1: its update made \d+ of \d+ trained tensors NaN", line)
    assert "No checkpoint from before step 1 is kept" in line
    assert not (out / "final").exists() and not (out / "result.json").exists()
    assert checkpoints_module.list_checkpoints(out) == []
    # The advice, followed: a lower learning rate trains to the end with finite weights.
    code, line = _train_cli(*_advised_command(line))
    assert code == 0, line
    assert _all_finite(out / "final" / "model.safetensors")


def test_the_advice_after_blown_weights_skips_a_checkpoint_it_cannot_read(tmp_path):
    """The advice reads each kept checkpoint's step: a damaged trainer_state.json there is not
    named (a traceback instead of the one line, before), an intact earlier one is."""
    from conftest import record_of

    from whisper_train.config import RunConfig
    from whisper_train.training.step import lower_learning_rate_advice

    record = record_of(RunConfig.from_flat({"mode": "full", "learning_rate": 1e-3}))
    for step in (1, 2):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        checkpoints_module.TrainerState(step=step).write(folder)
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text('{"step": ')  # cut short
    advice = lower_learning_rate_advice(record, tmp_path, suspect_step=3)
    assert "Continue from checkpoint-1" in advice and "--learning-rate 2e-05" in advice
    (tmp_path / "checkpoint-1" / "trainer_state.json").write_text("")
    advice = lower_learning_rate_advice(record, tmp_path, suspect_step=3)
    assert advice.startswith("No checkpoint from before step 3 is kept")


def test_weights_that_blow_up_later_stop_there_and_the_advice_resumes_from_before(
    tmp_path, tone_dataset, tiny_whisper_dir
):
    # Linear warm-up over 4 steps: step 1 runs at learning rate 0 (finite, saved as
    # checkpoint-1), step 2 at 1e307 / 4 (the encoder 2.5x that), infinite in float32.
    out = tmp_path / "out"
    argv = _tiny_run_argv(out, tone_dataset, tiny_whisper_dir, "--max-steps=4", "--save-steps=1")
    code, line = _train_cli(*argv, "--learning-rate=1e307", "--warmup-steps=4")

    assert code == 2 and "stopped at step 2: its update made" in line
    assert [p.name for p in checkpoints_module.list_checkpoints(out)] == ["checkpoint-1"]
    assert _all_finite(out / "checkpoint-1" / "trainable.safetensors")
    assert f"--resume {out / 'checkpoint-1'} --learning-rate 2e-05" in line
    code, line = _train_cli(*_advised_command(line))
    assert code == 0, line
    assert [row["step"] for row in metric_rows(out)] == [1, 2, 3, 4]
    assert all(row["loss"] is not None for row in metric_rows(out))
    assert _all_finite(out / "final" / "model.safetensors")


def test_a_bad_step_stop_after_finite_but_blown_weights_advises_what_trains_on(
    tmp_path, tone_dataset, tiny_whisper_dir
):
    # Step 2's update (learning rate 1e12 / 4) leaves the weights finite but near 1e11: every
    # later forward is NaN. The stop's checkpoint holds those (finite) weights; resuming from it
    # would stop again at once, so the advice resumes from checkpoint-1, before that update.
    out = tmp_path / "out"
    argv = _tiny_run_argv(out, tone_dataset, tiny_whisper_dir, "--max-steps=8", "--save-steps=1")
    flags = ["--learning-rate=1e12", "--warmup-steps=4", "--max-bad-steps=3"]
    flags += ["--save-total-limit=10"]  # checkpoint-1 is kept through the bad steps' saves
    code, line = _train_cli(*argv, *flags)

    assert code == 2 and "stopped at step 5: 3 optimizer steps in a row" in line
    assert _all_finite(out / "checkpoint-5" / "trainable.safetensors")
    assert f"--resume {out / 'checkpoint-1'} --learning-rate 2e-05" in line
    code, line = _train_cli(*_advised_command(line))
    assert code == 0, line
    rows = metric_rows(out)
    assert [row["step"] for row in rows] == list(range(1, 9))
    assert all(row["loss"] is not None for row in rows)


def test_a_model_with_a_nan_weight_is_refused_before_training_evaluating_or_exporting(
    tmp_path, tone_dataset, tiny_whisper_dir, capsys
):
    import shutil

    from safetensors.torch import save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_whisper_dir, model)
    weights = load_file(model / "model.safetensors")
    weights["model.encoder.layers.0.fc1.bias"][0] = math.nan
    save_file(weights, model / "model.safetensors")
    out = tmp_path / "out"
    # Before: LoRA trained 2 steps on it and stopped only at final/; evaluate and export
    # reported and shipped its NaN outputs.
    argv = _tiny_run_argv(out, tone_dataset, model, "--max-steps=2", "--mode=lora")
    code, line = _train_cli(*argv)
    assert code == 2
    assert f"--model {model}: 1 of" in line and "model.encoder.layers.0.fc1.bias" in line
    assert not (out / "metrics.jsonl").exists() and not (out / "final").exists()
    for command in (
        ["evaluate", "--model", str(model), "--data", str(tone_dataset)],
        ["export", "--model", str(model), "--format", "hf", "--output", str(tmp_path / "hf")],
    ):
        assert main(command) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "NaN or infinite" in err, err
    assert not (tmp_path / "hf").exists()


def test_two_processes_stop_together_when_an_update_blows_up(
    tmp_path, tone_dataset, tiny_whisper_dir
):
    # Both processes check their weights after every update and all-reduce the flags (the same
    # collective on each, whatever its weights): both stop after the same step with the same
    # line, and no process waits at a collective the other never reaches. Step 2 runs at
    # 1e307 / 4 (warm-up), infinite in float32. (Not --fsdp: its torch AdamW raises on a
    # learning rate that overflows float32 before any weight changes.)
    out = tmp_path / "out"
    argv = train_argv(tone_dataset, tiny_whisper_dir, out, "--max-steps=4", "--save-steps=1")
    flags = ["--nproc=2", "--batch-size=1", "--only-train", "--eval-split=0.25"]
    flags += ["--learning-rate=1e307", "--warmup-steps=4", "--seed=0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "whisper_train", *argv, *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )

    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "its update made" in line]
    assert lines and all("stopped at step 2: its update made" in line for line in lines), lines
    assert f"--resume {out / 'checkpoint-1'} --learning-rate 2e-05" in lines[0]
    assert [p.name for p in checkpoints_module.list_checkpoints(out)] == ["checkpoint-1"]
    assert not (out / "final").exists()
