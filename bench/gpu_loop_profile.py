"""Where whisper-train's training loop spends a step beyond the model's own forward and backward.

    python3 bench/gpu_loop_profile.py [--repeat 20] [--batch-size 16] [--num-workers 0]

bench/throughput.py's unpacked AN4 run (a random whisper-small-shaped model, bf16, checkpointing
off, 1.0-s clips) with each step split into the three parts of `FineTuneRecipe.train`'s loop,
timed with the device synchronised at each boundary (wall ms, median over the steps after the
first 5): waiting for the next step's micro-batches (data), `_train_step` (moves, forwards,
backwards, clip, optimizer) and `_after_step` (log, weight check, stop check). Then
torch.profiler over 5 steps, the top CPU operators. bench/gpu_profile.py gives the model's own
step for comparison. Needs ../shared/realspeech or WHISPER_TRAIN_REALSPEECH (AN4 clips).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402

from whisper_train.config import RunConfig  # noqa: E402
from whisper_train.training import recipe
from whisper_train.training.train import train  # noqa: E402


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    parts: dict[str, list[float]] = {"data": [], "train_step": [], "after_step": []}
    profiled: list = []
    real_train_step = recipe.FineTuneRecipe._train_step
    real_after_step = recipe.FineTuneRecipe._after_step
    clock = {"mark": 0.0}

    def timed(name, function):
        def wrapper(self, *a, **k):
            synchronize()
            start = time.perf_counter()
            parts["data"].append(start - clock["mark"])
            result = function(self, *a, **k)
            synchronize()
            parts[name].append(time.perf_counter() - start)
            clock["mark"] = time.perf_counter()
            return result

        return wrapper

    def train_step(self, micro_batches):
        return timed("train_step", real_train_step)(self, micro_batches)

    def after_step(self, step):
        result = real_after_step(self, step)
        synchronize()
        parts["after_step"].append(time.perf_counter() - clock["mark"])
        clock["mark"] = time.perf_counter()
        if profiled:
            profiled[0].step()
        return result

    recipe.FineTuneRecipe._train_step = train_step
    recipe.FineTuneRecipe._after_step = after_step
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=10, warmup=2, active=5, repeat=1),
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        manifest, clips, _ = throughput.set_manifest(folder, "an4", args.repeat)
        model_dir = throughput.save_model(folder / "model", args.d_model, args.layers, None)
        config = RunConfig()
        config.update(
            {
                "data": str(manifest),
                "model": str(model_dir),
                "gradient_checkpointing": "off",
                "precision": "auto",
                "batch_size": args.batch_size,
                "epochs": 1,
                "only_train": True,
                "eval_split": 0.0,
                "output_dir": str(folder / "out"),
                "max_grad_norm": 1.0,
                "learning_rate": 1e-5,
                "seed": 0,
                "num_workers": args.num_workers,
            }
        )
        with profiler:
            profiled.append(profiler)
            clock["mark"] = time.perf_counter()
            train(config)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(
        f"device: {device}; {clips} AN4 clips, batch {args.batch_size}, "
        f"{args.num_workers} workers; d_model {args.d_model}, {args.layers}+{args.layers} layers"
    )
    # The wait before each step (the first includes the loop's start-up); steady state after 5.
    steady = {"data": parts["data"][5:], **{k: parts[k][5:] for k in ("train_step", "after_step")}}
    total = 0.0
    for name, values in steady.items():
        median = statistics.median(values) * 1e3 if values else float("nan")
        total += median
        print(f"  {name:<11} median {median:7.1f} ms over {len(values)} steps")
    print(f"  {'step':<11} median sum {total:7.1f} ms")
    print(json.dumps({k: [round(v * 1e3, 1) for v in vs[:8]] for k, vs in steady.items()}))
    print(
        profiler.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70
        )
    )


if __name__ == "__main__":
    main()
