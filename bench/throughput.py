"""Training throughput: whisper-train's loop vs transformers' Seq2SeqTrainer (the blog recipe).

    .venv/bin/python bench/throughput.py [--rounds 2] [--clips 32] [--batch-size 8]
        [--d-model 128] [--layers 2 | --model tiny.en] [--checkpointing off|full]

Same model (a random one of tests/tiny_models.py dimensions, or with --model any model
whisper-train reads, such as the real tiny.en; saved once as a Hugging Face folder), same clips (the first --clips
of ../shared/realspeech when present, else generated tones), same batch, fp32 on a CPU (bf16
on CUDA), same checkpointing (non-reentrant in both: the Trainer gets
`gradient_checkpointing_kwargs={"use_reentrant": False}`), AdamW, no evaluation.

Two scenarios:
  full            every weight trains; samples/s of the training loop. The Trainer's features
                  are computed beforehand by `dataset.map` (the blog recipe); that time is
                  shown separately and in the "incl. features" ratio.
  freeze-encoder  whisper-train with its encoder cache (filled by an untimed run first, so
                  every timed epoch is cached) vs the Trainer with `model.freeze_encoder()`;
                  seconds per epoch after the first (whisper-train: its loop / epochs).

Packing (`--packing-sets an4,long,synth`): clips/s and seconds of audio trained per second for
whisper-train with --packing off, with --packing on, and the Seq2SeqTrainer recipe (scenario
full, same model, batch and clips), on AN4 (../shared/realspeech, 0.7-1.3 s), LJ Speech and
LibriVox (the realspeech clips of 5-10 s) and espeak-ng clips of the demo's voices (each set's
clips listed --repeat times). A packed batch holds --batch-size windows of up to 30 s, so about
the memory of --batch-size clips.

Each run is its own subprocess (`--worker`), and runs alternate (whisper-train, Trainer,
whisper-train, ...). Times are CPU seconds of the worker process (`time.process_time`), not wall
time: on a machine shared with other jobs wall time swung 6x between identical runs, CPU time
does not (with --threads 1 there are no idle OpenMP threads spinning either). On CUDA, where
the GPU does the work, wall time is used. On CUDA each
worker also reports peak allocated memory and MFU (FLOP formula of docs/compute.md; peak
FLOP/s from --peak-tflops, default H100 SXM dense bf16).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
from common import REALSPEECH  # noqa: E402  (bench/ is this script's folder: on sys.path)

# --packing-systems: whisper-train's rows and the --packing each trains with.
PACKING_OF = {"packed": "on", "per-clip": "per-clip", "unpacked": "off"}


def CLOCK() -> float:  # noqa: N802 - a constant-like alias for the clock every time uses
    """CPU seconds of this process on a CPU run (robust to other jobs), wall time on CUDA."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


# -- setup (parent process) -------------------------------------------------------------------


def write_manifest(folder: Path, n_clips: int) -> Path:
    """A JSONL manifest with absolute audio paths: real clips when available, else tones."""
    rows = []
    if (REALSPEECH / "manifest.jsonl").exists():
        for line in (REALSPEECH / "manifest.jsonl").read_text().splitlines()[:n_clips]:
            row = json.loads(line)
            rows.append({"audio": str(REALSPEECH / row["audio"]), "text": row["text"]})
    else:
        sys.path.insert(0, str(REPO / "tests"))
        from conftest import write_tone_dataset

        tones = write_tone_dataset(folder / "tones", n=n_clips, layout="jsonl")
        for line in tones.read_text().splitlines():
            row = json.loads(line)
            rows.append({"audio": str(tones.parent / row["audio"]), "text": row["text"]})
    manifest = folder / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return manifest


def save_model(folder: Path, d_model: int, layers: int, spec: str | None) -> Path:
    """The benchmark's model as a Hugging Face folder both systems load: `spec` read by
    whisper-train (a folder, a hub id, tiny.en), else a random tiny model of these sizes."""
    if spec:
        from whisper_train.models import load_model

        model, processor = load_model(spec)
    else:
        sys.path.insert(0, str(REPO / "tests"))
        from tiny_models import make_tiny_whisper

        # A published width (tiny 384 ... large 1280) gets the published heads (64 wide) and
        # feed-forward (4 x d_model): --d-model 768 --layers 12 is whisper-small's shape.
        published = {}
        if d_model in (384, 512, 768, 1024, 1280):
            published = {
                "encoder_attention_heads": d_model // 64,
                "decoder_attention_heads": d_model // 64,
                "encoder_ffn_dim": 4 * d_model,
                "decoder_ffn_dim": 4 * d_model,
            }
        model, processor = make_tiny_whisper(
            d_model=d_model, encoder_layers=layers, decoder_layers=layers, **published
        )
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


# -- workers (one subprocess per run) ---------------------------------------------------------


def run_whisper_train(args) -> dict:
    import torch

    from whisper_train.config import RunConfig
    from whisper_train.training.train import train

    try:  # the module whose loop prints "trained N steps in X s" (train.py before the recipe)
        import whisper_train.training.recipe as loop_module
    except ImportError:
        import whisper_train.training.train as loop_module
    if args.worker == "whisper-train-own-order":  # before memory.cross_attention: for comparison
        from whisper_train.memory import loss

        loss.folded_cross_attention = lambda *args, **kwargs: contextlib.nullcontext()
    if not torch.cuda.is_available():  # the loop is timed with time.perf_counter: make that
        clock = {name: getattr(time, name) for name in dir(time) if not name.startswith("_")}
        loop_module.time = types.SimpleNamespace(**{**clock, "perf_counter": CLOCK})  # CPU time
    config = RunConfig()
    config.update(
        {
            "data": args.manifest,
            "model": args.model_dir,
            "mode": args.scenario,
            "gradient_checkpointing": args.checkpointing,
            "precision": "auto",
            "batch_size": args.batch_size,
            "epochs": args.epochs,
            "only_train": True,
            "eval_split": 0.0,
            "output_dir": str(Path(args.workdir) / f"wt-{time.time_ns()}"),
            "max_grad_norm": 1.0,
            "learning_rate": 1e-5,
            "seed": 0,
            "packing": args.packing,
            # Speech alone by default, as the Trainer trains (--nonspeech auto, train's default,
            # adds a fifth of noise): bench/speed_watch.py asks for both.
            "nonspeech": args.nonspeech,
            "num_workers": None if args.num_workers < 0 else args.num_workers,
            "compile": {"on": True, "off": False, "default": None}[args.compile],
            # The bench's own cache: main() fills it in an untimed warm-up run, so every timed
            # epoch is a cached one (the user's cache would carry clips over between versions).
            "encoder_cache_dir": str(Path(args.workdir) / "encoder-cache"),
        }
    )
    step_ends, step_epochs = record_step_ends(loop_module)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = train(config)
    text = printed.getvalue()
    # train() prints its loop time ("trained N steps in X s") and the cache build time.
    loop_seconds = float(re.search(r"trained \d+ steps in ([0-9.]+) s", text).group(1))
    if step_ends:  # the loop ended at the last step's end: the times from its start
        loop_start = step_ends[-1] - loop_seconds
        step_ends[:] = [end - loop_start for end in step_ends]
    samples = result.train_examples * args.epochs
    out = {
        "loop_s": loop_seconds,
        "epoch_ends_s": epoch_ends(step_ends, step_epochs),
        "samples": samples,
        "samples_per_s": samples / loop_seconds,
        "epoch_s_after_first": loop_seconds / args.epochs,
        **steady_rate(step_ends, args.batch_size),
    }
    if torch.cuda.is_available():
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


# Steps left out of the steady rate: the first compiles the model, the second recompiles it for
# label lengths that vary (dynamic shapes), a few more settle the allocator and the data path.
WARM_STEPS = 10


def record_step_ends(loop_module) -> tuple[list[float], list[int]]:
    """The wall time at the end of each of whisper-train's optimizer steps (after its checks,
    which wait for the device once a step, so the times are the device's too), and the epoch
    each step was in."""
    ends: list[float] = []
    epochs: list[int] = []
    recipe_class = getattr(loop_module, "FineTuneRecipe", None)
    if recipe_class is None:
        return ends, epochs
    after_step = recipe_class._after_step

    def timed_after_step(self, step):
        epochs.append(self.state.epoch)
        result = after_step(self, step)
        ends.append(CLOCK())
        return result

    recipe_class._after_step = timed_after_step
    return ends, epochs


def epoch_ends(step_ends: list[float], step_epochs: list[int]) -> list[float]:
    """The time (from the loop's start) at which each epoch's last step ended."""
    ends: dict[int, float] = {}
    for end, epoch in zip(step_ends, step_epochs, strict=True):
        ends[epoch] = end
    return [ends[epoch] for epoch in sorted(ends)]


def steady_rate(step_ends: list[float], batch_size: int) -> dict:
    """Clips per second over the steps after the first WARM_STEPS (compilation and the first
    steps' one-off costs excluded), and the seconds those first steps took."""
    if len(step_ends) <= WARM_STEPS + 1:
        return {}
    steps = len(step_ends) - 1 - WARM_STEPS
    seconds = step_ends[-1] - step_ends[WARM_STEPS]
    return {
        "steady_samples_per_s": steps * batch_size / seconds,
        "steady_ms_per_step": 1e3 * seconds / steps,
        "warm_steps_s": step_ends[WARM_STEPS],  # relative to the first step's start: see callers
    }


def run_seq2seq_trainer(args) -> dict:
    import numpy as np
    import torch
    from transformers import (
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        TrainerCallback,
        WhisperForConditionalGeneration,
        WhisperProcessor,
    )

    from whisper_train.audio import load_audio

    processor = WhisperProcessor.from_pretrained(args.model_dir)
    model = WhisperForConditionalGeneration.from_pretrained(args.model_dir)
    model.model.encoder.embed_positions.requires_grad_(False)  # fixed sinusoids, as whisper-train
    model.config.use_cache = False
    if args.scenario == "freeze-encoder":
        model.freeze_encoder()
    rows = [json.loads(line) for line in Path(args.manifest).read_text().splitlines()]
    # datasets.Audio needs torchcodec (not loadable here): decode with the same reader.
    columns = {
        "audio": [load_audio(r["audio"]) for r in rows],
        "sentence": [r["text"] for r in rows],
    }

    def prepare(example):  # the blog's prepare_dataset: features and label ids per clip
        audio = np.asarray(example["audio"], dtype=np.float32)
        example["input_features"] = processor.feature_extractor(
            audio, sampling_rate=16_000
        ).input_features[0]
        example["labels"] = processor.tokenizer(example["sentence"]).input_ids
        return example

    start = CLOCK()
    try:
        from datasets import Dataset

        raw = Dataset.from_dict(columns)
        dataset = raw.map(prepare, remove_columns=raw.column_names)
    except ImportError:  # a GPU image without `datasets`: the same rows from a Python list,
        # which the Trainer reads faster than Arrow (the comparison only gets harder for us)
        dataset = []
        for audio, sentence in zip(columns["audio"], columns["sentence"], strict=True):
            row = prepare({"audio": audio, "sentence": sentence})
            dataset.append({"input_features": row["input_features"], "labels": row["labels"]})
    features_s = CLOCK() - start

    def collate(features):  # the blog's data collator: pad features and labels separately
        batch = processor.feature_extractor.pad(
            [{"input_features": f["input_features"]} for f in features], return_tensors="pt"
        )
        labels_batch = processor.tokenizer.pad(
            [{"input_ids": f["labels"]} for f in features], return_tensors="pt"
        )
        labels = labels_batch["input_ids"].masked_fill(labels_batch.attention_mask.ne(1), -100)
        if (labels[:, 0] == model.config.decoder_start_token_id).all():
            labels = labels[:, 1:]  # the model prepends the start token itself
        batch["labels"] = labels
        return batch

    epoch_times: list[float] = []

    loop_times: list[float] = []
    step_ends: list[float] = []

    class EpochTimer(TrainerCallback):
        def on_train_begin(self, *_, **__):
            self.train_start = CLOCK()

        def on_step_end(self, *_, **__):  # the Trainer reads the gradient norm each step: a sync
            step_ends.append(CLOCK() - self.train_start)

        def on_train_end(self, *_, **__):
            loop_times.append(CLOCK() - self.train_start)

        def on_epoch_begin(self, *_, **__):
            self.start = CLOCK()

        def on_epoch_end(self, *_, **__):
            epoch_times.append(CLOCK() - self.start)

    on_cuda = torch.cuda.is_available()
    training_args = Seq2SeqTrainingArguments(
        output_dir=str(Path(args.workdir) / f"hf-{time.time_ns()}"),
        per_device_train_batch_size=args.batch_size,
        learning_rate=1e-5,
        num_train_epochs=args.epochs,
        gradient_checkpointing=args.checkpointing != "off",
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=on_cuda,
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        logging_steps=1000,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        max_grad_norm=1.0,
        seed=0,
        use_cpu=not on_cuda,
        disable_tqdm=True,
        torch_compile=args.compile == "on",
    )
    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        data_collator=collate,
        callbacks=[EpochTimer()],
    )
    trainer.train()
    samples = len(dataset) * args.epochs
    out = {
        "loop_s": loop_times[0],
        "samples": samples,
        "samples_per_s": samples / loop_times[0],
        "features_s": features_s,
        "epoch_s_after_first": statistics.mean(epoch_times[1:] or epoch_times),
        **steady_rate(step_ends, args.batch_size),
    }
    if on_cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


# -- driver ------------------------------------------------------------------------------------


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    run = run_seq2seq_trainer if args.worker == "trainer" else run_whisper_train
    result = run(args)
    if torch.cuda.is_available():
        from transformers import AutoConfig

        from whisper_train.memory.plan import model_flops_per_sample

        config = AutoConfig.from_pretrained(args.model_dir)
        train_flops = 3 * model_flops_per_sample(config, label_tokens=32)
        result["mfu"] = result["samples_per_s"] * train_flops / (args.peak_tflops * 1e12)
    print("RESULT " + json.dumps(result), flush=True)


def launch(
    args,
    system: str,
    scenario: str,
    epochs: int,
    packing: str = "off",
    compile: str = "off",
    nonspeech: str = "none",
) -> dict:
    command = [
        sys.executable,
        __file__,
        "--worker",
        system,
        "--scenario",
        scenario,
        "--epochs",
        str(epochs),
        "--manifest",
        args.manifest,
        "--model-dir",
        args.model_dir,
        "--workdir",
        args.workdir,
        "--batch-size",
        str(args.batch_size),
        "--checkpointing",
        args.checkpointing,
        "--threads",
        str(args.threads),
        "--peak-tflops",
        str(args.peak_tflops),
        "--packing",
        packing,
        "--compile",
        compile,
        "--nonspeech",
        nonspeech,
        "--num-workers",
        str(-1 if args.num_workers is None else args.num_workers),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    match = re.search(r"^RESULT (.*)$", done.stdout, flags=re.MULTILINE)
    if not match:
        sys.exit(f"{system} {scenario} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clips", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--model", default=None, help="e.g. tiny.en, instead of a random model")
    parser.add_argument("--checkpointing", default="off")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--full-epochs", type=int, default=1)
    parser.add_argument("--freeze-epochs", type=int, default=3)
    parser.add_argument("--scenarios", default="full,freeze-encoder")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument(
        "--num-workers",
        type=int,
        default=0,
        help="whisper-train's data-loading workers (-1: its default, which depends on the device)",
    )
    parser.add_argument(
        "--packing-sets",
        default=None,
        help="an4,long,synth: compare --packing on/off and the Trainer on these clip sets",
    )
    parser.add_argument(
        "--packing-systems",
        default="packed,unpacked,trainer",
        help="with --packing-sets: of packed (joined), per-clip, unpacked, trainer",
    )
    parser.add_argument("--repeat", type=int, default=2, help="each set's clips listed N times")
    parser.add_argument(
        "--fill",
        action="store_true",
        help="with --packing-sets: only print windows and speech share of each set by gap",
    )
    parser.add_argument(
        "--compile-rows",
        default="default,eager,compiled,compiled-workers,trainer,trainer-compiled",
        help="which runs --compile-sets compares",
    )
    parser.add_argument(
        "--compile-sets",
        default=None,
        help="an4,...: whisper-train and the Trainer unpacked, eager and torch.compile'd",
    )
    # worker-only arguments
    parser.add_argument("--compile", choices=["on", "off", "default"], default="off")
    parser.add_argument("--packing", default="off")
    parser.add_argument("--nonspeech", default="none")
    parser.add_argument("--worker", choices=["whisper-train", "whisper-train-own-order", "trainer"])
    parser.add_argument("--scenario")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--manifest")
    parser.add_argument("--model-dir")
    parser.add_argument("--workdir")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    import torch

    if args.packing_sets and args.fill:
        packing_fill(args)
        return
    if args.packing_sets:
        packing_comparison(args)
        return
    if args.compile_sets:
        compile_comparison(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        args.manifest = str(write_manifest(tmp_path, args.clips))
        shape = set_up_model(args, tmp_path)
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} CPUs, cuda "
            f"{torch.cuda.is_available()}; model {shape}; {args.clips} clips "
            f"({'realspeech' if REALSPEECH.exists() else 'tones'}), batch {args.batch_size}, "
            f"checkpointing {args.checkpointing}, {args.rounds} alternating rounds"
        )
        medians: dict[tuple[str, str], float] = {}
        for scenario in args.scenarios.split(","):
            epochs = args.full_epochs if scenario == "full" else args.freeze_epochs
            runs: dict[str, list[dict]] = {"whisper-train": [], "trainer": []}
            if scenario == "freeze-encoder":  # encodes every clip once: later runs read them
                warm_up = launch(args, "whisper-train", scenario, 1)
                print(f"  freeze-encoder cache built in an untimed run: {json.dumps(warm_up)}")
                # and the cross-attention in the layers' own order, for the side-by-side ratio
                runs = {"whisper-train": [], "whisper-train-own-order": [], "trainer": []}
            for round_index in range(args.rounds):
                for system in runs:
                    runs[system].append(launch(args, system, scenario, epochs))
                    print(
                        f"  {scenario} round {round_index + 1} {system}: "
                        f"{json.dumps(runs[system][-1])}",
                        flush=True,
                    )
            report(scenario, runs)
            for system, results in runs.items():
                medians[(scenario, system)] = statistics.median(
                    run["epoch_s_after_first"] for run in results
                )
        if ("full", "trainer") in medians and ("freeze-encoder", "whisper-train") in medians:
            # What a user switching from the blog's full fine-tuning to a cached frozen encoder
            # gets per epoch (the same clips; full trains every weight, so not like for like).
            ratio = medians[("full", "trainer")] / medians[("freeze-encoder", "whisper-train")]
            print(
                f"Seq2SeqTrainer full fine-tuning epoch / whisper-train freeze-encoder epoch "
                f"(cached): {ratio:.2f}x"
            )


def set_manifest(folder: Path, name: str, repeat: int) -> tuple[Path, int, float]:
    """(manifest, clips, seconds of audio) of a named clip set, each clip listed `repeat` times:
    an4 and long from ../shared/realspeech, synth made by espeak-ng in the demo's voices."""
    import soundfile

    rows = []
    if name in ("an4", "long"):
        for line in (REALSPEECH / "manifest.jsonl").read_text().splitlines():
            row = json.loads(line)
            is_an4 = "/an4/" in row["source"]
            if (name == "an4" and is_an4) or (
                name == "long" and not is_an4 and 5.0 <= row["duration_s"] <= 10.5
            ):
                rows.append({"audio": str(REALSPEECH / row["audio"]), "text": row["text"]})
    elif name == "synth":
        import csv

        from whisper_train.data.synth import make_speech_dataset

        speech = make_speech_dataset(folder / "synth", n_utterances=64, seed=0)
        with (speech / "metadata.csv").open(encoding="utf-8") as stream:
            for row in csv.DictReader(stream):
                path = speech / row["file_name"]
                if 3.0 <= soundfile.info(str(path)).duration <= 5.0:
                    rows.append({"audio": str(path), "text": row["transcription"]})
    else:
        sys.exit(f"--packing-sets: unknown set {name!r} (an4, long, synth)")
    seconds = sum(soundfile.info(row["audio"]).duration for row in rows)
    manifest = folder / f"{name}.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows * repeat), encoding="utf-8")
    return manifest, len(rows) * repeat, seconds * repeat


def packing_fill(args) -> None:
    """Windows an epoch and the speech share of the encoder's input, by the gap between clips
    (label budget not binding on these sets: plain text, tiny.en's 448 positions)."""
    import soundfile

    from whisper_train.data.packing import ClipSize, fill_ratio, plan_windows

    print("| set | clips | gap s | windows | speech share of the encoder's input |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.packing_sets.split(","):
            manifest, clips, _ = set_manifest(Path(tmp), name, args.repeat)
            rows = [json.loads(line) for line in manifest.read_text().splitlines()]
            sizes = [
                ClipSize(soundfile.info(row["audio"]).duration, 4 * len(row["text"].split()))
                for row in rows
            ]
            print(f"| {name} | {clips} | none | {clips} | {100 * fill_ratio(sizes, sizes):.0f}% |")
            for gap in (0.0, 0.3, 0.5, 1.0):
                windows = plan_windows(
                    sizes, seed=0, epoch=0, prefix_tokens=2, max_tokens=448, gap_seconds=gap
                )
                share = 100 * fill_ratio(sizes, windows)
                print(f"| {name} | {clips} | {gap} | {len(windows)} | {share:.0f}% |")


def set_up_model(args, folder: Path) -> str:
    """Saves the bench's model in `folder` for the workers (args.model_dir, args.workdir) and
    returns its description."""
    args.workdir = str(folder)
    args.model_dir = str(save_model(folder / "model", args.d_model, args.layers, args.model))
    return args.model or f"random, d_model {args.d_model}, {args.layers}+{args.layers} layers"


def packing_comparison(args) -> None:
    """whisper-train packed (joined, per clip), unpacked and the Seq2SeqTrainer on each set,
    side by side (`--packing-systems` picks them)."""
    import torch

    systems = args.packing_systems.split(",")
    unknown = [s for s in systems if s not in (*PACKING_OF, "trainer")]
    if unknown:
        sys.exit(f"--packing-systems: unknown {unknown} (of {', '.join(PACKING_OF)}, trainer)")

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        shape = set_up_model(args, tmp_path)
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} CPUs, cuda "
            f"{torch.cuda.is_available()}; model {shape}; batch {args.batch_size} (clips, or "
            f"packed windows), checkpointing {args.checkpointing}, {args.threads} thread(s), "
            f"{args.rounds} round(s); "
            + ("wall seconds (CUDA)" if torch.cuda.is_available() else "CPU seconds of each worker")
        )
        table = []
        for name in args.packing_sets.split(","):
            manifest, clips, seconds = set_manifest(tmp_path, name, args.repeat)
            args.manifest = str(manifest)
            runs: dict[str, list[dict]] = {system: [] for system in systems}
            for _ in range(args.rounds):
                for system in systems:
                    if system == "trainer":
                        runs[system].append(launch(args, "trainer", "full", 1))
                    else:
                        runs[system].append(
                            launch(args, "whisper-train", "full", 1, PACKING_OF[system])
                        )
                for system, results in runs.items():
                    # On CUDA each run's MFU counts one 30-s encoder pass per clip: right for
                    # unpacked and the Trainer, not for packed windows (several clips a pass).
                    print(f"  {name} {system}: {json.dumps(results[-1])}", flush=True)
            loop = {k: statistics.median(r["loop_s"] for r in v) for k, v in runs.items()}
            trainer_runs = runs.get("trainer") or [{"features_s": 0.0}]
            features = statistics.median(r["features_s"] for r in trainer_runs)
            print(f"  {name}: {clips} clips, {seconds:.0f} s of audio; loop seconds {loop}")
            table.append((name, clips, seconds / clips, loop, features))
        print()
        print(
            "| set | clips | mean s | system | clips/s | audio s/s | vs Trainer (loop) "
            "| vs Trainer incl. its features |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for name, clips, mean, loop, features in table:
            for system in systems:
                rate = clips / loop[system]
                against = "n/a | n/a"
                if "trainer" in loop:
                    trainer_rate = clips / loop["trainer"]
                    with_features = clips / (loop["trainer"] + features)
                    against = f"{rate / trainer_rate:.2f}x | {rate / with_features:.2f}x"
                print(
                    f"| {name} | {clips} | {mean:.1f} | {system} | {rate:.2f} | "
                    f"{rate * mean:.1f} | {against} |"
                )


def compile_comparison(args) -> None:
    """Unpacked whisper-train and the Seq2SeqTrainer, each eager and torch.compile'd, on each
    set: the loop's clips/s (compilation included) and the steady clips/s after WARM_STEPS
    steps (excluded), which is what a run of thousands of steps gets."""
    import torch

    # (label, system, --compile on/off/default, whisper-train's data workers: None = its default)
    rows = {
        "default": ("whisper-train, its defaults", "whisper-train", "default", None),
        "eager": ("whisper-train eager, no workers", "whisper-train", "off", 0),
        "compiled": ("whisper-train compiled, no workers", "whisper-train", "on", 0),
        "compiled-workers": (
            "whisper-train compiled, default workers",
            "whisper-train",
            "on",
            None,
        ),
        "trainer": ("Trainer eager", "trainer", "off", 0),
        "trainer-compiled": ("Trainer compiled (torch_compile=True)", "trainer", "on", 0),
    }
    rows = [rows[name] for name in args.compile_rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        shape = set_up_model(args, tmp_path)
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} CPUs, cuda "
            f"{torch.cuda.is_available()}; model {shape}; batch {args.batch_size}, "
            f"checkpointing {args.checkpointing}; steady = steps after the first {WARM_STEPS}"
        )
        table = []
        for name in args.compile_sets.split(","):
            manifest, clips, _ = set_manifest(tmp_path, name, args.repeat)
            args.manifest = str(manifest)
            results = {}
            for label, system, compiled, workers in rows:
                args.num_workers = workers
                results[label] = launch(args, system, "full", 1, "off", compile=compiled)
                print(f"  {name} {label}: {json.dumps(results[label])}", flush=True)
            table.append((name, clips, results))
        print()
        print(
            "| set | clips | run | loop s | clips/s (loop) | first steps s | steady ms/step "
            "| steady clips/s | vs Trainer eager (steady) | MFU (steady) | peak GiB |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, clips, results in table:
            base = results.get("Trainer eager", {}).get("steady_samples_per_s")
            for label, result in results.items():
                steady = result.get("steady_samples_per_s")
                mfu = result.get("mfu", 0) * steady / result["samples_per_s"] if steady else 0
                ratio = f"{steady / base:.2f}x" if steady and base else "-"
                print(
                    f"| {name} | {clips} | {label} | {result['loop_s']:.1f} | "
                    f"{result['samples_per_s']:.1f} | {result.get('warm_steps_s', 0):.1f} | "
                    f"{result.get('steady_ms_per_step', 0):.1f} | {steady or 0:.1f} | {ratio} | "
                    f"{100 * mfu:.1f}% | {result.get('peak_gib', 0):.2f} |"
                )


def report(scenario: str, runs: dict[str, list[dict]]) -> None:
    def median(system: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[system])

    if scenario == "full":
        ours, theirs = median("whisper-train", "samples_per_s"), median("trainer", "samples_per_s")
        features = median("trainer", "features_s")
        samples = runs["trainer"][0]["samples"]
        with_features = samples / (samples / theirs + features)
        print(
            f"{scenario}: whisper-train {ours:.2f} samples/s, Seq2SeqTrainer {theirs:.2f} "
            f"samples/s (loop only, CPU time) -> {ours / theirs:.2f}x; Trainer incl. its dataset.map "
            f"features ({features:.1f} s) {with_features:.2f} samples/s -> "
            f"{ours / with_features:.2f}x"
        )
    else:
        ours = median("whisper-train", "epoch_s_after_first")
        theirs = median("trainer", "epoch_s_after_first")
        print(
            f"{scenario}: seconds per epoch after the first: whisper-train {ours:.2f} s "
            f"(every epoch cached), Seq2SeqTrainer {theirs:.2f} s -> {theirs / ours:.2f}x"
        )
        if runs.get("whisper-train-own-order"):
            own = median("whisper-train-own-order", "epoch_s_after_first")
            print(
                f"  with the cross-attention in the layers' own order: {own:.2f} s -> "
                f"{theirs / own:.2f}x (the folded order: {own / ours:.2f}x faster)"
            )
    for system in runs:
        if "peak_gib" in runs[system][0]:
            print(
                f"  {system}: peak allocated {median(system, 'peak_gib'):.2f} GiB, "
                f"MFU {100 * median(system, 'mfu'):.1f}%"
            )


if __name__ == "__main__":
    main()
