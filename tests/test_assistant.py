"""Speculative decoding (`--assistant`): a smaller model drafts, the model verifies, and the
text is exactly the model's own greedy text; what it cannot do beside it is refused in one line.

The main models here are seeded tiny Whispers (4 decoder layers) and the real tiny.en; the
assistants are students made from them (`student_from_teacher`: the encoder and 2 decoder
layers, untrained, so they agree with the model only some of the time, which is what makes the
verification do work), and a tiny Whisper with an encoder of its own.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import soundfile
from tiny_models import make_tiny_whisper, tiny_whisper_config
from transformers import WhisperForConditionalGeneration

from whisper_train.cli import main
from whisper_train.errors import UserError
from whisper_train.evaluation.generation import generate_texts
from whisper_train.student import student_from_teacher
from whisper_train.transcription.assistant import make_assistant
from whisper_train.transcription.decoding import NO_FALLBACK, DecodingOptions, generate_decoded
from whisper_train.transcription.transcribe import load_backend, transcribe_paths

# Long enough for drafts to be accepted and rejected, short enough to keep each decode quick.
MAX_TOKENS = 32
# Greedy only, with no no-speech test: the one plain generate call.
PLAIN = DecodingOptions(temperatures=(0.0,), no_speech_threshold=None)
SENTENCES = [
    "please call stella and ask her to bring these things from the store",
    "the weather today is cold and windy with a chance of rain",
    "we will meet at the station at seven in the morning",
]


@pytest.fixture(scope="module")
def main_model():
    """A seeded tiny Whisper (4 decoder layers): a random model writes one token over and over
    whatever it hears, enough for the refusals and the commands' plumbing."""
    return make_tiny_whisper(decoder_layers=4, seed=0)


@pytest.fixture(scope="module")
def student(main_model):
    model, _ = main_model
    return student_from_teacher(model, 2).eval()


@pytest.fixture(scope="module")
def tiny_en():
    """The real tiny.en (4 decoder layers) and an untrained 2-layer student made from it."""
    from whisper_train.models import load_model

    teacher, processor = load_model("tiny.en")
    return teacher, processor, student_from_teacher(teacher, 2).eval()


@pytest.fixture(scope="module")
def speech_features(tiny_en):
    """(3, 80, 3000) log-mel features of three synthesised sentences."""
    from whisper_train.data.synth import synthesize

    _, processor, _ = tiny_en
    audio = [synthesize(text) for text in SENTENCES]
    return processor.feature_extractor(
        audio, sampling_rate=16_000, return_tensors="pt"
    ).input_features


def _decode(model, processor, features, options, assistant=None):
    return [
        generate_decoded(
            model,
            {"input_features": features[row : row + 1]},
            processor.tokenizer,
            max_length=MAX_TOKENS,
            options=options,
            assistant=assistant,
        )[0]
        for row in range(features.shape[0])
    ]


@pytest.mark.speech
@pytest.mark.long  # tiny.en decoding three sentences twice, with and without its drafter
@pytest.mark.parametrize("options", [PLAIN, DecodingOptions()], ids=["plain", "fallback"])
def test_a_student_drafting_gives_the_models_own_tokens(tiny_en, speech_features, options):
    """Both decoding paths (one plain generate call; the fallback and the no-speech test, on
    the encoder outputs) give the same tokens and log-probs with the assistant as without;
    evaluation's batches (here all three clips) are decoded by the pair one clip at a time."""
    model, processor, student = tiny_en
    assistant = make_assistant(model, processor, student, processor, "student")
    assert assistant.shares_encoder  # drafts as a decoder on the model's encoder outputs
    assert assistant.model.config.decoder_layers == 2
    alone = _decode(model, processor, speech_features, options)
    assisted: list = []
    batch = {"input_features": speech_features, "size": len(SENTENCES)}
    generate_texts(
        model,
        processor,
        [batch],
        max_length=MAX_TOKENS,
        decoding=options,
        details=assisted,
        assistant=assistant,
    )
    assert [d.tokens for d in assisted] == [d.tokens for d in alone]
    assert all(len(d.text.split()) >= 8 for d in alone), "tiny.en must hear the sentences"
    for mine, theirs in zip(assisted, alone, strict=True):
        assert mine.text == theirs.text and mine.temperature == theirs.temperature
        # The model scores several verified tokens in one pass: float32 sums in another
        # order, ~1e-6 of a mean log-prob of order 0.1 to 1.
        if theirs.avg_logprob is not None:
            assert mine.avg_logprob == pytest.approx(theirs.avg_logprob, abs=1e-4)


@pytest.mark.speech
@pytest.mark.long  # every draft of a random drafter is rejected: 20 tokens scored for one
def test_an_assistant_with_its_own_encoder_gives_the_models_own_tokens(tiny_en, speech_features):
    """An assistant whose encoder is not the model's (a random tiny Whisper with tiny.en's
    tokenizer, which the model rejects almost every time) runs its own encoder on the clip's
    features, also where the model decodes encoder outputs (the no-speech test's path)."""
    model, processor, _ = tiny_en
    other, other_processor = make_tiny_whisper(decoder_layers=1, seed=7)
    assistant = make_assistant(model, processor, other, other_processor, "other")
    assert not assistant.shares_encoder
    for options in (PLAIN, NO_FALLBACK):
        alone = _decode(model, processor, speech_features[:2], options)
        assisted = _decode(model, processor, speech_features[:2], options, assistant)
        assert [d.tokens for d in assisted] == [d.tokens for d in alone]


def test_tokens_that_differ_are_refused_in_one_line(main_model, student):
    model, processor = main_model
    multilingual_size = WhisperForConditionalGeneration(
        tiny_whisper_config(vocab_size=51865, end_of_text_id=50257, start_of_transcript_id=50258)
    )
    with pytest.raises(UserError, match=r"^--assistant other: its vocabulary has 51865 tokens"):
        make_assistant(model, processor, multilingual_size, processor, "other")
    shifted = copy.deepcopy(student)
    shifted.generation_config.no_timestamps_token_id += 1
    with pytest.raises(UserError, match=r"special tokens differ .*no_timestamps_token_id"):
        make_assistant(model, processor, shifted, processor, "shifted")


def test_what_assisted_generation_cannot_do_is_refused_before_loading(main_model, student):
    model, processor = main_model
    pair = (student, processor)
    with pytest.raises(UserError, match=r"--beam-size 2: .*drop --beam-size or --assistant"):
        load_backend((model, processor), beam_size=2, assistant=pair)
    with pytest.raises(UserError, match=r"--word-timestamps: .*drop one of them"):
        load_backend((model, processor), word_timestamps=True, assistant=pair)


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory, main_model, student):
    """The main tiny model and its student, saved as any model folder is."""
    model, processor = main_model
    folders = tmp_path_factory.mktemp("assisted")
    for name, weights in (("model", model), ("student", student)):
        weights.save_pretrained(folders / name)
        processor.save_pretrained(folders / name)
    return folders / "model", folders / "student"


def test_evaluate_with_an_assistant_scores_the_same_text_and_says_which(
    model_folders, tone_dataset, tmp_path, capsys
):
    """Clips are batched for their features and decoded one at a time by the pair, and the
    report names the assistant. (The texts are compared on tiny.en above: a random model's
    logits are nearly tied, and the model scoring several drafts in one pass sums its floats
    in another order, which can flip a near-tie.)"""
    model, student = model_folders
    argv = [
        "evaluate",
        "--model",
        str(model),
        "--data",
        str(tone_dataset),
        "--eval-subset",
        "3",
        "--batch-size",
        "2",
        "--generation-max-length",
        "8",
        "--temperatures",
        "0",
    ]
    assert main([*argv, "--output", str(tmp_path / "alone.json")]) == 0
    assisted_argv = [
        *argv,
        "--output",
        str(tmp_path / "assisted.json"),
        "--assistant",
        str(student),
    ]
    assert main(assisted_argv) == 0
    alone = json.loads((tmp_path / "alone.json").read_text())
    assisted = json.loads((tmp_path / "assisted.json").read_text())
    assert len(assisted["utterances"]) == len(alone["utterances"]) == 3
    assert assisted["assistant"] == str(student) and alone["assistant"] is None
    capsys.readouterr()
    assert main([*argv, "--assistant", str(student), "--beam-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--beam-size 2" in err and "Traceback" not in err


@pytest.mark.speech
@pytest.mark.long
def test_transcribe_with_a_student_of_tiny_en_gives_tiny_ens_text(tmp_path, capsys):
    """The real tiny.en and a 2-layer student made from it, on synthesised speech, through the
    command's library function: tiny.en's CTranslate2 folder is read into transformers (said
    in one line), and the transcripts, short and long-form, are transformers' own greedy ones."""
    from whisper_train.data.synth import synthesize
    from whisper_train.models import load_model

    teacher, processor = load_model("tiny.en")
    folder = tmp_path / "student"
    student_from_teacher(teacher, 2).save_pretrained(folder)
    processor.save_pretrained(folder)
    sentences = [
        "please call stella and ask her to bring these things from the store",
        "the weather today is cold and windy with a chance of rain",
        "we will meet at the station at seven in the morning",
    ]
    pause = np.zeros(16_000 * 2, dtype=np.float32)
    for index, text in enumerate(sentences):
        soundfile.write(tmp_path / f"clip{index}.wav", synthesize(text), 16_000)
    # Over 30 s: decoded long-form, window by window, with timestamps.
    long = np.concatenate([part for text in sentences * 3 for part in (synthesize(text), pause)])
    assert len(long) > 16_000 * 31
    soundfile.write(tmp_path / "long.wav", long, 16_000)
    inputs = sorted(tmp_path.glob("*.wav"))
    options = {"progress": False, "decoding": NO_FALLBACK}
    alone = transcribe_paths((teacher, processor), inputs, **options)
    capsys.readouterr()
    assisted = transcribe_paths("tiny.en", inputs, assistant=str(folder), **options)
    assert "--assistant: transformers runs --model tiny.en" in capsys.readouterr().err
    assert [t.text for t in assisted] == [t.text for t in alone]
    assert [t.segments for t in assisted] == [t.segments for t in alone]
    assert all(t.error is None and len(t.text.split()) >= 8 for t in alone)
    assert alone[-1].segments[-1].start > 30.0  # the long recording's later windows
