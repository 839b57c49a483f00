"""Distillation: a student made from its teacher, trained on CE + KL against the teacher."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_whisper

from whisper_train.errors import UserError
from whisper_train.student import (
    kept_decoder_layers,
    student_alignment_heads,
    student_from_teacher,
)

# -- the student made from the teacher --------------------------------------------------------


@pytest.mark.parametrize(
    ("teacher_layers", "student_layers", "kept"),
    [(6, 2, [0, 5]), (4, 3, [0, 1, 3]), (32, 4, [0, 10, 20, 31]), (32, 2, [0, 31]), (4, 1, [3])],
)
def test_the_kept_layers_are_spread_from_the_first_to_the_last(
    teacher_layers, student_layers, kept
):
    """distil-whisper's choice (create_student_model.py: linspace rounded down, last kept)."""
    assert kept_decoder_layers(teacher_layers, student_layers) == kept


@pytest.mark.parametrize("layers", [0, 5])
def test_a_student_deeper_than_the_teacher_or_empty_is_refused(layers):
    with pytest.raises(UserError, match=f"--decoder-layers {layers}: .* between 1 and 4"):
        kept_decoder_layers(4, layers)


def test_the_student_holds_the_teachers_encoder_and_chosen_decoder_layers():
    teacher, _ = make_tiny_whisper(seed=3, decoder_layers=4)
    teacher_state = {name: value.clone() for name, value in teacher.state_dict().items()}
    student = student_from_teacher(teacher, 2)
    assert student.config.decoder_layers == 2 and len(student.model.decoder.layers) == 2
    assert teacher.config.decoder_layers == 4  # the teacher is left as it was
    for name, value in student.state_dict().items():
        source = name
        if name.startswith("model.decoder.layers."):
            index, rest = name.removeprefix("model.decoder.layers.").split(".", 1)
            source = f"model.decoder.layers.{[0, 3][int(index)]}.{rest}"
        assert torch.equal(value, teacher_state[source]), name
    # the copies are the student's own: training it leaves the teacher alone
    with torch.no_grad():
        student.model.decoder.layers[1].fc1.weight.add_(1.0)
    assert torch.equal(
        teacher.model.decoder.layers[3].fc1.weight,
        teacher_state["model.decoder.layers.3.fc1.weight"],
    )
    assert not student.model.encoder.embed_positions.weight.requires_grad


def test_alignment_heads_of_kept_layers_are_renumbered_and_the_others_dropped():
    heads = [[1, 0], [2, 0], [2, 5], [3, 0], [3, 1]]  # tiny.en's, in part
    assert student_alignment_heads(heads, [0, 3]) == [[1, 0], [1, 1]]
    assert student_alignment_heads(heads, [0, 1, 3]) == [[1, 0], [2, 0], [2, 1]]
    assert student_alignment_heads([[1, 0], [2, 3]], [0, 3]) == []


def test_a_student_without_the_teachers_heads_times_words_with_the_default_ones():
    teacher, _ = make_tiny_whisper(decoder_layers=4)
    teacher.generation_config.alignment_heads = [[1, 0], [2, 3]]
    student = student_from_teacher(teacher, 2)
    assert student.generation_config.alignment_heads is None
    teacher.generation_config.alignment_heads = [[1, 0], [3, 2]]
    assert student_from_teacher(teacher, 2).generation_config.alignment_heads == [[1, 2]]
