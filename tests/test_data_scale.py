"""Start-up that does not grow with the corpus: batch label counts, the screening cache shared
by processes and runs, and check-data's duplicate search reading only what it needs."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
from conftest import fill_disk_on_write
from tiny_models import english_tokenizer

from whisper_train.checkdata import PREFIX_BYTES, check_data
from whisper_train.checkdata import audio as checkdata_audio
from whisper_train.config import RunConfig
from whisper_train.config.resolve import evaluation_sets
from whisper_train.data import screening
from whisper_train.data.examples import Example, PackedExamples
from whisper_train.data.labels import LabelEncoder
from whisper_train.data.layouts import load_examples
from whisper_train.data.screening import screen
from whisper_train.training.datasets import prepare_datasets


def _wav(path: Path, samples: np.ndarray, rate: int = 16_000) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(path, samples.astype(np.int16), rate, subtype="PCM_16")
    return path


def _noise(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-3000, 3000, n)


def _manifest(folder: Path, rows: list[tuple[str, str]]) -> Path:
    path = folder / "train.jsonl"
    lines = [json.dumps({"audio": audio, "text": text}) for audio, text in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _encoder(**options) -> LabelEncoder:
    return LabelEncoder(english_tokenizer(), multilingual=False, **options)


# -- labels counted in batches ------------------------------------------------------------------
def test_batch_label_counts_equal_the_per_example_counts():
    texts = ["hello there", "", "  spaced  out  ", "naïve café, 東京 — 42%!", "a " * 300]
    examples = [Example("x.wav", text, origin=str(i)) for i, text in enumerate(texts)]
    examples.append(
        Example(
            "y.wav",
            "first part second",
            segments=((0.0, 1.2, "first part"), (1.3, 2.0, "second"), (0.5, 0.9, "overlap")),
        )
    )
    for timestamps in (False, True):
        encoder = _encoder(timestamps=timestamps)
        one_by_one = [encoder.count_tokens(example) for example in examples]
        # A chunk smaller than the list: counts must not depend on where chunks are cut.
        assert encoder.count_tokens_batch(examples, chunk_size=4) == one_by_one
        assert encoder.decoder_tokens_batch(examples) == [n - 1 for n in one_by_one]
    # The timestamped example really took the longer form (2 time tokens a segment).
    assert _encoder(timestamps=True).count_tokens_batch(examples[-1:])[0] > one_by_one[-1] - 6


def test_prepare_datasets_counts_each_label_once_and_hands_the_counts_on(
    tmp_path, monkeypatch, tone_dataset
):
    monkeypatch.setenv("WHISPER_TRAIN_CACHE", str(tmp_path / "cache"))
    config = RunConfig()
    config.update({"data": str(tone_dataset), "only_train": True, "output_dir": str(tmp_path)})
    encoder = _encoder()
    calls = []
    monkeypatch.setattr(encoder, "count_tokens", lambda e: calls.append(e) or 0)

    datasets = prepare_datasets(
        config, evaluation_sets(config), encoder, nonspeech=None, max_label_tokens=448
    )

    assert not calls  # no per-example tokenisation: screening counted them in one batch
    expected = [_encoder().count_tokens(example) for example in datasets.train]
    assert datasets.label_lengths(encoder) == expected
    assert len(expected) == len(load_examples(tone_dataset))


# -- the screening cache ------------------------------------------------------------------------
def _screen_with_counted_reads(examples, cache, monkeypatch, salt="tokenizer-a"):
    reads = []
    original = screening.audio_length
    monkeypatch.setattr(
        screening, "audio_length", lambda path: reads.append(path) or original(path)
    )
    result = screen(
        examples,
        count_all=lambda exs: [len(e.text.split()) for e in exs],
        max_label_tokens=3,
        cache_folder=cache,
        cache_salt=salt,
    )
    return result, reads


def _screening_data(tmp_path: Path) -> Path:
    for i in range(4):
        _wav(tmp_path / f"c{i}.wav", _noise(8000, i))
    rows = [("c0.wav", "one two"), ("c1.wav", "one two three four"), ("gone.wav", "x")]
    rows += [("c2.wav", "three"), ("c3.wav", "")]
    return _manifest(tmp_path, rows)


def test_a_second_run_reuses_the_screening_and_reads_no_header(tmp_path, monkeypatch):
    manifest = _screening_data(tmp_path)
    cache = tmp_path / "cache"
    first, first_reads = _screen_with_counted_reads(load_examples(manifest), cache, monkeypatch)
    assert first.kept == [0, 3] and first.label_tokens == [2, 1]
    assert [s.reason for s in first.skips] == [
        "label longer than 3 tokens",
        "audio file not found",
        "empty transcript",
    ]
    assert len(first_reads) == 5

    second, second_reads = _screen_with_counted_reads(load_examples(manifest), cache, monkeypatch)
    assert second == first
    assert second_reads == []


@pytest.mark.parametrize("change", ["manifest", "audio file", "tokenizer"])
def test_the_screening_is_redone_when_what_it_depends_on_changes(tmp_path, monkeypatch, change):
    manifest = _screening_data(tmp_path)
    cache = tmp_path / "cache"
    _screen_with_counted_reads(load_examples(manifest), cache, monkeypatch)
    salt = "tokenizer-a"
    if change == "manifest":
        manifest.write_text(manifest.read_text().replace("three four", "three"), encoding="utf-8")
    elif change == "audio file":  # c1.wav replaced by a file that passes: same name, new bytes
        _wav(tmp_path / "c1.wav", _noise(9000, 7))
        os.utime(tmp_path / "c1.wav", ns=(1, 1))
    else:
        salt = "tokenizer-b"
    again, reads = _screen_with_counted_reads(load_examples(manifest), cache, monkeypatch, salt)
    assert len(reads) == 5
    if change == "manifest":
        assert again.kept == [0, 1, 3]


# A rank of its own: screens the manifest and prints how many headers it read and what it kept.
_RANK = """
import json, sys
from whisper_train.data import layouts, screening
reads = []
original = screening.audio_length
screening.audio_length = lambda path: reads.append(path) or original(path)
result = screening.screen(
    layouts.load_examples(sys.argv[1]),
    count_all=lambda exs: [len(e.text.split()) for e in exs],
    max_label_tokens=3,
    cache_folder=sys.argv[2],
)
print(json.dumps([len(reads), result.kept]))
"""


def test_processes_started_together_read_the_headers_once(tmp_path):
    manifest = _screening_data(tmp_path)
    command = [sys.executable, "-c", _RANK, str(manifest), str(tmp_path / "cache")]
    ranks = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    results = [json.loads(rank.communicate(timeout=60)[0]) for rank in ranks]
    assert sorted(reads for reads, _ in results) == [0, 5]
    assert [kept for _, kept in results] == [[0, 3], [0, 3]]


def test_an_unwritable_cache_folder_screens_without_it(tmp_path, monkeypatch):
    manifest = _screening_data(tmp_path)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    result, reads = _screen_with_counted_reads(load_examples(manifest), blocker, monkeypatch)
    assert result.kept == [0, 3] and len(reads) == 5


def test_a_full_disk_costs_the_screening_cache_never_the_screening(tmp_path, monkeypatch):
    manifest = _screening_data(tmp_path)
    cache = tmp_path / "cache"
    with pytest.MonkeyPatch.context() as patch:
        fill_disk_on_write(patch)
        result, reads = _screen_with_counted_reads(load_examples(manifest), cache, monkeypatch)
    assert result.kept == [0, 3] and len(reads) == 5
    assert not [path.name for path in cache.iterdir() if not path.name.endswith(".lock")]
    again, reads = _screen_with_counted_reads(load_examples(manifest), cache, monkeypatch)
    assert again == result and len(reads) == 5  # nothing half-written was taken for a result


# -- paths ----------------------------------------------------------------------------------------
def test_relative_paths_resolve_against_the_manifest_folder_and_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    _wav(tmp_path / "data" / "a.wav", _noise(800, 0))
    rows = [("a.wav", "x"), ("sub/../a.wav", "x"), ("~/b.wav", "x"), (str(tmp_path / "c.wav"), "x")]
    examples = load_examples(_manifest(tmp_path / "data", rows))
    assert [e.audio for e in examples] == [
        str(tmp_path / "data" / "a.wav"),
        str(tmp_path / "data" / "a.wav"),
        str(tmp_path / "home" / "b.wav"),
        str(tmp_path / "c.wav"),
    ]


# -- check-data's duplicate search ----------------------------------------------------------------
def test_check_data_hashes_whole_files_only_when_size_and_prefix_collide(tmp_path, monkeypatch):
    long = 3 * PREFIX_BYTES // 2  # samples of 2 bytes: files three prefixes long
    base = _noise(long, 0)
    late_change = base.copy()
    late_change[-10] += 1  # same size, same first PREFIX_BYTES, other bytes
    _wav(tmp_path / "a.wav", base)
    _wav(tmp_path / "a-copy.wav", base)
    _wav(tmp_path / "a-late-change.wav", late_change)
    _wav(tmp_path / "b.wav", _noise(long, 1))  # same size, another prefix
    _wav(tmp_path / "short.wav", _noise(1000, 2))  # a size of its own
    _wav(tmp_path / "short-copy-name.wav", _noise(1200, 3))  # a size of its own
    names = ["a", "a-copy", "a-late-change", "b", "short", "short-copy-name"]
    manifest = _manifest(tmp_path, [(f"{name}.wav", f"text {name}") for name in names])

    hashed = []
    original = checkdata_audio._file_hash
    monkeypatch.setattr(
        checkdata_audio,
        "_file_hash",
        lambda path, limit=None: hashed.append((Path(path).name, limit)) or original(path, limit),
    )
    report = check_data(manifest)

    duplicates = [(f.origin, f.detail) for f in report.findings if f.kind == "duplicate_audio"]
    assert duplicates == [(str(tmp_path / "a-copy.wav"), f"same bytes as {tmp_path / 'a.wav'}")]
    whole = sorted(name for name, limit in hashed if limit is None)
    prefix_only = sorted(name for name, limit in hashed if limit == PREFIX_BYTES)
    assert whole == ["a-copy.wav", "a-late-change.wav", "a.wav"]
    assert prefix_only == ["a-copy.wav", "a-late-change.wav", "a.wav", "b.wav"]


# -- training audio checked by the loader, not before step 1 ------------------------------------
def _problem_clips(folder: Path) -> list[Example]:
    """One clip of each kind screening and the loader set aside, and one good clip."""
    _wav(folder / "good.wav", _noise(8000, 0))  # 0.5 s
    _wav(folder / "long.wav", _noise(31 * 8000, 1), rate=8000)  # 31 s
    (folder / "broken.wav").write_bytes(b"RIFF, but no audio after it")
    audio = {name: str(folder / f"{name}.wav") for name in ("good", "long", "broken", "gone")}
    return [
        Example(audio["good"], "fine", origin="row1"),
        Example(audio["gone"], "missing file", origin="row2"),
        Example(audio["broken"], "not audio", origin="row3"),
        Example(audio["long"], "too long", origin="row4"),
        Example(audio["good"], "window past the end", start=0.2, end=3.0, origin="row5"),
        Example(audio["good"], "   ", origin="row6"),
    ]


def test_the_loader_skips_each_clip_for_the_reason_screening_gives(tmp_path, monkeypatch):
    examples = _problem_clips(tmp_path)
    screened = screen(examples, count_all=lambda exs: [1] * len(exs), read_headers=True)
    assert screened.kept == [0]

    from whisper_train.data import features

    decoded = []
    original = features.load_audio
    monkeypatch.setattr(
        features, "load_audio", lambda path, **kw: decoded.append(path) or original(path, **kw)
    )
    dataset = features.SpeechDataset(examples, _encoder())
    items = [dataset[index] for index in range(len(examples))]

    assert isinstance(items[0], dict) and items[0]["text"] == "fine"
    assert items[1:] == screened.skips  # same origins, reasons and details
    assert [s.reason for s in screened.skips] == [
        "audio file not found",
        "unreadable audio",
        "longer than 30 s",
        "window ends after the audio",
        "empty transcript",
    ]
    assert decoded == [examples[0].audio]  # nothing set aside was decoded first


def test_training_audio_is_not_read_before_step_one_unless_strict(tmp_path, monkeypatch):
    for i in range(10):
        _wav(tmp_path / f"c{i}.wav", _noise(8000, i))
    manifest = _manifest(tmp_path, [(f"c{i}.wav", f"word {i}") for i in range(10)])
    reads = []
    original = screening.audio_length
    monkeypatch.setattr(
        screening, "audio_length", lambda path: reads.append(path) or original(path)
    )

    def read_before_step_one(**settings) -> tuple[int, int, int]:
        monkeypatch.setenv("WHISPER_TRAIN_CACHE", str(tmp_path / f"cache-{len(reads)}"))
        config = RunConfig()
        config.update({"data": str(manifest), "output_dir": str(tmp_path), **settings})
        reads.clear()
        sets = prepare_datasets(
            config, evaluation_sets(config), _encoder(), nonspeech=None, max_label_tokens=448
        )
        return len(reads), len(sets.train), sum(len(e) for e in sets.eval.values())

    # The held-out evaluation set's headers are read (each evaluation scores the same clips);
    # of the training set's, one: the check that some clip is usable. The loader reads the rest.
    assert read_before_step_one(eval_split=0.2) == (2 + 1, 8, 2)
    assert read_before_step_one(eval_split=0.2, strict=True) == (10, 8, 2)
    assert read_before_step_one(only_train=True) == (1, 10, 0)


def test_a_stated_duration_over_30_s_is_skipped_without_reading_the_file(tmp_path, monkeypatch):
    examples = [
        Example(str(tmp_path / "a.wav"), "kept", duration=29.9),
        Example(str(tmp_path / "b.wav"), "too long", duration=30.5),
    ]
    monkeypatch.setattr(screening, "audio_length", lambda path: pytest.fail(f"read {path}"))
    screened = screen(examples, count_all=lambda exs: [1] * len(exs), read_headers=False)
    assert screened.kept == [0]
    assert [(s.reason, s.detail) for s in screened.skips] == [("longer than 30 s", "30.5 s")]


def test_jsonl_rows_end_at_newlines_only_and_columns_may_be_missing_on_some_rows(tmp_path):
    _wav(tmp_path / "a.wav", _noise(800, 0))
    rows = [
        {"audio": "a.wav", "text": "first line\u2028same row"},  # U+2028: legal inside JSON
        {"audio": "a.wav", "text": "in german", "language": "de"},
        {"audio": "a.wav", "text": "no language again"},
    ]
    manifest = tmp_path / "train.jsonl"
    text = "".join(json.dumps(row, ensure_ascii=False) + "\r\n" for row in rows)
    manifest.write_text(text, encoding="utf-8", newline="")
    examples = load_examples(manifest)
    assert [(e.text, e.language, e.origin) for e in examples] == [
        ("first line\u2028same row", None, f"{manifest}:1"),
        ("in german", "de", f"{manifest}:2"),
        ("no language again", None, f"{manifest}:3"),
    ]


# -- the training set as one buffer -------------------------------------------------------------
def test_packed_examples_give_back_every_field_of_every_example():
    examples = [
        Example("/d/a.wav", "hello", origin="m.jsonl:1"),
        Example(
            "/d/ü b.flac",
            "naïve café, 東京 \u2028 42%",
            language="fr",
            start=1.25,
            end=7.5,
            duration=6.25,
            segments=((0.0, 1.5, "naïve"), (1.5, 6.25, "café, 東京")),
            origin="subs.srt (1.25-7.50 s)",
        ),
        Example("/d/c.wav", "", duration=0.0),
    ]
    packed = PackedExamples(iter(examples))  # any iterable, read once
    assert len(packed) == 3
    assert list(packed) == examples
    assert [packed[-1], packed[-3]] == [examples[2], examples[0]]
    assert packed[1:] == examples[1:] and packed[::2] == examples[::2]
    with pytest.raises(IndexError):
        packed[3]
    with pytest.raises(IndexError):
        packed[-4]
    # DataLoader workers started by spawn (macOS, Windows) receive it pickled.
    assert list(pickle.loads(pickle.dumps(packed))) == examples
    assert len(PackedExamples([])) == 0


def test_the_training_set_reaches_the_loader_packed(tmp_path, monkeypatch, tone_dataset):
    """No list of objects for forked workers to copy: prepare_datasets hands over the packed
    set and SpeechDataset keeps it as it is (packing any other sequence itself)."""
    from whisper_train.data.features import SpeechDataset

    monkeypatch.setenv("WHISPER_TRAIN_CACHE", str(tmp_path / "cache"))
    config = RunConfig()
    config.update({"data": str(tone_dataset), "only_train": True, "output_dir": str(tmp_path)})
    sets = prepare_datasets(
        config, evaluation_sets(config), _encoder(), nonspeech=None, max_label_tokens=448
    )
    assert isinstance(sets.train, PackedExamples)
    assert list(sets.train) == load_examples(tone_dataset)
    assert SpeechDataset(sets.train, _encoder()).examples is sets.train
    listed = SpeechDataset(list(sets.train), _encoder()).examples
    assert isinstance(listed, PackedExamples) and list(listed) == list(sets.train)
