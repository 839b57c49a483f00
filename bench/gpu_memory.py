"""Peak device memory of whole training steps against the memory planner's estimate.

    python3 bench/gpu_memory.py [--sizes small,medium,large-v3] [--policies off,every-2,encoder,full]
        [--label-tokens 64] [--no-targets]

Randomly initialised models of the published shapes (bench/activation_memory.SIZES), batch 1,
the full 30-s input (3000 frames), --label-tokens decoder positions, bf16 autocast (weights and
optimiser state float32, as whisper-train trains). Each row builds its model afresh and runs two
optimiser steps (`memory.prepare_model`, `memory.training_loss`, `memory.build_optimizer`: the
recipe's own pieces); `measured` is `torch.cuda.max_memory_allocated()` over the second step,
when the optimiser state exists, and `estimate` is `memory.plan.estimate_memory(...).total` for
the same model, policy, precision and optimiser (goal: within 15%).

Rows:
  full fine-tune, adamw, every size x policy        the planner against the device
  small, full fine-tune, full, adamw8bit            goal < 4 GB (a GTX 980's memory)
  large-v3, LoRA r=64 alpha 128 on q_proj,v_proj,
    full checkpointing, adamw                        goal < 10 GB (Unsloth's T4 notebook: 10.35)
  large-v3, whisper-train's LoRA default (r 32,
    alpha 64, every linear layer), full, adamw       the same goal, for the shipped default

Without CUDA the rows print the estimate only (a dry run of the code on the CPU, small sizes).
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
from whisper_train.memory import LoraSettings  # noqa: E402
from whisper_train.memory import plan as planner  # noqa: E402

GIB = 2**30
LARGE_V3_LORA = LoraSettings(r=64, alpha=128, dropout=0.0, targets=("q_proj", "v_proj"))


def build(size: str, device: str, *, mode: str, policy: str, lora: LoraSettings) -> torch.nn.Module:
    """Random weights of `size` on `device` (no per-module initialisation: shapes matter); on
    the meta device, shapes only."""
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(whisper_config(size))
    model.config._attn_implementation = "sdpa"
    if device != "meta":
        model = model.to_empty(device=device)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.normal_(0.0, 0.02)
    lora = lora if mode == "lora" else None
    return memory.prepare_model(model, mode=mode, checkpointing=policy, lora=lora).train()


def measured_peak(model, device: str, optimizer_name: str, label_tokens: int) -> int | None:
    """Peak allocated bytes over the second of two bf16 training steps (None on a CPU)."""
    optimizer = memory.build_optimizer(model, name=optimizer_name, lr=1e-5)
    mels = model.config.num_mel_bins
    generator = torch.Generator(device).manual_seed(0)
    batch = {
        "input_features": torch.randn(1, mels, 3000, device=device, generator=generator),
        "decoder_input_ids": torch.randint(
            0, 50000, (1, label_tokens), device=device, generator=generator
        ),
    }
    batch["labels"] = batch["decoder_input_ids"].clone()
    peak = None
    for step in range(2):
        if device == "cuda" and step == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = memory.training_loss(model, batch)
        loss.backward()
        optimizer.step()
        if not torch.isfinite(loss):
            raise SystemExit(f"non-finite loss {loss.item()} at step {step + 1}")
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    return peak


def row(
    size,
    device,
    *,
    mode,
    policy,
    optimizer,
    label_tokens,
    goal_gib=None,
    lora=LARGE_V3_LORA,
    note="",
) -> None:
    start = time.perf_counter()
    on = device if device == "cuda" or size in ("tiny", "base") else "meta"
    model = build(size, on, mode=mode, policy=policy, lora=lora)
    estimate = planner.estimate_memory(
        model, policy=policy, label_tokens=label_tokens, precision="bf16", optimizer=optimizer
    )
    # On a CPU (a dry run) only the small sizes run their steps: the rest is estimated.
    runs = device == "cuda" or size in ("tiny", "base")
    peak = measured_peak(model, device, optimizer, label_tokens) if runs else None
    line = f"{size:<10}{mode:<6}{policy:<9}{optimizer:<11}{estimate.total / GIB:>11.2f}"
    if peak is not None:
        line += f"{peak / GIB:>11.2f}{estimate.total / peak:>10.3f}"
    else:
        line += f"{'-':>11}{'-':>10}"
    if goal_gib is not None:
        verdict = "-" if peak is None else ("met" if peak < goal_gib * GIB else "MISSED")
        line += f"   goal < {goal_gib} GB: {verdict}"
    note = f"; {note}" if note else ""
    print(f"{line}   ({time.perf_counter() - start:.0f} s{note})", flush=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,medium,large-v3")
    parser.add_argument("--policies", default="off,every-2,encoder,full")
    parser.add_argument("--label-tokens", type=int, default=64)
    parser.add_argument("--no-targets", action="store_true", help="only the planner rows")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (estimates only)"
    print(
        f"device: {name}, torch {torch.__version__}; batch 1, 3000 frames, "
        f"{args.label_tokens} label tokens, bf16 autocast, float32 weights and optimiser state"
    )
    print(
        f"{'model':<10}{'mode':<6}{'policy':<9}{'optimizer':<11}{'estimate':>11}"
        f"{'measured':>11}{'est/meas':>10}   (GiB)"
    )
    for size in args.sizes.split(","):
        for policy in args.policies.split(","):
            row(
                size,
                device,
                mode="full",
                policy=policy,
                optimizer="adamw",
                label_tokens=args.label_tokens,
            )
    if not args.no_targets:
        row(
            "small",
            device,
            mode="full",
            policy="full",
            optimizer="adamw8bit",
            label_tokens=args.label_tokens,
            goal_gib=4,
        )
        # Unsloth's T4 notebook's LoRA (r 64 on q,v), then whisper-train's default
        for lora, note in (
            (LARGE_V3_LORA, ""),
            (LoraSettings(), "whisper-train's default LoRA: r 32 on every linear layer"),
        ):
            row(
                "large-v3",
                device,
                mode="lora",
                policy="full",
                optimizer="adamw",
                label_tokens=args.label_tokens,
                goal_gib=10,
                lora=lora,
                note=note,
            )


if __name__ == "__main__":
    main()
