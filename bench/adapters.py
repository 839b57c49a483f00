"""DoRA and rsLoRA against LoRA, and --average-checkpoints against the best single step, on the
demo's sets (tiny.en, synthesised speech: `whisper-train demo`'s data and settings).

    PYTHONPATH=src .venv/bin/python bench/adapters.py --dir /tmp/adapters \
        [--variants lora dora] [--seeds 0 1] [--average-seeds 0 1] [--average 3 --every 6] [--fast]
    PYTHONPATH=src .venv/bin/python bench/adapters.py --dir /tmp/adapters --step-time 5 \
        --variants lora dora rslora

Each run is the demo's (`demo.run_demo`'s options: 192 training sentences, batch 8, one epoch,
held-out and guard sets scored before step 1 and at the end) in a process of its own, so that
its peak resident memory (ru_maxrss) is its own. Variants: the default LoRA settings with
--lora-variant set. Averaging: LoRA at the default settings with a checkpoint and an
evaluation every --every steps, the last --average checkpoints averaged at the end; the table
gives the judge's best single step and the average, each with held-out and guard WER, and which
one final/ kept. A row is printed as its run ends.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from whisper_train.config import RunConfig
from whisper_train.demo import MAX_TOKENS, prepare_demo_data
from whisper_train.training.final import FinalRule, choose_final_step
from whisper_train.training.train import train

TRAINED = re.compile(r"trained (\d+) steps in ([0-9.]+) s")


class Tee:
    """Writes to the real stream and keeps a copy (the run's 'trained N steps in S s')."""

    def __init__(self, stream):
        self.stream, self.text = stream, []

    def write(self, text):
        self.text.append(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def one_run(args) -> None:
    """A child: one demo run; prints one JSON line of its figures last."""
    data = {name: args.data / name for name in ("train", "held-out", "guard")}
    config = RunConfig()
    settings = {
        "data": str(data["train"]),
        "eval_data": [f"held-out={data['held-out']}", f"guard={data['guard']}"],
        "guard": "guard",
        "model": "tiny.en",
        "mode": "lora",
        "lora_variant": args.variant,
        "epochs": 1,
        "batch_size": 8,
        "warmup_steps": 10,
        "logging_steps": 8,
        "generation_max_length": MAX_TOKENS,
        "output_dir": str(args.out),
        "overwrite": True,
        "seed": args.seed,
        "report_to": ["none"],
        # the speech alone, as the first rows (before --nonspeech auto was the default) trained
        "nonspeech": "none",
    }
    if args.fast:  # no guard (so no evaluation before step 1), decoded greedily only
        del settings["guard"]
        settings["temperatures"] = "0"
    if args.average:
        settings.update(
            save_steps=args.every,
            eval_steps=args.every,
            average_checkpoints=args.average,
            # every checkpoint kept, so that `whisper-train average` can average others later
            save_total_limit=max(args.average, args.keep),
        )
    config.update(settings)
    tee = Tee(sys.stdout)
    sys.stdout = tee
    result = train(config)
    sys.stdout = tee.stream
    steps, seconds = TRAINED.search("".join(tee.text)).groups()
    rows = result.evaluations
    single = [r for r in rows if not r.get("averaged")]
    evaluation = result.record["evaluation"]
    rule = FinalRule("held-out", evaluation["guard"], evaluation["max_regression"])
    best = choose_final_step(single, rule).step

    def wer(name, step, averaged=None):
        found = [
            r["wer"]
            for r in rows
            if r["set"] == name and r["step"] == step and r.get("averaged") == averaged
        ]
        return found[-1] if found else None

    averaged = next((r["averaged"] for r in rows if r.get("averaged")), None)
    figures = {
        "variant": args.variant,
        "seed": args.seed,
        "steps": int(steps),
        "step_seconds": float(seconds) / int(steps),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "start": {n: wer(n, 0) for n in ("held-out", "guard")},
        "best_step": best,
        "best": {n: wer(n, best) for n in ("held-out", "guard")},
        "averaged_steps": averaged,
        "average": {n: wer(n, result.final_step, averaged) for n in ("held-out", "guard")}
        if averaged
        else None,
        "last": {n: wer(n, int(steps)) for n in ("held-out", "guard")},
        "kept": "average" if result.final_averaged else f"step {result.final_step}",
    }
    print("FIGURES " + json.dumps(figures), flush=True)


def step_figures(data_dir: Path, variants: list[str], *, clips: int, repeats: int) -> None:
    """Per variant, on the real tiny.en with the default LoRA settings: the seconds of one
    optimizer step (forward, backward, AdamW) on `clips` training clips in 30-s windows (as
    --packing off batches them; medians of `repeats`, the variants interleaved so that a shared
    machine's load falls on each alike) and the bytes the forward keeps for backward
    (`memory.probe`, no checkpointing: a CPU's default)."""
    import csv
    import statistics

    import torch

    from whisper_train.audio import load_audio
    from whisper_train.memory import LoraSettings, build_optimizer, prepare_model, training_loss
    from whisper_train.memory.probe import probe_saved_bytes
    from whisper_train.models import load_model

    with (data_dir / "train" / "metadata.csv").open(encoding="utf-8") as file:
        rows = list(csv.DictReader(file))[:clips]
    models, optimizers, batch = {}, {}, None
    for variant in variants:
        torch.manual_seed(0)
        model, processor = load_model("tiny.en")
        model = prepare_model(model, mode="lora", lora=LoraSettings(variant=variant)).train()
        models[variant] = model
        optimizers[variant] = build_optimizer(model, lr=1.5e-4)
    audio = [load_audio(data_dir / "train" / row["file_name"]) for row in rows]
    features = processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt")
    ids = [processor.tokenizer(row["transcription"]).input_ids for row in rows]
    longest = max(map(len, ids))
    eot = processor.tokenizer.eos_token_id
    inputs = torch.tensor([i[:-1] + [eot] * (longest - len(i)) for i in ids])
    labels = torch.tensor([i[1:] + [-100] * (longest - len(i)) for i in ids])
    batch = {
        "input_features": features.input_features,
        "decoder_input_ids": inputs,
        "labels": labels,
    }
    seconds = {variant: [] for variant in variants}
    for repeat in range(repeats + 1):  # the first of each is a warm-up
        for variant in variants:
            started = time.perf_counter()
            training_loss(models[variant], batch).backward()
            optimizers[variant].step()
            optimizers[variant].zero_grad(set_to_none=True)
            if repeat:
                seconds[variant].append(time.perf_counter() - started)
    print(f"| variant | s/step ({clips} clips) | kept for backward (MiB) | trainable parameters |")
    print("|---|---:|---:|---:|")
    for variant, model in models.items():
        kept = probe_saved_bytes(model, batch["input_features"], batch["decoder_input_ids"])
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(
            f"| {variant} | {statistics.median(seconds[variant]):.2f} | {kept / 2**20:.0f} | "
            f"{trainable:,} |",
            flush=True,
        )


def child(args, **extra) -> dict:
    argv = [sys.executable, __file__, "--one", "--data", str(args.dir / "data")]
    argv += ["--fast"] * args.fast
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{argv}: exit {done.returncode}\n{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines()[::-1] if x.startswith("FIGURES "))
    return json.loads(line.removeprefix("FIGURES "))


def pct(value) -> str:
    return "–" if value is None else f"{100 * value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/adapters"))
    parser.add_argument("--variants", nargs="*", default=["lora", "dora"])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0], help="the variants' runs'")
    parser.add_argument("--average-seeds", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--average", type=int, default=None, help="checkpoints averaged (3)")
    parser.add_argument("--every", type=int, default=6)
    parser.add_argument(
        "--average-variants",
        nargs="*",
        default=["lora"],
        help="the variants the averaging runs train (each on every --average-seeds seed)",
    )
    parser.add_argument("--keep", type=int, default=4, help="checkpoints an averaging run keeps")
    parser.add_argument(
        "--fast",
        action="store_true",
        help="the sets scored at the end only, greedily (no guard veto, no temperature "
        "fallback): for a machine shared with other work",
    )
    parser.add_argument(
        "--step-time",
        type=int,
        default=0,
        metavar="REPEATS",
        help="only each variant's step time (median of REPEATS) and activations kept",
    )
    # a child's own options
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="lora", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one_run(args)
        return
    if args.step_time:
        prepare_demo_data(
            args.dir / "data", train_utterances=192, eval_utterances=40, guard_utterances=40, seed=0
        )
        step_figures(args.dir / "data", args.variants, clips=8, repeats=args.step_time)
        return
    started = time.perf_counter()
    prepare_demo_data(
        args.dir / "data", train_utterances=192, eval_utterances=40, guard_utterances=40, seed=0
    )
    print("| variant | seed | held-out WER | guard WER | s/step | peak RSS (MiB) |")
    print("|---|---:|---:|---:|---:|---:|", flush=True)
    for seed, variant in ((seed, variant) for seed in args.seeds for variant in args.variants):
        f = child(args, variant=variant, seed=seed, out=args.dir / f"run-{variant}-{seed}")
        print(
            f"| {variant} | {seed} | {pct(f['start']['held-out'])} → {pct(f['best']['held-out'])} | "
            f"{pct(f['start']['guard'])} → {pct(f['best']['guard'])} | "
            f"{f['step_seconds']:.2f} | {f['peak_rss_mib']:.0f} |",
            flush=True,
        )
    print()
    print(
        "| variant | seed | start held-out / guard WER | last step's | best single step | "
        "its held-out / guard WER | average of steps | its held-out / guard WER | final/ kept |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---:|---|", flush=True)
    for seed in args.average_seeds:
        for variant in args.average_variants:
            f = child(
                args,
                variant=variant,
                seed=seed,
                out=args.dir / f"run-average-{variant}-{seed}",
                average=args.average or 3,
                every=args.every,
                keep=args.keep,
            )
            average = f["average"] or {}
            print(
                f"| {variant} | {seed} | {pct(f['start']['held-out'])} / "
                f"{pct(f['start']['guard'])} | {pct(f['last']['held-out'])} / "
                f"{pct(f['last']['guard'])} | {f['best_step']} | {pct(f['best']['held-out'])} / "
                f"{pct(f['best']['guard'])} | {f['averaged_steps']} | "
                f"{pct(average.get('held-out'))} / {pct(average.get('guard'))} | {f['kept']} |",
                flush=True,
            )
    print(f"\n{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
