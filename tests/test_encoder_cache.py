"""The encoder cache of freeze-encoder runs: lazy, on disk, reused by later runs, bounded by a
size limit and the free space, safe with several writers, and managed by `whisper-train cache`."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import (
    SAME_RUN_LOSS_ATOL,
    lora_on_the_decoder_only,
    losses_and_evaluations,
    train_in_subprocess,
    write_tone_dataset,
)
from safetensors.torch import save as save_safetensors
from transformers.models.whisper import modeling_whisper

from whisper_train import runfolder
from whisper_train.cli import main
from whisper_train.config import RunConfig
from whisper_train.data.examples import Example
from whisper_train.errors import UserError
from whisper_train.memory.plan import encoder_cache_line
from whisper_train.training import encoder_cache
from whisper_train.training.encoder_cache import (
    TENSOR_NAME,
    EncoderCache,
    clip_key,
    list_cache,
    model_key,
)
from whisper_train.training.train import train
from whisper_train.units import parse_bytes

# tiny_run_config holds 3 of its 12 clips out for evaluation, unless the run only trains. One
# batch of every training clip a step: 2 steps are 2 epochs.
N_TRAIN = {True: 12, False: 9}  # by only_train
SHAPE = (1500, 64)  # the tiny model's encoder output: positions x d_model
# Two imports of torch on a busy machine, then 36 small writes each; a hang fails, never waits.
WRITERS_TIMEOUT_S = 120


@pytest.fixture
def encoded_rows(monkeypatch):
    """How many clips went through Whisper's encoder (a list, appended to per forward)."""
    rows: list[int] = []
    forward = modeling_whisper.WhisperEncoder.forward

    def counting(self, input_features, *args, **kwargs):
        rows.append(int(input_features.shape[0]))
        return forward(self, input_features, *args, **kwargs)

    monkeypatch.setattr(modeling_whisper.WhisperEncoder, "forward", counting)
    return rows


def _freeze_run(tiny_run_config, tmp_path, name, *, only_train=True, **overrides):
    config = tiny_run_config(
        output_dir=str(tmp_path / name),
        mode="freeze-encoder",
        only_train=only_train,
        batch_size=N_TRAIN[only_train],
        max_steps=2,
        encoder_cache_dir=str(tmp_path / "cache"),
        # --packing auto trains a cached run unpacked: its uncached twin is too.
        packing="off",
        **overrides,
    )
    return losses_and_evaluations(train(config).output_dir)


def _clip_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.safetensors"))


def test_encoded_once_then_reused_by_later_epochs_runs_and_evaluation(
    tmp_path, tiny_run_config, encoded_rows, capsys
):
    losses, evaluations = _freeze_run(tiny_run_config, tmp_path, "first", only_train=False)
    # Epoch 1 encodes the 9 training clips as their batch comes, the evaluation its 3; epoch 2
    # reads them back.
    assert sum(encoded_rows) == 12
    assert len(_clip_files(tmp_path / "cache")) == 12
    out = capsys.readouterr().out
    assert f"encoder cache: {tmp_path / 'cache'}" in out  # where it lives, in the summary
    assert "encoder cache: 12 clips encoded (12 stored), 9 read back" in out

    encoded_rows.clear()
    again, again_evaluations = _freeze_run(tiny_run_config, tmp_path, "second", only_train=False)
    assert sum(encoded_rows) == 0  # a later run encodes nothing
    # The same stored values: the same run, training and evaluation alike.
    np.testing.assert_allclose(again, losses, rtol=0, atol=SAME_RUN_LOSS_ATOL)
    assert again_evaluations[-1]["eval_loss"] == pytest.approx(
        evaluations[-1]["eval_loss"], abs=SAME_RUN_LOSS_ATOL
    )


def test_cached_training_gives_the_uncached_losses(tmp_path, tiny_run_config, encoded_rows):
    cached, _ = _freeze_run(tiny_run_config, tmp_path, "cached")
    # The cached run's step 2 read every clip back (else both runs would be uncached, and
    # equal whether or not the cache works); the uncached run encodes them every step.
    assert sum(encoded_rows) == N_TRAIN[True]
    encoded_rows.clear()
    uncached, _ = _freeze_run(tiny_run_config, tmp_path, "uncached", cache_encoder=False)
    assert sum(encoded_rows) == 2 * N_TRAIN[True]
    assert len(cached) == 2
    # Not bitwise: the cached outputs are float16 and computed a batch's missing clips at a time.
    np.testing.assert_allclose(cached, uncached, rtol=0, atol=SAME_RUN_LOSS_ATOL)


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == encoder_cache.__name__ and r.levelno >= logging.WARNING
    ]


def test_past_the_size_limit_clips_are_encoded_on_the_fly(
    tmp_path, tiny_run_config, encoded_rows, caplog
):
    limit = "1MB"  # room for a few of the 12 clips (188 KiB each), not all
    n_train = N_TRAIN[True]
    with caplog.at_level(logging.WARNING, logger=encoder_cache.__name__):
        losses, _ = _freeze_run(tiny_run_config, tmp_path, "bounded", encoder_cache_max_size=limit)
    assert len(losses) == 2
    stored = _clip_files(tmp_path / "cache")
    assert 0 < len(stored) < n_train
    total = sum(f.stat().st_size for f in (tmp_path / "cache").rglob("*") if f.is_file())
    assert total <= parse_bytes(limit)
    # Epoch 1 encodes every clip; epoch 2 again those the limit left out.
    assert sum(encoded_rows) == n_train + (n_train - len(stored))
    (message,) = _warnings(caplog)  # said once, with the numbers
    assert "stopped writing at the size limit" in message
    for number in (
        f"limit {parse_bytes(limit) / 2**20:.2f} MiB",
        "used ",
        "needed about ",
        "free ",
    ):
        assert number in message


def test_without_free_space_nothing_is_written(
    tmp_path, tiny_run_config, encoded_rows, caplog, monkeypatch
):
    real_disk_usage = shutil.disk_usage
    usage = namedtuple("usage", "total used free")
    full_disk = usage(100 * 2**30, 100 * 2**30 - 2**29, 2**29)  # 512 MiB free

    def disk_usage(path):
        if str(path).startswith(str(tmp_path / "cache")):
            return full_disk
        return real_disk_usage(path)  # the output folder's checkpoint check sees the real disk

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    with caplog.at_level(logging.WARNING, logger=encoder_cache.__name__):
        _freeze_run(tiny_run_config, tmp_path, "full-disk")
    assert _clip_files(tmp_path / "cache") == []
    assert sum(encoded_rows) == 2 * N_TRAIN[True]  # both epochs encode on the fly
    (message,) = _warnings(caplog)
    assert "stopped writing at the free space" in message
    assert f"free {full_disk.free / 2**20:.2f} MiB" in message


def test_a_changed_audio_file_is_a_new_clip(tmp_path):
    audio = tmp_path / "a.wav"
    audio.write_bytes(b"RIFF" + bytes(100))
    first = clip_key(Example(str(audio), "x"))
    assert clip_key(Example(str(audio), "x")) == first
    assert clip_key(Example(str(audio), "x", start=0.0, end=1.0)) != first  # another window
    audio.write_bytes(b"RIFF" + bytes(101))
    assert clip_key(Example(str(audio), "x")) != first
    assert clip_key(Example(str(tmp_path / "missing.wav"), "x")) is None  # encoded on the fly


def test_another_encoder_or_precision_is_another_model_key(tiny_whisper):
    model, processor = tiny_whisper
    extractor = processor.feature_extractor
    encoder = model.model.encoder
    key = model_key(encoder, extractor, compute="fp32")
    assert model_key(encoder, extractor, compute="fp32") == key
    assert model_key(encoder, extractor, compute="bf16") != key
    with torch.no_grad():
        encoder.layers[0].fc1.weight[0, 0] += 1e-3
    assert model_key(encoder, extractor, compute="fp32") != key


# One writer process: store every key ROUNDS times, the same bytes as the other writers.
WRITER = """
import sys
from pathlib import Path

import torch

from whisper_train.training.encoder_cache import EncoderCache

root, rounds, *keys = sys.argv[1:]
cache = EncoderCache(Path(root), "0123456789abcdef", (1500, 64), limit_bytes=2**40)
for _ in range(int(rounds)):
    for key in keys:
        generator = torch.Generator().manual_seed(int(key[:8], 16))  # as _clip_tensor
        assert cache.store(key, torch.randn((1500, 64), generator=generator).half())
"""


def _clip_tensor(key: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(int(key[:8], 16))
    return torch.randn(SHAPE, generator=generator).half()


def test_processes_writing_the_same_clips_leave_whole_files(tmp_path):
    keys = [f"{i:08x}" + "ab" * 12 for i in range(12)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", WRITER, str(tmp_path), "3", *keys]
    writers = [subprocess.Popen(command, env=env) for _ in range(2)]
    reader = EncoderCache(tmp_path, "0123456789abcdef", SHAPE, limit_bytes=0)
    # The raw bytes, not `load`: it reads a torn file as None, the same as no file.
    whole = {key: save_safetensors({TENSOR_NAME: _clip_tensor(key)}) for key in keys}
    deadline, polls = time.monotonic() + WRITERS_TIMEOUT_S, 0
    while any(w.poll() is None for w in writers) and time.monotonic() < deadline:
        for key in keys:  # meanwhile a reader sees no file or a whole one, never a part
            path = reader.path(key)  # once there, a file is only ever replaced, never removed
            assert (path.read_bytes() if path.is_file() else None) in (None, whole[key])
        polls += 1
        time.sleep(0.01)  # leave the writers most of the 2 cores
    assert [w.wait(timeout=1) for w in writers] == [0, 0]
    assert polls  # the reader looked while they ran (each first imports torch: seconds)
    for key in keys:
        assert torch.equal(reader.load(key), _clip_tensor(key))
    leftovers = [p.name for p in tmp_path.rglob("*") if p.is_file() and p.suffix == ".tmp"]
    assert leftovers == [] and len(_clip_files(tmp_path)) == len(keys)


def _cache_with_entries(root: Path, tiny_whisper, n_clips: int, compute: str) -> EncoderCache:
    model, processor = tiny_whisper
    cache = EncoderCache.open(
        root,
        model.model.encoder,
        processor.feature_extractor,
        compute=compute,
        model_name="tiny-test",
        shape=SHAPE,
        limit_bytes=2**40,
    )
    for i in range(n_clips):
        assert cache.store(f"{i:032x}", torch.zeros(SHAPE, dtype=torch.float16))
    return cache


def test_cache_ls_and_clear(tmp_path, tiny_whisper, capsys):
    root = tmp_path / "cache"
    fp32 = _cache_with_entries(root, tiny_whisper, 3, "fp32")
    bf16 = _cache_with_entries(root, tiny_whisper, 2, "bf16")
    (root / "notes.txt").write_text("a user's file: never removed")

    assert main(["cache", "ls", "--encoder-cache-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert str(root) in out
    assert fp32.key in out and bf16.key in out and "total: 5 clips" in out

    assert (
        main(["cache", "clear", "--encoder-cache-dir", str(root), "--model-key", bf16.key[:6]]) == 0
    )
    assert main(["cache", "clear", "--encoder-cache-dir", str(root), "--model-key", bf16.key]) == 2
    assert [e.key for e in list_cache(root)] == [fp32.key]
    assert main(["cache", "clear", "--encoder-cache-dir", str(root), "--all"]) == 0
    assert list_cache(root) == [] and (root / "notes.txt").is_file()


@pytest.mark.parametrize(
    "argv",
    [
        ["cache", "clear", "--encoder-cache-dir", "{root}"],  # neither --model-key nor --all
        ["cache", "clear", "--encoder-cache-dir", "{root}", "--model-key", "ffff"],
        ["cache", "ls", "--encoder-cache-dir", "{root}/typo"],
    ],
)
def test_cache_command_user_errors_are_one_line(tmp_path, capsys, argv):
    (tmp_path / "cache").mkdir()
    argv = [a.format(root=tmp_path / "cache") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_default_folder_is_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("WHISPER_TRAIN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert runfolder.encoder_cache_dir(None) == tmp_path / "whisper-train" / "encoder"
    assert runfolder.encoder_cache_dir(str(tmp_path / "x")) == tmp_path / "x"
    monkeypatch.setenv("WHISPER_TRAIN_CACHE", os.fspath(tmp_path / "wt"))
    assert runfolder.encoder_cache_dir(None) == tmp_path / "wt" / "encoder"


def test_the_memory_plan_sizes_the_cache_and_names_its_folder(tiny_whisper):
    model, _ = tiny_whisper
    folder = "/data/encoder-cache"
    line = encoder_cache_line(
        model.config, n_clips=10_000, folder=folder, limit_bytes=parse_bytes("10GB")
    )
    size = 10_000 * 1500 * model.config.d_model * 2  # 16-bit, 1500 positions a clip
    assert f"= {size / 2**30:.2f} GiB at most, in {folder}" in line
    assert "disk, not device memory" in line


def test_an_unreadable_size_limit_is_refused_before_the_run():
    config = RunConfig.from_flat({"mode": "freeze-encoder", "encoder_cache_max_size": "lots"})
    with pytest.raises(UserError, match="--encoder-cache-max-size lots"):
        config.validate()


def test_a_cache_folder_that_cannot_be_written_is_one_clear_error(tmp_path, tiny_whisper):
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file where the cache folder should be")
    with pytest.raises(UserError, match="--encoder-cache-dir .*cannot write"):
        _cache_with_entries(not_a_folder, tiny_whisper, 0, "fp32")


def test_two_processes_each_encode_and_store_only_their_own_clips(tmp_path, tiny_whisper_dir):
    """--nproc 2: every clip is encoded and written once over both processes (no clip by both,
    so no file written twice), and the second epoch reads every one back."""
    # 16 training clips, 2 processes x batch 4: 2 steps an epoch, no clip repeated to even out
    # the last batch (which would let both processes meet on one clip).
    data = write_tone_dataset(tmp_path / "data", n=16)
    cache = tmp_path / "cache"
    result = train_in_subprocess(
        [
            f"--data={data}",
            f"--model={tiny_whisper_dir}",
            f"--output-dir={tmp_path / 'run'}",
            f"--encoder-cache-dir={cache}",
            "--mode=freeze-encoder",
            "--only-train",
            "--nproc=2",
            "--batch-size=4",
            "--max-steps=4",
            "--nonspeech=none",  # the 16 clips alone
        ]
    )
    assert "encoder cache: 16 clips encoded (16 stored), 16 read back, over 2 process(es)" in (
        result.stdout
    )
    assert len(_clip_files(cache)) == 16


# -- LoRA with the encoder cache: the adapters go on the decoder only. Encoder
# adapters would train on the first epoch's freshly encoded clips, then read back outputs cached
# with their old values and get no gradient: stale features, silently.


def _lora_run(tiny_run_config, tmp_path, name, **overrides):
    config = tiny_run_config(
        output_dir=str(tmp_path / name),
        mode="lora",
        batch_size=N_TRAIN[True],
        max_steps=2,  # 2 epochs: the second reads back every clip the first cached
        encoder_cache_dir=str(tmp_path / "cache"),
        packing="off",  # as --packing auto trains a cached run: its uncached twin too
        **overrides,
    )
    result = train(config)
    return losses_and_evaluations(result.output_dir)[0], result.final_dir


def test_lora_with_the_cache_adapts_the_decoder_only(
    tmp_path, tiny_run_config, tiny_whisper_dir, encoded_rows, capsys, monkeypatch
):
    cached, final_dir = _lora_run(tiny_run_config, tmp_path, "cached", cache_encoder=True)
    assert sum(encoded_rows) == N_TRAIN[True]  # epoch 2 read every clip back
    out = capsys.readouterr().out
    assert "LoRA adapters on the decoder only" in out and "--no-cache-encoder" in out
    # The final model's encoder is the one that computed the cached outputs: the start's.
    trained = transformers.WhisperForConditionalGeneration.from_pretrained(final_dir)
    start = transformers.WhisperForConditionalGeneration.from_pretrained(tiny_whisper_dir)
    for (name, a), b in zip(
        trained.model.encoder.named_parameters(), start.model.encoder.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    decoder_q = (m.model.decoder.layers[0].self_attn.q_proj.weight for m in (trained, start))
    assert not torch.equal(*decoder_q)  # the decoder's adapters trained (merged)

    # The same math computed without the cache: decoder-only adapters, the encoder run on every
    # clip every step. Equal up to the cache's float16 storage (as for freeze-encoder).
    lora_on_the_decoder_only(monkeypatch)
    encoded_rows.clear()
    uncached, _ = _lora_run(tiny_run_config, tmp_path, "uncached", cache_encoder=False)
    assert sum(encoded_rows) == 2 * N_TRAIN[True]
    assert len(cached) == 2
    np.testing.assert_allclose(cached, uncached, rtol=0, atol=SAME_RUN_LOSS_ATOL)


def test_resuming_a_cached_lora_run_without_the_cache_names_the_flag(tmp_path, tiny_run_config):
    """Its checkpoint holds decoder adapters only; without the cache the model has encoder
    adapters too. The refusal must name --cache-encoder, and following it must work."""
    run = {"mode": "lora", "encoder_cache_dir": str(tmp_path / "cache"), "max_steps": 2}
    train(tiny_run_config(**run, cache_encoder=True, save_steps=1))
    checkpoint = str(tmp_path / "out" / "checkpoint-1")
    with pytest.raises(UserError, match="--cache-encoder"):
        train(tiny_run_config(**run, resume=checkpoint))
    train(tiny_run_config(**run, cache_encoder=True, resume=checkpoint))


def test_cached_lora_trains_in_two_processes(tmp_path, tone_dataset, tiny_whisper_dir):
    """Encoder adapters on cached outputs never got a gradient: with --nproc 2, DDP stopped at
    step 2 ("Expected to have finished reduction in the prior iteration")."""
    result = train_in_subprocess(
        [
            f"--data={tone_dataset}",
            f"--model={tiny_whisper_dir}",
            f"--output-dir={tmp_path / 'run'}",
            f"--encoder-cache-dir={tmp_path / 'cache'}",
            "--mode=lora",
            "--cache-encoder",
            "--only-train",
            "--nproc=2",
            "--batch-size=3",
            "--max-steps=2",
        ]
    )
    assert "LoRA adapters on the decoder only" in result.stdout
    assert "step 2/2" in result.stdout
