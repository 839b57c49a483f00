"""Distillation's part of a run's set-up (`--teacher`, `whisper-train distill`): the student and
its teacher loaded, the teacher's loss term built from the record, and the start line that says
where the data's size stands against the published rule.

The rule (`DISTIL_HOURS`): distil-whisper's 2-layer students were trained on ~22,000 h of
pseudo-labelled audio (arXiv 2311.00430), and users who distilled on less (reports on
distil-whisper's tracker; kotoba-whisper's ablation) found a 2-layer student needs on the order of
1,000 h: at ~100 h it trails a smaller model off the shelf, under an hour it writes empty
transcripts. Below that, fine-tune, or keep more decoder layers, or start from a distilled
model (`--student`). The line advises; it never refuses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from whisper_train import memory
from whisper_train.config.record import RunRecord
from whisper_train.data.examples import Example
from whisper_train.data.screening import read_audio_seconds
from whisper_train.errors import AudioError
from whisper_train.models import load_model
from whisper_train.runlog import say
from whisper_train.student import check_student_fits, kept_decoder_layers, student_from_teacher

# Hours of training audio a 2-layer distilled student needs (module docstring).
DISTIL_HOURS = 1_000
DISTIL_SOURCE = "distil-whisper, arXiv 2311.00430; kotoba-whisper's ablation"
DISTIL_PAPER = "arXiv 2311.00430"


def load_student_and_teacher(
    model_config,
) -> tuple[torch.nn.Module, object, torch.nn.Module | None]:
    """(model to train, its processor, teacher or None) for `model_config` (a `ModelConfig`):
    without --teacher, --model as it is; with --teacher and --decoder-layers N, a student made
    from the teacher (`student.student_from_teacher`); with --teacher alone, --model, refused
    in one line where its tokenizer or audio front end is not the teacher's."""
    m = model_config
    if m.teacher is None:
        model, processor = load_model(m.model, attn_implementation=m.attn_implementation)
        return model, processor, None
    teacher, processor = load_model(m.teacher, attn_implementation=m.attn_implementation)
    if m.decoder_layers is not None:
        return student_from_teacher(teacher, m.decoder_layers), processor, teacher.eval()
    student, student_processor = load_model(m.model, attn_implementation=m.attn_implementation)
    check_student_fits(teacher, processor, student, student_processor, m.model)
    return student, student_processor, teacher.eval()


def frozen_model_term(
    record: RunRecord, model, teacher, precision: memory.Precision, *, accelerator
) -> memory.BasePreservation | None:
    """The loss's KL term against a frozen model, on the model `memory.prepare_model`
    returned (before any update or resume changes it): the starting model's (--preserve-base),
    the teacher's (--teacher), or None. Autocast wraps only the prepared model, so the frozen
    one is told the dtype itself."""
    autocast_dtype = precision.dtype if precision.mixed_precision != "no" else None
    if record.training.preserve_base:
        return memory.BasePreservation.from_model(
            model, record.training.preserve_base, autocast_dtype=autocast_dtype
        )
    if teacher is None:
        return None
    return teacher_term(record, model, teacher, autocast_dtype, accelerator=accelerator)


def load_start_model(model_record) -> tuple[torch.nn.Module, object]:
    """(model, processor) the run started from, before any training, read again from its record
    (`ModelRecord`): a student made from the teacher where the run made one, else `model`."""
    m = model_record
    model, processor = load_model(m.model, attn_implementation=m.attn_implementation)
    if m.teacher is not None and m.decoder_layers is not None:
        model = student_from_teacher(model, m.decoder_layers)  # `model` is the teacher's spec
    return model, processor


def teacher_term(
    record: RunRecord, model, teacher, autocast_dtype: torch.dtype | None, *, accelerator
) -> memory.BasePreservation:
    """The loss's term against `teacher`, with the record's temperature and weights, on the
    model `memory.prepare_model` returned; its start line says what distils into what."""
    t, m = record.training, record.model
    term = memory.BasePreservation.from_teacher(
        model,
        teacher,
        weight=t.distill_kl_weight,
        temperature=t.distill_temperature,
        cross_entropy_weight=t.distill_ce_weight,
        autocast_dtype=autocast_dtype,
    )
    layers = teacher.config.decoder_layers
    student = (
        f"decoder layers {kept_decoder_layers(layers, m.decoder_layers)} of {layers}"
        if m.decoder_layers
        else f"{m.model}"
    )
    shared = "; one encoder pass for both" if term.shares_encoder else ""
    say(
        accelerator,
        f"distilling: student {student}; loss {t.distill_ce_weight:g} CE + "
        f"{t.distill_kl_weight:g} KL at T={t.distill_temperature:g}{shared}",
        detail=f"teacher {m.teacher}, frozen: {term.extra_bytes / 2**20:,.1f} MiB of weights "
        "beside the student's",
    )
    return term


def training_hours(examples: Sequence[Example]) -> float:
    """Hours of audio in `examples`: their stated lengths, else their files' headers (a clip
    whose header does not read counts nothing)."""
    unknown = [e.audio for e in examples if e.duration is None and e.end is None]
    headers = read_audio_seconds(unknown) if unknown else {}
    seconds = 0.0
    for example in examples:
        if example.duration is not None:
            seconds += example.duration
        elif example.end is not None:
            seconds += example.end - (example.start or 0.0)
        else:
            length = headers[example.audio]
            if not isinstance(length, AudioError) and math.isfinite(length):
                seconds += max(0.0, length - (example.start or 0.0))
    return seconds / 3600


def advise_on_data_size(
    process, model_config, teacher, examples: Sequence[Example], *, streamed: bool
) -> None:
    """The start line of `data_size_advice` for the training `examples` (or a stream)."""
    hours = None if streamed else training_hours(examples)
    line, detail = data_size_advice(
        hours,
        decoder_layers=model_config.decoder_layers,
        teacher_layers=teacher.config.decoder_layers,
    )
    say(process, line, detail=detail)


def data_size_advice(
    hours: float | None, *, decoder_layers: int | None, teacher_layers: int
) -> tuple[str, str]:
    """(the start line, its detail) placing `hours` of training audio (None: a stream, not
    known before it ends) against DISTIL_HOURS."""
    depth = f"{decoder_layers} of {teacher_layers}" if decoder_layers else "--student's"
    detail = (
        f"a 2-layer student needs ~{DISTIL_HOURS:,} h ({DISTIL_SOURCE}: at ~100 h it trails a "
        "smaller model off the shelf, under 1 h it writes empty transcripts); below that, "
        "fine-tune (`whisper-train train`), keep more decoder layers, or start from a distilled "
        f"model (--student); this student keeps {depth} decoder layers"
    )
    if hours is None:
        return (
            f"distillation: streamed data (hours unknown); a 2-layer student needs "
            f"~{DISTIL_HOURS:,} h ({DISTIL_PAPER})",
            detail,
        )
    shown = f"{hours:,.0f}" if hours >= 10 else f"{hours:.2g}"
    if hours >= DISTIL_HOURS:
        return (
            f"distillation: {shown} h of audio, at or above the ~{DISTIL_HOURS:,} h a 2-layer "
            f"student needs ({DISTIL_PAPER})",
            detail,
        )
    return (
        f"distillation: {shown} h of audio, under the ~{DISTIL_HOURS:,} h a 2-layer student "
        f"needs ({DISTIL_PAPER}): fine-tuning likely wins",
        detail,
    )
