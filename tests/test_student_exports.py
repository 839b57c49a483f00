"""A distilled student of the real tiny.en in every runtime, and its word timestamps.

A 2-layer student (tiny.en's encoder, decoder layers 0 and 3) distilled for a few steps by
`whisper-train distill` writes real text; each of its exports (hf, ct2, ggml, openai) passes
the export check in its own runtime, and `transcribe --word-timestamps` times its words inside
the clip, in order. The untrained student, which writes one token a clip at p ~ 0.01, passes
whisper.cpp's check too: the check's bound follows the tokens' uncertainty
(`deploy.parity.logprob_tolerance`), which is what made it fail before, not the file.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from whisper_train.deploy.export import save_export
from whisper_train.deploy.parity import (
    CALIBRATION_UNCERTAINTY,
    check_clips,
    check_export,
    logprob_tolerance,
    score_source,
)

# What each runtime is checked in (float32 where its arithmetic is float32 anyway; whisper.cpp
# aborts on a float32 file, openai-whisper's model.pt holds float16).
EXPORTS = [("hf", "float32"), ("ct2", "float32"), ("ct2", "int8"), ("ggml", "float16")]
EXPORTS += [("openai", "float16")]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """final/ of a 2-layer student of tiny.en distilled for 24 steps (batch 4, lr 3e-4) on 16
    synthesised sentences, the teacher's encoder frozen (distill's default)."""
    from whisper_train.cli import main
    from whisper_train.data import synth

    folder = tmp_path_factory.mktemp("student")
    clips = synth.make_speech_dataset(folder / "clips", n_utterances=16, seed=0)
    argv = [
        "distill",
        "--teacher=tiny.en",
        "--decoder-layers=2",
        f"--data={clips}",
        f"--output-dir={folder / 'run'}",
        "--max-steps=24",
        "--batch-size=4",
        "--learning-rate=3e-4",
        "--seed=0",
        "--only-train",
        "--nonspeech=none",
        "--no-cache-encoder",  # nothing written to the user's cache folder
    ]
    assert main(argv) == 0
    return folder / "run" / "final"


@pytest.fixture(scope="module")
def check_set():
    return check_clips(None, n_clips=4)


def test_the_tolerance_grows_with_the_uncertainty_of_the_scored_tokens():
    """Confident tokens (the calibration's scale and below) keep the measured bounds; a
    model that guesses its tokens is allowed proportionally more, as its log p carries the
    runtime's whole logit error."""
    for arithmetic in ("float32", "float16", "int8"):
        bound = logprob_tolerance(arithmetic)
        assert logprob_tolerance(arithmetic, 0.05) == bound
        assert logprob_tolerance(arithmetic, CALIBRATION_UNCERTAINTY) == bound
        assert logprob_tolerance(arithmetic, 2.0) == pytest.approx(
            bound * 2.0 / CALIBRATION_UNCERTAINTY
        )


@pytest.mark.speech
@pytest.mark.long
def test_a_distilled_student_passes_the_check_in_every_runtime(distilled, check_set, tmp_path):
    from whisper_train.models import load_model

    student, processor = load_model(str(distilled))
    assert student.config.decoder_layers == 2
    student.eval()
    source = score_source(student, processor, check_set, None)
    # It writes text, not one token a clip: the check compares real transcripts.
    assert sum(len(tokens) for tokens in source.tokens) > 30, source.texts
    for format, quantization in EXPORTS:
        output = tmp_path / f"{format}-{quantization}"
        save_export(student, processor, output, format=format, quantization=quantization)
        check = check_export(source, format, output, quantization, greedy=False)
        assert check.passed, f"{format} {quantization}: {check.summary()}"


@pytest.mark.speech
@pytest.mark.long
def test_the_untrained_students_ggml_export_passes_whisper_cpps_check(check_set, tmp_path):
    """The case that failed (0.066 nats against 0.05 on 4 tokens): its tokens' p ~ 0.01 lets
    float16 arithmetic's logit error reach log p whole; the bound follows that scale."""
    from whisper_train.models import load_model
    from whisper_train.student import student_from_teacher

    teacher, processor = load_model("tiny.en")
    student = student_from_teacher(teacher, 2).eval()
    source = score_source(student, processor, check_set, None)
    save_export(student, processor, tmp_path, format="ggml", quantization="float16")
    check = check_export(source, "ggml", tmp_path, "float16", greedy=False)
    assert check.uncertainty > 1.5  # guessed tokens: the case this is about
    assert check.tolerance > logprob_tolerance("float16")
    assert check.passed, check.summary()


@pytest.mark.speech
@pytest.mark.long
@pytest.mark.parametrize("format", ["hf", "ct2"])
def test_transcribe_times_a_distilled_students_words_inside_the_clip_in_order(
    distilled, check_set, format, tmp_path, capsys
):
    """The student's alignment heads are the teacher's in the layers it kept, renumbered
    (tiny.en's layer 3 is its layer 1): transformers (final/ as written) and faster-whisper
    (its ct2 export) time its words with them."""
    import soundfile

    from whisper_train.cli import main
    from whisper_train.models import load_model

    heads = json.loads((distilled / "generation_config.json").read_text())["alignment_heads"]
    assert heads and all(layer == 1 for layer, _ in heads)  # tiny.en's layer-3 heads, kept
    model = distilled
    if format != "hf":
        student, processor = load_model(str(distilled))
        model = tmp_path / format
        save_export(student, processor, model, format=format, quantization="float16")
    _, audio, _, _ = check_set[0]
    soundfile.write(tmp_path / "clip.wav", audio, 16_000)
    duration = len(audio) / 16_000
    argv = ["transcribe", f"--model={model}", "--word-timestamps", "--format=json"]
    code = main([*argv, f"--output-dir={tmp_path / 'out'}", str(tmp_path / "clip.wav")])
    assert code == 0, capsys.readouterr().err
    segments = json.loads((tmp_path / "out" / "clip.json").read_text())["segments"]
    words = [word for segment in segments for word in segment["words"]]
    assert len(words) >= 5, segments  # "Open the door and turn ..."
    starts = np.array([word["start"] for word in words])
    ends = np.array([word["end"] for word in words])
    assert starts[0] >= 0 and ends.max() <= duration + 0.02, words
    assert (ends >= starts).all() and (np.diff(starts) >= 0).all(), words
