"""One home per shared fact: a run folder's model, the 448-token and 30 s limits, label length.

`check-data` and `train` count a label's length with one function
(`LabelEncoder.decoder_tokens`), so the labels check-data flags as too long are exactly the ones
train's screening skips, whatever the model's prefix (language, task) and timestamps.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import shutil
import tokenize
from pathlib import Path

import numpy as np
import pytest
import soundfile
from multilingual import make_tiny_multilingual_whisper

import whisper_train
from whisper_train import audio, runfolder
from whisper_train.checkdata import check_data, label_encoder_for
from whisper_train.config import RunConfig
from whisper_train.data import labels, layouts, screening
from whisper_train.deploy import export
from whisper_train.evaluation.evaluate import report_paths
from whisper_train.formats import ct2
from whisper_train.memory import plan
from whisper_train.models import is_multilingual, load_model, model_folder
from whisper_train.training import setup_phases
from whisper_train.training.recipe import FineTuneRecipe
from whisper_train.transcription import transcribe

PACKAGE = Path(whisper_train.__file__).parent


@pytest.fixture(scope="module")
def multilingual_dir(tmp_path_factory) -> Path:
    """A saved tiny multilingual Whisper: its byte-level tokenizer makes one token a character."""
    out = tmp_path_factory.mktemp("tiny-multilingual")
    model, processor = make_tiny_multilingual_whisper()
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


# -- a run folder's model ------------------------------------------------------------------------


def test_every_reader_of_a_run_folder_finds_its_final_model(tmp_path, tiny_whisper_dir):
    run = tmp_path / "run"
    shutil.copytree(tiny_whisper_dir, run / runfolder.FINAL_DIR)
    (run / runfolder.CONFIG_FILE).write_text("model: {}\n")
    final = run / runfolder.FINAL_DIR

    assert runfolder.final_model_dir(run) == final and model_folder(str(run)) == final
    assert runfolder.final_model_dir(final) is None and model_folder(str(final)) == final
    assert runfolder.run_folder_of(run) == run == runfolder.run_folder_of(final)
    # Loading, transcribing, exporting, checking data and placing reports all agree.
    assert load_model(str(run))[0].config.vocab_size == load_model(str(final))[0].config.vocab_size
    assert transcribe.load_backend(str(run)).processor.tokenizer.name_or_path == str(final)
    assert export.load_for_export(str(run))[2] is False
    assert label_encoder_for(str(run)).tokenizer.name_or_path == str(final)
    assert report_paths(str(run), baseline="b")[0].parent == run / runfolder.EVALUATION_DIR


def test_a_folder_holding_a_model_is_that_model_even_beside_a_final_folder(
    tmp_path, tiny_whisper_dir, multilingual_dir
):
    """check-data used to take `final/` whenever there was one; loading did not."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_whisper_dir, folder)  # English-only
    shutil.copytree(multilingual_dir, folder / runfolder.FINAL_DIR)
    assert runfolder.final_model_dir(folder) is None and model_folder(str(folder)) == folder
    assert runfolder.run_folder_of(folder) is None
    model, _ = load_model(str(folder))
    assert not is_multilingual(model)
    assert label_encoder_for(str(folder)).multilingual is False

    adapter = tmp_path / "adapter"  # a LoRA adapter saved with a final/ beside it
    (adapter / runfolder.FINAL_DIR).mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    assert runfolder.final_model_dir(adapter) is None


# -- the limits ----------------------------------------------------------------------------------


def _numbers(path: Path) -> list[float]:
    """The number literals of a module's code (not its comments and docstrings, not powers, not
    negated ones: `-30` dBFS is a level, never a count of tokens or seconds)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline))
    return [
        float(ast.literal_eval(token.string))  # 0o644 and 1_000 too
        for before, previous, token in zip(tokens, tokens[1:], tokens[2:], strict=False)
        if token.type == tokenize.NUMBER
        and previous.string != "**"
        and not (previous.string == "-" and before.string in ("(", ",", "=", "[", ":", "{"))
        and not token.string.lower().endswith("j")
    ]


def test_the_448_tokens_and_the_30_s_window_are_each_named_once():
    homes = {"448": PACKAGE / "data" / "labels.py", "30": PACKAGE / "audio.py"}
    for literal, home in homes.items():
        found = [
            path.relative_to(PACKAGE)
            for path in sorted(PACKAGE.rglob("*.py"))
            if float(literal) in _numbers(path)
        ]
        assert found == [home.relative_to(PACKAGE)], literal

    assert labels.MAX_DECODER_TOKENS == 448 and audio.CHUNK_LENGTH == 30
    screen = inspect.signature(screening.screen_examples).parameters
    assert screen["max_label_tokens"].default == labels.MAX_DECODER_TOKENS
    assert screen["max_seconds"].default == audio.CHUNK_LENGTH
    for function in (plan.estimate_memory, plan.plan_checkpointing):
        assert inspect.signature(function).parameters["label_tokens"].default == 448
    assert labels.N_TIME_TOKENS == 1501  # <|0.00|> ... <|30.00|>
    assert len(ct2._timestamp_tokens()) == labels.N_TIME_TOKENS


# -- label length: check-data and train agree -----------------------------------------------------


def _write_wav(path: Path, seconds: float) -> None:
    soundfile.write(path, np.zeros(int(seconds * 16_000), dtype=np.float32), 16_000)


def _manifest(folder: Path, texts: list[str], language: str | None) -> Path:
    folder.mkdir()
    _write_wav(folder / "clip.wav", 1.0)
    rows = [
        {"audio": "clip.wav", "text": text, **({"language": language} if language else {})}
        for text in texts
    ]
    manifest = folder / "train.jsonl"
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return manifest


def _srt_time(seconds: float) -> str:
    return f"00:00:{int(seconds):02d},{round(seconds % 1 * 1000):03d}"


def _subtitles(folder: Path, pairs: list[tuple[str, str]]) -> Path:
    """One recording per example, two timed segments each: the labels carry time tokens."""
    folder.mkdir()
    for index, segment_texts in enumerate(pairs):
        _write_wav(folder / f"rec{index}.wav", 6.0)
        cues = [(0.5, 2.0), (2.5, 5.0)]
        (folder / f"rec{index}.srt").write_text(
            "".join(
                f"{n + 1}\n{_srt_time(start)} --> {_srt_time(end)}\n{text}\n\n"
                for n, ((start, end), text) in enumerate(zip(cues, segment_texts, strict=True))
            ),
            encoding="utf-8",
        )
    return folder


def _skipped_by_train(tmp_path: Path, data_path: Path, model: str, **options) -> set[str]:
    """Origins of the examples train's screening sets aside (the recipe's own set-up phases)."""
    config = RunConfig()
    config.update(
        {
            "data": str(data_path),
            "model": model,
            "output_dir": str(tmp_path / "out"),
            "only_train": True,
            **options,
        }
    )
    recipe = FineTuneRecipe(config)
    # The sets are facts gathered before the record: no accelerator is needed.
    facts = setup_phases.gather_facts(
        recipe.asked, process=setup_phases.join_processes(), saved=None
    )
    kept = {example.origin for example in facts.datasets.train}
    return {example.origin for example in layouts.load_examples(data_path)} - kept


def _check_and_train(tmp_path, data_path, model, **options):
    report = check_data(data_path, model=model, **options)
    flagged = {f.origin for f in report.findings if f.kind == "long_label"}
    return report, flagged, _skipped_by_train(tmp_path, data_path, model, **options)


def _assert_agree_around_the_limit(report, flagged, skipped):
    # The data straddles the limit: 448 positions fit, 449 do not.
    assert {448, 449} <= set(report.label_tokens)
    assert flagged == skipped
    assert 0 < len(flagged) < len(report.label_tokens)
    assert len(flagged) == sum(n > labels.MAX_DECODER_TOKENS for n in report.label_tokens)


def test_multilingual_prefix_check_data_flags_exactly_what_train_skips(tmp_path, multilingual_dir):
    # Byte-level tokenizer: " " + n characters are n + 1 tokens; the prefix is <|sot|><|de|>
    # <|transcribe|><|notimestamps|>, so a label takes n + 5 decoder positions.
    texts = ["x" * n for n in range(440, 447)]
    manifest = _manifest(tmp_path / "data", texts, language="de")
    report, flagged, skipped = _check_and_train(tmp_path, manifest, str(multilingual_dir))
    assert sorted(report.label_tokens) == [n + 5 for n in range(440, 447)]
    _assert_agree_around_the_limit(report, flagged, skipped)


def test_timestamped_labels_check_data_flags_exactly_what_train_skips(tmp_path, multilingual_dir):
    # Time tokens count: <|sot|><|de|><|transcribe|>, then <|t|> " text" <|t|> per segment.
    pairs = [("a" * 200, "b" * n) for n in range(234, 242)]
    folder = _subtitles(tmp_path / "data", pairs)
    options = {"language": "de", "timestamps": True}
    report, flagged, skipped = _check_and_train(tmp_path, folder, str(multilingual_dir), **options)
    assert sorted(report.label_tokens) == [3 + (2 + 201) + (2 + 1 + n) for n in range(234, 242)]
    _assert_agree_around_the_limit(report, flagged, skipped)
    # Without timestamps the same data is shorter, as train without --timestamps counts it.
    plain = check_data(folder, model=str(multilingual_dir), language="de")
    assert max(plain.label_tokens) < max(report.label_tokens)


@pytest.mark.parametrize("model", ["tiny.en", "hf"])
def test_english_only_check_data_flags_exactly_what_train_skips(tmp_path, tiny_whisper_dir, model):
    """tiny.en (a CTranslate2 folder) and an HF folder: " hello" is one token, the prefix
    <|sot|><|notimestamps|>, so n words take n + 2 decoder positions (check-data once said
    n + 5: it assumed the multilingual prefix and counted <|endoftext|> too)."""
    spec = "tiny.en" if model == "tiny.en" else str(tiny_whisper_dir)
    texts = [" ".join(["hello"] * n) for n in range(443, 450)]
    manifest = _manifest(tmp_path / "data", texts, language=None)
    report, flagged, skipped = _check_and_train(tmp_path, manifest, spec)
    assert sorted(report.label_tokens) == [n + 2 for n in range(443, 450)]
    _assert_agree_around_the_limit(report, flagged, skipped)
