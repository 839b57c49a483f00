"""A smaller Whisper to distil a teacher into: the teacher's encoder and some of its decoder.

`student_from_teacher(teacher, N)` keeps the teacher's encoder, embeddings and final layer norm
as they are and N of its decoder layers, chosen as distil-whisper's `create_student_model.py`
chooses them: spread evenly from the first layer to the last, both kept (`kept_decoder_layers`).
The decoder is where Whisper spends its decoding time (one pass per token, against the
encoder's one pass per clip), so cutting it is what makes the student fast, and a decoder that
starts from the teacher's own first and last layers starts close to the teacher's output.

A model's `generation_config.alignment_heads` name [decoder layer, head] pairs that follow word
timing; the student keeps those in the layers it keeps (renumbered) and drops the rest
(`student_alignment_heads`). Where none is left, word timestamps use the default heads (the
upper half of the decoder's), as for any model that names none, and the log says so once.

`--student MODEL` instead distils into a checkpoint of its own: `check_student_fits` refuses,
in one line, one whose tokenizer or audio front end differs from the teacher's.
"""

from __future__ import annotations

import copy
import logging
import re

import torch
from transformers import WhisperForConditionalGeneration

from whisper_train.errors import UserError
from whisper_train.transcription.assistant import check_same_tokens

log = logging.getLogger(__name__)

_DECODER_LAYER = re.compile(r"^model\.decoder\.layers\.(\d+)\.(.*)$")


def kept_decoder_layers(teacher_layers: int, student_layers: int) -> list[int]:
    """The teacher's decoder layers a student of `student_layers` keeps, in order.

    distil-whisper's rule: `student_layers` points evenly spaced from 0 to `teacher_layers - 1`,
    each rounded down, and the last one set to the teacher's last layer (2 of 6: 0, 5; 3 of 4:
    0, 1, 3; 4 of 32: 0, 10, 20, 31). A student as deep as the teacher keeps every layer.
    """
    if not 1 <= student_layers <= teacher_layers:
        raise UserError(
            f"--decoder-layers {student_layers}: the teacher's decoder has {teacher_layers} "
            f"layers; keep between 1 and {teacher_layers}"
        )
    if student_layers == 1:
        return [teacher_layers - 1]
    step = (teacher_layers - 1) / (student_layers - 1)
    kept = [int(index * step) for index in range(student_layers)]
    kept[-1] = teacher_layers - 1
    return kept


def student_alignment_heads(heads, kept: list[int]) -> list[list[int]]:
    """`heads` ([[teacher layer, head], ...]) of the layers in `kept`, renumbered to the
    student's layers; the heads of dropped layers are left out."""
    student_layer = {teacher: student for student, teacher in enumerate(kept)}
    return [
        [student_layer[int(layer)], int(head)]
        for layer, head in heads or []
        if int(layer) in student_layer
    ]


def student_from_teacher(
    teacher: WhisperForConditionalGeneration, decoder_layers: int
) -> WhisperForConditionalGeneration:
    """A new model: `teacher`'s encoder, embeddings and layer norms copied, and the decoder
    layers `kept_decoder_layers` chooses, copied in order; `config.decoder_layers` and the
    generation config's alignment heads follow. `teacher` is left as it was. The student is
    in the teacher's dtype and on its device, in training mode as a new model is."""
    teacher_config = teacher.config
    kept = kept_decoder_layers(teacher_config.decoder_layers, decoder_layers)
    config = copy.deepcopy(teacher_config)
    config.decoder_layers = decoder_layers
    parameter = next(teacher.parameters())
    with torch.device(parameter.device):
        student = WhisperForConditionalGeneration(config).to(parameter.dtype)
    student.config._attn_implementation = teacher_config._attn_implementation
    student.load_state_dict(_student_state(teacher.state_dict(), kept), strict=True)
    # The constructor freezes the encoder's fixed sinusoids; the copy must not thaw them.
    student.model.encoder.embed_positions.requires_grad_(False)

    student.generation_config = copy.deepcopy(teacher.generation_config)
    teacher_heads = getattr(teacher.generation_config, "alignment_heads", None)
    if teacher_heads:
        heads = student_alignment_heads(teacher_heads, kept)
        student.generation_config.alignment_heads = heads or None
        if not heads:
            log.info(
                "the student keeps decoder layers %s, which hold none of the teacher's alignment "
                "heads: word timestamps use the upper half of its decoder's heads "
                "(`export --find-alignment-heads` finds better ones)",
                kept,
            )
    return student


def _student_state(teacher_state: dict, kept: list[int]) -> dict:
    """The teacher's state dict with decoder layer `kept[i]` renamed to layer i and the
    decoder layers not kept left out."""
    student_layer = {teacher: student for student, teacher in enumerate(kept)}
    state = {}
    for name, tensor in teacher_state.items():
        match = _DECODER_LAYER.match(name)
        if match is None:
            state[name] = tensor
        elif int(match.group(1)) in student_layer:
            state[f"model.decoder.layers.{student_layer[int(match.group(1))]}.{match.group(2)}"] = (
                tensor
            )
    return state


def check_student_fits(teacher, teacher_processor, student, student_processor, spec: str) -> None:
    """One line, naming `--student spec`, where the student cannot learn from the teacher's
    token distributions: another vocabulary or tokenizer, or another audio front end."""
    check_same_tokens(
        teacher,
        teacher_processor,
        student,
        student_processor,
        named=f"--student {spec}",
        against="the teacher's",
        remedy="distil into a model with the teacher's tokenizer and audio front end, or use "
        "--decoder-layers",
    )
