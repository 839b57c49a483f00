"""Bytes saved for backward per sample, per checkpointing policy, for Whisper sizes.

    .venv/bin/python bench/activation_memory.py [--sizes tiny,base,small] [--label-tokens 64]
        [--measure-up-to small]

Randomly initialised models with the published dimensions (no download). For each policy
(off, every-2, encoder, full) and mode full fine-tuning, batch 1, the full 3000-frame input:

    measured   saved-tensor hooks on one training forward pass, unique storages, parameters
               excluded, plus the inputs that checkpointed layers keep for their recompute
               (`whisper_train.memory.plan.probe_saved_bytes`)
    counted    the planner's count from the model's shapes (`memory.plan.count_saved_bytes`)

Sizes larger than --measure-up-to are counted only, and measured at their full width with
2 encoder + 2 decoder layers (`*-2L` rows) so that the per-layer count is still checked without
holding the whole model's activations. On CUDA the peak allocated memory of one forward and
backward step is printed too.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import WhisperConfig, WhisperForConditionalGeneration  # noqa: E402

from whisper_train import memory
from whisper_train.memory import plan as planner  # noqa: E402

# (d_model, encoder layers, decoder layers, heads, mel bins, vocabulary) from the model cards
SIZES = {
    "tiny": (384, 4, 4, 6, 80, 51865),
    "base": (512, 6, 6, 8, 80, 51865),
    "small": (768, 12, 12, 12, 80, 51865),
    "medium": (1024, 24, 24, 16, 80, 51865),
    "large-v3": (1280, 32, 32, 20, 128, 51866),
}
POLICIES = ("off", "every-2", "encoder", "full")


def whisper_config(name: str, layers: int | None = None) -> WhisperConfig:
    d, enc, dec, heads, mels, vocab = SIZES[name]
    return WhisperConfig(
        d_model=d,
        encoder_layers=layers or enc,
        decoder_layers=layers or dec,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=4 * d,
        decoder_ffn_dim=4 * d,
        num_mel_bins=mels,
        vocab_size=vocab,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        decoder_start_token_id=50258,
        pad_token_id=50257,
    )


def build(config: WhisperConfig, device: str) -> torch.nn.Module:
    """Random weights without the slow per-module initialisation (only shapes matter here)."""
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    model.config._attn_implementation = "sdpa"
    model = model.to_empty(device=device)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
    return memory.prepare_model(model, mode="full", checkpointing="full")


def peak_step_bytes(model, features, tokens) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    batch = {"input_features": features, "decoder_input_ids": tokens, "labels": tokens}
    memory.training_loss(model, batch).backward()  # the loss whisper-train trains with
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated() - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,base,small,medium,large-v3")
    parser.add_argument("--measure-up-to", default="small")
    parser.add_argument("--label-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = list(SIZES)
    measure_limit = names.index(args.measure_up_to)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, device {device}, "
        f"batch 1, 3000 frames, {args.label_tokens} label tokens, fp32, sdpa, mode full"
    )
    header = (
        f"{'model':<12}{'policy':<9}{'measured MiB':>13}{'counted MiB':>12}"
        f"{'count/meas':>11}{'% of off':>9}"
    )
    if device == "cuda":
        header += f"{'peak step MiB':>14}"
    print(header)
    for name in args.sizes.split(","):
        rows = []
        if names.index(name) <= measure_limit:
            rows.append((name, whisper_config(name), True))
        else:
            with torch.device("meta"):  # the full model's count needs shapes only
                meta = memory.prepare_model(
                    WhisperForConditionalGeneration(whisper_config(name)),
                    mode="full",
                    checkpointing="full",
                )
            rows.append((name, meta, False))
            rows.append((f"{name}-2L", whisper_config(name, layers=2), True))
        for label, config_or_model, measure in rows:
            start = time.perf_counter()
            model = build(config_or_model, device) if measure else config_or_model
            mels = model.config.num_mel_bins
            features = torch.randn(1, mels, 3000, device=device if measure else "cpu")
            tokens = torch.full((1, args.label_tokens), 50258, device=features.device)
            off = None
            for policy in POLICIES:
                counted = planner.count_saved_bytes(
                    model, policy=policy, label_tokens=args.label_tokens
                )["device"]
                measured = peak = None
                if measure:
                    with memory.checkpointing_policy(model, policy):
                        measured = planner.probe_saved_bytes(model, features, tokens)
                        if device == "cuda":
                            peak = peak_step_bytes(model, features, tokens)
                reference = measured if measure else counted
                off = reference if policy == "off" else off
                line = (
                    f"{label:<12}{policy:<9}"
                    + (f"{measured / 2**20:>13.1f}" if measured else f"{'-':>13}")
                    + f"{counted / 2**20:>12.1f}"
                    + (f"{counted / measured:>11.3f}" if measured else f"{'-':>11}")
                    + f"{100 * reference / off:>8.1f}%"
                )
                if peak is not None:
                    line += f"{peak / 2**20:>14.1f}"
                print(line, flush=True)
            if measure:
                print(f"{'':<12}({time.perf_counter() - start:.0f} s)", flush=True)
            del model


if __name__ == "__main__":
    main()
