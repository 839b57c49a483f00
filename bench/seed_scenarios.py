"""The seed reports on a GPU: the stock recipe against the same training through whisper-train.

    python3 bench/seed_scenarios.py [--steps 2]

On whatever transformers is importable (run it once on 4.56.2, where users report the failure,
and once on 5.x), with random weights of the published shapes on CUDA (bf16, as the Trainer's
`bf16=True` runs), batch 1 of full 30-s inputs:

  medium, stock       Seq2SeqTrainer(gradient_checkpointing=True), no kwargs: the blog recipe
  medium, ours        the same Trainer and data, the model through `memory.prepare_model`
                      (full fine-tune, full checkpointing, non-reentrant) and the Trainer's own
                      gradient_checkpointing left False
  large-v3 LoRA r=64  Unsloth #3592's setting: LoRA r=64 alpha 128 on q_proj,v_proj, 128 mel
                      bins, checkpointing, through `memory.prepare_model`; every adapter matrix
                      must get a non-zero gradient by step 2 (peft starts B at zero)

Each row prints what happened (trained, or the error's first line), the steps' losses and the
peak allocated memory (before 2026-11-26 it included the earlier cases' leftovers: the first
H200 run's 9.27 and 10.06 GiB for the LoRA row are not its own; bench/gpu_memory.py's 7.03 is). Without CUDA it runs on the CPU with 2-layer models of the same widths
(a dry run of the code).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    TrainerCallback,
    WhisperForConditionalGeneration,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from activation_memory import whisper_config  # noqa: E402

from whisper_train import memory
from whisper_train.memory import LoraSettings  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def random_whisper(size: str) -> WhisperForConditionalGeneration:
    config = whisper_config(size, layers=None if CUDA else 2)
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    model = model.to_empty(device=DEVICE)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
    model.config.use_cache = False
    return model


def utterances(n: int, mels: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "input_features": torch.randn(mels, 3000, generator=generator),
            "labels": torch.randint(0, 50000, (24,), generator=generator),
        }
        for _ in range(n)
    ]


def collate(rows):
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


class Losses(TrainerCallback):
    def __init__(self):
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(round(float(logs["loss"]), 4))


def trainer_run(model, *, steps: int, checkpointing: bool, folder: str) -> tuple[str, list]:
    losses = Losses()
    args = Seq2SeqTrainingArguments(
        output_dir=folder,
        per_device_train_batch_size=1,
        max_steps=steps,
        learning_rate=1e-5,
        gradient_checkpointing=checkpointing,
        bf16=CUDA,
        use_cpu=not CUDA,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        remove_unused_columns=False,
        label_names=["labels"],
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    mels = model.config.num_mel_bins
    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=utterances(steps, mels),
        data_collator=collate,
        callbacks=[losses],
    )
    try:
        trainer.train()
    except RuntimeError as error:
        return f"FAILED: {str(error).splitlines()[0][:90]}", losses.losses
    return "trained", losses.losses


def lora_run(steps: int) -> tuple[str, list]:
    lora = LoraSettings(r=64, alpha=128, dropout=0.0, targets=("q_proj", "v_proj"))
    model = memory.prepare_model(
        random_whisper("large-v3"), mode="lora", checkpointing="full", lora=lora
    ).train()
    optimizer = memory.build_optimizer(model, name="adamw", lr=1e-3)
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    losses = []
    for row in utterances(steps, 128):
        batch = {k: v.unsqueeze(0).to(DEVICE) for k, v in row.items()}
        batch["decoder_input_ids"] = batch["labels"]
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=CUDA):
            loss = memory.training_loss(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(round(loss.item(), 4))
    no_gradient = [n for n, p in adapters.items() if p.grad is None or not p.grad.abs().sum() > 0]
    if no_gradient:
        return f"FAILED: {len(no_gradient)} adapter matrices without gradient", losses
    return f"trained ({len(adapters)} adapter matrices, all with gradients)", losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if CUDA else "CPU dry run (2-layer models)"
    print(f"device: {name}; torch {torch.__version__}, transformers {transformers.__version__}")
    folder = tempfile.mkdtemp()
    cases = {
        "medium, stock Trainer + gradient_checkpointing=True": lambda: trainer_run(
            random_whisper("medium"), steps=args.steps, checkpointing=True, folder=folder
        ),
        "medium, ours (memory.prepare_model) + Trainer": lambda: trainer_run(
            memory.prepare_model(random_whisper("medium"), mode="full", checkpointing="full"),
            steps=args.steps,
            checkpointing=False,
            folder=folder,
        ),
        "large-v3, LoRA r=64 q/v, checkpointing (ours)": lambda: lora_run(args.steps),
    }
    for label, run in cases.items():
        gc.collect()  # the last case's model, optimizer and Trainer: not in this case's peak
        if CUDA:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        outcome, losses = run()
        peak = f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if CUDA else "-"
        print(
            f"{label:<54} {outcome}; losses {losses}; peak {peak}; "
            f"{time.perf_counter() - start:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
