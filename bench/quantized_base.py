"""LoRA with its base as loaded, in 8 bits and in 4 bits (--quantize-base none, int8, nf4),
side by side on the demo's synthesised speech, for tiny.en or the multilingual base: what final/
(the model a user deploys) scores, step time and peak memory.

    PYTHONPATH=src .venv/bin/python bench/quantized_base.py --dir /tmp/quantized-base \
        [--model tiny.en|base] [--kinds none int8 nf4] [--seeds 0 1] [--train 192] \
        [--steps 24] [--batch-size 8] [--eval 40] [--real 40] [--nonspeech none|builtin]
    PYTHONPATH=src .venv/bin/python bench/quantized_base.py --dir /tmp/quantized-base \
        --merge-error run-tiny.en-nf4-0 run-tiny.en-int8-0

    PYTHONPATH=src .venv/bin/python bench/quantized_base.py --plan small large-v3
    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/quantized_base.py --peak-only \
        --dir /tmp/quantized-base [--model tiny.en|base] [--kinds none nf4] [--repeats 3] \
        [--steps 3] [--malloc glibc steptrim mmap=65536 mmap=65536,hugetlb trim=131072]

The fourth trains only (whisper-train's CPU defaults: no checkpointing; nothing scored), each
run in a fresh process, --repeats times per base and C allocator setting, and prints peak
resident memory (during the steps, and for the whole run with final/) and CPU seconds a step
(user + system of every thread; the first step apart, as it warms up), mean and spread. The
allocator settings: glibc (its defaults, as whisper-train runs), steptrim (glibc's defaults,
its free pages handed back after each step by `memory.return_freed_memory`), mmap=N (the
environment's MALLOC_MMAP_THRESHOLD_=N), trim=N (MALLOC_TRIM_THRESHOLD_=N) and hugetlb
(GLIBC_TUNABLES=glibc.malloc.hugetlb=1: transparent huge pages), joined by commas.

The third prints the planner's peak for each size's default LoRA (batch 1, full
checkpointing, bf16, AdamW, 448 label tokens) with the base as loaded, in int8 and in nf4,
from the shapes alone (the meta device: nothing is allocated).

The second form reads runs the first trained and measures what final/ avoids by merging the
adapters into the original weights: merged into the dequantized ones instead, each adapted
weight moves by its quantization error, which the table sets beside the adapters' own largest
change, and the logits move (teacher-forced on the held-out clips' transcripts).

Each run is LoRA at the default settings (every linear layer, r 32), full checkpointing, on
speech alone unless --nonspeech builtin (the default run's noise training beside it),
--steps steps of --batch-size on --train synthesised sentences, in a process of its own so that
its peak resident memory (ru_maxrss, taken when final/ is written) is its own; s/step is the
run's own "trained N steps in S s" over N. Then its final/ is scored as its user would run it:
WER on --eval held-out sentences (voices training never heard), on the guard (the default voice,
words of the whole vocabulary), on --real real recordings (../shared/realspeech), and words a
minute on the built-in non-speech set; the first row is the model as shipped. With two seeds or
more, a mean row per base follows. A row is printed as its run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

TRAINED = re.compile(r"trained (\d+) steps in ([0-9.]+) s")


def scores(model_spec: str, args) -> dict:
    """`model_spec` (a folder, tiny.en or base) as its user would run it: WER on the held-out
    voices, the guard (the default voice, words of the whole vocabulary), --real clips of real
    speech, and words a minute on the built-in non-speech set."""
    from common import REALSPEECH

    from whisper_train.data.examples import Example
    from whisper_train.data.layouts import load_examples
    from whisper_train.data.nonspeech import load_nonspeech
    from whisper_train.evaluation.evaluate import evaluate_examples
    from whisper_train.evaluation.nonspeech import evaluate_nonspeech_examples
    from whisper_train.models import load_model

    model, processor = load_model(model_spec)
    figures = {}
    for name in ("held-out", "guard"):
        examples = load_examples(args.data / name)[: args.eval]
        figures[name] = evaluate_examples(model, processor, examples, language="en").wer
    manifest = REALSPEECH / "manifest.jsonl"
    if manifest.exists() and args.real:
        rows = [json.loads(line) for line in manifest.read_text().splitlines()[: args.real]]
        real = [Example(audio=str(REALSPEECH / r["audio"]), text=r["text"]) for r in rows]
        figures["real"] = evaluate_examples(model, processor, real, language="en").wer
    report = evaluate_nonspeech_examples(model, processor, load_nonspeech("builtin"), language="en")
    figures["nonspeech_wpm"] = report.scores.words_per_minute
    return figures


def one_run(args) -> None:
    """A child: one run (or, --kind base, the model as shipped); prints one JSON line of its
    figures last. The peak is taken when train returns (final/ written), before scoring."""
    import contextlib
    import io

    from whisper_train.training.train import train

    figures = {"kind": args.kind, "seed": args.seed}
    if args.kind == "base":
        figures.update(scores(args.model, args))
        print("FIGURES " + json.dumps(figures), flush=True)
        return
    config = lora_run_config(args, gradient_checkpointing="full")
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        train(config)
    steps, seconds = TRAINED.search(said.getvalue()).groups()
    figures["step_seconds"] = float(seconds) / int(steps)
    figures["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    figures.update(scores(str(args.out / "final"), args))
    print("FIGURES " + json.dumps(figures), flush=True)


def lora_run_config(args, **settings):
    """The run both children train: the default LoRA on a base held as args.kind, speech and
    args.nonspeech, nothing scored while it trains; `settings` on top."""
    from whisper_train.config import RunConfig

    config = RunConfig()
    config.update(
        {
            "data": str(args.data / "train"),
            "model": args.model,
            "language": "en",
            "mode": "lora",
            "quantize_base": args.kind,
            "max_steps": args.steps,
            "batch_size": args.batch_size,
            "only_train": True,
            "output_dir": str(args.out),
            "overwrite": True,
            "seed": args.seed,
            "report_to": ["none"],
            "nonspeech": args.nonspeech,
            **settings,
        }
    )
    return config


def peak_run(args) -> None:
    """A child of --peak-only: train only; one JSON line of its peaks and CPU seconds a step."""
    import contextlib
    import io

    from whisper_train.memory import host
    from whisper_train.training.recipe import FineTuneRecipe
    from whisper_train.training.train import train

    step_cpu: list[float] = []
    step_peaks: list[float] = []
    train_peak: list[float] = []
    timed_step, timed_loop = FineTuneRecipe._train_step, FineTuneRecipe.train

    def cpu_seconds() -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        return own.ru_utime + own.ru_stime

    def step(recipe, micro_batches):
        before = cpu_seconds()
        try:
            return timed_step(recipe, micro_batches)
        finally:
            if args.malloc == "steptrim":
                host.return_freed_memory()
            step_cpu.append(cpu_seconds() - before)
            step_peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

    def loop(recipe):
        try:
            return timed_loop(recipe)
        finally:
            train_peak.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

    FineTuneRecipe._train_step, FineTuneRecipe.train = step, loop
    config = lora_run_config(args)  # train's CPU default: no checkpointing
    with contextlib.redirect_stdout(io.StringIO()):
        train(config)
    figures = {
        "kind": args.kind,
        "malloc": args.malloc,
        "train_peak_mib": train_peak[0],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "first_step_cpu": step_cpu[0],
        "step_cpu": sum(step_cpu[1:]) / max(1, len(step_cpu) - 1),
        "step_peaks_mib": step_peaks,
    }
    print("FIGURES " + json.dumps(figures), flush=True)


def malloc_environment(setting: str) -> dict[str, str]:
    """The child's environment for an allocator setting (`--malloc`'s)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
    }
    for part in setting.split(","):
        if part == "hugetlb":  # transparent huge pages for what malloc takes from the system
            env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
        elif "=" in part:
            name, value = part.split("=")
            env[{"mmap": "MALLOC_MMAP_THRESHOLD_", "trim": "MALLOC_TRIM_THRESHOLD_"}[name]] = value
    return env


def spread(values: list[float], digits: int) -> str:
    mean = sum(values) / len(values)
    return f"{mean:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def peak_table(args) -> None:
    """--peak-only: every (base, allocator setting) --repeats times, round-robin so that a
    busy spell of the machine falls on all of them alike."""
    print(
        f"{args.model}, LoRA defaults on the CPU (no checkpointing), batch {args.batch_size}, "
        f"{args.steps} steps, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; "
        f"{args.repeats} fresh processes each; mean (min–max)"
    )
    print(
        "| base | allocator | peak RSS, steps (MiB) | peak RSS, run (MiB) | CPU s, step 1 | "
        "CPU s/step after |"
    )
    print("|---|---|---:|---:|---:|---:|", flush=True)
    runs: dict[tuple[str, str], list[dict]] = {}
    variants = [(kind, setting) for kind in args.kinds for setting in args.malloc_settings]
    data, out = args.dir / "data", args.dir / "peak-run"
    for repeat in range(args.repeats):
        for kind, setting in variants:
            argv = [sys.executable, __file__, "--one", "--peak-only", "--data", str(data)]
            argv += ["--model", args.model, "--steps", str(args.steps), "--kind", kind]
            argv += ["--batch-size", str(args.batch_size), "--malloc", setting]
            argv += ["--nonspeech", args.nonspeech, "--out", str(out)]
            shutil.rmtree(out, ignore_errors=True)  # a run's final/ each, none kept
            done = subprocess.run(
                argv, capture_output=True, text=True, env=malloc_environment(setting)
            )
            if done.returncode != 0:
                raise SystemExit(f"{argv}: exit {done.returncode}\n{done.stderr[-3000:]}")
            line = next(x for x in done.stdout.splitlines()[::-1] if x.startswith("FIGURES "))
            f = json.loads(line.removeprefix("FIGURES "))
            runs.setdefault((kind, setting), []).append(f)
            print(
                f"<!-- {repeat} {kind} {setting}: {f['train_peak_mib']:.0f} "
                f"{f['peak_rss_mib']:.0f} {f['first_step_cpu']:.2f} {f['step_cpu']:.2f}; "
                f"peak after each step {' '.join(f'{x:.0f}' for x in f['step_peaks_mib'])} -->",
                flush=True,
            )
    for (kind, setting), done in runs.items():
        print(
            f"| {kind} | {setting} | {spread([f['train_peak_mib'] for f in done], 0)} | "
            f"{spread([f['peak_rss_mib'] for f in done], 0)} | "
            f"{spread([f['first_step_cpu'] for f in done], 2)} | "
            f"{spread([f['step_cpu'] for f in done], 2)} |"
        )


def dequantized(weight, kind: str):
    """`weight` through bitsandbytes' `kind` and back, as merging into the quantized layer
    would start from."""
    import bitsandbytes as bnb
    import torch

    if kind == "nf4":
        held = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4")
        held = held.to("cpu")
        return bnb.functional.dequantize_4bit(held.data, held.quant_state).to(torch.float32)
    held = bnb.nn.Int8Params(weight.clone(), requires_grad=False, has_fp16_weights=False)
    held = held.to("cpu")
    return held.data.float() * held.SCB.float()[:, None] / 127.0


def merge_error(run_dir: Path, data_dir: Path, clips: int = 8) -> str:
    """A table row: dequantize-then-merge against final/'s merge into the original weights."""
    import copy
    import csv

    import torch

    from whisper_train.audio import load_audio
    from whisper_train.config.record import RunRecord
    from whisper_train.memory.quantize import base_linears
    from whisper_train.models import load_model

    record = RunRecord.from_yaml((run_dir / "whisper-train.yaml").read_text())
    kind = record.model.quantize_base
    final, processor = load_model(str(run_dir / "final"))
    base, _ = load_model(record.model.model)
    other = copy.deepcopy(final)
    rounding = change = 0.0
    with torch.no_grad():
        layers = zip(base_linears(base), base_linears(final), base_linears(other), strict=True)
        for original, merged, into_dequantized in layers:
            w = original.weight
            rounded = dequantized(w, kind)
            into_dequantized.weight.copy_(merged.weight - w + rounded)
            rounding = max(rounding, (rounded - w).abs().max().item())
            change = max(change, (merged.weight - w).abs().max().item())
    with (data_dir / "held-out" / "metadata.csv").open(encoding="utf-8") as file:
        rows = list(csv.DictReader(file))[:clips]
    audio = [load_audio(data_dir / "held-out" / row["file_name"]) for row in rows]
    features = processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt")
    ids = [processor.tokenizer(row["transcription"]).input_ids for row in rows]
    width = min(map(len, ids))
    decoder_ids = torch.tensor([i[:width] for i in ids])
    with torch.no_grad():
        a = final.eval()(input_features=features.input_features, decoder_input_ids=decoder_ids)
        b = other.eval()(input_features=features.input_features, decoder_input_ids=decoder_ids)
    logits, moved = a.logits, (a.logits - b.logits).abs()
    agree = (a.logits.argmax(-1) == b.logits.argmax(-1)).float().mean().item()
    return (
        f"| {run_dir.name} | {kind} | {change:.2e} | {rounding:.2e} | {moved.max().item():.2f} "
        f"(logits' std {logits.std().item():.2f}) | {100 * agree:.1f}% |"
    )


def plan_rows(sizes: list[str], kinds: list[str]) -> None:
    """The planner's estimate per size and base, by term, in GiB."""
    import torch
    from activation_memory import whisper_config
    from transformers import WhisperForConditionalGeneration

    from whisper_train.memory import LoraSettings, estimate_memory, prepare_model

    gib = 2**30
    print("| model | base | planned peak | weights | gradients + AdamW | activations | working |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for size in sizes:
        with torch.device("meta"):
            model = WhisperForConditionalGeneration(whisper_config(size))
        model.config._attn_implementation = "sdpa"
        model = prepare_model(model, mode="lora", checkpointing="full", lora=LoraSettings())
        for kind in kinds:
            e = estimate_memory(model, policy="full", precision="bf16", quantize_base=kind)
            print(
                f"| {size} | {kind} | {e.total / gib:.2f} | {e.weights / gib:.2f} | "
                f"{(e.gradients + e.optimizer) / gib:.2f} | {e.activations / gib:.2f} | "
                f"{e.working / gib:.2f} |",
                flush=True,
            )


def planned_mib(model: str, kinds: list[str], batch_size: int) -> dict[str, float]:
    """The planner's peak for this bench's runs (the default LoRA, full checkpointing, fp32,
    AdamW, `batch_size` clips of up to 448 label tokens), per base, in MiB: what it counts
    for the step (weights, gradients, optimizer, activations, working buffers), not the
    process's own (the Python and torch runtime, the data), which RSS adds."""
    import torch
    from activation_memory import whisper_config
    from transformers import WhisperForConditionalGeneration

    from whisper_train.memory import LoraSettings, estimate_memory, prepare_model

    with torch.device("meta"):
        whisper = WhisperForConditionalGeneration(whisper_config(model.removesuffix(".en")))
    whisper.config._attn_implementation = "sdpa"
    whisper = prepare_model(whisper, mode="lora", checkpointing="full", lora=LoraSettings())
    return {
        kind: estimate_memory(
            whisper, policy="full", batch_size=batch_size, quantize_base=kind
        ).total
        / 2**20
        for kind in kinds
    }


def child(args, **extra) -> dict:
    argv = [sys.executable, __file__, "--one", "--data", str(args.dir / "data")]
    for option in ("model", "steps", "batch_size", "eval", "real", "nonspeech"):
        argv += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    for key, value in extra.items():
        argv += [f"--{key}", str(value)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{argv}: exit {done.returncode}\n{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines()[::-1] if x.startswith("FIGURES "))
    return json.loads(line.removeprefix("FIGURES "))


def pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def row(f: dict) -> str:
    trained = "–" if "step_seconds" not in f else f"{f['step_seconds']:.2f}"
    peak = "–" if "peak_rss_mib" not in f else f"{f['peak_rss_mib']:.0f}"
    return (
        f"| {f['kind']} | {f['seed'] if f['kind'] != 'base' else '–'} | {pct(f['held-out'])} | "
        f"{pct(f['guard'])} | {pct(f.get('real'))} | {f['nonspeech_wpm']:.1f} | {trained} | "
        f"{peak} |"
    )


def mean_row(runs: list[dict]) -> str:
    keys = ("held-out", "guard", "real", "nonspeech_wpm", "step_seconds", "peak_rss_mib")
    mean = {"kind": f"{runs[0]['kind']} (mean)", "seed": "–"}
    for key in keys:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            mean[key] = sum(values) / len(values)
    return row(mean)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/quantized-base"))
    parser.add_argument("--model", default="tiny.en", help="tiny.en or base (multilingual)")
    parser.add_argument("--kinds", nargs="*", default=["none", "int8", "nf4"])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--train", type=int, default=192, help="training sentences")
    parser.add_argument("--eval", type=int, default=40, help="held-out and guard sentences")
    parser.add_argument("--real", type=int, default=40, help="real recordings scored")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--nonspeech",
        default="none",
        help="none (speech only), or builtin: the default run's noise training beside it",
    )
    parser.add_argument(
        "--no-shipped", action="store_true", help="leave out the row of the model as shipped"
    )
    parser.add_argument("--plan", nargs="*", metavar="SIZE", help="planned peaks, e.g. large-v3")
    parser.add_argument(
        "--peak-only", action="store_true", help="train only: peak memory and CPU s a step"
    )
    parser.add_argument("--repeats", type=int, default=3, help="--peak-only: runs per variant")
    parser.add_argument(
        "--malloc",
        dest="malloc_settings",
        nargs="*",
        default=["glibc", "mmap=65536"],
        help="--peak-only: C allocator settings (glibc, steptrim, mmap=N, trim=N, hugetlb; a,b)",
    )
    parser.add_argument(
        "--merge-error", nargs="*", metavar="RUN", help="runs (under --dir) to measure merging on"
    )
    # a child's own options
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one and args.peak_only:
        args.malloc = args.malloc_settings[0]
        peak_run(args)
        return
    if args.one:
        one_run(args)
        return
    if args.plan:
        plan_rows(args.plan, args.kinds)
        return
    if args.merge_error:
        print(
            "| run | base | adapters' largest change to a weight | dequantize-then-merge: "
            "largest weight moved | largest logit moved | same argmax |"
        )
        print("|---|---|---:|---:|---:|---:|")
        for run in args.merge_error:
            print(merge_error(args.dir / run, args.dir / "data"), flush=True)
        return
    from whisper_train.demo import prepare_demo_data

    started = time.perf_counter()
    if args.peak_only:
        prepare_demo_data(
            args.dir / "data",
            train_utterances=args.batch_size * args.steps,
            eval_utterances=8,
            guard_utterances=8,
            seed=0,
        )
        peak_table(args)
        print(f"\n{time.perf_counter() - started:.0f} s in all")
        return
    prepare_demo_data(
        args.dir / "data",
        train_utterances=args.train,
        eval_utterances=args.eval,
        guard_utterances=args.eval,
        seed=0,
    )
    print(
        f"{args.model}, LoRA defaults, batch {args.batch_size}, {args.steps} steps, full "
        f"checkpointing, {args.train} training sentences, --nonspeech {args.nonspeech}; final/ "
        "scored (WER %, non-speech words a minute)"
    )
    print("| base | seed | held-out | guard | real speech | non-speech | s/step | peak RSS (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    if not args.no_shipped:
        print(row(child(args, kind="base")), flush=True)
    runs: dict[str, list[dict]] = {kind: [] for kind in args.kinds}
    for seed, kind in ((seed, kind) for seed in args.seeds for kind in args.kinds):
        f = child(args, kind=kind, seed=seed, out=args.dir / f"run-{args.model}-{kind}-{seed}")
        runs[kind].append(f)
        print(row(f), flush=True)
    if len(args.seeds) > 1:
        for kind in args.kinds:
            print(mean_row(runs[kind]), flush=True)
    planned = planned_mib(args.model, args.kinds, args.batch_size)
    print("\n| base | planned step peak (MiB) | vs none | measured peak RSS vs none (mean) |")
    print("|---|---:|---:|---:|")
    measured = {k: sum(r["peak_rss_mib"] for r in v) / len(v) for k, v in runs.items() if v}
    for kind in args.kinds:
        saved = measured.get(kind, 0) - measured.get("none", 0) if "none" in measured else None
        print(
            f"| {kind} | {planned[kind]:.0f} | {planned[kind] - planned.get('none', 0):+.0f} | "
            f"{'–' if saved is None else f'{saved:+.0f}'} |"
        )
    print(f"\n{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
