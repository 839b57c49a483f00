"""Distillation's options met with one another and with the rest (`validate_distillation`,
called by `RunConfig.validate`): --teacher, --decoder-layers and the loss's temperature and
weights (`options.DISTILL_*`)."""

from __future__ import annotations

import math

from whisper_train.config.options import ModelConfig
from whisper_train.config.values import require_positive
from whisper_train.errors import UserError

# --model's default: with --decoder-layers the student is made from --teacher, so a --model
# other than this one (and the teacher) would be silently ignored.
_DEFAULT_MODEL = ModelConfig.__dataclass_fields__["model"].default


def validate_distillation(config) -> None:
    """One line for each way the distillation options cannot run (`config` a `RunConfig`)."""
    m, t = config.model, config.train
    # A value out of range first, whatever else is given: the line names what the flag takes.
    if m.decoder_layers is not None:
        require_positive("--decoder-layers", m.decoder_layers)
    for flag, value, accepted in (
        ("--distill-temperature", t.distill_temperature, "a finite temperature above 0"),
        ("--distill-kl-weight", t.distill_kl_weight, "a finite weight of 0 or more"),
        ("--distill-ce-weight", t.distill_ce_weight, "a finite weight of 0 or more"),
    ):
        low_ok = value > 0 if flag == "--distill-temperature" else value >= 0
        if not (math.isfinite(value) and low_ok):
            raise UserError(f"{flag} {value:g}: expected {accepted}")
    if m.teacher is None:
        if m.decoder_layers is not None:
            raise UserError(
                f"--decoder-layers {m.decoder_layers} makes a student from a teacher: add "
                "--teacher MODEL (or use `whisper-train distill`)"
            )
        return
    if m.decoder_layers is not None and m.model not in (_DEFAULT_MODEL, m.teacher):
        raise UserError(
            f"--decoder-layers {m.decoder_layers} makes the student from --teacher "
            f"{m.teacher}, so --model {m.model} would not be read: drop --model, or drop "
            "--decoder-layers to distil into --model"
        )
    if t.distill_kl_weight == 0 and t.distill_ce_weight == 0:
        raise UserError(
            "--distill-kl-weight 0 with --distill-ce-weight 0: nothing would train; give one "
            "of them a weight above 0"
        )
    if m.decoder_layers is None and config.cache_encoder:
        raise UserError(
            f"--teacher {m.teacher} with the frozen encoder's cache: the student (--model "
            f"{m.model}) has an encoder of its own, so the teacher needs the audio, which cached "
            "batches no longer hold; add --no-cache-encoder (or use --decoder-layers)"
        )
    if t.preserve_base:
        raise UserError(
            f"--preserve-base with --teacher {m.teacher}: both are a KL term against a frozen "
            "model, and the teacher's is the one that distils; drop --preserve-base"
        )
    if m.new_language is not None:
        raise UserError(
            f"--new-language {m.new_language} with --teacher {m.teacher}: the teacher has no "
            "token for the new language to teach; fine-tune the teacher with it first, then "
            "distil"
        )
