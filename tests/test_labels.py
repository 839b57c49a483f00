"""Decoder labels: prefixes, languages, refusals, timestamps, and generation settings.

English-only checks use tiny.en's real tokenizer; multilingual ones a byte-level tokenizer
with the hub's multilingual special-token layout (tests/multilingual.py).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from multilingual import make_tiny_multilingual_whisper, multilingual_tokenizer
from tiny_models import EOT, NO_TIMESTAMPS, SOT, english_tokenizer, make_tiny_whisper
from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

from whisper_train.data.collate import SpeechCollator
from whisper_train.data.examples import Example
from whisper_train.data.features import LogMel
from whisper_train.data.labels import LabelEncoder, configure_generation
from whisper_train.errors import UserError

SEGMENTS = ((0.2, 1.4, "Hello"), (1.8, 3.0, "world"))


@pytest.fixture(scope="module")
def en_tokenizer():
    return english_tokenizer()


@pytest.fixture(scope="module")
def ml_tokenizer():
    return multilingual_tokenizer()


def example(text="Hello world", **fields) -> Example:
    return Example(audio="/data/clip.wav", text=text, origin="test.jsonl:1", **fields)


def time_pairs(body: list[int], timestamp_begin: int) -> list[tuple[float, float, list[int]]]:
    """Split `<|t0|> text <|t1|>` runs into (t0, t1, text ids); fails on malformed runs."""
    segments, index = [], 0
    while index < len(body):
        start = body[index]
        assert start >= timestamp_begin, f"segment must open with a time token: {body}"
        end_index = index + 1
        while body[end_index] < timestamp_begin:
            end_index += 1
        text = body[index + 1 : end_index]
        to_seconds = [round((t - timestamp_begin) * 0.02, 2) for t in (start, body[end_index])]
        segments.append((*to_seconds, text))
        index = end_index + 1
    return segments


# -- prefixes -------------------------------------------------------------------------------
def test_english_only_label_is_sot_notimestamps_text_eot(en_tokenizer):
    encoder = LabelEncoder(en_tokenizer, language="english", multilingual=False)
    ids, n_prefix = encoder.encode(example("  Hello world "))

    assert ids[:n_prefix] == [SOT, NO_TIMESTAMPS]
    assert ids[-1] == EOT
    # The pretrained model writes a leading space before the first word.
    assert en_tokenizer.decode(ids[n_prefix:-1]) == " Hello world"


def test_multilingual_prefix_matches_transformers_for_german_translation(ml_tokenizer):
    encoder = LabelEncoder(ml_tokenizer, language="German", task="translate", multilingual=True)
    ids, n_prefix = encoder.encode(example("Good morning"))

    ml_tokenizer.set_prefix_tokens(language="de", task="translate", predict_timestamps=False)
    assert ids[:n_prefix] == ml_tokenizer.prefix_tokens
    assert ml_tokenizer.convert_ids_to_tokens(ids[:n_prefix]) == [
        "<|startoftranscript|>", "<|de|>", "<|translate|>", "<|notimestamps|>",
    ]  # fmt: skip
    assert ml_tokenizer.decode(ids[n_prefix:-1]) == " Good morning"


def test_a_rows_language_wins_over_the_default(ml_tokenizer):
    encoder = LabelEncoder(ml_tokenizer, language="de", multilingual=True)
    french, n_fr = encoder.encode(example("Bonjour", language="French"))
    german, n_de = encoder.encode(example("Hallo"))

    assert ml_tokenizer.convert_ids_to_tokens(french[1]) == "<|fr|>"
    assert ml_tokenizer.convert_ids_to_tokens(german[1]) == "<|de|>"
    assert n_fr == n_de == 4


def test_multilingual_without_any_language_asks_for_one(ml_tokenizer):
    encoder = LabelEncoder(ml_tokenizer, multilingual=True)
    with pytest.raises(UserError, match="--language"):
        encoder.encode(example("Hallo"))


# -- refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"language": "de"}, "English-only.*multilingual checkpoint"),
        ({"language": "english", "task": "translate"}, "English-only.*cannot translate"),
        ({"language": "klingon"}, "not one Whisper knows.*en, de"),
    ],
)
def test_english_only_model_refuses_what_it_cannot_learn(en_tokenizer, kwargs, message):
    with pytest.raises(UserError, match=message):
        LabelEncoder(en_tokenizer, multilingual=False, **kwargs)


def test_english_only_model_refuses_a_foreign_row(en_tokenizer):
    encoder = LabelEncoder(en_tokenizer, multilingual=False)
    with pytest.raises(UserError, match="English-only"):
        encoder.encode(example("Hallo", language="de"))


# -- timestamps -----------------------------------------------------------------------------
@pytest.mark.parametrize("tokenizer_name", ["en", "ml"])
def test_timestamp_labels_are_paired_ascending_and_within_30_s(tokenizer_name, request):
    tokenizer = request.getfixturevalue(f"{tokenizer_name}_tokenizer")
    multilingual = tokenizer_name == "ml"
    encoder = LabelEncoder(
        tokenizer, language="en", timestamps=True, multilingual=multilingual,
        timestamp_probability=1.0,
    )  # fmt: skip
    segments = ((0.0, 1.234, "one"), (1.2, 2.0, "two"), (29.5, 31.0, "three"))
    ids, n_prefix = encoder.encode(example("one two three", segments=segments))

    assert NO_TIMESTAMPS not in ids and encoder.no_timestamps_id not in ids
    assert ids[-1] == encoder.eot_id
    # Times round to 20 ms, the overlap (1.2 < 1.234) is moved forward, 31 s is clamped to 30.
    pairs = time_pairs(ids[n_prefix:-1], encoder.timestamp_begin_id)
    assert [(start, end) for start, end, _ in pairs] == [
        (0.0, 1.24), (1.24, 2.0), (29.5, 30.0),
    ]  # fmt: skip
    assert [tokenizer.decode(text) for *_, text in pairs] == [" one", " two", " three"]


def test_multilingual_timestamps_decode_to_the_segment_offsets(ml_tokenizer):
    encoder = LabelEncoder(
        ml_tokenizer, language="de", timestamps=True, multilingual=True, timestamp_probability=1.0
    )
    ids, n_prefix = encoder.encode(example("Hallo Welt", segments=SEGMENTS))

    assert ml_tokenizer.convert_ids_to_tokens(ids[:n_prefix]) == [
        "<|startoftranscript|>", "<|de|>", "<|transcribe|>",
    ]  # fmt: skip
    decoded = ml_tokenizer.decode(ids, output_offsets=True)
    offsets = [(o["text"], tuple(round(t, 2) for t in o["timestamp"])) for o in decoded["offsets"]]
    assert offsets == [
        (" Hello", (0.2, 1.4)), (" world", (1.8, 3.0)),
    ]  # fmt: skip


def test_timestamp_form_is_drawn_per_example_with_the_given_probability(en_tokenizer):
    encoder = LabelEncoder(en_tokenizer, timestamps=True, multilingual=False)
    timed = example(segments=SEGMENTS)

    def forms(seed: int) -> list[bool]:
        rng = random.Random(seed)
        return [NO_TIMESTAMPS not in encoder.encode(timed, rng)[0] for _ in range(400)]

    assert forms(1) == forms(1)  # seeded: the same labels every run
    assert 0.4 < sum(forms(1)) / 400 < 0.6
    # Without segments there is nothing to time: always the plain form.
    assert NO_TIMESTAMPS in encoder.encode(example(), random.Random(0))[0]


def test_count_tokens_is_the_length_of_the_longest_form(en_tokenizer):
    encoder = LabelEncoder(en_tokenizer, timestamps=True, multilingual=False)
    always = LabelEncoder(
        en_tokenizer, timestamps=True, multilingual=False, timestamp_probability=1.0
    )
    timed = example(segments=SEGMENTS)
    assert encoder.count_tokens(timed) == len(always.encode(timed)[0])
    assert encoder.count_tokens(example()) == len(encoder.encode(example())[0])


# -- generation settings --------------------------------------------------------------------
def test_configured_generation_prompts_with_language_and_task_without_detection():
    model, processor = make_tiny_multilingual_whisper()
    configure_generation(
        model.generation_config, language="german", task="translate", multilingual=True
    )
    features = torch.zeros(1, 80, 3000)
    with torch.no_grad():
        out = model.generate(features, max_new_tokens=3, return_dict_in_generate=True)
    tokens = processor.tokenizer.convert_ids_to_tokens(out.sequences[0, :4].tolist())
    assert tokens == ["<|startoftranscript|>", "<|de|>", "<|translate|>", "<|notimestamps|>"]


def test_configure_generation_on_english_only_clears_language_and_refuses_german():
    model, _ = make_tiny_whisper()
    model.generation_config.language = "en"
    configure_generation(model.generation_config, language="en", multilingual=False)
    assert model.generation_config.language is None and model.generation_config.task is None
    with pytest.raises(UserError, match="English-only"):
        configure_generation(model.generation_config, language="de", multilingual=False)


# -- acceptance: a fine-tuned model still writes timestamps ---------------------------------
CHUNK_SECONDS = 10  # a 10 s window (500 encoder positions) keeps the test fast


def short_window_whisper() -> tuple[WhisperForConditionalGeneration, object]:
    """tests/tiny_models' English-only model with a 10 s window instead of 30 s."""
    model, processor = make_tiny_whisper()
    config = WhisperConfig(**{**model.config.to_dict(), "max_source_positions": 50 * CHUNK_SECONDS})
    torch.manual_seed(0)
    short = WhisperForConditionalGeneration(config)
    short.generation_config = model.generation_config
    processor.feature_extractor = WhisperFeatureExtractor(
        feature_size=80, chunk_length=CHUNK_SECONDS
    )
    return short.eval(), processor


def tones(spans: list[tuple[float, float, float]], seconds: float = 4.0) -> np.ndarray:
    """Silence with a sine tone (start, end, Hz) per span: audio whose events have times."""
    t = np.arange(int(seconds * 16_000)) / 16_000
    audio = np.zeros_like(t)
    for start, end, hz in spans:
        inside = (t >= start) & (t < end)
        audio[inside] = 0.5 * np.sin(2 * np.pi * hz * t[inside])
    return audio.astype(np.float32)


def generated_segments(model, features, timestamp_begin) -> list[list[tuple]]:
    with torch.no_grad():
        sequences = model.generate(features, return_timestamps=True, max_new_tokens=12)
    rows = []
    for row in sequences.tolist():
        body = [t for t in row if t not in (SOT, EOT)]
        rows.append([(s, e, tuple(text)) for s, e, text in time_pairs(body, timestamp_begin)])
    return rows


# 60 optimizer steps: ~25 s on an idle 2-core CPU. In the default suite: the issue asks for it.
@pytest.mark.long
def test_fine_tuning_on_timestamped_labels_teaches_generate_the_times(en_tokenizer):
    """A few steps on two timed clips; generate(return_timestamps=True) must give their times.

    A label whose time tokens sat at the wrong ids, kept <|notimestamps|>, or lost the pairs
    would make generate disagree with the labelled segments below (or fail to parse).
    """
    model, processor = short_window_whisper()
    examples = [
        example("Hello world", segments=SEGMENTS),
        example("good", segments=((0.6, 2.6, "good"),)),
    ]
    audio = [tones([(0.2, 1.4, 440), (1.8, 3.0, 1200)]), tones([(0.6, 2.6, 2500)])]
    features = LogMel(processor.feature_extractor)(audio)  # (2, 80, 1000)
    encoder = LabelEncoder(
        en_tokenizer, timestamps=True, multilingual=False, timestamp_probability=1.0
    )
    expected = [
        [(s, e, tuple(en_tokenizer.encode(" " + text, add_special_tokens=False)))
         for s, e, text in ex.segments]
        for ex in examples
    ]  # fmt: skip
    begin = encoder.timestamp_begin_id
    assert generated_segments(model, features, begin) != expected  # untrained: not by chance

    collator = SpeechCollator(en_tokenizer.pad_token_id)
    encoded = [encoder.encode(ex) for ex in examples]
    batch = collator.pad_labels([ids for ids, _ in encoded], [n for _, n in encoded])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(60):
        loss = model(
            input_features=features,
            decoder_input_ids=batch["decoder_input_ids"],
            labels=batch["labels"],
        ).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()

    assert generated_segments(model, features, begin) == expected
