"""Bytes of weights, gradients and Adam state each process holds, with and without --fsdp.

    .venv/bin/python bench/fsdp_memory.py [--size base] [--nproc 2]

Re-launches itself as N CPU processes (gloo). Each builds the randomly initialised Whisper of
the published dimensions (`activation_memory.SIZES`, no download), prepares it for full
fine-tuning as a run does, shards it with `memory.shard_model` (--fsdp) or not (a whole copy per
process, as data parallel keeps; DDP's gradient buckets are not counted), and takes one
AdamW step on the training loss of a stand-in row. Then it counts the bytes of the tensors it
holds itself: its shard of each weight (the local tensor of a DTensor), of each gradient (just
before the step, after the reduce-scatter) and of Adam's state. Activations are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))


def _local_bytes(tensors) -> int:
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def worker(size: str, sharded: bool) -> dict:
    from activation_memory import whisper_config
    from transformers import WhisperForConditionalGeneration

    from whisper_train.data.source import stand_in_batch
    from whisper_train.memory import build_optimizer, loss_terms, prepare_model, shard_model

    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(whisper_config(size))
    model = prepare_model(model, mode="full", checkpointing="full").train()
    if sharded:
        shard_model(model, torch.device("cpu"))
    optimizer = build_optimizer(model, name="adamw", lr=1e-5, weight_decay=0.0)
    batch = stand_in_batch(model.config, torch.device("cpu"), encoder_outputs=False)
    batch["labels"] = batch["decoder_input_ids"].clone()  # one label: a real loss
    loss = loss_terms(model, batch).loss
    loss.backward()
    params = list(model.parameters())
    grads = _local_bytes(p.grad for p in params)
    optimizer.step()
    state = _local_bytes(v for s in optimizer.state.values() for v in s.values() if v.dim())
    return {"weights": _local_bytes(params), "gradients": grads, "adam": state}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="base")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--worker", choices=["ddp", "fsdp"])
    args = parser.parse_args()
    if args.worker:
        torch.distributed.init_process_group("gloo")
        row = worker(args.size, args.worker == "fsdp")
        rows = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(rows, row)
        if torch.distributed.get_rank() == 0:
            print(json.dumps(rows))
        torch.distributed.destroy_process_group()
        return
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"Whisper {args.size} (random weights), full fine-tuning, {args.nproc} CPU processes")
    print("| mode | process | weights MB | gradients MB | Adam state MB | total MB |")
    print("|---|---|---|---|---|---|")
    for mode in ("ddp", "fsdp"):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc-per-node={args.nproc}", __file__, f"--size={args.size}"]
        output = subprocess.run(
            [*command, f"--worker={mode}"], capture_output=True, text=True, check=True
        ).stdout
        rows = json.loads(output.strip().splitlines()[-1])
        name = "--fsdp" if mode == "fsdp" else "data parallel"
        for rank, row in enumerate(rows):
            total = sum(row.values())
            cells = " | ".join(f"{row[k] / 1e6:.1f}" for k in ("weights", "gradients", "adam"))
            print(f"| {name} | {rank} | {cells} | {total / 1e6:.1f} |")


if __name__ == "__main__":
    main()
