"""Defaults that depend on the device: torch.compile and the data workers are on by default on a
CUDA GPU (where they were measured to pay: BENCHMARKS.md "Compiled, and data workers") and off
on a CPU, and what the user names always wins."""

from __future__ import annotations

import types

import pytest
import torch
import yaml

from whisper_train import runfolder
from whisper_train.config import RunConfig
from whisper_train.data import loaders
from whisper_train.data.loaders import CUDA_DATA_WORKERS, default_num_workers, pins_memory
from whisper_train.training.setup_phases import COMPILE_BY_DEFAULT_FROM_STEPS, compiles
from whisper_train.training.train import train

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def config_with(**values) -> RunConfig:
    config = RunConfig()
    config.update(values)
    return config


def test_compiling_by_default_needs_cuda_and_a_run_long_enough_to_pay_it_back():
    default = config_with()
    assert compiles(default, CUDA, COMPILE_BY_DEFAULT_FROM_STEPS)
    assert not compiles(default, CUDA, COMPILE_BY_DEFAULT_FROM_STEPS - 1)
    # On a CPU the step is bound by arithmetic, and Inductor's C++ build takes minutes.
    assert not compiles(default, CPU, 100 * COMPILE_BY_DEFAULT_FROM_STEPS)


@pytest.mark.parametrize(
    "values",
    [
        {"nproc": 2, "fsdp": True, "gradient_checkpointing": "full"},
        {"packing": "per-clip"},
        {"offload_activations": True, "gradient_checkpointing": "full"},
    ],
    ids=["fsdp", "per-clip", "offload"],
)
def test_no_default_compiling_with_what_compile_is_refused_with_or_was_never_run_with(values):
    assert not compiles(config_with(**values), CUDA, 10 * COMPILE_BY_DEFAULT_FROM_STEPS)


def test_compile_named_by_the_user_wins_over_the_default():
    assert compiles(config_with(compile=True), CPU, 1)
    assert not compiles(config_with(compile=False), CUDA, 10 * COMPILE_BY_DEFAULT_FROM_STEPS)


def accelerator_on(device: torch.device, processes: int = 1):
    return types.SimpleNamespace(device=device, num_processes=processes)


@pytest.mark.parametrize(
    ("cpus", "processes", "expected"),
    [
        (16, 1, CUDA_DATA_WORKERS),  # the H200 machine it was measured on
        (16, 8, 1),  # 8 GPUs on 16 CPUs: one worker each, one CPU each to train
        (4, 1, 3),
        (2, 2, 0),  # no CPU to spare: clips are read in the training processes
    ],
)
def test_data_workers_by_default_on_cuda_leave_each_training_process_a_cpu(
    monkeypatch, cpus, processes, expected
):
    monkeypatch.setattr(loaders.os, "sched_getaffinity", lambda _: set(range(cpus)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    assert default_num_workers(None, accelerator_on(CUDA, processes)) == expected
    assert pins_memory(accelerator_on(CUDA))


def test_no_data_workers_by_default_on_a_cpu_and_the_users_number_wins(monkeypatch):
    monkeypatch.setattr(loaders.os, "sched_getaffinity", lambda _: set(range(64)), raising=False)
    assert default_num_workers(None, accelerator_on(CPU)) == 0
    assert default_num_workers(3, accelerator_on(CPU)) == 3
    assert default_num_workers(0, accelerator_on(CUDA)) == 0
    assert not pins_memory(accelerator_on(CPU))


def test_the_saved_configuration_keeps_the_defaults_unresolved(tiny_run_config):
    """A run's whisper-train.yaml says what was asked for, so resuming it on another machine
    resolves the device's defaults there (a CPU does not inherit a GPU machine's workers)."""
    result = train(tiny_run_config(max_steps=1))
    saved = yaml.safe_load((result.output_dir / runfolder.CONFIG_FILE).read_text())
    assert saved["train"]["num_workers"] is None
    assert saved["memory"]["compile"] is None
