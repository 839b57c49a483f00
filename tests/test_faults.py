"""Runs that survive: NaN steps, a full disk, an unwritable folder, SIGINT and SIGTERM."""

from __future__ import annotations

import errno
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
from conftest import metric_rows, train_argv, write_tone_dataset
from safetensors.torch import load_file

import whisper_train.checkpoints as checkpoints_module
import whisper_train.features as features_module
import whisper_train.recipe as recipe_module
from whisper_train.cli import main
from whisper_train.errors import AudioError, UserError
from whisper_train.train import train


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


def test_full_disk_at_save_time_keeps_the_previous_checkpoint(
    tmp_path, tiny_run_config, monkeypatch
):
    real_save = checkpoints_module.save_file
    calls = {"n": 0}

    def disk_fills_up(tensors, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(checkpoints_module, "save_file", disk_fills_up)
    with pytest.raises(UserError, match=r"No space left.*checkpoint-1 is intact"):
        train(tiny_run_config(save_steps=1, save_total_limit=1))
    out = tmp_path / "out"
    assert [p.name for p in checkpoints_module.list_checkpoints(out)] == ["checkpoint-1"]
    assert not list(out.glob("*.tmp"))
    assert load_file(out / "checkpoint-1" / "trainable.safetensors")


def test_too_little_free_space_is_refused_before_training(tmp_path, tiny_run_config, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(
        checkpoints_module.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 1000)
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


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_finishes_the_step_saves_and_prints_the_resume_command(
    tmp_path, tone_dataset, tiny_whisper_dir, signum
):
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "whisper_train",
        *train_argv(tone_dataset, tiny_whisper_dir, out),
        "--max-steps",
        "100000",
        "--batch-size",
        "2",
        "--only-train",
        "--seed",
        "0",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
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


def test_bad_clips_are_skipped_as_they_are_read_and_named_once(tmp_path, tiny_run_config, capsys):
    manifest = write_tone_dataset(tmp_path / "data", n=8, layout="jsonl")
    (manifest.parent / "broken.wav").write_bytes(b"RIFF, and then nothing audio")
    with manifest.open("a", encoding="utf-8") as rows:
        rows.write('{"audio": "gone.wav", "text": "alpha bravo"}\n')
        rows.write('{"audio": "broken.wav", "text": "charlie delta"}\n')
    # 10 rows in batches of 4: 3 micro-batches an epoch; step 4 is in the second epoch.
    result = train(tiny_run_config(data=str(manifest), max_steps=4))

    assert result.steps == 4 and result.train_examples == 10
    # Both bad clips were skipped in epoch 0; step 4's batch may have met one of them again.
    assert result.skipped_clips in (2, 3)
    out = capsys.readouterr().out
    assert "(training audio is checked as each clip is read;" in out
    report = out[out.index("epoch 0: clips skipped as they were read:") :].splitlines()
    assert report[0] == "epoch 0: clips skipped as they were read: 2 skipped"
    assert sorted(report[1:3]) == [  # one line a reason, in the order the shuffle met them
        f"  1 audio file not found: {manifest}:9 [{manifest.parent / 'gone.wav'}]",
        f"  1 unreadable audio: {manifest}:10 [{manifest.parent / 'broken.wav'}]",
    ]
    assert out.count("clips skipped as they were read") == 1  # named once, not every epoch


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

    monkeypatch.setattr(checkpoints_module.torch, "save", disk_fills_up)
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
    assert "a training process failed" in result.stderr.splitlines()[-1]
    assert [p.name for p in checkpoints_module.list_checkpoints(out)] == ["checkpoint-1"]
    assert not list(out.glob("*.tmp"))


def test_sigterm_is_honoured_before_an_evaluation_that_is_due(
    tmp_path, tiny_run_config, monkeypatch
):
    # SIGTERM arrives during step 2, when an evaluation is due (--eval-steps 2): the run saves
    # and exits first, inside the grace period, instead of evaluating and then being killed.
    real = recipe_module.loss_terms
    calls = {"n": 0}

    def terminated_in_step_2(model, batch, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(model, batch, **kwargs)

    monkeypatch.setattr(recipe_module, "loss_terms", terminated_in_step_2)
    with pytest.raises(SystemExit) as stopped:
        train(tiny_run_config(max_steps=4, eval_steps=2, only_train=False))

    assert stopped.value.code == 128 + signal.SIGTERM
    out = tmp_path / "out"
    assert [p.name for p in checkpoints_module.list_checkpoints(out)] == ["checkpoint-2"]
    assert [row["step"] for row in metric_rows(out) if "wer" in row] == []


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
    # Issue 33: --learning-rate 1e308 finished with exit 0 and a final/ whose tensors were NaN.
    out = tmp_path / "out"
    argv = _tiny_run_argv(out, tone_dataset, tiny_whisper_dir, "--max-steps=3")
    code, line = _train_cli(*argv, "--learning-rate=1e308", "--save-steps=1")

    assert code == 2
    assert re.search(r"stopped at step 1: its update made \d+ of \d+ trained tensors NaN", line)
    assert "No checkpoint from before step 1 is kept" in line
    assert not (out / "final").exists() and not (out / "result.json").exists()
    assert checkpoints_module.list_checkpoints(out) == []
    # The advice, followed: a lower learning rate trains to the end with finite weights.
    code, line = _train_cli(*_advised_command(line))
    assert code == 0, line
    assert _all_finite(out / "final" / "model.safetensors")


def test_weights_that_blow_up_later_stop_there_and_the_advice_resumes_from_before(
    tmp_path, tone_dataset, tiny_whisper_dir
):
    # Linear warm-up over 4 steps: step 1 runs at learning rate 0 (finite, saved as
    # checkpoint-1), step 2 at 1e308 / 4, which is infinite in float32.
    out = tmp_path / "out"
    argv = _tiny_run_argv(out, tone_dataset, tiny_whisper_dir, "--max-steps=4", "--save-steps=1")
    code, line = _train_cli(*argv, "--learning-rate=1e308", "--warmup-steps=4")

    assert code == 2 and "stopped at step 2: its update made" in line
    assert [p.name for p in checkpoints_module.list_checkpoints(out)] == ["checkpoint-1"]
    assert _all_finite(out / "checkpoint-1" / "trainable.safetensors")
    assert f"--resume {out / 'checkpoint-1'} --learning-rate 1e-05" in line
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
    assert f"--resume {out / 'checkpoint-1'} --learning-rate 1e-05" in line
    code, line = _train_cli(*_advised_command(line))
    assert code == 0, line
    rows = metric_rows(out)
    assert [row["step"] for row in rows] == list(range(1, 9))
    assert all(row["loss"] is not None for row in rows)


def test_a_model_with_a_nan_weight_it_did_not_train_is_not_written_as_final(
    tmp_path, tone_dataset, tiny_whisper_dir
):
    import shutil

    from safetensors.torch import save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_whisper_dir, model)
    weights = load_file(model / "model.safetensors")
    weights["model.encoder.layers.0.fc1.bias"][0] = math.nan
    save_file(weights, model / "model.safetensors")
    out = tmp_path / "out"
    argv = _tiny_run_argv(out, tone_dataset, model, "--max-steps=2", "--mode=lora")
    code, line = _train_cli(*argv)

    assert code == 2
    assert "the model of step 2 has 1 of" in line and "final/ was not written" in line
    assert f"--model {model} holds them" in line
    assert not (out / "final").exists()


def test_two_processes_stop_together_when_an_update_blows_up(
    tmp_path, tone_dataset, tiny_whisper_dir
):
    # Both processes check their weights after every update and all-reduce the flags (the same
    # collective on each, whatever its weights): both stop after the same step with the same
    # line, and no process waits at a collective the other never reaches. Step 2 runs at
    # 1e308 / 4 (warm-up), infinite in float32. (Not --fsdp: its torch AdamW raises on a
    # learning rate that overflows float32 before any weight changes.)
    out = tmp_path / "out"
    argv = train_argv(tone_dataset, tiny_whisper_dir, out, "--max-steps=4", "--save-steps=1")
    flags = ["--nproc=2", "--batch-size=1", "--only-train", "--eval-split=0.25"]
    flags += ["--learning-rate=1e308", "--warmup-steps=4", "--seed=0"]
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
    assert f"--resume {out / 'checkpoint-1'} --learning-rate 1e-05" in lines[0]
    assert [p.name for p in checkpoints_module.list_checkpoints(out)] == ["checkpoint-1"]
    assert not (out / "final").exists()
