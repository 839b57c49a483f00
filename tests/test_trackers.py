"""--report-to: MLflow and W&B get the rows of metrics.jsonl and the resolved configuration, read
back by each tracker's own library from its files on disk (MLflow's file store, W&B offline);
an unknown tracker, a missing package or a tracker that cannot start is one line at start."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import pytest
from conftest import metric_rows, train_argv

from whisper_train.cli import main
from whisper_train.training.train import train


def tracker_env(monkeypatch, root: Path) -> str:
    """MLflow to a file store under `root`, W&B offline (its files in OUTPUT/wandb/), nothing
    read from or written to the home folder; returns MLflow's tracking URI."""
    uri = f"file:{root / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store opt-in
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(root / "wandb-home"))
    for variable in ("WANDB_DIR", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "WANDB_API_KEY"):
        monkeypatch.delenv(variable, raising=False)
    # wandb reads its settings once a process: an earlier test's would outlive their variables.
    import wandb

    wandb.teardown()
    return uri


def expected_values(output_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl's numbers as {name: {step: value}}: train/<key> for a step's row,
    eval/<set>/<key> for an evaluation set's."""
    values: dict[str, dict[int, float]] = {}
    for row in metric_rows(output_dir):
        scope = f"eval/{row['set']}" if "set" in row else "train"
        for key, value in row.items():
            if key in ("step", "set") or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                values.setdefault(f"{scope}/{key}", {})[row["step"]] = value
    return values


def mlflow_values(uri: str) -> tuple[dict[str, dict[int, float]], list]:
    """Every metric's history over the runs of MLflow's `whisper-train` experiment (a resumed
    run is a second run), as {name: {step: value}}, and the runs."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("whisper-train")
    runs = client.search_runs([experiment.experiment_id])
    values: dict[str, dict[int, float]] = {}
    for run in runs:
        for name in run.data.metrics:
            for metric in client.get_metric_history(run.info.run_id, name):
                values.setdefault(name, {})[metric.step] = metric.value
    return values, runs


def wandb_records(path: Path):
    """The records of a .wandb file, parsed with W&B's own message type: the file is W&B's
    header (":W&B", magic, version) and LevelDB's log format (32 KiB blocks; a chunk is CRC,
    length, type, then data; a record is one FULL chunk or FIRST, MIDDLE..., LAST). wandb no
    longer ships a Python reader of it (wandb-core reads it)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    position, pending = 7, b""
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:  # a block's tail too short for a chunk header is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0:  # zeros: the rest of the block is padding
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_values(output_dir: Path) -> tuple[dict[str, dict[int, float]], dict, list[Path]]:
    """The history of every offline run in OUTPUT/wandb/ as {name: {step: value}}, the config
    the runs were given, and their .wandb files."""
    files = sorted(output_dir.glob("wandb/offline-run-*/run-*.wandb"))
    values: dict[str, dict[int, float]] = {}
    config: dict = {}
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {_key(item): json.loads(item.value_json) for item in record.history.item}
                step = items.pop("_step")
                for name, value in items.items():
                    if not name.startswith("_"):
                        values.setdefault(name, {})[step] = value
            elif kind == "config":
                config.update({_key(i): json.loads(i.value_json) for i in record.config.update})
    return values, config, files


def _key(item) -> str:
    """A history or config item's name (one with a slash comes as `nested_key`)."""
    return item.key or "/".join(item.nested_key)


def assert_trackers_hold_the_metrics(output_dir: Path, uri: str) -> None:
    """MLflow's and W&B's histories are metrics.jsonl's numbers, each at its step."""
    expected = expected_values(output_dir)
    assert expected["train/loss"], expected
    logged, _ = mlflow_values(uri)
    assert logged == expected
    logged, _, files = wandb_values(output_dir)
    assert files
    assert logged == expected


def test_mlflow_and_wandb_get_every_row_and_the_configuration(
    tiny_run_config, tone_dataset, tmp_path, monkeypatch
):
    uri = tracker_env(monkeypatch, tmp_path)
    config = tiny_run_config(
        max_steps=2,
        only_train=False,
        eval_steps=1,
        eval_data=[f"held-out={tone_dataset}", f"guard={tone_dataset}"],
        eval_subset=4,
        report_to=["tensorboard", "mlflow", "wandb"],
    )
    out = train(config).output_dir

    expected = expected_values(out)
    # per-set WER and loss, the training loss, learning rate and gradient norm, each step
    for name in ("eval/held-out/wer", "eval/guard/wer", "eval/held-out/eval_loss"):
        assert set(expected[name]) == {1, 2}, expected
    for name in ("train/loss", "train/lr", "train/grad_norm"):
        assert set(expected[name]) == {1, 2}, expected
    assert_trackers_hold_the_metrics(out, uri)

    _, runs = mlflow_values(uri)
    assert len(runs) == 1
    params = runs[0].data.params
    assert runs[0].info.run_name == "out"
    assert runs[0].info.status == "FINISHED"
    assert params["train.learning_rate"] == "0.001"
    assert params["train.report_to"] == "tensorboard,mlflow,wandb"
    assert params["data.eval_data"] == f"held-out={tone_dataset},guard={tone_dataset}"
    _, wandb_config, _ = wandb_values(out)
    assert wandb_config["train.learning_rate"] == 0.001
    assert wandb_config["model.mode"] == "full"
    # TensorBoard, named too, is written as without trackers
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_report_to_none_writes_metrics_jsonl_alone(tiny_run_config):
    out = train(tiny_run_config(max_steps=1, report_to=["none"])).output_dir
    assert [row["step"] for row in metric_rows(out)] == [1]
    assert not (out / "tensorboard").exists()
    assert not (out / "wandb").exists()


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: "), err
    return err


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("tensorboard,comet", "--report-to comet: expected one of tensorboard, mlflow, wandb"),
        ("none,mlflow", "--report-to none turns every tracker off"),
    ],
)
def test_an_unknown_tracker_is_one_line(
    value, named, capsys, tmp_path, tone_dataset, tiny_whisper_dir
):
    argv = train_argv(tone_dataset, tiny_whisper_dir, tmp_path / "out", "--report-to", value)
    assert main(argv) == 2
    assert named in _one_line(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tracker", ["mlflow", "wandb"])
def test_a_missing_tracker_package_names_its_extra(
    tracker, capsys, tmp_path, tone_dataset, tiny_whisper_dir, monkeypatch
):
    monkeypatch.setitem(sys.modules, tracker, None)  # `import mlflow` raises ImportError
    argv = train_argv(tone_dataset, tiny_whisper_dir, tmp_path / "out", "--report-to", tracker)
    assert main(argv) == 2
    line = _one_line(capsys)
    assert f"--report-to {tracker}: {tracker} is not installed" in line
    assert f"pip install 'whisper-train[{tracker}]'" in line
    assert not (tmp_path / "out").exists()  # refused before the run folder was claimed


@pytest.mark.parametrize(
    ("tracker", "setting"),
    [
        # MLflow 3 refuses its file store unless MLFLOW_ALLOW_FILE_STORE says otherwise
        ("mlflow", "set MLFLOW_TRACKING_URI"),
        # no key and not offline: W&B refuses before it reaches any server
        ("wandb", "set WANDB_MODE=offline"),
    ],
)
def test_a_tracker_that_cannot_start_is_one_line_before_training(
    tracker, setting, capsys, tmp_path, tone_dataset, tiny_whisper_dir, monkeypatch
):
    tracker_env(monkeypatch, tmp_path)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc with a key
    argv = train_argv(
        tone_dataset, tiny_whisper_dir, tmp_path / "out", "--max-steps", "1", "--only-train"
    )
    assert main([*argv, "--report-to", f"tensorboard,{tracker}"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"error: --report-to {tracker}: could not start ("), line
    assert setting in line
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # no step was trained


def test_a_tracker_that_fails_later_is_said_once_and_the_run_goes_on(tmp_path, capsys):
    """A tracker server that goes away mid-run: one line, then metrics.jsonl alone."""
    from whisper_train.runlog import MetricsLog
    from whisper_train.trackers import Trackers

    class Tracker:  # an accelerate tracker; MLflow's second log fails
        def __init__(self, name):
            self.name, self.logged, self.finished = name, [], False

        def log(self, values, step):
            if self.name == "mlflow" and step == 2:
                raise ConnectionError("server gone\nmore detail")
            self.logged.append((step, values))

        def finish(self):
            self.finished = True

    class Accelerator:  # accelerate's calls that start the trackers
        def __init__(self):
            self.trackers = []

        def init_trackers(self, project, config, init_kwargs):
            self.project, self.config = project, config
            self.trackers += [Tracker("mlflow"), Tracker("wandb")]

    accelerator = Accelerator()
    trackers = Trackers(accelerator, ["mlflow", "wandb"], "train:\n  learning_rate: 0.001\n")
    log = MetricsLog(tmp_path, enabled=True, trackers=trackers)
    mlflow, wandb = accelerator.trackers
    for step in (1, 2, 3):
        log.write({"step": step, "loss": 1.0 / step, "lr": 0.1, "grad_norm": None})
    assert mlflow.finished and not wandb.finished  # ended at its failure; W&B goes on
    log.close()
    assert accelerator.config == {"train.learning_rate": 0.001}
    assert mlflow.logged == [(1, {"train/loss": 1.0, "train/lr": 0.1})]
    assert [step for step, _ in wandb.logged] == [1, 2, 3]  # every row, before and after
    assert wandb.finished
    captured = capsys.readouterr()
    said = captured.out + captured.err
    assert said.count("--report-to") == 1
    assert "--report-to mlflow: stopped logging at step 2 (server gone)" in said
    assert [row["step"] for row in metric_rows(tmp_path)] == [1, 2, 3]
    assert not (tmp_path / "tensorboard").exists()  # not named in --report-to
