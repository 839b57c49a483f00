"""`accelerate launch` with the configs the repository ships (configs/accelerate/, the command
docs/multi-gpu.md gives): the CPU config's two processes, and the GPU config's launcher asked for
two processes on a machine without GPUs, train as one process does at the same global batch, and
final/ is written once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TRAIN_SUBPROCESS_TIMEOUT_S
from test_nodes import as_flags, assert_trains_as_one_process, tiny_run_settings

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "accelerate"


@pytest.mark.long
@pytest.mark.parametrize(
    ("config", "options"),
    [("ddp-cpu.yaml", []), ("ddp-gpu.yaml", ["--num_processes", "2"])],
)
def test_accelerate_launch_with_each_config_equals_one_process(
    config, options, tmp_path, tiny_whisper_dir
):
    settings = tiny_run_settings(tmp_path, tiny_whisper_dir)
    two = tmp_path / "two"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(CONFIGS / config),
            *options,
            "-m",
            "whisper_train",
            "train",
            *as_flags(settings),
            "--only-train",
            "--batch-size=2",  # x 2 processes (the config's): 4 clips a step
            f"--output-dir={two}",
        ],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=TRAIN_SUBPROCESS_TIMEOUT_S,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert_trains_as_one_process(settings, two, tmp_path / "one")
    assert (two / "final" / "model.safetensors").is_file()
    assert done.stdout.count("fine-tuned model:") == 1
