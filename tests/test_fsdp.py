"""--fsdp: two gloo processes holding half the model each train as one process does."""

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
from safetensors.torch import load_file

from whisper_train.cli import build_parser, config_from_args
from whisper_train.config import RunConfig
from whisper_train.errors import UserError
from whisper_train.models import load_model
from whisper_train.training.train import train


def _runs(tmp_path, tiny_whisper_dir, **extra):
    """Training data with one missing clip, a separate evaluation set, and the settings both
    runs share (as flags and as a config)."""
    data = write_tone_dataset(tmp_path / "data", n=16)
    metadata = data / "metadata.csv"
    metadata.write_text(metadata.read_text() + "missing.wav,alpha bravo charlie\n")
    evaluation = write_tone_dataset(tmp_path / "eval", n=4, seed=1)
    common = {
        "data": str(data),
        "eval_data": f"held={evaluation}",
        "model": str(tiny_whisper_dir),
        "learning_rate": 1e-3,
        "seed": 0,
        "gradient_checkpointing": "on",
        "lr_scheduler": "constant_with_warmup",
        "generation_max_length": 4,
        "temperatures": "0",
        # Clips one by one: 4 clips split 1 x 2 x 2 (whole windows cannot be); the matrix
        # trains per-clip packing sharded.
        "packing": "off",
        "nonspeech": "none",  # its own clips alone: the counts above
        **extra,
    }
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in common.items()]
    return common, flags


def _one_process(common: dict, output_dir, steps: int):
    config = RunConfig()
    config.update({**common, "output_dir": str(output_dir), "max_steps": steps, "batch_size": 4})
    return train(config)


@pytest.mark.long
def test_sharded_two_processes_equal_one_with_an_unusable_share_and_resume_exactly(
    tmp_path, tiny_whisper_dir
):
    # Global batch 4: one process x 4, or 2 sharded processes x 1 clip x 2 micro-batches. At
    # batch 1 the missing clip leaves one process a micro-batch with nothing usable: it runs the
    # zero-weight stand-in, so both still all-gather and reduce-scatter every layer alike.
    common, flags = _runs(tmp_path, tiny_whisper_dir)
    single = _one_process(common, tmp_path / "one", steps=5)
    single_losses, single_evals = losses_and_evaluations(single.output_dir)

    two = tmp_path / "two"
    sharded = [*flags, "--nproc=2", "--fsdp", "--batch-size=1", "--gradient-accumulation=2"]
    # 3 steps and a checkpoint, then --resume for 2 more: across the epoch boundary (17 clips).
    first = train_in_subprocess(
        [*sharded, f"--output-dir={two}", "--max-steps=3", "--save-steps=3"]
    )
    # Each process wrote its own shard of the weights and the optimiser state.
    shards = sorted(p.name for p in (two / "checkpoint-3" / "sharded").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    resumed = train_in_subprocess(
        [*sharded, f"--output-dir={two}", "--max-steps=5", "--save-steps=5", "--resume=latest"]
    )
    # The missing clip is named (by the part of the run that met it), not silently dropped.
    said = first.stdout + first.stderr + resumed.stdout + resumed.stderr
    assert "audio file not found" in said and "missing.wav" in said

    two_losses, two_evals = losses_and_evaluations(two)
    # Equal up to float32 summation order: a wrong shard, a lost gradient or a stand-in that
    # weighed would exceed this many times over.
    assert len(single_losses) == 5
    np.testing.assert_allclose(two_losses, single_losses, rtol=0, atol=SAME_RUN_LOSS_ATOL)
    # The evaluation ran on the gathered weights, each process decoding its own clips.
    np.testing.assert_allclose(
        two_evals[-1]["eval_loss"], single_evals[-1]["eval_loss"], rtol=0, atol=SAME_RUN_LOSS_ATOL
    )
    # final/ is a whole model that loads like any other (both runs chose step 5: the last
    # evaluated one with the lower WER is the same step, the losses being equal).
    model, _ = load_model(str(two / "final"))
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters())
    one_final = load_file(single.output_dir / "final" / "model.safetensors")
    two_final = load_file(two / "final" / "model.safetensors")
    assert set(two_final) == set(one_final)
    # 5 Adam steps of 1e-3 move a weight by up to ~5e-3; the two runs' weights agree far closer.
    worst = max(float((two_final[k] - one_final[k]).abs().max()) for k in one_final)
    assert worst < 1e-4, worst


@pytest.mark.slow
def test_sharded_lora_equals_one_process(tmp_path, tiny_whisper_dir):
    # LoRA dropout off: each process draws its own masks, which one process cannot repeat.
    common, flags = _runs(tmp_path, tiny_whisper_dir, mode="lora", lora_dropout=0.0)
    single = _one_process(common, tmp_path / "one", steps=3)
    two = tmp_path / "two"
    train_in_subprocess(
        [*flags, "--nproc=2", "--fsdp", "--batch-size=2", f"--output-dir={two}", "--max-steps=3"]
    )
    np.testing.assert_allclose(
        losses_and_evaluations(two)[0],
        losses_and_evaluations(single.output_dir)[0],
        rtol=0,
        atol=SAME_RUN_LOSS_ATOL,
    )
    # final/ holds the adapters merged into whole weights, as without --fsdp.
    weights = load_file(two / "final" / "model.safetensors")
    assert not any("lora" in name for name in weights)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ([], "add --nproc 2"),
        (["--nproc=2", "--precision=fp16"], "use --precision bf16"),
        (["--nproc=2", "--compile"], "--compile"),
        (["--nproc=2", "--mode=freeze-encoder"], "add --no-cache-encoder"),
    ],
)
def test_fsdp_refuses_what_it_cannot_shard_in_one_line(flags, named, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # not started by a launcher
    args = build_parser().parse_args(["train", "--fsdp", *flags])
    with pytest.raises(UserError, match="^--fsdp") as refused:
        config_from_args(args)  # validates
    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_fsdp_is_a_yaml_setting_too(tmp_path):
    preset = tmp_path / "sharded.yaml"
    preset.write_text("train: {nproc: 2, fsdp: true}\n")
    assert RunConfig.from_yaml(preset).validate().train.fsdp


def test_the_gathered_projection_is_the_whole_weight_outside_forward(tmp_path):
    # The loss applies the tied output projection after the model's forward: on a model
    # sharded by one process (world of 1), the weight the loss gets is a whole tensor.
    from tiny_models import make_tiny_whisper

    from whisper_train.memory import shard_model
    from whisper_train.memory.sharding import gathered_weight

    assert not torch.distributed.is_initialized()
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1
    )
    try:
        model, _ = make_tiny_whisper()
        expected = model.proj_out.weight.detach().clone()
        shard_model(model, torch.device("cpu"))
        sharded = model.proj_out.weight
        assert type(sharded).__name__ == "DTensor"
        whole = gathered_weight(sharded, model)
        assert type(whole).__name__ != "DTensor"
        torch.testing.assert_close(whole.detach(), expected, rtol=0, atol=0)
    finally:
        torch.distributed.destroy_process_group()
