"""Where a training step's time goes on the GPU: the model alone, eager and compiled, by batch.

    python3 bench/gpu_profile.py [--size small] [--batches 16,32] [--label-tokens 32]
        [--compile] [--profile]

whisper-train's step without its data path: a random model of the published shape through
`memory.prepare_model` (full fine-tune, checkpointing off), bf16 autocast, fused AdamW,
`memory.training_loss`, on random full 30-s inputs already on the device. Each row times 10
steps after 3 warm-up steps (wall time, synchronised) and gives MFU by docs/compute.md's formula
(`memory.plan.model_flops_per_sample`, x3 for training) against --peak-tflops (989: H100/H200
SXM dense bf16). Comparing these rows with bench/throughput.py's loop times separates the
model's cost from the data path's. --profile prints torch.profiler's top CUDA kernels and CPU
operators for 3 eager steps at the first batch size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import WhisperForConditionalGeneration  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from activation_memory import whisper_config  # noqa: E402

from whisper_train import memory
from whisper_train.memory.plan import model_flops_per_sample  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def build(size: str, layers: int | None) -> torch.nn.Module:
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(whisper_config(size, layers))
    model.config._attn_implementation = "sdpa"
    model = model.to_empty(device=DEVICE)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
    return memory.prepare_model(model, mode="full", checkpointing="off").train()


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def stepper(model, batch_size: int, label_tokens: int, compiled: bool):
    optimizer = memory.build_optimizer(model, name="adamw", lr=1e-5)
    forward_model = torch.compile(model) if compiled else model
    mels = model.config.num_mel_bins
    tokens = torch.randint(0, 50000, (batch_size, label_tokens), device=DEVICE)
    batch = {
        "input_features": torch.randn(batch_size, mels, 3000, device=DEVICE),
        "decoder_input_ids": tokens,
        "labels": tokens,
    }

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = memory.training_loss(forward_model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--layers", type=int, help="fewer layers (a CPU dry run)")
    parser.add_argument("--batches", default="16,32")
    parser.add_argument("--label-tokens", type=int, default=32)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument(
        "--compile", action="store_true", help="also time torch.compile'd (first batch size)"
    )
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (dry run)"
    print(
        f"device: {name}, torch {torch.__version__}; whisper-{args.size} shape, full "
        f"fine-tune, checkpointing off, bf16, fused AdamW, {args.label_tokens} label tokens"
    )
    print(f"{'mode':<10}{'batch':>6}{'ms/step':>9}{'clips/s':>9}{'MFU':>7}{'peak GiB':>10}")
    model = build(args.size, args.layers)
    train_flops = 3 * model_flops_per_sample(model.config, label_tokens=args.label_tokens)
    modes = ["eager"] + (["compiled"] if args.compile else [])
    batches = [int(b) for b in args.batches.split(",")]
    for mode in modes:
        # Compiled at the first batch size only: each further shape is another compilation.
        for batch_size in batches if mode == "eager" else batches[:1]:
            step = stepper(model, batch_size, args.label_tokens, mode == "compiled")
            start = time.perf_counter()
            for _ in range(3):
                step()
            synchronize()
            warm_s = time.perf_counter() - start
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            synchronize()
            seconds = (time.perf_counter() - start) / args.steps
            mfu = batch_size * train_flops / seconds / (args.peak_tflops * 1e12)
            peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
            print(
                f"{mode:<10}{batch_size:>6}{seconds * 1e3:>9.1f}{batch_size / seconds:>9.1f}"
                f"{100 * mfu:>6.1f}%{peak:>10.2f}   (warm-up {warm_s:.0f} s)",
                flush=True,
            )
    if args.profile:
        batch_size = int(args.batches.split(",")[0])
        step = stepper(model, batch_size, args.label_tokens, compiled=False)
        step()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if DEVICE == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profiler:
            for _ in range(3):
                step()
            synchronize()
        sort = "self_cuda_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
        print(profiler.key_averages().table(sort_by=sort, row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
