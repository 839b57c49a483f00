"""Time to quality: held-out and guard WER against training seconds, whisper-train vs the blog's
Seq2SeqTrainer recipe, on the same data, model, batch memory and learning rate.

    .venv/bin/python bench/time_to_quality.py [--target synth|real] [--mode full|lora]
        [--model tiny.en] [--learning-rate LR] [--trainer-learning-rates LR ...]
        [--seeds 0 1] [--batch-size 8] [--budget-factor 1.5] [--points 5]
        [--variant "packed=--packing on --batch-size 1" ...] [--work-dir DIR] [--smoke]

Systems, each its own process, each starting from the same model folder (--model saved once):
  trainer        the blog recipe (bench/throughput.py's): features per clip with the processor
                 beforehand (their seconds reported, not counted), the blog's collator, linear
                 schedule, no warm-up, batch --batch-size clips; bf16 and non-reentrant
                 checkpointing on CUDA, fp32 and none on a CPU (whisper-train's defaults there).
  whisper-train  `whisper-train train` (its CLI, in-process) with its shipped defaults plus
                 --learning-rate, --batch-size, --seed, --max-steps and each --variant's own
                 flags (after the others: they win). `default=` (no flags) always runs.

The Trainer runs first, for --budget-factor epochs; its training seconds are the budget. Each
whisper-train variant is timed for a few steps (a calibration run), then trained for the steps
that fill the budget (its linear schedule ends there, as the Trainer's does). Both save the
model (LoRA merged) at --points evenly spaced steps (the Trainer also at its one-epoch step);
training seconds are wall seconds of the training loop (CUDA synchronised) up to each save,
less the saves. Every saved model is scored afterwards, outside the timed region, with
whisper-train's `evaluate_examples` (generate-based WER, temperature fallback, English
normaliser) on the held-out and the guard set; the starting model is every curve's point 0.

Prints a table of every point, then per system: the WER at the Trainer's one-epoch time and
the seconds to reach the Trainer's WER at one epoch and at its end (linear interpolation
between points; "beyond" / "not reached" where the curve does not get there), mean over
seeds. Writes WORK/time_to_quality-TARGET-MODE.json (every point) and .png (held-out WER
solid, guard dashed, one colour a system). With several --trainer-learning-rates the Trainer's
reference is the rate with the lower final held-out WER (mean over seeds).

Targets (bench/quality.py's sets): real = AN4 train (30 clips) / AN4 test / LJ Speech guard
(../shared/realspeech, or $WHISPER_TRAIN_REALSPEECH); synth = the demo's espeak-ng sets, 128
training sentences, 32 held-out (other voices and words), 32 guard. --smoke: 8 training clips,
4 clips a scored set, a 2-step Trainer run: checks the script in a few minutes.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
DEFAULT_LR = {"full": 1e-5, "lora": 3e-4}  # whisper-train's defaults (config/options.py)
LORA = {"r": 32, "lora_alpha": 64, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}


def realspeech() -> Path:
    """../shared/realspeech beside the checkout (a worktree's is one level further up), or a
    copy named by WHISPER_TRAIN_REALSPEECH (a lent GPU machine: bench/gpu_carry.sh)."""
    if "WHISPER_TRAIN_REALSPEECH" in os.environ:
        return Path(os.environ["WHISPER_TRAIN_REALSPEECH"])
    candidates = [REPO.parent / "shared", REPO.parents[1] / "shared", REPO / "shared"]
    found = [c / "realspeech" for c in candidates if (c / "realspeech").is_dir()]
    return found[0] if found else candidates[0] / "realspeech"


def clock() -> float:
    """Wall seconds, after the GPU's queued work is done (on CUDA)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


# -- data and model (parent process) ------------------------------------------------------------


def make_sets(target: str, folder: Path, smoke: bool) -> dict[str, Path]:
    """{"train", "target", "guard"}: bench/quality.py's sets (the synth ones smaller in smoke)."""
    sys.path.insert(0, str(REPO / "bench"))
    import quality

    folder.mkdir(parents=True, exist_ok=True)
    if target == "real":
        quality.REALSPEECH = realspeech()
        if not quality.REALSPEECH.is_dir():
            raise SystemExit(f"--target real needs {quality.REALSPEECH}; use --target synth")
        return quality.real_sets(folder)
    if not smoke:
        return quality.synth_sets(folder)
    from whisper_train.demo import prepare_demo_data

    dirs = prepare_demo_data(
        folder, train_utterances=8, eval_utterances=4, guard_utterances=4, seed=0
    )
    return {"train": dirs["train"], "target": dirs["held-out"], "guard": dirs["guard"]}


def save_base_model(spec: str, folder: Path) -> Path:
    """The model both systems start from, as one transformers folder."""
    from whisper_train.models import load_model, save_model_folder

    if not (folder / "config.json").is_file():
        model, processor = load_model(spec)
        save_model_folder(model, processor, folder)
    return folder


def save_point(model, processor, folder: Path) -> None:
    """The weights as they are now, as a model folder (a copy: LoRA merged into it), for the
    scoring afterwards. The same writer for both systems."""
    from whisper_train.models import save_model_folder

    whole = copy.deepcopy(model)
    if hasattr(whole, "merge_and_unload"):
        whole = whole.merge_and_unload()
    whole.config.use_cache = True
    save_model_folder(whole, processor, folder)


# -- workers (one process a run) --------------------------------------------------------------------


def trainer_worker(spec: dict) -> dict:
    """The blog recipe for spec["steps"] steps, saving at spec["marks"]."""
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
    from whisper_train.data.layouts import load_examples

    processor = WhisperProcessor.from_pretrained(spec["model_dir"])
    model = WhisperForConditionalGeneration.from_pretrained(spec["model_dir"])
    model.model.encoder.embed_positions.requires_grad_(False)  # fixed sinusoids, as whisper-train
    model.config.use_cache = False
    if spec["mode"] == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**LORA))
    examples = load_examples(spec["train"])[: spec["train_clips"]]
    started = clock()
    dataset = []  # the blog's prepare_dataset, from a list (no torchcodec for datasets.Audio)
    for example in examples:
        audio = load_audio(example.audio, start=example.start, end=example.end)
        features = processor.feature_extractor(np.asarray(audio), sampling_rate=16_000)
        labels = processor.tokenizer(example.text).input_ids
        dataset.append({"input_features": features.input_features[0], "labels": labels})
    features_seconds = clock() - started

    def collate(rows):  # the blog's data collator: pad features and labels separately
        batch = processor.feature_extractor.pad(
            [{"input_features": r["input_features"]} for r in rows], return_tensors="pt"
        )
        padded = processor.tokenizer.pad(
            [{"input_ids": r["labels"]} for r in rows], return_tensors="pt"
        )
        labels = padded["input_ids"].masked_fill(padded.attention_mask.ne(1), -100)
        if (labels[:, 0] == model.config.decoder_start_token_id).all():
            labels = labels[:, 1:]  # the model prepends the start token itself
        batch["labels"] = labels
        return batch

    points: list[dict] = []
    marks = set(spec["marks"])

    class SaveAtMarks(TrainerCallback):
        def on_train_begin(self, *_, **__):
            self.start, self.excluded = clock(), 0.0

        def on_step_end(self, _args, state, _control, model=None, **__):
            if state.global_step not in marks:
                return
            now = clock()
            folder = Path(spec["out"]) / f"step-{state.global_step}"
            save_point(model, processor, folder)
            points.append(
                {
                    "step": state.global_step,
                    "seconds": now - self.start - self.excluded,
                    "model": str(folder),
                }
            )
            self.excluded += clock() - now

    on_cuda = torch.cuda.is_available()
    arguments = Seq2SeqTrainingArguments(
        output_dir=str(Path(spec["out"]) / "trainer"),
        per_device_train_batch_size=spec["batch_size"],
        learning_rate=spec["learning_rate"],
        max_steps=spec["steps"],
        lr_scheduler_type="linear",
        warmup_steps=0,
        gradient_checkpointing=on_cuda,
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
    trainer = Seq2SeqTrainer(
        model=model,
        args=arguments,
        train_dataset=dataset,
        data_collator=collate,
        callbacks=[SaveAtMarks()],
    )
    trainer.train()
    epoch = next(p["seconds"] for p in points if p["step"] == spec["epoch_step"])
    return {"points": points, "epoch_seconds": epoch, "features_seconds": features_seconds}


def whisper_train_worker(spec: dict) -> dict:
    """`whisper-train train` in this process, with its loop's steps timed (FineTuneRecipe's
    train and _after_step wrapped) and the model saved at spec["marks"] (spec["save"] False:
    only timed, the calibration run)."""
    from transformers import WhisperProcessor

    from whisper_train.cli import main as whisper_train_main
    from whisper_train.training.recipe import FineTuneRecipe

    processor = WhisperProcessor.from_pretrained(spec["model_dir"])
    marks, points = set(spec["marks"]), []
    train, after_step = FineTuneRecipe.train, FineTuneRecipe._after_step
    timer = {"start": 0.0, "excluded": 0.0}

    def timed_train(recipe):
        timer["start"] = clock()
        return train(recipe)

    def timed_after_step(recipe, step):
        after_step(recipe, step)  # its logging and checks are the loop's cost (--only-train)
        if recipe.state.step not in marks:
            return
        now = clock()
        point = {"step": recipe.state.step, "seconds": now - timer["start"] - timer["excluded"]}
        if spec["save"]:
            point["model"] = str(Path(spec["out"]) / f"step-{recipe.state.step}")
            save_point(recipe._whole_model(), processor, Path(point["model"]))
        points.append(point)
        timer["excluded"] += clock() - now

    FineTuneRecipe.train, FineTuneRecipe._after_step = timed_train, timed_after_step
    code = whisper_train_main(["train", *spec["argv"]])
    if code:
        raise SystemExit(f"whisper-train train exited {code}")
    return {"points": points}


def launch(spec: dict, folder: Path) -> dict:
    """Run a worker in its own process; its result."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.json").write_text(json.dumps(spec, indent=1))
    log = folder / "worker.log"
    with log.open("w") as stream:
        done = subprocess.run(
            [sys.executable, __file__, "--worker", str(folder / "spec.json")],
            stdout=stream,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"{spec['system']} failed ({log}):\n{log.read_text()[-3000:]}")
    return json.loads((folder / "result.json").read_text())


def evenly(steps: int, points: int) -> list[int]:
    return sorted({max(1, round(steps * i / points)) for i in range(1, points + 1)})


# -- the runs (parent process) ----------------------------------------------------------------------


@dataclass
class Variant:
    name: str
    flags: list[str]

    @classmethod
    def parse(cls, text: str) -> Variant:
        name, _, flags = text.partition("=")
        return cls(name.strip(), shlex.split(flags))


def run_trainer(args, sets, model_dir: Path) -> list[dict]:
    n_train = len(_examples(sets["train"], args.train_clips))
    epoch_steps = -(-n_train // args.batch_size)
    steps = max(1, round(args.budget_factor * epoch_steps))
    marks = sorted({*evenly(steps, args.points), min(epoch_steps, steps)})
    runs = []
    for lr in args.trainer_learning_rates or [args.learning_rate]:
        for seed in args.seeds:
            name = f"trainer-lr{lr:g}-seed{seed}"
            spec = {
                "system": "trainer",
                "model_dir": str(model_dir),
                "mode": args.mode,
                "train": str(sets["train"]),
                "train_clips": args.train_clips,
                "batch_size": args.batch_size,
                "learning_rate": lr,
                "seed": seed,
                "steps": steps,
                "marks": marks,
                "epoch_step": min(epoch_steps, steps),
                "out": str(args.work_dir / name),
            }
            result = launch(spec, args.work_dir / name)
            runs.append({"system": "trainer", "variant": "blog", "lr": lr, "seed": seed, **result})
            print(f"  {name}: {_progress(result)}", flush=True)
    return runs


def whisper_train_spec(args, sets, model_dir, variant, seed, steps, marks, out) -> dict:
    """A whisper-train worker's run: the variant's flags last (they win); saves only at `marks`
    when `out` is not a calibration run's folder."""
    argv = [
        "--model", str(model_dir), "--data", str(sets["train"]), "--mode", args.mode,
        "--learning-rate", str(args.learning_rate), "--batch-size", str(args.batch_size),
        "--seed", str(seed), "--max-steps", str(steps), "--only-train",
        "--output-dir", str(out / "run"), "--overwrite",
        *(["--train-subset", str(args.train_clips)] if args.train_clips else []),
        *variant.flags,
    ]  # fmt: skip
    save = not out.name.endswith("-calibration")
    return {"system": "whisper-train", "model_dir": str(model_dir), "argv": argv, "marks": marks,
            "save": save, "out": str(out)}  # fmt: skip


def run_whisper_train(args, sets, model_dir: Path, variant: Variant, budget: float) -> list[dict]:
    """Per seed: a calibration run (seconds a step), then the steps that fill `budget`."""
    runs = []
    for seed in args.seeds:
        name, steps = f"wt-{variant.name}-seed{seed}", args.calibration_steps
        out = args.work_dir / f"{name}-calibration"
        spec = whisper_train_spec(
            args, sets, model_dir, variant, seed, steps, [*range(1, steps + 1)], out
        )
        seconds = [p["seconds"] for p in launch(spec, out)["points"]]
        # the first step carries one-off costs (allocation, the first batch): left out
        per_step = (seconds[-1] - seconds[0]) / max(1, len(seconds) - 1) or seconds[0]
        steps = max(args.points, round(budget / per_step))
        steps = min(steps, 4) if args.smoke else steps
        out = args.work_dir / name
        spec = whisper_train_spec(
            args, sets, model_dir, variant, seed, steps, evenly(steps, args.points), out
        )
        result = launch(spec, out)
        lr = float(_flag(variant.flags, "--learning-rate") or args.learning_rate)
        runs.append({"system": "whisper-train", "variant": variant.name, "flags": variant.flags,
                     "lr": lr, "seed": seed, "calibrated_s_per_step": per_step, **result})  # fmt: skip
        print(f"  {name}: {per_step:.2f} s/step calibrated, {steps} steps; {_progress(result)}")
    return runs


def _flag(flags: list[str], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags[:-1] else None


def _progress(result: dict) -> str:
    return ", ".join(f"step {p['step']} at {p['seconds']:.1f} s" for p in result["points"])


def _examples(path: Path, limit: int | None) -> list:
    from whisper_train.data.layouts import load_examples

    examples = load_examples(str(path))
    return examples[:limit] if limit else examples


# -- scoring (parent process, after every run) ---------------------------------------------------


def score_all(runs: list[dict], sets, model_dir: Path, eval_clips: int | None) -> dict:
    """Held-out and guard WER of every saved point (and of the starting model: returned)."""
    import torch

    from whisper_train.decoding import DecodingOptions
    from whisper_train.evaluation.evaluate import evaluate_examples
    from whisper_train.models import load_model

    scored = {
        "held_out": _examples(sets["target"], eval_clips),
        "guard": _examples(sets["guard"], eval_clips),
    }

    def score(folder: str) -> dict:
        model, processor = load_model(folder)
        if torch.cuda.is_available():
            model = model.to("cuda")
        model.eval()
        return {
            f"{name}_wer": evaluate_examples(
                model, processor, examples, normalizer="english", decoding=DecodingOptions()
            ).wer
            for name, examples in scored.items()
        }

    base = {"step": 0, "seconds": 0.0, "model": str(model_dir), **score(str(model_dir))}
    print(f"  starting model: {_wers(base)}", flush=True)
    for run in runs:
        for point in run["points"]:
            point.update(score(point["model"]))
        print(f"  {run['system']} {run['variant']} seed {run['seed']}: "
              + "; ".join(f"{p['seconds']:.0f} s {_wers(p)}" for p in run["points"]), flush=True)  # fmt: skip
    return base


def _wers(point: dict) -> str:
    return f"held-out {100 * point['held_out_wer']:.1f}, guard {100 * point['guard_wer']:.1f}"


# -- the summary ----------------------------------------------------------------------------------


def value_at(curve: list[tuple[float, float]], seconds: float) -> float | None:
    """Linear interpolation of (seconds, wer) at `seconds`; None past the curve's end."""
    for (t0, w0), (t1, w1) in zip(curve, curve[1:], strict=False):
        if t0 <= seconds <= t1:
            return w0 + (w1 - w0) * (seconds - t0) / (t1 - t0) if t1 > t0 else w1
    return None


def time_to(curve: list[tuple[float, float]], wer: float) -> float | None:
    """The first time the interpolated curve reaches `wer` or lower; None if it never does."""
    for (t0, w0), (t1, w1) in zip(curve, curve[1:], strict=False):
        if w1 <= wer:
            return t1 if w0 <= wer or w0 == w1 else t0 + (t1 - t0) * (w0 - wer) / (w0 - w1)
    return None


def groups(runs: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for run in runs:
        out.setdefault((run["system"], run["variant"], run["lr"]), []).append(run)
    return out


def summarise(runs: list[dict], base: dict) -> tuple[list[dict], dict]:
    """Per (system, variant, lr): the mean over seeds of WER at the Trainer's one-epoch time
    and of the seconds to the Trainer's one-epoch and final held-out WER."""

    def curve(run, key):
        return [(0.0, base[key])] + [(p["seconds"], p[key]) for p in run["points"]]

    trainers = {k: v for k, v in groups(runs).items() if k[0] == "trainer"}
    best = min(
        trainers,
        key=lambda k: statistics.mean(r["points"][-1]["held_out_wer"] for r in trainers[k]),
    )
    epoch_s = statistics.mean(r["epoch_seconds"] for r in trainers[best])
    reference = {
        "trainer_lr": best[2],
        "epoch_seconds": epoch_s,
        "epoch_wer": statistics.mean(value_at(curve(r, "held_out_wer"), epoch_s) or r["points"][-1]["held_out_wer"] for r in trainers[best]),
        "final_wer": statistics.mean(r["points"][-1]["held_out_wer"] for r in trainers[best]),
    }  # fmt: skip

    def mean_or_none(values):
        return None if any(v is None for v in values) else statistics.mean(values)

    rows = []
    for (system, variant, lr), members in groups(runs).items():
        rows.append({
            "system": system, "variant": variant, "lr": lr, "seeds": len(members),
            "held_out_at_epoch": mean_or_none([value_at(curve(r, "held_out_wer"), epoch_s) for r in members]),
            "guard_at_epoch": mean_or_none([value_at(curve(r, "guard_wer"), epoch_s) for r in members]),
            "s_to_epoch_wer": mean_or_none([time_to(curve(r, "held_out_wer"), reference["epoch_wer"]) for r in members]),
            "s_to_final_wer": mean_or_none([time_to(curve(r, "held_out_wer"), reference["final_wer"]) for r in members]),
            "final_held_out": statistics.mean(r["points"][-1]["held_out_wer"] for r in members),
            "final_guard": statistics.mean(r["points"][-1]["guard_wer"] for r in members),
            "final_seconds": statistics.mean(r["points"][-1]["seconds"] for r in members),
        })  # fmt: skip
    return rows, reference


def print_tables(runs: list[dict], base: dict, rows: list[dict], reference: dict) -> None:
    def pct(value, missing="beyond"):
        return missing if value is None else f"{100 * value:.1f}"

    print("\n| system | variant | lr | seed | step | train s | held-out WER | guard WER |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    print(
        f"| starting model | | | | 0 | 0 | {pct(base['held_out_wer'])} | {pct(base['guard_wer'])} |"
    )
    for run in runs:
        for p in run["points"]:
            print(f"| {run['system']} | {run['variant']} | {run['lr']:g} | {run['seed']} | {p['step']} "
                  f"| {p['seconds']:.1f} | {pct(p['held_out_wer'])} | {pct(p['guard_wer'])} |")  # fmt: skip
    print(
        f"\nTrainer reference (lr {reference['trainer_lr']:g}): one epoch = {reference['epoch_seconds']:.1f} s "
        f"of training, held-out WER {pct(reference['epoch_wer'])} there, {pct(reference['final_wer'])} at "
        "its end. Values at a time are interpolated linearly between saved points (point 0: the "
        "starting model at 0 s); means over seeds."
    )
    print(
        "\n| system | variant | lr | held-out WER at Trainer's epoch time | guard WER there "
        "| s to Trainer's 1-epoch WER | s to Trainer's final WER | final held-out | final guard | train s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        reach = [
            ("not reached" if s is None else f"{s:.0f}")
            for s in (r["s_to_epoch_wer"], r["s_to_final_wer"])
        ]
        print(f"| {r['system']} | {r['variant']} | {r['lr']:g} | {pct(r['held_out_at_epoch'])} "
              f"| {pct(r['guard_at_epoch'])} | {reach[0]} | {reach[1]} | {pct(r['final_held_out'])} "
              f"| {pct(r['final_guard'])} | {r['final_seconds']:.0f} |")  # fmt: skip


def write_png(runs: list[dict], base: dict, reference: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    colours = {}
    for run in runs:
        label = f"{run['system']} {run['variant']} lr {run['lr']:g}"
        colour = colours.setdefault(label, f"C{len(colours)}")
        seconds = [0.0] + [p["seconds"] for p in run["points"]]
        for key, style in (("held_out_wer", "-"), ("guard_wer", "--")):
            wers = [100 * base[key]] + [100 * p[key] for p in run["points"]]
            first = run["seed"] == runs[0]["seed"] and key == "held_out_wer"
            axes.plot(
                seconds, wers, style, marker="o", color=colour, label=label if first else None
            )
    axes.axvline(
        reference["epoch_seconds"], color="grey", linewidth=0.8, label="Trainer: one epoch"
    )
    axes.set_xlabel("training seconds")
    axes.set_ylabel("WER % (held-out solid, guard dashed)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# -- main ----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=("synth", "real"), default="synth")
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--mode", choices=tuple(DEFAULT_LR), default="full")
    parser.add_argument("--learning-rate", type=float, help="every system's (default: the mode's)")
    parser.add_argument(
        "--trainer-learning-rates", type=float, nargs="+", help="the Trainer's sweep"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--batch-size", type=int, default=8, help="clips a step (both systems)")
    parser.add_argument(
        "--variant", action="append", default=[], metavar="NAME=FLAGS",
        help='a whisper-train variant beside its defaults, e.g. "packed=--packing on --batch-size 1"',
    )  # fmt: skip
    parser.add_argument("--budget-factor", type=float, default=1.5, help="the Trainer's epochs")
    parser.add_argument("--points", type=int, default=5, help="saved points a run")
    parser.add_argument("--calibration-steps", type=int, default=4)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "wt-ttq")
    parser.add_argument("--smoke", action="store_true", help="tiny budgets: checks the script")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.learning_rate = args.learning_rate or DEFAULT_LR[args.mode]
    args.train_clips = args.eval_clips = None
    if args.smoke:
        args.train_clips, args.eval_clips, args.budget_factor = 8, 4, 2.0
        args.points, args.calibration_steps = min(args.points, 2), 2
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        run = trainer_worker if spec["system"] == "trainer" else whisper_train_worker
        result = run(spec)
        (Path(args.worker).parent / "result.json").write_text(json.dumps(result, indent=1))
        return
    import torch

    variants = [Variant("default", []), *map(Variant.parse, args.variant)]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    sets = make_sets(
        args.target,
        args.work_dir / f"data-{args.target}{'-smoke' if args.smoke else ''}",
        args.smoke,
    )
    model_dir = save_base_model(args.model, args.work_dir / "model")
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU ({os.cpu_count()} cores)"
    )
    print(f"command: {shlex.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}")
    print(f"machine: {platform.processor() or platform.machine()}, {device}; torch {torch.__version__}; "
          f"model {args.model}, {args.mode}, lr {args.learning_rate:g}, batch {args.batch_size}", flush=True)  # fmt: skip
    started = time.perf_counter()
    runs = run_trainer(args, sets, model_dir)
    budget = statistics.mean(r["points"][-1]["seconds"] for r in runs)
    print(
        f"  budget: {budget:.1f} training seconds (the Trainer's {args.budget_factor:g} epochs)",
        flush=True,
    )
    for variant in variants:
        runs += run_whisper_train(args, sets, model_dir, variant, budget)
    base = score_all(runs, sets, model_dir, args.eval_clips)
    rows, reference = summarise(runs, base)
    print_tables(runs, base, rows, reference)
    stem = (
        args.work_dir / f"time_to_quality-{args.target}-{args.mode}{'-smoke' if args.smoke else ''}"
    )
    stem.with_suffix(".json").write_text(json.dumps(
        {"command": sys.argv, "device": device, "base": base, "reference": reference, "summary": rows,
         "runs": runs}, indent=1))  # fmt: skip
    write_png(runs, base, reference, stem.with_suffix(".png"))
    print(f"\nwrote {stem}.json and .png; {time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
