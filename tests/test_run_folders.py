"""A new run never replaces an earlier one: refused unless --resume or --overwrite (moved aside)."""

from __future__ import annotations

import hashlib
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import metric_rows, start_whisper_train, train_argv

import whisper_train.training.checkpoints as checkpoints_module
import whisper_train.training.launch as launch_module
from whisper_train.cli import main
from whisper_train.config import RunConfig
from whisper_train.errors import UserError
from whisper_train.training.train import train


def _hashes(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative path → sha256): equal dicts mean byte for byte."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != ".whisper-train.lock"  # the folder's, not a run's
    }


def _argv(tone_dataset, tiny_whisper_dir, out: Path, *extra: str) -> list[str]:
    flags = ["--max-steps", "2", "--batch-size", "4", "--only-train", "--seed", "0", *extra]
    return train_argv(tone_dataset, tiny_whisper_dir, out, *flags)


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    return errors[0]


def test_a_finished_run_is_refused_and_kept_byte_for_byte(
    tmp_path, tiny_run_config, tone_dataset, tiny_whisper_dir, capsys
):
    out = tmp_path / "out"
    train(tiny_run_config())  # finished: final/, metrics.jsonl, ... and no checkpoint
    assert not list(out.glob("checkpoint-*"))
    before = _hashes(out)
    assert "final/model.safetensors" in before and "metrics.jsonl" in before
    capsys.readouterr()

    assert main(_argv(tone_dataset, tiny_whisper_dir, out)) == 2
    line = _error_line(capsys)
    assert str(out) in line and "--overwrite" in line and "--resume" in line
    assert _hashes(out) == before
    assert not list(tmp_path.glob("out.old-*"))


def test_overwrite_moves_the_run_aside_and_leaves_the_users_files(
    tmp_path, tiny_run_config, tone_dataset, tiny_whisper_dir, capsys
):
    out = tmp_path / "out"
    train(tiny_run_config(max_steps=3))
    (out / "notes.txt").write_text("my notes about this run")
    old_run = {k: v for k, v in _hashes(out).items() if k != "notes.txt"}

    assert main(_argv(tone_dataset, tiny_whisper_dir, out, "--overwrite")) == 0
    (aside,) = tmp_path.glob("out.old-*")
    assert _hashes(aside) == old_run  # moved whole, nothing lost
    assert str(aside) in capsys.readouterr().out  # and the user is told where
    assert (out / "notes.txt").read_text() == "my notes about this run"
    assert [row["step"] for row in metric_rows(out)] == [1, 2]  # the new run's own metrics
    assert (out / "final" / "model.safetensors").is_file()


def test_a_folder_of_other_files_is_trained_into_and_kept(tmp_path, tiny_run_config):
    out = tmp_path / "out"
    out.mkdir()
    (out / "recordings.csv").write_text("not ours")
    result = train(tiny_run_config(max_steps=1))
    assert result.final_dir == out / "final"
    assert (out / "recordings.csv").read_text() == "not ours"
    assert not list(tmp_path.glob("out.old-*"))


def test_resume_still_continues_a_run_with_checkpoints(
    tmp_path, tone_dataset, tiny_whisper_dir, capsys
):
    out = tmp_path / "out"
    argv = _argv(tone_dataset, tiny_whisper_dir, out, "--save-steps", "1")
    assert main(argv) == 0
    assert main([*argv, "--max-steps", "3"]) == 2  # a fresh start over checkpoints: refused
    assert "--resume latest" in _error_line(capsys)
    assert main([*argv, "--max-steps", "3", "--resume"]) == 0
    assert [row["step"] for row in metric_rows(out)] == [1, 2, 3]
    assert not list(tmp_path.glob("out.old-*"))


def test_refusals_that_protect_a_run(tmp_path, tiny_run_config):
    out = tmp_path / "out"
    train(tiny_run_config(max_steps=1, save_steps=1))
    before = _hashes(out)
    # Fine-tuning the run's own model further would move that model away before loading it.
    with pytest.raises(UserError, match="--model .* would move aside"):
        train(tiny_run_config(model=str(out), overwrite=True))
    with pytest.raises(UserError, match="--resume .*--overwrite|--overwrite .*--resume"):
        train(tiny_run_config(resume="latest", overwrite=True))
    # A checkpoint of another run resumed into this folder would replace this run.
    other = tmp_path / "other"
    train(tiny_run_config(output_dir=str(other), max_steps=1, save_steps=1))
    with pytest.raises(UserError, match="not in --output-dir"):
        train(tiny_run_config(resume=str(other / "checkpoint-1"), max_steps=2))
    assert _hashes(out) == before
    assert not list(tmp_path.glob("*.old-*"))


def test_nproc_checks_once_and_its_workers_use_their_folder(tmp_path, tiny_run_config, monkeypatch):
    """--nproc re-launches the command: the parent moves the old run aside; a worker, which
    finds the parent's launch.yaml in the folder, must neither refuse it nor move it again."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (out / "final").mkdir()
    launched = []

    class FakeLaunch:  # runs "the worker" in this process, with the environment it would get
        def __init__(self, command, env, **kwargs):
            assert not (out / "metrics.jsonl").exists(), "the parent clears the folder first"
            config = RunConfig.from_yaml(out / "launch.yaml")
            config.update({"nproc": 1})  # one in-process worker stands in for the two
            with monkeypatch.context() as patch:
                for key, value in env.items():
                    patch.setenv(key, value)
                launched.append(train(config))

        def wait(self):
            return 0

    monkeypatch.setattr(launch_module.subprocess, "Popen", FakeLaunch)
    result = train(tiny_run_config(nproc=2, overwrite=True))
    assert launched and result.steps == 3 == launched[0].steps
    (aside,) = tmp_path.glob("out.old-*")  # once: the worker moved nothing
    assert sorted(p.name for p in aside.iterdir()) == ["final", "metrics.jsonl"]
    assert (out / "launch.yaml").is_file() and (out / "final").is_dir()


def test_a_failed_move_aside_says_where_everything_is(tmp_path, tiny_run_config, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "final").mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    real_rename = Path.rename

    def rename_once(self, target):  # the second rename fails, as on a full or read-only disk
        if any(tmp_path.glob("out.old-*/*")):
            raise PermissionError(13, "Permission denied")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename_once)
    with pytest.raises(
        UserError, match=r"could not move .*Permission denied.*1 of them are already"
    ):
        train(tiny_run_config(overwrite=True))
    (aside,) = tmp_path.glob("out.old-*")
    assert [p.name for p in aside.iterdir()] == ["final"]  # moved: kept
    assert (out / "metrics.jsonl").read_text() == "{}\n"  # not moved: kept


def test_checkpoints_a_resume_set_aside_belong_to_the_run(tmp_path):
    from whisper_train import runfolder

    out = tmp_path / "out"
    for name in ("abandoned-after-step-4", "abandoned-after-step-4-2", "notes"):
        (out / name).mkdir(parents=True)
    # A new run refuses them and --overwrite moves them with the run; the user's own stay.
    assert [p.name for p in runfolder.run_entries(out)] == [
        "abandoned-after-step-4",
        "abandoned-after-step-4-2",
    ]


# -- one run at a time in a folder -------------------------------------------------------------


def _start_run(tone_dataset, tiny_whisper_dir, out: Path) -> subprocess.Popen:
    """A run of many steps in its own process, returned once it has logged its first step."""
    argv = _argv(tone_dataset, tiny_whisper_dir, out, "--max-steps", "100000", "--batch-size", "2")
    process = start_whisper_train(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 150
    metrics = out / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(process.communicate()[1][-2000:] or "training never started")
        time.sleep(0.2)
    return process


def test_a_run_refused_at_setup_leaves_no_folder_behind(tmp_path, tiny_run_config):
    # The lock is taken before the folder is claimed, so it creates the folder: a run that then
    # stops before training (here: data with no transcripts) must not leave it, holding only
    # the lock file, where the user did not ask for one.
    empty = tmp_path / "no-data"
    empty.mkdir()
    out = tmp_path / "new" / "out"
    with pytest.raises(UserError):
        train(tiny_run_config(data=str(empty), output_dir=str(out)))
    assert not (tmp_path / "new").exists()
    # A folder that was there before is left as it was (its lock file, empty, stays).
    out.mkdir(parents=True)
    with pytest.raises(UserError):
        train(tiny_run_config(data=str(empty), output_dir=str(out)))
    assert [p.name for p in out.iterdir()] == [".whisper-train.lock"]


def test_a_second_run_into_a_folder_in_use_is_refused_and_the_first_goes_on(
    tmp_path, tone_dataset, tiny_whisper_dir, capsys
):
    out = tmp_path / "out"
    first = _start_run(tone_dataset, tiny_whisper_dir, out)
    try:
        # --overwrite would move the first run's files aside under it; --resume would train
        # beside it; a plain start would find its files: each is refused for the lock first.
        for flags in (["--overwrite"], ["--resume"], []):
            assert main(_argv(tone_dataset, tiny_whisper_dir, out, *flags)) == 2
            line = _error_line(capsys)
            assert f"--output-dir {out} is in use by another whisper-train run" in line
            assert f"PID {first.pid} on {socket.gethostname()}" in line
        assert not list(tmp_path.glob("out.old-*"))
        first.send_signal(signal.SIGTERM)
        stdout, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    # The first run saved and stopped as asked; its folder holds its own steps and nothing else.
    assert first.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    (checkpoint,) = checkpoints_module.list_checkpoints(out)
    step = checkpoints_module.TrainerState.read(checkpoint).step
    assert [row["step"] for row in metric_rows(out)] == list(range(1, step + 1))
    assert f"--resume {checkpoint}" in stdout + stderr


def test_the_folder_of_a_killed_run_is_usable_at_once(
    tmp_path, tone_dataset, tiny_whisper_dir, capsys
):
    out = tmp_path / "out"
    killed = _start_run(tone_dataset, tiny_whisper_dir, out)
    killed.kill()  # SIGKILL: no handler runs, nothing is released but by the kernel
    killed.communicate()
    assert (out / ".whisper-train.lock").is_file()  # the file stays; its lock went with the run
    assert main(_argv(tone_dataset, tiny_whisper_dir, out, "--overwrite")) == 0
    assert [row["step"] for row in metric_rows(out)] == [1, 2]
    (aside,) = tmp_path.glob("out.old-*")
    assert (aside / "metrics.jsonl").is_file()  # the killed run's files, moved aside
