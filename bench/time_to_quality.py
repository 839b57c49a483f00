"""Time to quality: held-out and guard WER against training seconds, whisper-train vs the blog's
Seq2SeqTrainer recipe, on the same data, model, batch memory and learning rate.

    .venv/bin/python bench/time_to_quality.py [--target synth|real] [--mode full|lora]
        [--model tiny.en] [--learning-rate LR] [--trainer-learning-rates LR ...]
        [--trainer-every-linear] [--seeds 0 1] [--batch-size 8] [--budget-factor 1.5] [--points 5]
        [--own-length] [--train-sentences 128] [--held-out-sentences 32] [--cpu-seconds]
        [--variant "packed=--packing on --batch-size 1" ...] [--work-dir DIR] [--smoke]

Systems, each its own process, each starting from the same model folder (--model saved once):
  trainer        the blog recipe (bench/throughput.py's): features per clip with the processor
                 beforehand (their seconds reported, not counted), the blog's collator, linear
                 schedule, no warm-up, batch --batch-size clips; bf16 and non-reentrant
                 checkpointing on CUDA, fp32 and none on a CPU (whisper-train's defaults there);
                 --mode lora: peft's LoRA r 32, alpha 64, dropout 0.05 on q_proj,v_proj (the
                 HF PEFT blog's), or on every linear layer with --trainer-every-linear.
  whisper-train  `whisper-train train` (its CLI, in-process) with its shipped defaults plus
                 --learning-rate, --batch-size, --seed, --max-steps, --only-train (nothing
                 scored while timed) and each --variant's own flags (after the others: they
                 win; leading VAR=VALUE words go to its environment). The default (no flags)
                 always runs.

The Trainer runs first, for --budget-factor epochs; its training seconds are the budget. Each
whisper-train variant is timed for a few steps (a calibration run), then trained for the steps
that fill the budget (its linear schedule ends there, as the Trainer's does). --own-length:
each trains for its own length instead (3 epochs, or a variant's --epochs; no calibration), and
a run that ends before a time the tables ask about counts its final WER there. Both save the
model (LoRA merged) at --points evenly spaced steps (the Trainer also at its one-epoch step);
training seconds are wall seconds of the training loop (CUDA synchronised) up to each save,
less the saves (whisper-train's --save-steps checkpoints hold the trained tensors and the
optimizer, not a model folder: the bench saves both systems' models itself). Every saved
model is scored afterwards, outside the timed region, with whisper-train's `evaluate_examples`
(generate-based WER, temperature fallback, English normaliser) on the held-out and the guard
set; the starting model is every curve's point 0.

Prints a table of every point, then per system: the WER at the Trainer's one-epoch time and
the seconds to reach the Trainer's WER at one epoch and at its end (linear interpolation
between points; "beyond" / "not reached" where the curve does not get there), mean over
seeds. Writes WORK/time_to_quality-TARGET-MODE.json (every point) and .png (held-out WER
solid, guard dashed, one colour a system). With several --trainer-learning-rates the Trainer's
reference is the rate with the lower final held-out WER (mean over seeds).

Targets (bench/quality.py's sets): real = AN4 train (30 clips) / AN4 test / LJ Speech guard
(bench/common.py says where they are found); synth = the demo's espeak-ng sets, 128
training sentences (--train-sentences N: more, where 128 run out before the budget does), 32
held-out (other voices and words; --held-out-sentences N: more, less noise), 32 guard.
--smoke: 8 training clips, 4 clips a scored set, batches of 4, a 2-step Trainer run: checks
the script in minutes. A point's model folder is deleted once scored (--keep-models keeps
them). --combine A.json B.json trains nothing: it summarises the runs of earlier outputs
together (seeds run at different times, on the same model and sets).

On CUDA the same command runs in bf16 with checkpointing, wall time synchronised; --model may
be any model folder, and synth sets already in WORK/data-synth/ are reused, not synthesised
again.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
# whisper-train's default rates (config/options.py), read from the checkout being measured
sys.path.insert(0, str(REPO / "src"))
from whisper_train.config import DEFAULT_LEARNING_RATES as DEFAULT_LR  # noqa: E402
from whisper_train.config.options import LORA_TARGETS  # noqa: E402

# whisper-train's LoRA defaults (--lora-r, --lora-alpha, --lora-dropout, --lora-targets)
# Set by --cpu-seconds for the workers it starts (`clock`).
CPU_SECONDS = "TIME_TO_QUALITY_CPU_SECONDS"

LORA = {"r": 32, "lora_alpha": 64, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}


def clock() -> float:
    """Wall seconds, after the GPU's queued work is done (on CUDA); with --cpu-seconds on a CPU,
    the worker's own CPU seconds (one thread, no loader workers on a CPU: robust to other jobs
    on the machine, and a quiet machine's wall seconds)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elif os.environ.get(CPU_SECONDS) == "1":
        return time.process_time()
    return time.perf_counter()


# -- data and models ------------------------------------------------------------------------------


def make_sets(
    target: str, folder: Path, smoke: bool, train_sentences: int, held_out_sentences: int
) -> dict[str, Path]:
    """{"train", "target", "guard"}: bench/quality.py's sets (the synth ones smaller in smoke)."""
    sys.path.insert(0, str(REPO / "bench"))
    import quality

    folder.mkdir(parents=True, exist_ok=True)
    if target == "real":
        if not quality.REALSPEECH.is_dir():
            raise SystemExit(f"--target real needs {quality.REALSPEECH}; use --target synth")
        return quality.real_sets(folder)
    if not smoke:
        return quality.synth_sets(folder, train_sentences, held_out_sentences)
    from whisper_train.demo import prepare_demo_data

    dirs = prepare_demo_data(
        folder, train_utterances=8, eval_utterances=4, guard_utterances=4, seed=0
    )
    return {"train": dirs["train"], "target": dirs["held-out"], "guard": dirs["guard"]}


def examples_of(path: Path | str, limit: int | None = None) -> list:
    from whisper_train.data.layouts import load_examples

    return load_examples(str(path))[:limit]


def save_base_model(spec: str, folder: Path) -> Path:
    """The model both systems start from, as one transformers folder."""
    from whisper_train.formats.hf import save_model_folder
    from whisper_train.models import load_model

    if not (folder / "config.json").is_file():
        model, processor = load_model(spec)
        save_model_folder(model, processor, folder)
    return folder


def save_point(model, processor, folder: Path) -> None:
    """The weights as they are now, as a model folder (a copy: LoRA merged into it), for the
    scoring afterwards. The same writer for both systems."""
    from whisper_train.formats.hf import save_model_folder

    whole = copy.deepcopy(model)
    if hasattr(whole, "merge_and_unload"):
        whole = whole.merge_and_unload()
    whole.config.use_cache = True
    save_model_folder(whole, processor, folder)


class Marks:
    """Training seconds at the marked steps: wall time since `start`, less the time spent
    saving the model there (into OUT/step-N; `out` None: only timed)."""

    def __init__(self, steps: list[int], out: str | None, processor):
        self.steps, self.out, self.processor = set(steps), out, processor
        self.points: list[dict] = []

    def start(self) -> None:
        self.started, self.excluded = clock(), 0.0

    def reached(self, step: int, model) -> None:
        """`model`: a callable that returns the model to save (called only at a mark)."""
        if step not in self.steps:
            return
        now = clock()
        point = {"step": step, "seconds": now - self.started - self.excluded}
        if self.out:
            point["model"] = str(Path(self.out) / f"step-{step}")
            save_point(model(), self.processor, Path(point["model"]))
        self.points.append(point)
        self.excluded += clock() - now


# -- workers (one process a run) ----------------------------------------------------------------


def blog_dataset(processor, examples) -> list[dict]:
    """The blog's prepare_dataset, from a list (datasets.Audio needs torchcodec, absent here):
    log-mel features and label ids per clip, read with whisper-train's audio reader."""
    import numpy as np

    from whisper_train.audio import load_audio

    rows = []
    for example in examples:
        audio = load_audio(example.audio, start=example.start, end=example.end)
        features = processor.feature_extractor(np.asarray(audio), sampling_rate=16_000)
        labels = processor.tokenizer(example.text).input_ids
        rows.append({"input_features": features.input_features[0], "labels": labels})
    return rows


def blog_collator(processor, start_token: int):
    def collate(rows):  # the blog's data collator: pad features and labels separately
        batch = processor.feature_extractor.pad(
            [{"input_features": r["input_features"]} for r in rows], return_tensors="pt"
        )
        padded = processor.tokenizer.pad(
            [{"input_ids": r["labels"]} for r in rows], return_tensors="pt"
        )
        labels = padded["input_ids"].masked_fill(padded.attention_mask.ne(1), -100)
        if (labels[:, 0] == start_token).all():
            labels = labels[:, 1:]  # the model prepends the start token itself
        batch["labels"] = labels
        return batch

    return collate


def trainer_worker(spec: dict) -> dict:
    """The blog recipe for spec["steps"] steps, saving at spec["marks"]."""
    import torch
    from transformers import (
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        TrainerCallback,
        WhisperForConditionalGeneration,
        WhisperProcessor,
    )

    processor = WhisperProcessor.from_pretrained(spec["model_dir"])
    model = WhisperForConditionalGeneration.from_pretrained(spec["model_dir"])
    model.model.encoder.embed_positions.requires_grad_(False)  # fixed sinusoids, as whisper-train
    model.config.use_cache = False
    start_token = model.config.decoder_start_token_id
    if spec["mode"] == "lora":
        from peft import LoraConfig, get_peft_model

        targets = spec.get("lora_targets") or LORA["target_modules"]
        model = get_peft_model(model, LoraConfig(**{**LORA, "target_modules": targets}))
    started = clock()
    dataset = blog_dataset(processor, examples_of(spec["train"], spec["train_clips"]))
    features_seconds = clock() - started
    marks = Marks(spec["marks"], spec["out"], processor)

    class AtMarks(TrainerCallback):
        def on_train_begin(self, *_, **__):
            marks.start()

        def on_step_end(self, _args, state, _control, model=None, **__):
            marks.reached(state.global_step, lambda: model)

    on_cuda = torch.cuda.is_available()
    arguments = Seq2SeqTrainingArguments(
        output_dir=str(Path(spec["out"]) / "trainer"),
        per_device_train_batch_size=spec["batch_size"],
        learning_rate=spec["learning_rate"],
        max_steps=spec["steps"],
        lr_scheduler_type="linear",
        warmup_steps=0,
        gradient_checkpointing=on_cuda,  # whisper-train's default: full on a GPU, off on a CPU
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=on_cuda,
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        logging_steps=25,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        max_grad_norm=1.0,
        seed=spec["seed"],
        use_cpu=not on_cuda,
        disable_tqdm=True,
    )
    collate = blog_collator(processor, start_token)
    trainer = Seq2SeqTrainer(model=model, args=arguments, train_dataset=dataset,
                             data_collator=collate, callbacks=[AtMarks()])  # fmt: skip
    trainer.train()
    epoch = next(p for p in marks.points if p["step"] == spec["epoch_step"])
    return {
        "points": marks.points,
        "epoch_step": epoch["step"],
        "epoch_seconds": epoch["seconds"],
        "features_seconds": features_seconds,
    }


def whisper_train_worker(spec: dict) -> dict:
    """`whisper-train train` (its CLI) in this process, its loop timed by wrapping
    FineTuneRecipe.train and ._after_step, the model saved at spec["marks"] (steps, or a
    count spread over the run's own steps; spec["save"] False: only timed, the calibration
    run)."""
    from transformers import WhisperProcessor

    from whisper_train.cli import main as whisper_train_main
    from whisper_train.training.finish import whole_model
    from whisper_train.training.recipe import FineTuneRecipe

    processor = WhisperProcessor.from_pretrained(spec["model_dir"])
    spread = spec["marks"] if isinstance(spec["marks"], int) else None  # --own-length
    marks = Marks([] if spread else spec["marks"], spec["out"] if spec["save"] else None, processor)
    train, after_step = FineTuneRecipe.train, FineTuneRecipe._after_step

    def timed_train(recipe):
        if spread:  # that many marks spread over the run's own steps
            marks.steps = set(evenly(recipe.total_steps, spread))
        marks.start()  # the loop's own clock starts here too, after the setup
        return train(recipe)

    def timed_after_step(recipe, step):
        after_step(recipe, step)  # its logging and checks are the loop's (--only-train: no eval)
        marks.reached(
            recipe.state.step,
            lambda: whole_model(recipe.model, recipe.record.model, recipe.accelerator),
        )

    FineTuneRecipe.train, FineTuneRecipe._after_step = timed_train, timed_after_step
    if code := whisper_train_main(["train", *spec["argv"]]):
        raise SystemExit(f"whisper-train train exited {code}")
    return {"points": marks.points}


class WorkerFailed(Exception):
    """A worker process exited with an error (a variant's flags this checkout lacks...)."""


def launch(spec: dict, folder: Path) -> dict:
    """Run a worker in its own process (its output in FOLDER/worker.log); its result."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.json").write_text(json.dumps(spec, indent=1))
    log = folder / "worker.log"
    with log.open("w") as stream:
        command = [sys.executable, __file__, "--worker", str(folder / "spec.json")]
        env = {**os.environ, **spec.get("env", {})}
        done = subprocess.run(
            command, stdout=stream, stderr=subprocess.STDOUT, check=False, env=env
        )
    if done.returncode != 0:
        raise WorkerFailed(f"{folder.name} failed ({log}):\n{log.read_text()[-2000:]}")
    return json.loads((folder / "result.json").read_text())


def evenly(steps: int, points: int) -> list[int]:
    return sorted({max(1, round(steps * i / points)) for i in range(1, points + 1)})


# -- the runs (parent process) ------------------------------------------------------------------


def run_trainer(args, sets, model_dir: Path) -> list[dict]:
    """The Trainer for --budget-factor epochs, per learning rate and seed."""
    epoch_steps = -(-len(examples_of(sets["train"], args.train_clips)) // args.batch_size)
    steps = max(1, round(args.budget_factor * epoch_steps))
    epoch_step = min(epoch_steps, steps)
    runs = []
    for lr in args.trainer_learning_rates or [args.learning_rate]:
        for seed in args.seeds:
            name = f"trainer-lr{lr:g}-seed{seed}"
            spec = {
                "system": "trainer", "model_dir": str(model_dir), "mode": args.mode,
                "train": str(sets["train"]), "train_clips": args.train_clips,
                "batch_size": args.batch_size, "learning_rate": lr, "seed": seed, "steps": steps,
                "marks": sorted({*evenly(steps, args.points), epoch_step}),
                "epoch_step": epoch_step, "out": str(args.work_dir / name),
                "lora_targets": args.trainer_lora_targets,
            }  # fmt: skip
            result = launch(spec, args.work_dir / name)
            variant = "blog" if args.trainer_lora_targets is None else "blog, every linear"
            runs.append({"system": "trainer", "variant": variant, "lr": lr, "seed": seed, **result})
            print(f"  {name}: {progress(result)}", flush=True)
    return runs


def variant_of(text: str) -> tuple[str, list[str], dict[str, str]]:
    """ "NAME=[VAR=VALUE ...] FLAGS": the variant's name, its flags and the environment its
    worker adds (leading VAR=VALUE words, as a shell takes them: an internal switch such as
    WHISPER_TRAIN_PER_CLIP_ENCODER, which has no flag)."""
    name, _, rest = text.partition("=")
    words, env = shlex.split(rest), {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return name.strip(), words, env


def whisper_train_spec(args, sets, model_dir, variant, seed, steps, marks, out) -> dict:
    """A whisper-train worker's run: the variant's flags last (they win); saves at `marks`
    unless `out` is a calibration run's folder. `steps` None: the run's own length, `marks`
    an int: that many points spread over it."""
    argv = [
        "--model", str(model_dir), "--data", str(sets["train"]), "--mode", args.mode,
        "--learning-rate", str(args.learning_rate), "--batch-size", str(args.batch_size),
        "--seed", str(seed), *(["--max-steps", str(steps)] if steps else []), "--only-train",
        "--output-dir", str(out / "run"), "--overwrite",
        *(["--train-subset", str(args.train_clips)] if args.train_clips else []),
        *variant[1],
    ]  # fmt: skip
    save = not out.name.endswith("-calibration")
    return {"system": "whisper-train", "model_dir": str(model_dir), "argv": argv,
            "marks": marks, "save": save, "out": str(out), "env": variant[2]}  # fmt: skip


def run_whisper_train(args, sets, model_dir: Path, variant, budget: float) -> list[dict]:
    """A calibration run (seconds a step, first seed), then per seed the steps that fill
    `budget` (the Trainer's training seconds); --own-length: per seed its own length."""
    (label, flags, _), runs = variant, []
    if args.own_length:
        return [own_length_run(args, sets, model_dir, variant, seed) for seed in args.seeds]
    steps, out = args.calibration_steps, args.work_dir / f"wt-{label}-calibration"
    marks = list(range(1, steps + 1))
    spec = whisper_train_spec(args, sets, model_dir, variant, args.seeds[0], steps, marks, out)
    seconds = [point["seconds"] for point in launch(spec, out)["points"]]
    # A run pays one-off costs in its first steps (allocation; kernels met with new shapes: on
    # a CPU step 2 took 7.1 s where later ones took 4.8-5.6; on CUDA the first 8-20 steps),
    # as the Trainer's run does inside its budget. So the first half of the calibration counts
    # as it came, and the second half gives the seconds a warm step.
    cold = len(seconds) // 2 if len(seconds) >= 4 else 1
    per_step = (seconds[-1] - seconds[cold - 1]) / max(1, len(seconds) - cold) or seconds[0]
    steps = max(args.points, cold + round((budget - seconds[cold - 1]) / per_step))
    steps = min(steps, 3) if args.smoke else steps
    for seed in args.seeds:
        out = args.work_dir / f"wt-{label}-seed{seed}"
        marks = evenly(steps, args.points)
        spec = whisper_train_spec(args, sets, model_dir, variant, seed, steps, marks, out)
        result = launch(spec, out)
        if not args.keep_models:
            shutil.rmtree(out / "run" / "final", ignore_errors=True)
        runs.append({"system": "whisper-train", "variant": label, "flags": flags,
                     "lr": rate_of(flags, args.learning_rate), "seed": seed,
                     "calibrated_s_per_step": per_step, **result})  # fmt: skip
        print(f"  {out.name}: {per_step:.2f} s/step calibrated; {progress(result)}", flush=True)
    return runs


def own_length_run(args, sets, model_dir: Path, variant, seed: int) -> dict:
    """whisper-train for its own length (--epochs 3 unless the variant's flags say otherwise),
    its schedule ending there: what a user running it gets, whatever the budget."""
    label, flags, _ = variant
    out = args.work_dir / f"wt-{label}-own-length-seed{seed}"
    spec = whisper_train_spec(args, sets, model_dir, variant, seed, None, args.points, out)
    result = launch(spec, out)
    if not args.keep_models:
        shutil.rmtree(out / "run" / "final", ignore_errors=True)
    print(f"  {out.name}: {progress(result)}", flush=True)
    return {"system": "whisper-train", "variant": f"{label}, own length", "flags": flags,
            "lr": rate_of(flags, args.learning_rate), "seed": seed, "own_length": True,
            **result}  # fmt: skip


def rate_of(flags: list[str], default: float) -> float:
    """A variant's --learning-rate, else every system's."""
    return (
        float(flags[flags.index("--learning-rate") + 1]) if "--learning-rate" in flags else default
    )


def progress(result: dict) -> str:
    return ", ".join(f"step {p['step']} at {p['seconds']:.1f} s" for p in result["points"])


# -- scoring (parent process, after every run) --------------------------------------------------


def score_all(runs: list[dict], sets, model_dir: Path, eval_clips: int | None, keep: bool):
    """Held-out and guard WER of every saved point, and of the starting model (returned as
    the point 0 of every curve); a point's model folder is deleted once scored unless `keep`."""
    import torch
    from transformers.utils import logging as transformers_logging

    from whisper_train.evaluation.evaluate import evaluate_examples
    from whisper_train.models import load_model
    from whisper_train.transcription.decoding import DecodingOptions

    transformers_logging.disable_progress_bar()
    scored = {name: examples_of(sets[key], eval_clips) for name, key in
              (("held_out", "target"), ("guard", "guard"))}  # fmt: skip

    def score(folder: str) -> dict:
        model, processor = load_model(folder)
        model = model.to("cuda") if torch.cuda.is_available() else model
        model.eval()
        return {
            f"{name}_wer": evaluate_examples(
                model, processor, examples, normalizer="english", decoding=DecodingOptions()
            ).wer
            for name, examples in scored.items()
        }

    started = time.perf_counter()
    base = {"step": 0, "seconds": 0.0, **score(str(model_dir))}
    print(f"  starting model: {wers(base)}", flush=True)
    for run in runs:
        for point in run["points"]:
            point.update(score(point["model"]))
            if not keep:
                shutil.rmtree(point.pop("model"))
        summary = "; ".join(f"{p['seconds']:.0f} s {wers(p)}" for p in run["points"])
        print(f"  {run['system']} {run['variant']} seed {run['seed']}: {summary}", flush=True)
    models = 1 + sum(len(run["points"]) for run in runs)
    print(f"  scored {models} models in {time.perf_counter() - started:.0f} s", flush=True)
    return base


def wers(point: dict) -> str:
    return f"held-out {100 * point['held_out_wer']:.1f}, guard {100 * point['guard_wer']:.1f}"


# -- the summary --------------------------------------------------------------------------------


def value_at(curve: list[tuple[float, float]], seconds: float) -> float | None:
    """Linear interpolation of (seconds, wer) at `seconds`; None past the curve's end."""
    for (t0, w0), (t1, w1) in zip(curve, curve[1:], strict=False):
        if t0 <= seconds <= t1:
            return w1 if t1 == t0 else w0 + (w1 - w0) * (seconds - t0) / (t1 - t0)
    return None


def time_to(curve: list[tuple[float, float]], wer: float) -> float | None:
    """The first time the interpolated curve is at `wer` or lower; None if it never is."""
    if curve[0][1] <= wer:
        return curve[0][0]
    for (t0, w0), (t1, w1) in zip(curve, curve[1:], strict=False):
        if w1 <= wer:  # and w0 > wer: it crossed in between
            return t0 + (t1 - t0) * (w0 - wer) / (w0 - w1)
    return None


def summarise(runs: list[dict], base: dict) -> tuple[list[dict], dict]:
    """Per (system, variant, lr): means over seeds of the WER at the Trainer's one-epoch time,
    of the seconds to the Trainer's one-epoch and final held-out WER, and of the final point."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["system"], run["variant"], run["lr"]), []).append(run)

    def curve(run, key):
        points = [(0.0, base[key])] + [(p["seconds"], p[key]) for p in run["points"]]
        if run.get("own_length"):  # finished early: its user has the final model from then on
            points.append((float("inf"), points[-1][1]))
        return points

    def mean(values):  # None when any seed's curve does not get there
        values = list(values)
        return None if any(v is None for v in values) else statistics.mean(values)

    trainers = {key: group for key, group in groups.items() if key[0] == "trainer"}
    best = min(trainers.values(), key=lambda g: mean(r["points"][-1]["held_out_wer"] for r in g))
    reference = {
        "trainer_lr": best[0]["lr"],
        "epoch_seconds": mean(r["epoch_seconds"] for r in best),
        "epoch_wer": mean(
            next(p["held_out_wer"] for p in r["points"] if p["step"] == r["epoch_step"])
            for r in best
        ),  # fmt: skip
        "final_wer": mean(r["points"][-1]["held_out_wer"] for r in best),
        "features_seconds": mean(r["features_seconds"] for r in best),
    }
    epoch_s, epoch_wer, final_wer = (
        reference[k] for k in ("epoch_seconds", "epoch_wer", "final_wer")
    )

    def at(run):  # a Trainer run: its own one-epoch point (the mean may lie past a seed's end)
        return run.get("epoch_seconds", epoch_s)

    rows = []
    for (system, variant, lr), group in groups.items():
        rows.append({
            "system": system, "variant": variant, "lr": lr, "seeds": len(group),
            "held_out_at_epoch": mean(value_at(curve(r, "held_out_wer"), at(r)) for r in group),
            "guard_at_epoch": mean(value_at(curve(r, "guard_wer"), at(r)) for r in group),
            "s_to_epoch_wer": mean(time_to(curve(r, "held_out_wer"), epoch_wer) for r in group),
            "s_to_final_wer": mean(time_to(curve(r, "held_out_wer"), final_wer) for r in group),
            "final_held_out": mean(r["points"][-1]["held_out_wer"] for r in group),
            "final_guard": mean(r["points"][-1]["guard_wer"] for r in group),
            "final_seconds": mean(r["points"][-1]["seconds"] for r in group),
        })  # fmt: skip
    return rows, reference


def pct(value: float | None) -> str:
    return "beyond its run" if value is None else f"{100 * value:.1f}"


def print_tables(runs: list[dict], base: dict, rows: list[dict], reference: dict) -> None:
    print("\n| system | variant | lr | seed | step | train s | held-out WER | guard WER |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    print(
        f"| starting model | | | | 0 | 0 | {pct(base['held_out_wer'])} | {pct(base['guard_wer'])} |"
    )
    for r in runs:
        for p in r["points"]:
            print(f"| {r['system']} | {r['variant']} | {r['lr']:g} | {r['seed']} | {p['step']} "
                  f"| {p['seconds']:.1f} | {pct(p['held_out_wer'])} "
                  f"| {pct(p['guard_wer'])} |")  # fmt: skip
    print(
        f"\nThe Trainer (lr {reference['trainer_lr']:g}): one epoch in "
        f"{reference['epoch_seconds']:.1f} training s (its features beforehand, not counted: "
        f"{reference['features_seconds']:.1f} s), held-out WER {pct(reference['epoch_wer'])} "
        f"there, {pct(reference['final_wer'])} at its end. Values between saved points are "
        "interpolated linearly (point 0: the starting model at 0 s); means over seeds (a "
        "Trainer seed's 'at the epoch time' is its own one-epoch point)."
    )
    print(
        "\n| system | variant | lr | held-out WER at the Trainer's epoch time | guard WER there "
        "| s to the Trainer's 1-epoch WER | s to its final WER | final held-out | final guard "
        "| train s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        reach = ["not reached" if s is None else f"{s:.0f}"
                 for s in (r["s_to_epoch_wer"], r["s_to_final_wer"])]  # fmt: skip
        print(f"| {r['system']} | {r['variant']} | {r['lr']:g} | {pct(r['held_out_at_epoch'])} "
              f"| {pct(r['guard_at_epoch'])} | {reach[0]} | {reach[1]} "
              f"| {pct(r['final_held_out'])} | {pct(r['final_guard'])} "
              f"| {r['final_seconds']:.0f} |")  # fmt: skip


def write_png(runs: list[dict], base: dict, reference: dict, path: Path) -> None:
    """Held-out WER (solid) and guard WER (dashed) against training seconds, a colour a
    system; every seed drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    colours: dict[str, str] = {}
    for run in runs:
        label = f"{run['system']} {run['variant']} lr {run['lr']:g}"
        first = label not in colours
        colour = colours.setdefault(label, f"C{len(colours)}")
        seconds = [0.0] + [p["seconds"] for p in run["points"]]
        for key, style in (("held_out_wer", "-"), ("guard_wer", "--")):
            wers = [100 * base[key]] + [100 * p[key] for p in run["points"]]
            shown = label if first and key == "held_out_wer" else None
            axes.plot(seconds, wers, style, marker="o", color=colour, label=shown)
    axes.axvline(reference["epoch_seconds"], color="grey", lw=0.8, label="Trainer: one epoch")
    axes.set_xlabel("training seconds")
    axes.set_ylabel("WER % (held-out solid, guard dashed)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def combine(paths: list[Path], work_dir: Path) -> None:
    """One summary over the runs of several outputs, e.g. seeds run at different times: the
    same sets and starting model, so the same starting WERs."""
    outputs = []
    for path in paths:
        try:
            output = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise SystemExit(f"{path}: not readable as JSON ({error})") from None
        if not isinstance(output, dict) or not {"base", "runs", "command"} <= output.keys():
            raise SystemExit(f"{path}: not a time_to_quality output (no base, runs, command)")
        if outputs and output["base"] != outputs[0]["base"]:
            raise SystemExit(f"{path}: another starting model or sets ({output['base']}); "
                             f"combine only outputs of one model and one set of sets")  # fmt: skip
        outputs.append(output)
    base = outputs[0]["base"]
    runs = [run for output in outputs for run in output["runs"]]
    rows, reference = summarise(runs, base)
    print_tables(runs, base, rows, reference)
    stem = work_dir / "time_to_quality-combined"
    work_dir.mkdir(parents=True, exist_ok=True)
    commands = [output["command"] for output in outputs]
    stem.with_suffix(".json").write_text(json.dumps({
        "commands": commands, "base": base, "reference": reference, "summary": rows,
        "runs": runs}, indent=1))  # fmt: skip
    write_png(runs, base, reference, stem.with_suffix(".png"))
    print(f"\nwrote {stem}.json and .png")


# -- main ---------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    add = parser.add_argument
    add("--target", choices=("synth", "real"), default="synth")
    add("--model", default="tiny.en")
    add("--mode", choices=("full", "lora"), default="full")
    add("--learning-rate", type=float, help="every system's (default: the mode's default)")
    add("--trainer-learning-rates", type=float, nargs="+", help="the Trainer's sweep")
    add("--trainer-every-linear", dest="trainer_lora_targets", action="store_const",
        const=list(LORA_TARGETS),
        help="--mode lora: the Trainer's adapters on every linear layer (whisper-train's "
        "default), not the blog's q_proj,v_proj")  # fmt: skip
    add("--train-sentences", type=int, default=128,
        help="--target synth: training sentences (the guard set stays 32)")  # fmt: skip
    add("--held-out-sentences", type=int, default=32,
        help="--target synth: held-out sentences (the first 32 are the default set's)")  # fmt: skip
    add("--seeds", type=int, nargs="+", default=[0, 1])
    add("--batch-size", type=int, default=8, help="clips a step (a variant may change its own)")
    example = "'packed=--packing on --batch-size 1'"
    add("--variant", action="append", default=[], metavar="NAME=FLAGS",
        help=f"whisper-train with these flags too, e.g. {example}; leading VAR=VALUE words "
        "set the worker's environment")  # fmt: skip
    add("--budget-factor", type=float, default=1.5, help="the Trainer's epochs: the budget")
    add("--own-length", action="store_true",
        help="whisper-train trains for its own length (its default 3 epochs, or a variant's "
        "--epochs), not the steps that fill the budget: what a user running it gets")  # fmt: skip
    add("--points", type=int, default=5, help="saved points a run")
    add("--calibration-steps", type=int,
        help="steps timed before each variant's runs (default: 8 on a CPU, 24 on CUDA, whose "
        "first 8-20 steps carry one-off costs)")  # fmt: skip
    add("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "wt-time-to-quality")
    add("--keep-models", action="store_true", help="keep every point's model folder")
    add("--cpu-seconds", action="store_true",
        help="on a CPU, time training in each worker's CPU seconds, not wall seconds (run with "
        "OMP_NUM_THREADS=1): figures that hold while other jobs share the machine")  # fmt: skip
    add("--smoke", action="store_true", help="tiny budgets: checks the script")
    add("--combine", type=Path, nargs="+", metavar="JSON",
        help="trains nothing: the runs of these earlier outputs (the same sets and model, "
        "other seeds) summarised together; writes WORK/time_to_quality-combined.json, .png")  # fmt: skip
    add("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.learning_rate = args.learning_rate or DEFAULT_LR[args.mode]
    if args.cpu_seconds:
        os.environ[CPU_SECONDS] = "1"  # inherited by the workers
    args.train_clips = args.eval_clips = None
    if args.calibration_steps is None:
        import torch

        # On a CPU 4 steps of the per-clip LoRA default gave 1.78 s a warm step where its run
        # then took 1.45 (micro-batches differ in clips and labels): 8 average more of them.
        args.calibration_steps = 24 if torch.cuda.is_available() else 8
    if args.smoke:
        # 8 clips in batches of 4: 2 Trainer steps, 2 calibration steps, at most 3 after
        args.train_clips, args.eval_clips, args.batch_size, args.budget_factor = 8, 4, 4, 1.0
        args.points, args.calibration_steps = min(args.points, 2), 2
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        worker = trainer_worker if spec["system"] == "trainer" else whisper_train_worker
        result = worker(spec)
        (Path(args.worker).parent / "result.json").write_text(json.dumps(result, indent=1))
        return
    if args.combine:
        return combine(args.combine, args.work_dir)
    import torch

    variants = [("default", [], {})] + [variant_of(text) for text in args.variant]
    smoke = "-smoke" if args.smoke else ""
    args.work_dir.mkdir(parents=True, exist_ok=True)
    size = f"-{args.train_sentences}" if args.train_sentences != 128 else ""
    size += f"-h{args.held_out_sentences}" if args.held_out_sentences != 32 else ""
    folder = args.work_dir / f"data-{args.target}{size}{smoke}"
    sets = make_sets(args.target, folder, args.smoke, args.train_sentences, args.held_out_sentences)
    model_dir = save_base_model(args.model, args.work_dir / f"model-{Path(args.model).name}")
    on_cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if on_cuda else f"CPU, {os.cpu_count()} cores"
    print(f"command: {shlex.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}")
    print(f"machine: {platform.processor() or platform.machine()} ({device}), torch "
          f"{torch.__version__}; model {args.model}, {args.mode}, lr {args.learning_rate:g}, "
          f"batch {args.batch_size}", flush=True)  # fmt: skip
    if args.cpu_seconds and not on_cuda:
        print("training seconds are each worker's CPU seconds (--cpu-seconds)", flush=True)
    started = time.perf_counter()
    try:
        runs = run_trainer(args, sets, model_dir)
    except WorkerFailed as failure:
        raise SystemExit(str(failure)) from None
    budget = statistics.mean(r["points"][-1]["seconds"] for r in runs)
    print(f"  budget: {budget:.1f} training s (the Trainer's {args.budget_factor:g} epochs)")
    for variant in variants:
        try:
            runs += run_whisper_train(args, sets, model_dir, variant, budget)
        except WorkerFailed as failure:  # the other variants' runs still count
            print(f"  variant {variant[0]} left out: {failure}", flush=True)
    base = score_all(runs, sets, model_dir, args.eval_clips, args.keep_models)
    rows, reference = summarise(runs, base)
    print_tables(runs, base, rows, reference)
    stem = args.work_dir / f"time_to_quality-{args.target}-{args.mode}{smoke}"
    everything = {"command": sys.argv, "device": device, "torch": torch.__version__,
                  "base": base, "reference": reference, "summary": rows, "runs": runs}  # fmt: skip
    stem.with_suffix(".json").write_text(json.dumps(everything, indent=1))
    write_png(runs, base, reference, stem.with_suffix(".png"))
    print(f"\nwrote {stem}.json and .png; {time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
