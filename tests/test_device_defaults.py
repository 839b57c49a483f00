"""Defaults that depend on the device: torch.compile and the data workers are on by default on a
CUDA GPU (where they were measured to pay: BENCHMARKS.md "Compiled, and data workers") and off
on a CPU, and what the user names always wins."""

from __future__ import annotations

import types

import pytest
import torch
import yaml

from whisper_train import runfolder
from whisper_train.config import RunConfig, resolve
from whisper_train.config.resolve import (
    COMPILE_BY_DEFAULT_FROM_STEPS,
    CUDA_DATA_WORKERS,
    decide_compile,
    default_num_workers,
)
from whisper_train.data.loaders import pins_memory
from whisper_train.training.train import train

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def config_with(**values) -> RunConfig:
    config = RunConfig()
    config.update(values)
    return config


def compiles(config: RunConfig, device: torch.device, steps: int, packing: str = "off") -> bool:
    return decide_compile(config, device, packing, steps)[0]


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
        # The plan may choose activation offload: compiling was never run with it.
        {"gradient_checkpointing": "auto", "max_memory": "4GB"},
    ],
    ids=["fsdp", "per-clip", "offload", "auto-checkpointing"],
)
def test_no_default_compiling_with_what_compile_is_refused_with_or_was_never_run_with(values):
    """Not compiled, and the start line says why: --compile's default is not silently off."""
    config = config_with(**values)
    packing = "per-clip" if values.get("packing") == "per-clip" else "off"
    compiled, note = decide_compile(config, CUDA, packing, 10 * COMPILE_BY_DEFAULT_FROM_STEPS)
    assert not compiled
    assert note.startswith("compile off (the default for 20000 steps on a GPU)")


def test_compile_named_by_the_user_wins_over_the_default():
    assert compiles(config_with(compile=True), CPU, 1)
    assert not compiles(config_with(compile=False), CUDA, 10 * COMPILE_BY_DEFAULT_FROM_STEPS)


def accelerator_on(device: torch.device, processes: int = 1):
    return types.SimpleNamespace(device=device, num_processes=processes)


def workers(requested, device, processes: int = 1) -> int:
    return default_num_workers(requested, device, processes)


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
    monkeypatch.setattr(resolve.os, "sched_getaffinity", lambda _: set(range(cpus)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    assert workers(None, CUDA, processes) == expected
    assert pins_memory(accelerator_on(CUDA))


def test_no_data_workers_by_default_on_a_cpu_and_the_users_number_wins(monkeypatch):
    monkeypatch.setattr(resolve.os, "sched_getaffinity", lambda _: set(range(64)), raising=False)
    assert workers(None, CPU) == 0
    assert workers(3, CPU) == 3
    assert workers(0, CUDA) == 0
    assert not pins_memory(accelerator_on(CPU))


def test_the_saved_configuration_keeps_the_options_as_asked_and_the_record_what_was_done(
    tiny_run_config,
):
    """A run's whisper-train.yaml says what was asked for, so that used as --config on another
    machine it resolves the device's defaults there (a CPU does not inherit a GPU machine's
    workers); its record says what this run did."""
    result = train(tiny_run_config(max_steps=1))
    saved = yaml.safe_load((result.output_dir / runfolder.CONFIG_FILE).read_text())
    assert saved["train"]["num_workers"] is None
    assert saved["memory"]["compile"] is None
    assert saved["record"]["data"]["num_workers"] == 0
    assert saved["record"]["memory"]["compile"] is False
    assert saved["record"]["memory"]["precision"] == "fp32"
