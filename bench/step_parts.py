"""Where an unpacked full fine-tuning step goes: whisper-train's loop and the Seq2SeqTrainer's,
part by part, at several batch sizes (issue 32's fifth deliverable).

    OMP_NUM_THREADS=1 .venv/bin/python bench/step_parts.py [--model tiny.en] [--batch-sizes 4 8 16]
        [--clips 32] [--rounds 2] [--threads 1]

Each run is bench/throughput.py's (scenario full, `--packing off`, the same model folder and
clips, fp32, checkpointing off, one epoch, AdamW, clip 1.0) in a process of its own, with a
timer (CPU seconds of the process, `time.process_time`: robust to other jobs, as throughput.py
argues) around each part. Parts both loops run, wrapped at their class or module:

  forward     the forward and the loss: whisper-train's `memory.loss_terms`, the Trainer's
              `compute_loss`
  backward    `Accelerator.backward`
  clip        `Accelerator.clip_grad_norm_`
  optimizer   `AcceleratedOptimizer.step` (AdamW's update)

and whisper-train's own: `step_loss_weights` (the token-weight pass before the first forward),
`_read_loss_and_norm` (the step's one read of the loss and the norm back to the host) and
`_after_step` (its log line, the weight check, the stop check). "data and the rest" is the
loop's time less those: the loaders' reads, features and collation (the Trainer's features
are computed before its loop, by `dataset.map`, shown as "features beforehand"), moves to the
device, the loops' own bookkeeping. Runs alternate (whisper-train, Trainer, ...); each figure is
CPU milliseconds a step, the median over the rounds. CPU only: on CUDA, where the host waits
for the device, CPU seconds are not the step's time (bench/gpu_loop_profile.py times it there).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402

SHARED_PARTS = ("forward", "backward", "clip", "optimizer")
OWN_PARTS = ("token weights", "read back", "after step")
PARTS = (*SHARED_PARTS, *OWN_PARTS, "data and the rest")


def timed(owner, name: str, part: str, seconds: dict[str, float]) -> None:
    """Replace `owner.name` by a wrapper adding its CPU seconds to `seconds[part]`."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            seconds[part] = seconds.get(part, 0.0) + time.process_time() - start

    setattr(owner, name, wrapper)


def worker(args) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    torch.set_num_threads(args.threads)
    seconds: dict[str, float] = {}
    timed(Accelerator, "backward", "backward", seconds)
    timed(Accelerator, "clip_grad_norm_", "clip", seconds)
    timed(AcceleratedOptimizer, "step", "optimizer", seconds)
    if args.worker == "trainer":
        from transformers import Seq2SeqTrainer

        timed(Seq2SeqTrainer, "compute_loss", "forward", seconds)
        result = throughput.run_seq2seq_trainer(args)
    else:
        from whisper_train.training import recipe

        timed(recipe, "loss_terms", "forward", seconds)
        timed(recipe, "step_loss_weights", "token weights", seconds)
        timed(recipe, "_read_loss_and_norm", "read back", seconds)
        timed(recipe.FineTuneRecipe, "_after_step", "after step", seconds)
        result = throughput.run_whisper_train(args)
    steps = math.ceil(args.clips / args.batch_size)
    parts = {part: 1e3 * value / steps for part, value in seconds.items()}
    parts["data and the rest"] = 1e3 * result["loop_s"] / steps - sum(parts.values())
    result.update(steps=steps, ms_per_step=1e3 * result["loop_s"] / steps, parts=parts)
    print("RESULT " + json.dumps(result), flush=True)


def launch(args, system: str, batch_size: int) -> dict:
    command = [
        sys.executable, __file__, "--worker", system, "--batch-size", str(batch_size),
        "--clips", str(args.clips), "--threads", str(args.threads),
        "--manifest", args.manifest, "--model-dir", args.model_dir, "--workdir", args.workdir,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    match = re.search(r"^RESULT (.*)$", done.stdout, flags=re.MULTILINE)
    if not match:
        sys.exit(
            f"{system} batch {batch_size} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return json.loads(match.group(1))


def report(batch_size: int, runs: dict[str, list[dict]]) -> None:
    def median(system: str, key: str) -> float:
        values = [r["parts"].get(key, 0.0) if key in PARTS else r[key] for r in runs[system]]
        return statistics.median(values)

    ours, theirs = median("whisper-train", "ms_per_step"), median("trainer", "ms_per_step")
    each = {system: ", ".join(f"{r['ms_per_step']:.0f}" for r in rs) for system, rs in runs.items()}
    print(
        f"\nbatch {batch_size}, {runs['trainer'][0]['steps']} steps a run, CPU ms a step (median "
        f"of {len(runs['trainer'])}; whisper-train's runs {each['whisper-train']}, the "
        f"Trainer's {each['trainer']})"
    )
    print("| part | whisper-train | Trainer | difference |")
    print("|---|---:|---:|---:|")
    for part in PARTS:
        a, b = median("whisper-train", part), median("trainer", part)
        print(f"| {part} | {a:.1f} | {b:.1f} | {a - b:+.1f} |")
    print(f"| **the step** | **{ours:.1f}** | **{theirs:.1f}** | {ours - theirs:+.1f} |")
    features = statistics.median(r["features_s"] for r in runs["trainer"])
    steps = runs["trainer"][0]["steps"]
    print(f"| features beforehand (Trainer) | | {1e3 * features / steps:.1f} | |")
    per_step = 1e3 * features / steps
    print(f"speed, whisper-train / Trainer: {theirs / ours:.2f}x (the loops); "
          f"{(theirs + per_step) / ours:.2f}x counting the Trainer's features")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--clips", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", choices=["whisper-train", "trainer"])
    parser.add_argument("--manifest")
    parser.add_argument("--model-dir")
    parser.add_argument("--workdir")
    args = parser.parse_args()
    if args.worker:  # throughput.py's run_* read these fields
        vars(args).update(scenario="full", epochs=1, checkpointing="off", packing="off",
                          num_workers=-1, compile="off")  # fmt: skip
        worker(args)
        return
    import platform

    import torch

    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"{args.threads} thread(s) a run")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        args.manifest = str(throughput.write_manifest(folder, args.clips))
        args.model_dir = str(throughput.save_model(folder / "model", 0, 0, args.model))
        args.workdir = str(folder)
        for batch_size in args.batch_sizes:
            runs: dict[str, list[dict]] = {"whisper-train": [], "trainer": []}
            for _ in range(args.rounds):
                for system in runs:
                    runs[system].append(launch(args, system, batch_size))
            report(batch_size, runs)


if __name__ == "__main__":
    main()
