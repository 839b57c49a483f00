"""Data parallel on CPU (2 gloo processes) equals one process; --compile trains."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import (
    SAME_RUN_LOSS_ATOL,
    losses_and_evaluations,
    train_in_subprocess,
    write_tone_dataset,
)

from whisper_train.config import RunConfig
from whisper_train.training.train import train


@pytest.mark.long
def test_two_processes_equal_one_and_resume_exactly(tmp_path, tiny_whisper_dir):
    # 19 clips, 3 held out: 16 training clips, global batch 4 (1 x 4, or 2 processes x 1 x 2
    # micro-batches: the usual multi-GPU run, gradient accumulation under DDP's no_sync). The
    # 3 evaluation clips split over 2 processes (batch 1) give process 1 one clip and an empty
    # batch: every clip must be scored once, and the processes must not wait for each other.
    data = write_tone_dataset(tmp_path / "data", n=19)
    common = {
        "data": str(data),
        "model": str(tiny_whisper_dir),
        "learning_rate": 1e-3,
        "seed": 0,
        "eval_split": 0.16,
        "gradient_checkpointing": "on",
        "lr_scheduler": "constant_with_warmup",
        "generation_max_length": 4,
        "temperatures": "0",  # decode once: a random model would take the whole fallback
        # The default packing: a step of 4 clips is planned whole, then split over the
        # processes and micro-batches (data.step_plan).
    }
    config = RunConfig()
    config.update({**common, "output_dir": str(tmp_path / "one"), "max_steps": 5, "batch_size": 4})
    single = train(config)
    single_losses, single_evals = losses_and_evaluations(single.output_dir)

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in common.items()]
    two = tmp_path / "two"
    # 3 steps and a checkpoint, then --resume for 2 more: 5 steps across an epoch boundary.
    train_in_subprocess(
        [
            *flags,
            "--nproc=2",
            "--batch-size=1",
            "--gradient-accumulation=2",
            f"--output-dir={two}",
            "--max-steps=3",
            "--save-steps=3",
        ]
    )
    assert (two / "checkpoint-3" / "rng-1.pt").is_file()  # each process's random state
    train_in_subprocess(
        [
            *flags,
            "--nproc=2",
            "--batch-size=1",
            "--gradient-accumulation=2",
            f"--output-dir={two}",
            "--max-steps=5",
            "--save-steps=5",
            "--resume=latest",
        ]
    )
    two_losses, two_evals = losses_and_evaluations(two)
    # Equal up to float32 summation order (2 x 1 x 2 rows and an all-reduce vs 4 rows), which a clip
    # seen twice or skipped, or a wrong per-process loss weight, would exceed many times over.
    np.testing.assert_allclose(two_losses, single_losses, rtol=0, atol=SAME_RUN_LOSS_ATOL)
    # Evaluation ran sharded (clips 0 and 2 on process 0, clip 1 and an empty batch on process
    # 1) and gathered: the same 3 clips scored once each, so the same validation loss and
    # `clips` (a clip counted twice would make it 4, and weigh its loss twice). (The first run's closing
    # evaluation at step 3 stays in the file: it happened.) WER is not compared: a random
    # model's top two logits can lie closer than float noise, so its greedy words may differ
    # between the runs without anything being wrong.
    assert [e["step"] for e in two_evals] == [3, 5]
    assert [e["clips"] for e in two_evals] == [3, 3] and single_evals[-1]["clips"] == 3
    np.testing.assert_allclose(
        two_evals[-1]["eval_loss"], single_evals[-1]["eval_loss"], rtol=0, atol=SAME_RUN_LOSS_ATOL
    )
    # It is a WER of those 3 clips' 9 words (3 each): a whole number of word errors over 9.
    # metrics.jsonl's 6 decimals move `errors` by 9 x 5e-7 at most, far inside the 1e-4 allowed.
    errors = two_evals[-1]["wer"] * 9
    assert errors >= 0 and abs(errors - round(errors)) < 1e-4


def test_compile_trains_one_step_like_eager(tmp_path, tiny_run_config, monkeypatch):
    # Inductor's C++ code generation takes minutes on a busy CPU; aot_eager traces the same graph
    # through dynamo and AOT autograd (what --compile changes) without generating code.
    real_compile = torch.compile
    compiled = []

    def compile_for_test(model, **kwargs):
        compiled.append(model)
        return real_compile(model, **{**kwargs, "backend": "aot_eager"})

    monkeypatch.setattr(torch, "compile", compile_for_test)
    runs = {}
    for name, flag in (("eager", False), ("compiled", True)):
        # --compile trains unpacked (per-clip's routing runs hooks on tensors): so does eager.
        config = tiny_run_config(
            output_dir=str(tmp_path / name), max_steps=1, compile=flag, packing="off"
        )
        runs[name] = train(config)
    assert len(compiled) == 1
    # AOT autograd decomposes some operations (layer norm, softmax): same values up to float32
    # rounding, not bitwise.
    np.testing.assert_allclose(
        losses_and_evaluations(runs["compiled"].output_dir)[0],
        losses_and_evaluations(runs["eager"].output_dir)[0],
        rtol=0,
        atol=SAME_RUN_LOSS_ATOL,
    )
    assert (runs["compiled"].final_dir / "model.safetensors").is_file()


def test_ddp_searches_for_unused_parameters_only_with_layerdrop_and_never_uses_a_static_graph():
    """The DDP settings are decided from the model before the Accelerator is built: layerdrop
    leaves parameters unused in a step (T4), so only then does DDP search for them; a static
    graph would break gradient accumulation's no_sync (pytorch#143580)."""
    from tiny_models import fresh_short_whisper

    from whisper_train.memory.wrappers import ddp_settings

    model = fresh_short_whisper()
    plain = ddp_settings(model)
    assert plain.find_unused_parameters is False and plain.static_graph is False
    model.config.decoder_layerdrop = 0.1
    with_layerdrop = ddp_settings(model)
    assert with_layerdrop.find_unused_parameters is True and with_layerdrop.static_graph is False
