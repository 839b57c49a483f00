"""What fine-tuning keeps and what it gains: target WER, guard WER and loops for a grid of runs.

    .venv/bin/python bench/quality.py [--target real|synth] [--steps 30] [--grid defaults|lr|all]
        [--only MODE] [--model tiny.en]

Each run is `whisper-train train` as a user starts it (its own process), with the target's
held-out set and the guard set as `--eval-data`, scored after the last step; the starting
model's scores come from the first run's `--eval-at-start` row (every run starts from the same
weights, so they are the same for all). Figures are percent: WER (generate-based, with the
temperature fallback), and the repeated 3-gram rate of the transcripts (loops).

Targets:
  real   (needs ../shared/realspeech) train on CMU AN4's 30 training clips (single words and
         spelled letters, ~25 speakers), score AN4's 10 test clips (other speakers) as the
         target and LJ Speech's 35 clips (read news-style English, one speaker) as the guard:
         what the model knew of general English.
  synth  the demo's sets at a smaller size (demo.py): 128 training sentences in the training
         voices and words, 32 held-out sentences in voices and content words training never
         saw (the target), 32 general sentences in the default voice (the guard).

Grids:
  defaults  each mode at today's default learning rate;
  packing   LoRA at its default learning rate, --packing off (batch 8 clips) and on (batch 1
         window: about as many clips a step, so about as many steps at equal clips seen), each
         for --epochs (equal clips seen), and packed for 3x the epochs (about the unpacked
         run's wall time); no --max-steps;
  packing-timestamps  the packing grid's runs at equal clips seen, packed with and without
         --packing-timestamps on (every window of 2+ clips labelled with its clips' times);
         --equal-wall-epochs N adds packed runs, with and without timestamps, of N epochs (N:
         an unpacked epoch's measured training time over a packed epoch's: equal compute);
  per-clip  each mode (--only) at its default learning rate for --epochs: unpacked (batch 8
         clips), --packing on and --packing per-clip (batch 1 window, about 8 clips of the
         demo's): equal clips seen; --equal-wall-epochs N adds per-clip for N epochs;
         --per-clip-encoder CONTEXT (repeatable: window, block, block-restart,
         block-restart-pad, block-restart-ownpad, block-restart-silence,
         block-restart-silence-self, block-restart-silence-detached,
         block-restart-ownpad-sampled) adds per-clip with that
         encoder context (`memory.clip_attention.ENCODER_CONTEXT`; the plain per-clip row is
         the default context, block-restart-ownpad-sampled, in every mode:
         `packing.DEFAULT_PER_CLIP_CONTEXT`), --encoder-only runs only those;
  lr     each mode at its default learning rate, a third and a tenth of it, and
         --preserve-base 1 at the default; with --learning-rate (repeatable) each mode at
         exactly those rates instead (a sweep: nothing else);
  all    lr, plus warm-up (10 steps) and SpecAugment at each mode's default.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from whisper_train.config import DEFAULT_LEARNING_RATES

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
from common import REALSPEECH  # noqa: E402  (bench/ is this script's folder: on sys.path)

WHISPER_TRAIN = [sys.executable, "-m", "whisper_train.cli"]
# config.py's defaults when this grid was first run (the defaults now: CURRENT_LR)
DEFAULT_LR = {"full": 1e-5, "lora": 1e-3, "freeze-encoder": 3e-5}
CURRENT_LR = DEFAULT_LEARNING_RATES  # the defaults now (lora's grid runs at its default targets)


@dataclass
class Run:
    mode: str
    learning_rate: float
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # the run's internal switches

    @property
    def label(self) -> str:
        flags = " ".join([*self.extra, *(f"{k}={v}" for k, v in self.env.items())])
        return f"{self.mode} lr {self.learning_rate:.2g}" + (f" {flags}" if flags else "")


# The packing grids' baseline: clips one by one, named (the default packs per clip).
UNPACKED = ["--packing", "off"]


def grid(
    name: str,
    modes: list[str],
    epochs: int = 1,
    equal_wall_epochs: int = 0,
    encoder_contexts: tuple[str, ...] = (),
    rates: tuple[float, ...] = (),
) -> list[Run]:
    packed = ["--packing", "on", "--batch-size", "1"]
    if name == "packing-timestamps":
        lr = CURRENT_LR["lora"]
        timestamped = [*packed, "--packing-timestamps", "on"]
        runs = [
            Run("lora", lr, ["--epochs", str(epochs), *UNPACKED]),
            Run("lora", lr, ["--epochs", str(epochs), *packed]),
            Run("lora", lr, ["--epochs", str(epochs), *timestamped]),
        ]
        if equal_wall_epochs:
            runs += [
                Run("lora", lr, ["--epochs", str(equal_wall_epochs), *timestamped]),
                Run("lora", lr, ["--epochs", str(equal_wall_epochs), *packed]),
            ]
        return runs
    if name == "per-clip":  # each mode at its default rate: unpacked, joined, per-clip
        runs = []
        for mode in modes:
            lr, epochs_flag = CURRENT_LR[mode], ["--epochs", str(epochs)]
            runs += [
                Run(mode, lr, [*epochs_flag, *UNPACKED]),
                Run(mode, lr, [*epochs_flag, "--packing", "on", "--batch-size", "1"]),
                Run(mode, lr, [*epochs_flag, "--packing", "per-clip", "--batch-size", "1"]),
            ]
            per_clip = ["--packing", "per-clip", "--batch-size", "1"]
            if equal_wall_epochs:
                runs.append(Run(mode, lr, ["--epochs", str(equal_wall_epochs), *per_clip]))
            for context in encoder_contexts:
                env = {"WHISPER_TRAIN_PER_CLIP_ENCODER": context}
                runs.append(Run(mode, lr, [*epochs_flag, *per_clip], env))
        return runs
    if name == "packing":
        lr = CURRENT_LR["lora"]
        return [
            Run("lora", lr, ["--epochs", str(epochs), *UNPACKED]),
            Run("lora", lr, ["--epochs", str(epochs), "--packing", "on", "--batch-size", "1"]),
            Run("lora", lr, ["--epochs", str(3 * epochs), "--packing", "on", "--batch-size", "1"]),
        ]
    if name == "defaults":
        return [Run(mode, CURRENT_LR[mode]) for mode in modes]
    if name == "lr" and rates:  # a sweep at the rates asked for
        return [Run(mode, lr) for mode in modes for lr in rates]
    runs = []
    for mode in modes:
        default = DEFAULT_LR[mode]
        runs += [Run(mode, lr) for lr in (default / 10, default / 3, default)]
        runs.append(Run(mode, default, ["--preserve-base", "1"]))
        if name == "all":
            runs.append(Run(mode, default, ["--warmup-steps", "10"]))
            if mode != "freeze-encoder":  # its cached encoder outputs cannot be augmented
                runs.append(Run(mode, default, ["--spec-augment"]))
    return runs


def real_sets(folder: Path) -> dict[str, Path]:
    """Manifests (absolute audio paths) for AN4 train, AN4 test and LJ Speech."""
    rows = [json.loads(line) for line in (REALSPEECH / "manifest.jsonl").open()]
    picks = {
        "train": lambda r: "/asr/train/an4/" in r["source"],
        "target": lambda r: "/asr/test/an4/" in r["source"],
        "guard": lambda r: "ljspeech" in r["audio"],
    }
    sets = {}
    for name, keep in picks.items():
        path = folder / f"{name}.jsonl"
        with path.open("w") as stream:
            for row in filter(keep, rows):
                audio = str(REALSPEECH / row["audio"])
                stream.write(json.dumps({"audio": audio, "text": row["text"]}) + "\n")
        sets[name] = path
    return sets


def synth_sets(
    folder: Path, train_utterances: int = 128, held_out_utterances: int = 32
) -> dict[str, Path]:
    """The demo's sets; more held-out sentences (the first 32 are the same) cut the scoring
    noise a 32-sentence set puts on a WER (1 point is ~3 of its 289 words)."""
    from whisper_train.demo import prepare_demo_data

    dirs = prepare_demo_data(
        folder,
        train_utterances=train_utterances,
        eval_utterances=held_out_utterances,
        guard_utterances=32,
        seed=0,
    )
    return {"train": dirs["train"], "target": dirs["held-out"], "guard": dirs["guard"]}


def train_once(run: Run, sets: dict[str, Path], args, out: Path, at_start: bool) -> dict:
    """One `whisper-train train`; returns its result.json."""
    command = [
        *WHISPER_TRAIN,
        "train",
        "--model", args.model,
        "--data", str(sets["train"]),
        "--eval-data", f"target={sets['target']}",
        "--eval-data", f"guard={sets['guard']}",
        "--mode", run.mode,
        "--learning-rate", str(run.learning_rate),
        *([] if "--epochs" in run.extra else ["--max-steps", str(args.steps)]),
        "--batch-size", "8",
        "--seed", str(args.seed),
        "--output-dir", str(out),
        "--overwrite",
        *(["--eval-at-start"] if at_start else []),
        *run.extra,
    ]  # fmt: skip
    started = time.perf_counter()
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, **run.env}
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{run.label} failed:\n{done.stderr[-3000:]}")
    result = json.loads((out / "result.json").read_text())
    result["seconds"] = time.perf_counter() - started
    # the whole run's CPU (training and evaluation), and the training loop's wall time as the
    # run states it ("trained N steps in S s"): on a shared machine wall time is not the cost
    result["cpu_seconds"] = sum(
        getattr(cpu_after, k) - getattr(cpu_before, k) for k in ("ru_utime", "ru_stime")
    )
    trained = re.findall(r"trained \d+ steps.* in ([\d.]+) s", done.stdout + done.stderr)
    result["train_seconds"] = float(trained[-1]) if trained else None
    return result


def score_timestamps(specs: list[str], sets: dict[str, Path]) -> None:
    """Each model decodes the target and guard clips in Whisper's timestamp mode (greedy, one
    30 s window, `return_timestamps=True`: the form `transcribe` writes subtitles with): the
    WER of that transcript, the share of clips whose output is whole segments (a start and an
    end time each, in order) and the mean distance of the last end time from the clip's end.
    What training on labels without times may wear away, and packed timestamps may keep."""
    import jiwer
    import torch

    from whisper_train.audio import load_audio
    from whisper_train.data.layouts import load_examples
    from whisper_train.evaluation.evaluate import get_normalizer
    from whisper_train.models import load_model

    normalize = get_normalizer("english")
    print("| model | set | WER (timestamp mode) | whole segments | mean end error s |")
    print("|---|---|---:|---:|---:|")
    for spec in specs:
        model, processor = load_model(spec)
        model.eval()
        tokenizer = processor.tokenizer
        begin = tokenizer.convert_tokens_to_ids("<|0.00|>")
        for name in ("target", "guard"):
            examples = load_examples(str(sets[name]))
            references, hypotheses, whole, end_errors = [], [], 0, []
            for example in examples:
                audio = load_audio(example.audio)
                features = processor.feature_extractor(
                    audio, sampling_rate=16_000, return_tensors="pt"
                ).input_features
                with torch.no_grad():
                    ids = model.generate(features, return_timestamps=True, max_new_tokens=200)[0]
                ids = ids.tolist()
                times = [0.02 * (t - begin) for t in ids if t >= begin]
                text = tokenizer.decode([t for t in ids if t < begin], skip_special_tokens=True)
                references.append(normalize(example.text))
                hypotheses.append(normalize(text))
                if times and len(times) % 2 == 0 and times == sorted(times):
                    whole += 1
                if times:
                    end_errors.append(abs(times[-1] - len(audio) / 16_000))
            wer = jiwer.wer(references, hypotheses)
            error = sum(end_errors) / len(end_errors) if end_errors else float("nan")
            print(
                f"| {spec} | {name} | {100 * wer:.1f} | {whole}/{len(examples)} | {error:.2f} |",
                flush=True,
            )


def rows_at(result: dict, step: int) -> dict[str, dict]:
    return {row["set"]: row for row in result["evaluations"] if row["step"] == step}


def main() -> None:
    from whisper_train.memory.clip_attention import ENCODER_CONTEXTS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=("real", "synth"), default="real")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--grid",
        choices=("defaults", "lr", "all", "packing", "packing-timestamps", "per-clip"),
        default="lr",
    )
    parser.add_argument("--epochs", type=int, default=1, help="--grid packing: epochs a run")
    parser.add_argument(
        "--equal-wall-epochs",
        type=int,
        default=0,
        help="--grid packing-timestamps: also packed runs (with and without timestamps) of "
        "this many epochs",
    )
    parser.add_argument(
        "--skip-unpacked",
        action="store_true",
        help="--grid packing*: leave out the unpacked run (its row is in BENCHMARKS.md)",
    )
    parser.add_argument(
        "--equal-wall-only",
        action="store_true",
        help="--grid packing-timestamps: only the --equal-wall-epochs run",
    )
    parser.add_argument(
        "--score-timestamps",
        nargs="+",
        metavar="MODEL",
        help="instead of training: score these models' timestamp-mode decoding of the sets",
    )
    parser.add_argument(
        "--skip-baseline",
        action="store_true",
        help="no --eval-at-start row (the starting model's scores are known from another run)",
    )
    parser.add_argument(
        "--per-clip-encoder",
        action="append",
        default=[],
        choices=ENCODER_CONTEXTS,
        help="--grid per-clip: also per-clip with this encoder context (plain per-clip: the "
        "mode's default, block-restart-pad with LoRA, block-restart-silence-detached otherwise)",
    )
    parser.add_argument(
        "--encoder-only",
        action="store_true",
        help="--grid per-clip: only the --per-clip-encoder runs (the others are in BENCHMARKS.md)",
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        action="append",
        default=[],
        help="--grid lr: each mode at exactly these rates (repeatable)",
    )
    parser.add_argument(
        "--extra",
        default="",
        help="flags added to every run's command line (e.g. '--warmup-steps 3')",
    )
    parser.add_argument("--only", choices=tuple(DEFAULT_LR), action="append")
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--seed", type=int, default=0, help="every run's --seed")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "wt-quality")
    args = parser.parse_args()
    if args.target == "real" and not REALSPEECH.is_dir():
        raise SystemExit(f"--target real needs {REALSPEECH}; use --target synth")

    args.work_dir.mkdir(parents=True, exist_ok=True)
    data = args.work_dir / f"data-{args.target}"
    data.mkdir(exist_ok=True)
    sets = real_sets(data) if args.target == "real" else synth_sets(data)
    if args.score_timestamps:
        score_timestamps(args.score_timestamps, sets)
        return
    runs = grid(
        args.grid,
        args.only or list(DEFAULT_LR),
        args.epochs,
        args.equal_wall_epochs,
        tuple(args.per_clip_encoder),
        tuple(args.learning_rate),
    )
    if args.extra:
        for run in runs:
            run.extra = [*run.extra, *shlex.split(args.extra)]
    if args.encoder_only:
        runs = [run for run in runs if run.env]
    if args.skip_unpacked:
        runs = [run for run in runs if "--packing" in run.extra]
    if args.equal_wall_only:
        runs = [run for run in runs if run.extra[:2] == ["--epochs", str(args.equal_wall_epochs)]]

    print(f"command: {' '.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}; model {args.model}, {args.steps} steps of batch 8"
    )
    header = (
        f"| {'run':<40} | target WER | guard WER | target loops | guard loops "
        "| target insertions | s | steps | training s | CPU s |"
    )
    lines = [header, "|" + "---|" * 10]
    print(header, flush=True)
    base = {} if args.skip_baseline else None  # {}: no --eval-at-start row
    for index, run in enumerate(runs):
        result = train_once(run, sets, args, args.work_dir / f"run{index}", at_start=base is None)
        if base is None:
            base = rows_at(result, 0)
            line = _line(f"{args.model}, before fine-tuning", base, None) + " 0 | | |"
            lines.insert(2, line)
            print(line, flush=True)
        final = rows_at(result, result["steps"])
        trained = result["train_seconds"]
        line = _line(run.label, final, result["seconds"]) + (
            f" {result['steps']} | {'' if trained is None else f'{trained:.0f}'} "
            f"| {result['cpu_seconds']:.0f} |"
        )
        lines.append(line)
        print(line, flush=True)
    print()
    print("\n".join(lines))


def _line(label: str, rows: dict[str, dict], seconds: float | None) -> str:
    def pct(name: str, key: str) -> str:
        return f"{100 * rows[name][key]:.1f}"

    spent = f"{seconds:.0f}" if seconds is not None else ""
    return (
        f"| {label:<40} | {pct('target', 'wer'):>10} | {pct('guard', 'wer'):>9} | "
        f"{pct('target', 'repeated_ngram_rate'):>12} | {pct('guard', 'repeated_ngram_rate'):>11} "
        f"| {pct('target', 'insertion_rate'):>17} | {spent} |"
    )


if __name__ == "__main__":
    main()
