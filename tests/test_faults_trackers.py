"""The fault suite (tests/test_faults.py) for the trackers of --report-to: a destination they
cannot write at start is one line before step 1; a tracker whose disk fills mid-run stops alone
with one line while the run, its checkpoints and metrics.jsonl go on whole; a run killed with
trackers on and resumed logs each step once, to a new run named for the checkpoint's step.
MLflow (file store) and W&B (offline) write real files, read back with their own readers."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import time

import pytest
from conftest import metric_rows, start_whisper_train, train_argv
from safetensors.torch import load_file
from test_trackers import _key, tracker_env, wandb_records

import whisper_train.training.checkpoints as checkpoints_module
from whisper_train.cli import main
from whisper_train.training.train import train

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _error_line(capsys) -> str:
    """stderr is one `error:` line and nothing else (no traceback, no tracker's warnings)."""
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: "), err
    return err


def _mlflow_runs(uri: str) -> list[tuple[object, dict[str, list[tuple[int, float]]]]]:
    """MLflow's runs of the `whisper-train` experiment, oldest first, each with every metric's
    history as logged: [(step, value), ...] in step order, a step logged twice shown twice."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("whisper-train")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    return [
        (
            run,
            {
                name: sorted(
                    (m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)
                )
                for name in run.data.metrics
            },
        )
        for run in runs
    ]


def _wandb_steps(path) -> tuple[str, list[int]]:
    """An offline W&B run's name and the steps of its history, as logged."""
    name, steps = "", []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            name = record.run.display_name
        elif kind == "history":
            items = {_key(item): item.value_json for item in record.history.item}
            steps.append(int(items["_step"]))
    return name, steps


def test_a_failure_while_final_is_written_leaves_no_tracker_run_open(
    tmp_path, tiny_run_config, monkeypatch
):
    """The run's end can stop it (final/ refused for a NaN weight, a full disk at final/):
    MLflow's run is ended all the same, not left RUNNING for ever in the tracking server."""
    import whisper_train.training.finish as finish_module
    import whisper_train.training.recipe as recipe_module
    from whisper_train.errors import UserError

    uri = tracker_env(monkeypatch, tmp_path)

    def refused(*args, **kwargs):
        raise UserError("the model of step 1 has 3 of 30 tensors NaN or infinite")

    for module, name in ((recipe_module, "refuse_nonfinite_final"), (finish_module, "save_final")):
        with monkeypatch.context() as patch:
            patch.setattr(module, name, refused)
            out = tmp_path / name
            with pytest.raises(UserError, match="NaN or infinite"):
                train(tiny_run_config(max_steps=1, report_to=["mlflow"], output_dir=str(out)))
    assert [run.info.status for run, _ in _mlflow_runs(uri)] == ["FINISHED", "FINISHED"]


# == 1. A destination the tracker cannot write, met at start ==================================


@pytest.mark.parametrize("tracker", ["mlflow", "wandb", "tensorboard"])
def test_a_tracker_folder_it_cannot_write_is_one_line_before_step_1(
    tracker, tmp_path, tone_dataset, tiny_whisper_dir, monkeypatch, capsys
):
    # Each tracker's folder lies under a file (as root, the tests' user, a read-only folder
    # would still be writable): NotADirectoryError, as EACCES or EROFS would be for a user.
    uri = tracker_env(monkeypatch, tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    out = tmp_path / "out"
    if tracker == "mlflow":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'a-file' / 'mlruns'}")
        setting = "MLFLOW_TRACKING_URI"
    elif tracker == "wandb":
        # W&B itself would fall back to /tmp/wandb (silently under WANDB_SILENT) and the run
        # would exit 0 with its offline files where nobody looks.
        monkeypatch.setenv("WANDB_DIR", str(tmp_path / "a-file" / "wandb"))
        setting = f"WANDB_DIR={tmp_path / 'a-file' / 'wandb'} is not a folder this run can write"
    else:  # another user's folder: its events file cannot be written (was: a stop after step 1
        # advising to free space)
        from tensorboard.compat.tensorflow_stub.io import gfile

        def denied(self, filename, *args, **kwargs):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), filename)

        monkeypatch.setattr(gfile.LocalFileSystem, "write", denied)  # its first event
        monkeypatch.setattr(gfile.LocalFileSystem, "append", denied)  # the later ones
        setting = f"cannot write {out / 'tensorboard'} (Permission denied)"
    argv = train_argv(tone_dataset, tiny_whisper_dir, out, "--max-steps=1", "--only-train")
    # Another tracker named first: started before the one that fails, its run is ended.
    first = "mlflow" if tracker != "mlflow" else "wandb"
    assert main([*argv, f"--report-to={first},{tracker}"]) == 2

    line = _error_line(capsys)
    assert line.startswith(f"error: --report-to {tracker}: "), line
    assert setting in line
    assert not (out / "metrics.jsonl").exists() or not metric_rows(out)  # no step trained
    if tracker == "tensorboard":  # (W&B's folder is checked before MLflow starts)
        assert [run.info.status for run, _ in _mlflow_runs(uri)] == ["FINISHED"]


def test_a_resumed_run_whose_tensorboard_folder_is_in_the_way_keeps_its_checkpoint(
    tmp_path, tone_dataset, tiny_whisper_dir, capsys
):
    # Was a FileExistsError traceback from SummaryWriter.
    out = tmp_path / "out"
    argv = train_argv(tone_dataset, tiny_whisper_dir, out, "--only-train", "--save-steps=1")
    assert main([*argv, "--max-steps=1"]) == 0
    (out / "tensorboard").rename(tmp_path / "tensorboard-moved")
    (out / "tensorboard").write_text("a file where the folder was")
    capsys.readouterr()

    assert main([*argv, "--max-steps=2", "--resume=latest"]) == 2
    line = _error_line(capsys)
    assert line.startswith(f"error: --report-to tensorboard: cannot write {out / 'tensorboard'}")
    assert [p.name for p in checkpoints_module.list_checkpoints(out)] == ["checkpoint-1"]
    assert [row["step"] for row in metric_rows(out)] == [1]
    # The remedy, followed, resumes.
    (out / "tensorboard").unlink()
    assert main([*argv, "--max-steps=2", "--resume=latest"]) == 0
    assert [row["step"] for row in metric_rows(out)] == [1, 2]


# == 2. A full disk under a tracker, mid-run ==================================================


def _disk_full_from_step_2(monkeypatch, tracker: str) -> None:
    """The tracker's write of step 2's row and every later one fails with ENOSPC, where its
    library writes: MLflow's file store, W&B's run (its files are written by wandb-core)."""
    if tracker == "mlflow":
        from mlflow.store.tracking.file_store import FileStore

        real = FileStore.log_batch

        def log_batch(self, run_id, metrics, params, tags):
            if any(metric.step >= 2 for metric in metrics):
                raise ENOSPC
            return real(self, run_id, metrics, params, tags)

        monkeypatch.setattr(FileStore, "log_batch", log_batch)
    else:
        from wandb.sdk.wandb_run import Run

        real = Run.log

        def log(self, data, step=None, *args, **kwargs):
            if step is not None and step >= 2:
                raise ENOSPC
            return real(self, data, step, *args, **kwargs)

        monkeypatch.setattr(Run, "log", log)


@pytest.mark.parametrize(("full", "other"), [("mlflow", "wandb"), ("wandb", "mlflow")])
def test_a_tracker_whose_disk_fills_stops_alone_and_the_run_finishes_whole(
    full, other, tiny_run_config, tmp_path, monkeypatch, capsys
):
    uri = tracker_env(monkeypatch, tmp_path)
    _disk_full_from_step_2(monkeypatch, full)
    config = tiny_run_config(
        max_steps=3, save_steps=1, save_total_limit=5, report_to=["mlflow", "wandb"]
    )
    result = train(config)

    out = result.output_dir
    said = capsys.readouterr()
    lines = [line for line in (said.out + said.err).splitlines() if "--report-to" in line]
    assert lines == [
        f"--report-to {full}: stopped logging at step 2 ([Errno 28] No space left on device); "
        "metrics.jsonl has every row"
    ]
    assert result.steps == 3
    assert [row["step"] for row in metric_rows(out)] == [1, 2, 3]
    steps = [p.name for p in checkpoints_module.list_checkpoints(out)]
    assert steps == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    for checkpoint in checkpoints_module.list_checkpoints(out):
        assert load_file(checkpoint / "trainable.safetensors")
    from transformers import WhisperForConditionalGeneration

    assert WhisperForConditionalGeneration.from_pretrained(out / "final")
    # The tracker that failed has the rows before; the other one every row (it used to be
    # ended with the failing one, or to miss the rows after it).
    [(run, history)] = _mlflow_runs(uri)
    [wandb_file] = out.glob("wandb/offline-run-*/run-*.wandb")
    logged = {
        "mlflow": [step for step, _ in history["train/loss"]],
        "wandb": _wandb_steps(wandb_file)[1],
    }
    assert logged[full] == [1]
    assert logged[other] == [1, 2, 3]
    assert run.info.status == "FINISHED"


# == 3. Killed mid-run with trackers on, then --resume'd ======================================


def test_a_killed_run_resumed_with_trackers_logs_each_step_once_to_a_new_named_run(
    tmp_path, tone_dataset, tiny_whisper_dir, monkeypatch
):
    uri = tracker_env(monkeypatch, tmp_path)  # os.environ: the subprocess inherits it
    out = tmp_path / "out"
    argv = train_argv(tone_dataset, tiny_whisper_dir, out, "--only-train", "--batch-size=2")
    argv += [
        "--seed=0",
        "--report-to=tensorboard,mlflow,wandb",
        "--lr-scheduler=constant_with_warmup",
    ]
    process = start_whisper_train(
        [*argv, "--max-steps=100000", "--save-steps=2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # wandb-core is killed with it, as a lost machine would be
    )
    try:
        deadline = time.monotonic() + 150
        while True:  # a checkpoint, and a step logged after it that the resumed run redoes
            found = checkpoints_module.list_checkpoints(out)
            if found and (out / "metrics.jsonl").is_file():
                saved = checkpoints_module.TrainerState.read(found[-1]).step
                # The first step after the checkpoint: the next checkpoint is a whole step away
                # (its row is logged just before it is saved, so waiting for that row raced the
                # kill against the save, and lost in a fresh clone's CI).
                if len(metric_rows(out)) > saved:
                    break
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "training never reached a checkpoint"
            time.sleep(0.01)
    finally:
        with contextlib.suppress(ProcessLookupError):  # exited already: the assert says why
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    killed_at = len(metric_rows(out))
    saved = checkpoints_module.TrainerState.read(checkpoints_module.list_checkpoints(out)[-1]).step
    assert killed_at > saved  # rows after the checkpoint: metrics.jsonl is cut back to it
    last = killed_at + 2

    assert main([*argv, f"--max-steps={last}", "--resume=latest"]) == 0

    rows = metric_rows(out)
    assert [row["step"] for row in rows] == list(range(1, last + 1))
    (killed, killed_history), (resumed, history) = _mlflow_runs(uri)
    assert killed.info.run_name == "out"
    # The killed run's steps: up to where it was killed (its last row may not have reached
    # MLflow), each once.
    killed_steps = [step for step, _ in killed_history["train/loss"]]
    assert killed_steps == list(range(1, len(killed_steps) + 1))
    assert len(killed_steps) in (killed_at - 1, killed_at)
    assert resumed.info.run_name == f"out (resumed from step {saved})"
    assert resumed.info.status == "FINISHED"
    # From the step after the checkpoint on, each once, the values metrics.jsonl holds.
    assert history["train/loss"] == [(row["step"], row["loss"]) for row in rows[saved:]]
    assert resumed.data.params["train.max_steps"] == str(last)
    # W&B: the resumed run is a second offline run, named alike, from the same step on.
    name, steps = _wandb_steps(sorted(out.glob("wandb/offline-run-*/run-*.wandb"))[-1])
    assert name == f"out (resumed from step {saved})"
    assert steps == list(range(saved + 1, last + 1))
