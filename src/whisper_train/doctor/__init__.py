"""`whisper-train doctor`: prove a training configuration's gradient checkpointing is sound.

Two kinds of check, each tied to a trigger in docs/checkpointing.md (T1-T10):

* static checks read versions, flags and the model's checkpointing state: cheap enough for
  `train` to run before step 1 (`static_checks`, which refuses a known failure);
* dynamic checks run one forward + backward on a real batch twice, on deep copies of the model,
  with and without checkpointing (dropout off, same seed), and compare: every trainable
  parameter has a gradient, the set of non-zero gradients matches, the largest difference, and
  that the checkpointed layers really were recomputed. One instrumented forward also looks at
  what each checkpointed layer receives: a tensor that needs grad passed by keyword (T1) or no
  positional input that needs grad around trainable weights (T2) under reentrant checkpointing.

The model is checked the way it will train: if Hugging Face `Seq2SeqTrainingArguments` are
given, the copy first gets the checkpointing the Trainer would switch on.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

from whisper_train.config import RunConfig
from whisper_train.config.resolve import (
    COMPILE_BY_DEFAULT_FROM_STEPS,
    choose_packing,
    decide_compile,
)
from whisper_train.data.collate import SpeechCollator
from whisper_train.data.examples import Example
from whisper_train.data.features import LogMel, SpeechDataset
from whisper_train.data.labels import LabelEncoder
from whisper_train.data.layouts import load_examples
from whisper_train.doctor.probe import compare_with_and_without_checkpointing, model_loss
from whisper_train.doctor.report import MODEL_INPUTS, Check, DoctorReport, format_report
from whisper_train.doctor.static import T1_AFFECTED, check_statically, hooks_replay_on_recompute
from whisper_train.doctor.trainer import as_trainer_will_run, trainer_checkpointing
from whisper_train.errors import UserError
from whisper_train.memory import (
    LoraSettings,
    prepare_model,
    resolve_checkpointing,
    training_loss,
)
from whisper_train.models import is_multilingual, load_model

# -- entry points ------------------------------------------------------------------------------


def run(
    model: nn.Module,
    batch: dict[str, Any],
    *,
    mode: str | None = None,
    checkpointing: str | None = None,
    lora: LoraSettings | None = None,
    trainer_args: Any = None,
    ddp: dict[str, Any] | None = None,
    compile: bool | None = None,
) -> DoctorReport:
    """All checks for `model` trained on `batch` ({"input_features": (B, n_mels, frames),
    "labels": (B, T), ...}).

    With `mode` given, a copy of the model is first prepared by `prepare_model(mode,
    checkpointing, lora)`: the check of a whisper-train configuration. Without it the model is
    checked as it is (a hand-made setup). `trainer_args` are Seq2SeqTrainingArguments the model
    will be trained with; `ddp` is {"world_size", "find_unused_parameters", "static_graph",
    "gradient_accumulation"}.
    The caller's model is never modified.
    """
    model = copy.deepcopy(model)
    if mode is not None:
        model = prepare_model(model, mode=mode, checkpointing=checkpointing or "off", lora=lora)
    model, hand_enabled = as_trainer_will_run(model, trainer_args)
    model.train()  # checkpointing acts only in training mode
    report = DoctorReport(
        check_statically(
            model, trainer_args=trainer_args, ddp=ddp, compile=compile, hand_enabled=hand_enabled
        )
    )
    inputs = {k: v for k, v in batch.items() if k in MODEL_INPUTS and v is not None}
    if "labels" not in inputs:
        raise UserError("doctor: the batch needs labels (token ids) to compute a training loss")
    # A whisper-train configuration is checked with the loss `train` computes (chunked, and
    # recomputed under checkpointing); a hand-made setup with the model's own loss.
    ours = mode is not None and "decoder_input_ids" in inputs
    report.checks.extend(
        compare_with_and_without_checkpointing(
            model, inputs, loss_of=training_loss if ours else model_loss
        )
    )
    return report


def static_checks(
    model: nn.Module,
    *,
    trainer_args: Any = None,
    ddp: dict[str, Any] | None = None,
    compile: bool | None = None,
    refuse: bool = True,
) -> list[Check]:
    """The cheap checks (no forward pass). With `refuse`, a failed check raises `UserError`
    naming the trigger and the remedy, so `train` stops before step 1."""
    if trainer_checkpointing(trainer_args)[0]:
        model = copy.deepcopy(model)  # the Trainer's setting is tried on a copy
    model, hand_enabled = as_trainer_will_run(model, trainer_args)
    checks = check_statically(
        model, trainer_args=trainer_args, ddp=ddp, compile=compile, hand_enabled=hand_enabled
    )
    for check in checks:
        if refuse and check.status == "fail":
            raise UserError(f"{check.message} ({check.trigger}); {check.remedy}")
    return checks


# -- a training configuration, as `whisper-train doctor` checks it ------------------------------


def check_config(config: RunConfig, *, probe_batch_size: int = 2) -> DoctorReport:
    """Every check for the model, mode and memory options of `config`, as `train` would set
    them up: load the model, probe `probe_batch_size` utterances (--data's first, or a
    synthetic batch without --data) and `run` the static and dynamic checks on it."""
    model, processor = load_model(
        config.model.model, attn_implementation=config.model.attn_implementation
    )
    batch = probe_batch(model, processor, config, size=probe_batch_size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m = config.model
    return run(
        model.to(device),
        {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()},
        mode=m.mode,
        checkpointing=resolve_checkpointing(config.memory.gradient_checkpointing, device),
        lora=LoraSettings(
            m.lora_r, m.lora_alpha, m.lora_dropout, tuple(m.lora_targets), variant=m.lora_variant
        ),
        ddp={
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "find_unused_parameters": False,
        },  # as `train` configures DDP
        compile=doctor_compiles(config, device),
    )


def doctor_compiles(config: RunConfig, device: torch.device) -> bool:
    """Whether `train` would compile this configuration: the run's own decision, not the flag.
    Without a data plan the run's length is --max-steps, or else taken as long enough for the
    default to compile where it can: the check then covers the compiled run a long job gets."""
    packing, _ = choose_packing(config)
    steps = config.train.max_steps or COMPILE_BY_DEFAULT_FROM_STEPS
    return decide_compile(config, device, packing, steps)[0]


def probe_batch(model, processor, config, *, size: int = 2) -> dict[str, torch.Tensor]:
    """The first `size` utterances of --data through the training pipeline, or, without
    --data, `size` rows of noise features with a short transcript: the shapes are what matter."""
    encoder = LabelEncoder(
        processor.tokenizer,
        language=config.data.language,
        task=config.data.task,
        multilingual=is_multilingual(model),
    )
    collator = SpeechCollator(
        processor.tokenizer.pad_token_id, log_mel=LogMel(processor.feature_extractor)
    )
    if config.data.data:
        examples = load_examples(config.data.data, data_format=config.data.data_format)[:size]
        batch = collator([SpeechDataset(examples, encoder)[i] for i in range(len(examples))])
        if not batch.get("size"):
            raise UserError(
                f"--data {config.data.data}: none of the first {size} clips could be "
                "read; run `whisper-train check-data` on it"
            )
    else:
        tokens = [encoder.encode(Example(audio="", text="hello world"))] * size
        batch = collator.pad_labels([t for t, _ in tokens], [n for _, n in tokens])
        generator = torch.Generator().manual_seed(0)
        frames = 2 * model.config.max_source_positions
        batch["input_features"] = torch.randn(
            size, model.config.num_mel_bins, frames, generator=generator
        )
    return batch


__all__ = [
    "T1_AFFECTED",
    "Check",
    "DoctorReport",
    "check_config",
    "format_report",
    "hooks_replay_on_recompute",
    "probe_batch",
    "run",
    "static_checks",
]
