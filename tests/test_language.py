"""Languages on a multilingual Whisper, with seeded tiny models: one decode per window (the
fallback's crash on transformers 5.24), language detection per clip, per-set languages.

The same behaviour on OpenAI's real multilingual base is in tests/test_multilingual_base.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from multilingual import EOT, SOT, TIMESTAMP_BEGIN, make_tiny_multilingual_whisper
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.whisper.tokenization_whisper import LANGUAGES

from whisper_train.config import named_sets
from whisper_train.errors import UserError
from whisper_train.evaluation.evaluate import detected_counts, language_id, normalizer_for
from whisper_train.transcription.decoding import (
    Decoded,
    DecodingOptions,
    detect_languages,
    generate_decoded,
)

CHUNK_SECONDS = 2  # a 2 s window: 200 mel frames, 100 encoder positions


def timestamp_loving_whisper():
    """A tiny multilingual Whisper whose decoder says the same thing at every step, whatever it
    hears: 'a' (logit 2), <|1.00|> (1.8), <|endoftext|> (1.5), anything else -10.

    Greedy decoding writes 'a' until max_length (a loop: the fallback must decode again); at
    temperatures near 1 some rows sample a pair of time tokens mid-text, which transformers'
    generate reads as a segment that ends at 1.00 s, and others end at once.
    """
    model, processor = make_tiny_multilingual_whisper(seed=0, chunk_seconds=CHUNK_SECONDS)
    letter = processor.tokenizer.convert_tokens_to_ids("a")
    one_second = TIMESTAMP_BEGIN + 50
    with torch.no_grad():
        decoder = model.model.decoder
        decoder.layer_norm.weight.zero_()  # every position's output is the bias: e0
        decoder.layer_norm.bias.zero_()
        decoder.layer_norm.bias[0] = 1.0
        embeddings = decoder.embed_tokens.weight  # tied with proj_out: logit i = E[i, 0]
        embeddings[:, 0] = -10.0
        embeddings[letter, 0], embeddings[one_second, 0], embeddings[EOT, 0] = 2.0, 1.8, 1.5
    model.generation_config.language = "en"
    model.generation_config.task = "transcribe"
    return model, processor


@pytest.mark.long
def test_the_fallback_decodes_one_window_per_call_from_encoder_outputs():
    """A crash users met: the fallback passes encoder outputs to generate; when a sampled
    decode held a time-token pair, transformers 5.24 went on to a second window, dropped the
    finished rows from `input_features` (None) and raised TypeError in _maybe_reduce_batch.
    Each call is one 30 s window here: every row comes back, decoded once."""
    model, processor = timestamp_loving_whisper()
    letter = processor.tokenizer.convert_tokens_to_ids("a")
    features = torch.randn(6, 80, 100 * CHUNK_SECONDS)
    options = DecodingOptions(temperatures=(0.0, 0.6, 0.8, 1.0), logprob_threshold=None)
    for inputs in (
        {"input_features": features},
        {"encoder_outputs": BaseModelOutput(last_hidden_state=model.get_encoder()(features)[0])},
    ):
        decoded = generate_decoded(
            model, inputs, processor.tokenizer, max_length=60, options=options
        )
        assert len(decoded) == 6
        assert all(item.fallback for item in decoded)  # greedy looped: 'aaaa...'
        assert all(item.temperature > 0 for item in decoded)
        one_second = TIMESTAMP_BEGIN + 50
        assert any(one_second in item.tokens for item in decoded)  # the case that crashed
        # Each row's whole decode, time tokens and all, with every 'a' in its text.
        assert all(item.text == "a" * item.tokens.count(letter) for item in decoded)


# -- detection and per-row languages on a tiny multilingual model ---------------------------


def test_each_clip_is_decoded_in_its_given_language_or_its_detected_one(monkeypatch):
    model, processor = make_tiny_multilingual_whisper(seed=1, chunk_seconds=CHUNK_SECONDS)
    features = torch.randn(3, 80, 100 * CHUNK_SECONDS)
    detected = [code for code, _ in detect_languages(model, {"input_features": features})]
    prompts = []
    plain_generate = model.generate

    def recording_generate(*args, **kwargs):
        output = plain_generate(*args, **kwargs)
        sequences = getattr(output, "sequences", output)  # a tensor without return_dict
        prompts.append((kwargs.get("language"), sequences[:, 1].tolist()))
        return output

    monkeypatch.setattr(model, "generate", recording_generate)
    decoded = generate_decoded(
        model,
        {"input_features": features},
        processor.tokenizer,
        max_length=8,
        options=DecodingOptions(temperatures=(0.0,), logprob_threshold=None),
        languages=["de", None, "spanish"],
    )
    assert [item.language for item in decoded] == ["de", detected[1], "es"]
    assert [item.detected_language for item in decoded] == detected
    assert all(0 < item.detected_probability <= 1 for item in decoded)
    # One generate call, each row prompted with its own language token.
    ((language, prompted),) = prompts
    assert language == ["de", detected[1], "es"]
    assert prompted == [SOT + 1 + list(LANGUAGES).index(code) for code in language]


def test_without_a_language_the_configured_one_is_used_else_each_clip_is_detected():
    model, processor = make_tiny_multilingual_whisper(seed=1, chunk_seconds=CHUNK_SECONDS)
    features = torch.randn(2, 80, 100 * CHUNK_SECONDS)
    options = DecodingOptions(temperatures=(0.0,))
    inputs = {"input_features": features}
    detected = [code for code, _ in detect_languages(model, inputs)]
    decoded = generate_decoded(model, inputs, processor.tokenizer, max_length=8, options=options)
    assert [item.language for item in decoded] == detected
    model.generation_config.language = "<|fr|>"
    decoded = generate_decoded(model, inputs, processor.tokenizer, max_length=8, options=options)
    assert [item.language for item in decoded] == ["fr", "fr"]
    assert [item.detected_language for item in decoded] == detected  # still measured


def test_language_id_accuracy_counts_clips_with_a_stated_language():
    decoded = [
        Decoded("a", (), None, 1.0, 0.0, language=code, detected_language=found)
        for code, found in (("en", "en"), ("es", "en"), ("es", "es"), ("de", "de"))
    ]
    identified = language_id(["en", "es", "es", None], decoded)
    assert (identified.correct, identified.n) == (2, 3)
    assert language_id([None] * 4, decoded) is None
    assert detected_counts(decoded) == {"en": 2, "de": 1, "es": 1}
    assert normalizer_for(["en", None]) == "english" and normalizer_for(["en", "es"]) == "basic"


def test_eval_data_states_a_sets_language_on_the_name_side():
    sets = named_sets(
        ["target:es=held/out", "general:English=g.jsonl", "hub=user/cv:es:test", "plain/"],
        "--eval-data",
    )
    assert sets == {
        "target": ("held/out", "es"),
        "general": ("g.jsonl", "en"),
        "hub": ("user/cv:es:test", None),  # a hub id's colons stay in the path
        "eval": ("plain/", None),
    }
    with pytest.raises(UserError, match="--eval-data target:xx=p: language 'xx'"):
        named_sets(["target:xx=p"], "--eval-data")


@pytest.fixture(scope="module")
def tiny_multilingual_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-multilingual")
    model, processor = make_tiny_multilingual_whisper(seed=0)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def test_each_evaluation_set_is_decoded_in_its_own_language_not_the_training_one(
    tiny_run_config, tiny_multilingual_dir, tone_dataset, monkeypatch, tmp_path
):
    """--language es trains Spanish prefixes; the split of --data is decoded in Spanish, a set
    stated English (general:en=) in English, a set with no language in each clip's detected
    one; the saved model detects (no language) unless --pin-language."""
    from whisper_train.evaluation import generation as generation_module
    from whisper_train.training.train import train

    seen: dict[int, list] = {}
    plain = generation_module.generate_decoded

    def recording(model, inputs, tokenizer, **kwargs):
        decoded = plain(model, inputs, tokenizer, **kwargs)
        seen.setdefault(len(seen), []).append((kwargs["languages"], decoded))
        return decoded

    monkeypatch.setattr(generation_module, "generate_decoded", recording)
    config = tiny_run_config(
        model=str(tiny_multilingual_dir),
        language="es",
        only_train=False,
        max_steps=1,
        eval_subset=2,
        eval_data=[f"general:en={tone_dataset}", f"unstated={tone_dataset}"],
    )
    result = train(config)
    rows = [row for row in result.evaluations if row["step"] == 1]
    by_set = {row["set"]: row for row in rows}
    # One batch per set per evaluation: general (en), then unstated (detected).
    (general_languages, general), (unstated_languages, unstated) = seen[0][0], seen[1][0]
    assert general_languages == ["en", "en"]
    assert [item.language for item in general] == ["en", "en"]
    assert unstated_languages == [None, None]
    assert [item.language for item in unstated] == [item.detected_language for item in unstated]
    assert "language_id_accuracy" in by_set["general"]
    assert "language_id_accuracy" not in by_set["unstated"]
    assert sum(by_set["unstated"]["detected_languages"].values()) == 2
    saved = json.loads((result.final_dir / "generation_config.json").read_text())
    assert saved.get("language") is None and saved["task"] == "transcribe"

    seen.clear()
    pinned = train(
        tiny_run_config(
            model=str(tiny_multilingual_dir),
            language="es",
            pin_language=True,
            only_train=False,
            max_steps=1,
            eval_subset=2,
            output_dir=str(tmp_path / "pinned"),
        )
    )
    (split_languages, _) = seen[0][0]
    assert split_languages == ["es", "es"]  # the split of --data: the training language
    saved = json.loads((pinned.final_dir / "generation_config.json").read_text())
    assert saved["language"] == "es"


def test_check_data_says_a_multilingual_model_needs_the_clips_language(
    tone_dataset, tiny_multilingual_dir, tiny_whisper_dir
):
    from whisper_train.checkdata import check_data, format_report

    report = check_data(tone_dataset, model=str(tiny_multilingual_dir))
    assert report.languages == {"unspecified": 12} and report.without_language == 12
    assert "12 clip(s) state no language and --model is multilingual" in format_report(report)
    english_only = check_data(tone_dataset, model=str(tiny_whisper_dir))
    assert english_only.without_language == 0
    assert "state no language" not in format_report(english_only)


def test_evaluate_says_how_far_it_got_where_no_bar_is_drawn(tiny_whisper, tone_dataset, capsys):
    from whisper_train.data.layouts import load_examples
    from whisper_train.evaluation.evaluate import evaluate_examples
    from whisper_train.transcription.decoding import NO_FALLBACK

    model, processor = tiny_whisper
    examples = load_examples(tone_dataset)
    evaluate_examples(
        model, processor, examples, batch_size=4, max_length=4, progress=True, decoding=NO_FALLBACK
    )
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("evaluate:")]
    assert [line.split(" in ")[0] for line in lines] == [
        f"evaluate: {n} of 12 clips transcribed" for n in (4, 8, 12)
    ]
