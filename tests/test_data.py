"""Every data layout → Examples; windows from subtitles; split; screening; one-line errors.

Each test writes its own small dataset (sine/noise WAVs) in tmp_path.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile

from whisper_train.audio import SAMPLE_RATE, load_audio
from whisper_train.data.examples import Example, Skip
from whisper_train.data.layouts import load_examples, pack_segments, parse_subtitles
from whisper_train.data.screening import screen_examples, split_examples, summarize_skips
from whisper_train.errors import UserError


def write_wav(path: Path, seconds: float = 1.0, rate: int = SAMPLE_RATE, channels: int = 1):
    path.parent.mkdir(parents=True, exist_ok=True)
    noise = np.random.default_rng(0).uniform(-0.3, 0.3, (round(seconds * rate), channels))
    soundfile.write(path, noise.astype(np.float32), rate)
    return path


def write_csv(path: Path, rows: list[dict], delimiter: str = ",") -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter=delimiter)
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def words(n: int) -> int:
    """A stand-in token counter for screening: one token per word."""
    return n


# -- audiofolder and manifests -------------------------------------------------------------
@pytest.mark.parametrize("metadata, second_row_line", [("metadata.csv", 3), ("metadata.jsonl", 2)])
def test_audiofolder(tmp_path, metadata, second_row_line):
    write_wav(tmp_path / "clips" / "a.wav", rate=8_000)
    write_wav(tmp_path / "clips" / "b.wav", rate=44_100, channels=2)
    rows = [
        {"file_name": "clips/a.wav", "transcription": " Hello there "},
        {"file_name": "clips/b.wav", "transcription": "General Kenobi"},
    ]
    writer = write_csv if metadata.endswith(".csv") else write_jsonl
    writer(tmp_path / metadata, rows)

    examples = load_examples(tmp_path)

    assert [e.text for e in examples] == ["Hello there", "General Kenobi"]
    assert [e.audio for e in examples] == [
        str(tmp_path / "clips" / "a.wav"),
        str(tmp_path / "clips" / "b.wav"),
    ]
    assert examples[1].origin == f"{tmp_path / metadata}:{second_row_line}"
    audio = load_audio(examples[1].audio)
    assert audio.shape == (SAMPLE_RATE,) and audio.dtype == np.float32


def test_jsonl_manifest_nemo_style_with_windows_and_language(tmp_path):
    long = write_wav(tmp_path / "audio" / "long.wav", seconds=10, rate=22_050)
    elsewhere = write_wav(tmp_path / "other" / "abs.wav")
    manifest = write_jsonl(
        tmp_path / "audio" / "train.jsonl",
        [
            {"audio_filepath": "long.wav", "text": "one", "offset": 2.0, "duration": 3.0},
            {"audio_filepath": "long.wav", "text": "two", "start": 6, "end": 7.5, "language": "de"},
            {"audio_filepath": str(elsewhere), "text": "three", "duration": 1.0},
        ],
    )

    one, two, three = load_examples(manifest)

    assert (one.audio, one.start, one.end, one.duration) == (str(long), 2.0, 5.0, 3.0)
    assert (two.start, two.end, two.language) == (6.0, 7.5, "de")
    assert (three.audio, three.start, three.duration) == (str(elsewhere), None, 1.0)
    assert len(load_audio(one.audio, start=one.start, end=one.end)) == 3 * SAMPLE_RATE


def test_csv_and_tsv_manifests(tmp_path):
    write_wav(tmp_path / "a.wav")
    rows = [{"path": "a.wav", "sentence": 'She said "hi", twice', "duration": "1.0"}]
    write_csv(tmp_path / "data.csv", rows)
    (tmp_path / "data.tsv").write_text('path\tsentence\na.wav\tShe said "hi", twice\n')

    for name in ("data.csv", "data.tsv"):
        (example,) = load_examples(tmp_path / name)
        assert example.text == 'She said "hi", twice'
        assert example.audio == str(tmp_path / "a.wav")


def test_forced_format_reads_a_file_with_any_suffix(tmp_path):
    write_wav(tmp_path / "a.wav")
    manifest = tmp_path / "train.txt"
    manifest.write_text(json.dumps({"audio": "a.wav", "text": "hi"}) + "\n")

    with pytest.raises(UserError, match="no recognised data layout"):
        load_examples(manifest)
    assert load_examples(manifest, data_format="jsonl")[0].text == "hi"


# -- Common Voice ---------------------------------------------------------------------------
def make_commonvoice(root: Path) -> Path:
    for name in ("x.mp3", "y.wav", "z.wav"):
        write_wav(root / "clips" / name)
    # Common Voice writes sentences unquoted: a `"` is part of the text.
    header = "client_id\tpath\tsentence\tup_votes\tlocale\n"
    (root / "train.tsv").write_text(
        header + 'c1\tx.mp3\tFirst "one"\t2\ten\nc2\ty.wav\tTwo\t2\ten\n'
    )
    (root / "dev.tsv").write_text(header + "c3\tz.wav\tDrei\t2\tde\n")
    (root / "test.tsv").write_text(header)
    return root


def test_commonvoice_default_split_is_train(tmp_path):
    root = make_commonvoice(tmp_path / "cv")

    examples = load_examples(root)

    assert [e.text for e in examples] == ['First "one"', "Two"]
    assert examples[0].audio == str(root / "clips" / "x.mp3")
    assert examples[0].language == "en"


def test_commonvoice_split_suffix_and_tsv_file(tmp_path):
    root = make_commonvoice(tmp_path / "cv")

    (dev,) = load_examples(f"{root}:dev")
    assert (dev.text, dev.language, dev.audio) == ("Drei", "de", str(root / "clips" / "z.wav"))
    assert load_examples(root / "dev.tsv") == [dev]
    with pytest.raises(UserError, match=r"no validated.tsv.*splits found: dev, test, train"):
        load_examples(f"{root}:validated")
    with pytest.raises(UserError, match="no examples found"):
        load_examples(f"{root}:test")


# -- Kaldi ----------------------------------------------------------------------------------
def test_kaldi_folder_with_segments(tmp_path):
    recipe = tmp_path / "recipe"
    write_wav(recipe / "wav" / "rec1.wav", seconds=8, rate=8_000)
    data = recipe / "data" / "train"
    data.mkdir(parents=True)
    (data / "wav.scp").write_text("rec1 wav/rec1.wav\n")  # relative to the recipe root
    (data / "text").write_text("utt1 HELLO WORLD\nutt2 GOOD BYE\n")
    (data / "segments").write_text("utt1 rec1 0.50 2.25\nutt2 rec1 3.0 6.0\nutt3 rec1 6 7\n")

    examples = load_examples(data)

    assert [(e.text, e.start, e.end) for e in examples] == [
        ("HELLO WORLD", 0.5, 2.25),
        ("GOOD BYE", 3.0, 6.0),
    ]
    assert examples[0].audio == str(recipe / "wav" / "rec1.wav")


def test_kaldi_without_segments_and_piped_wav_scp(tmp_path):
    write_wav(tmp_path / "a.wav")
    (tmp_path / "wav.scp").write_text(f"a {tmp_path / 'a.wav'}\n")
    (tmp_path / "text").write_text("a some words\n")
    (example,) = load_examples(tmp_path)
    assert (example.text, example.start) == ("some words", None)

    (tmp_path / "wav.scp").write_text("a sph2pipe -f wav a.sph |\n")
    with pytest.raises(UserError, match=r"wav.scp:1: 'a' is a piped command.*plain paths"):
        load_examples(tmp_path)


# -- Hugging Face datasets ------------------------------------------------------------------
def test_hf_saved_dataset_bytes_are_cached_once_as_they_are(tmp_path, monkeypatch):
    import datasets  # a test dependency (the `datasets` extra)

    monkeypatch.setenv("WHISPER_TRAIN_CACHE", str(tmp_path / "cache"))
    encoded = io.BytesIO()
    soundfile.write(encoded, np.full(22_050, 0.25, np.float32), 22_050, format="FLAC")
    on_disk = write_wav(tmp_path / "b.wav")
    # Built from plain structs: encoding with Audio() would need torchcodec.
    table = datasets.Dataset.from_dict(
        {
            "audio": [
                {"bytes": encoded.getvalue(), "path": None},
                {"bytes": None, "path": str(on_disk)},
            ],
            "sentence": ["from bytes", "from a path"],
        }
    ).cast_column("audio", datasets.Audio())
    datasets.DatasetDict({"train": table, "validation": table.select([0])}).save_to_disk(
        tmp_path / "hf"
    )

    from_bytes, from_path = load_examples(tmp_path / "hf")

    assert from_bytes.text == "from bytes"
    assert from_bytes.audio.startswith(str(tmp_path / "cache")) and from_bytes.audio.endswith(
        ".flac"
    )
    # The FLAC's own bytes, not a float32 WAV decoded from them (4x the disk).
    assert Path(from_bytes.audio).read_bytes() == encoded.getvalue()
    samples, rate = soundfile.read(from_bytes.audio, dtype="float32")
    assert rate == 22_050 and np.allclose(samples, 0.25, atol=1e-4)  # decoded, not resampled
    assert load_audio(from_bytes.audio).shape == (SAMPLE_RATE,)
    # save_to_disk embeds local files too, so both come back as cached copies.
    assert from_path.text == "from a path"
    np.testing.assert_array_equal(soundfile.read(from_path.audio)[0], soundfile.read(on_disk)[0])
    assert [e.text for e in load_examples(f"{tmp_path / 'hf'}:validation")] == ["from bytes"]
    with pytest.raises(UserError, match="no split 'test'; splits found: train, validation"):
        load_examples(f"{tmp_path / 'hf'}:test")


def test_hub_id_offline_fails_with_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as caught:
        load_examples("someone/speech-set:clean:train")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("someone/speech-set:clean:train: not a local file or folder")


def test_missing_datasets_package_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now fails
    with pytest.raises(UserError, match=r"pip install 'whisper-train\[datasets\]'"):
        load_examples(tmp_path)


# -- subtitles ------------------------------------------------------------------------------
SRT = """1
00:00:00,500 --> 00:00:04,000
<i>Hello</i> and
welcome

2
00:00:04,000 --> 00:00:12,250
{\\an8}to the show

3
00:00:13,000 --> 00:00:29,000
today we talk

4
00:00:29,500 --> 00:00:40,000
about windows
"""

VTT = """WEBVTT

NOTE a comment that is not a cue

intro
00:01.000 --> 00:03.500 align:start
<v Ann>Good morning</v>

00:00:04.000 --> 00:00:05.000
everyone
"""


def test_parse_srt_and_vtt(tmp_path):
    (tmp_path / "a.srt").write_text(SRT)
    (tmp_path / "b.vtt").write_text(VTT)

    assert parse_subtitles(tmp_path / "a.srt")[:2] == [
        (0.5, 4.0, "Hello and welcome"),
        (4.0, 12.25, "to the show"),
    ]
    assert parse_subtitles(tmp_path / "b.vtt") == [
        (1.0, 3.5, "Good morning"),
        (4.0, 5.0, "everyone"),
    ]


def test_subtitle_folder_packs_windows_of_at_most_30_seconds(tmp_path):
    write_wav(tmp_path / "talk.wav", seconds=41, rate=44_100, channels=2)
    (tmp_path / "talk.srt").write_text(SRT)

    first, second = load_examples(tmp_path)

    # Cues 1-3 end at 29 s, within 30 s of 0.5 s; cue 4 would reach 40 s: a new window.
    assert (first.start, first.end) == (0.5, 29.0)
    assert first.text == "Hello and welcome to the show today we talk"
    assert first.segments == (
        (0.0, 3.5, "Hello and welcome"),
        (3.5, 11.75, "to the show"),
        (12.5, 28.5, "today we talk"),
    )
    assert (second.start, second.end, second.segments) == (
        29.5,
        40.0,
        ((0.0, 10.5, "about windows"),),
    )
    assert first.audio == str(tmp_path / "talk.wav")
    assert len(load_audio(second.audio, start=second.start, end=second.end)) == 10.5 * SAMPLE_RATE


def test_pack_segments_keeps_an_overlong_segment_alone():
    windows = pack_segments("/a.wav", [(0, 5, "a"), (5, 45, "b"), (45, 50, "c")], origin="x")
    assert [(w.start, w.end) for w in windows] == [(0, 5), (5, 45), (45, 50)]


def test_manifest_rows_of_segments_are_grouped_with_the_subtitles_format(tmp_path):
    write_wav(tmp_path / "a.wav", seconds=40)
    write_wav(tmp_path / "b.wav", seconds=5)
    rows = [
        {"audio": "a.wav", "text": "second", "start": 10, "end": 20},
        {"audio": "b.wav", "text": "other", "start": 1, "end": 2},
        {"audio": "a.wav", "text": "first", "start": 0, "end": 10},
        {"audio": "a.wav", "text": "third", "start": 25, "end": 38},
    ]
    manifest = write_jsonl(tmp_path / "segments.jsonl", rows)

    examples = load_examples(manifest, data_format="subtitles")

    assert [(Path(e.audio).name, e.text, e.start, e.end) for e in examples] == [
        ("a.wav", "first second", 0, 20),
        ("a.wav", "third", 25, 38),
        ("b.wav", "other", 1, 2),
    ]
    assert len(load_examples(manifest)) == 4  # without the format, one example per row


@pytest.mark.parametrize(
    "cues, problem",
    [
        ("1\n00:00:05,000 --> 00:00:04,000\nback\n", "a.srt:2: cue ends .* before it starts"),
        (
            "1\n00:00:01,000 --> 00:00:05,000\nx\n\n2\n00:00:04,000 --> 00:00:06,000\ny\n",
            "a.srt:6: cue starts .* before the previous cue ends",
        ),
    ],
)
def test_bad_subtitle_times_name_the_line(tmp_path, cues, problem):
    write_wav(tmp_path / "a.wav")
    (tmp_path / "a.srt").write_text(cues)
    with pytest.raises(UserError, match=problem):
        load_examples(tmp_path)


def test_subtitle_without_audio(tmp_path):
    (tmp_path / "lonely.srt").write_text(SRT)
    with pytest.raises(UserError, match=r"lonely.srt: no audio file with the same name"):
        load_examples(tmp_path)


# -- errors ---------------------------------------------------------------------------------
def test_missing_path_and_unknown_format(tmp_path):
    with pytest.raises(UserError, match=r"nothing\.jsonl: no such file or folder"):
        load_examples(tmp_path / "nothing.jsonl")
    with pytest.raises(UserError, match=r"--data-format parquet: unknown format; choose one of "):
        load_examples(tmp_path, data_format="parquet")


def test_unrecognised_folder_lists_what_was_looked_for(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    with pytest.raises(UserError) as caught:
        load_examples(tmp_path)
    message = str(caught.value)
    for looked_for in ("metadata.csv", "wav.scp", "train.tsv", "state.json", ".srt", ".jsonl"):
        assert looked_for in message


def test_missing_text_column_lists_columns_and_accepted_names(tmp_path):
    write_wav(tmp_path / "a.wav")
    manifest = write_csv(tmp_path / "d.csv", [{"audio": "a.wav", "words": "hi"}])
    with pytest.raises(UserError, match=r"d.csv: no text column; found audio, words; accepted "
                       r"names: transcription, text, sentence, normalized_text"):  # fmt: skip
        load_examples(manifest)


def test_all_audio_missing_is_an_error(tmp_path):
    manifest = write_jsonl(tmp_path / "d.jsonl", [{"audio": "gone.wav", "text": "hi"}])
    with pytest.raises(UserError, match=r"d.jsonl:1: audio file .*gone.wav not found"):
        load_examples(manifest)


@pytest.mark.parametrize(
    "name, content, problem",
    [
        ("d.jsonl", '{"audio": "a.wav", "text": "ok"}\n{"audio": "a.wav", "text": \n', "d.jsonl:2: malformed row: not valid JSON"),
        ("d.jsonl", '["a.wav", "hi"]\n', "d.jsonl:1: malformed row: expected a JSON object"),
        ("d.csv", "audio,text\na.wav,ok\na.wav,too,many\n", "d.csv:3: malformed row: 3 fields where the header has 2"),
        ("d.tsv", "audio\ttext\na.wav\n", "d.tsv:2: malformed row: 1 fields where the header has 2"),
        ("d.jsonl", '{"audio": "a.wav", "text": "x", "duration": "long"}\n', "d.jsonl:1: malformed row: duration 'long'"),
        ("d.jsonl", '{"audio": "a.wav", "text": "x", "start": 2, "end": 1}\n', "d.jsonl:1: malformed row: end 1.0 is not after"),
        ("d.jsonl", '{"audio": "a.wav", "text": null}\n', "d.jsonl:1: malformed row: column 'text' must be text"),
    ],
)  # fmt: skip
def test_malformed_rows_name_file_and_line(tmp_path, name, content, problem):
    write_wav(tmp_path / "a.wav")
    (tmp_path / name).write_text(content)
    with pytest.raises(UserError, match=problem):
        load_examples(tmp_path / name)


def test_non_utf8_text_names_the_line(tmp_path):
    write_wav(tmp_path / "a.wav")
    (tmp_path / "d.csv").write_bytes("audio,text\na.wav,ok\na.wav,caf\xe9\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"d.csv:3: not UTF-8 text \(byte 0xe9\); re-save"):
        load_examples(tmp_path / "d.csv")


def test_utf8_bom_is_accepted(tmp_path):
    write_wav(tmp_path / "a.wav")
    (tmp_path / "d.csv").write_bytes("audio,text\na.wav,café\n".encode("utf-8-sig"))
    assert load_examples(tmp_path / "d.csv")[0].text == "café"


def test_empty_dataset(tmp_path):
    (tmp_path / "d.jsonl").write_text("\n")
    with pytest.raises(UserError, match=r"d.jsonl: no examples found"):
        load_examples(tmp_path / "d.jsonl")


def test_every_error_is_one_line(tmp_path):
    (tmp_path / "d.csv").write_text("audio,words\na.wav,hi\n")
    (tmp_path / "x").mkdir()
    for path in (tmp_path / "d.csv", tmp_path / "x", tmp_path / "none.csv"):
        with pytest.raises(UserError) as caught:
            load_examples(path)
        assert "\n" not in str(caught.value)


# -- split ----------------------------------------------------------------------------------
def clips(n: int, per_recording: int = 1) -> list[Example]:
    return [Example(audio=f"/r{i // per_recording}.wav", text=f"t{i}") for i in range(n)]


def test_split_is_seeded_deterministic_and_disjoint():
    examples = clips(50)

    train, held_out = split_examples(examples, 0.2, seed=7)

    assert len(held_out) == 10 and len(train) == 40
    assert set(train).isdisjoint(held_out) and set(train) | set(held_out) == set(examples)
    assert split_examples(examples, 0.2, seed=7) == (train, held_out)
    assert split_examples(examples, 0.2, seed=8)[1] != held_out


def test_split_keeps_windows_of_one_recording_together():
    examples = clips(40, per_recording=4)  # 10 recordings of 4 windows

    train, held_out = split_examples(examples, 0.25, seed=0)

    assert len(held_out) % 4 == 0 and 8 <= len(held_out) <= 12  # whole recordings, about 25%
    assert {e.audio for e in train}.isdisjoint({e.audio for e in held_out})


def test_split_of_one_recording_falls_back_to_windows():
    train, held_out = split_examples(clips(10, per_recording=10), 0.2, seed=0)
    assert (len(train), len(held_out)) == (8, 2)


def test_split_of_two_long_recordings_holds_out_about_the_fraction_as_time_ranges(caplog):
    # Two 25-minute recordings cut into 50 windows each by their subtitles (30 s cues).
    examples = [
        window
        for name in ("a", "b")
        for window in pack_segments(
            f"/{name}.wav",
            [(30.0 * i, 30.0 * i + 29.0, f"{name} cue {i}") for i in range(50)],
            origin=f"{name}.srt",
        )
    ]
    assert len(examples) == 100

    with caplog.at_level("INFO", logger="whisper_train.data"):
        train, held_out = split_examples(examples, 0.1, seed=0)

    # 10% of the clips (whole recordings would have held out 50%), 5 of each recording, each
    # a contiguous time range with no training window inside it.
    assert len(held_out) == 10 and len(train) == 90
    for name in ("/a.wav", "/b.wav"):
        starts = sorted(e.start for e in held_out if e.audio == name)
        assert starts == [starts[0] + 30.0 * i for i in range(5)]
        assert not [e for e in train if e.audio == name and starts[0] <= e.start <= starts[-1]]
    assert "10 of 100 clips held out for evaluation as a time range of each recording" in (
        caplog.text
    )
    assert split_examples(examples, 0.1, seed=0) == (train, held_out)


def test_split_leaves_out_training_windows_that_overlap_a_held_out_one():
    # One recording in 10 s windows every 5 s: each overlaps its neighbours.
    examples = [
        Example("/r.wav", f"w{i}", start=5.0 * i, end=5.0 * i + 10.0, origin=f"w{i}")
        for i in range(20)
    ]
    train, held_out = split_examples(examples, 0.1, seed=0)

    assert len(held_out) == 2
    first, last = min(e.start for e in held_out), max(e.end for e in held_out)
    assert len(train) == 20 - 2 - sum(1 for e in examples if e.start in (first - 5, last - 5))
    assert all(e.end <= first or e.start >= last for e in train)


def test_split_never_leaves_training_empty():
    assert split_examples(clips(3), 0.0, seed=0) == (clips(3), [])
    assert len(split_examples(clips(2), 0.5, seed=0)[0]) == 1
    with pytest.raises(UserError, match="only 1 examples: too few"):
        split_examples(clips(1), 0.1, seed=0)


# -- screening ------------------------------------------------------------------------------
def test_screen_skips_each_kind_of_problem(tmp_path):
    ok = write_wav(tmp_path / "ok.wav", seconds=2)
    long = write_wav(tmp_path / "long.wav", seconds=31, rate=8_000)
    broken = tmp_path / "broken.wav"
    broken.write_text("not audio")
    examples = [
        Example(str(ok), "fine", origin="row1"),
        Example(str(tmp_path / "gone.wav"), "x", origin="row2"),
        Example(str(broken), "x", origin="row3"),
        Example(str(long), "x", origin="row4"),
        Example(str(long), "window is fine", start=1.0, end=20.0, origin="row5"),
        Example(str(ok), "   ", origin="row6"),
        Example(str(ok), "a b c d e", origin="row7"),
        Example(str(ok), "x", start=1.0, end=5.0, origin="row8"),
    ]

    kept, skips = screen_examples(
        examples, count_tokens=lambda e: len(e.text.split()), max_label_tokens=4
    )

    assert [e.origin for e in kept] == ["row1", "row5"]
    assert [(s.origin, s.reason) for s in skips] == [
        ("row2", "audio file not found"),
        ("row3", "unreadable audio"),
        ("row4", "longer than 30 s"),
        ("row6", "empty transcript"),
        ("row7", "label longer than 4 tokens"),
        ("row8", "window ends after the audio"),
    ]


def test_screen_strict_raises_on_the_first_problem(tmp_path):
    ok = write_wav(tmp_path / "ok.wav")
    examples = [Example(str(ok), "fine", origin="r1"), Example(str(ok), "", origin="r2")]
    with pytest.raises(UserError, match=r"r2: empty transcript.*without --strict"):
        screen_examples(examples, count_tokens=lambda e: 1, strict=True)


def test_screening_decodes_float_files_and_skips_windows_with_nan_or_inf_samples(tmp_path):
    samples = np.full(16_000 * 4, 0.1, dtype=np.float32)
    samples[16_000 * 3 + 100] = np.inf  # in the last second only
    soundfile.write(tmp_path / "float.wav", samples, 16_000, subtype="FLOAT")
    path = str(tmp_path / "float.wav")
    examples = [
        Example(path, "clean window", start=0.0, end=2.5, origin="r1"),
        Example(path, "window with inf", start=2.5, end=4.0, origin="r2"),
    ]

    kept, skips = screen_examples(examples, count_tokens=lambda e: 1)

    assert [e.origin for e in kept] == ["r1"]
    assert [(s.origin, s.reason) for s in skips] == [("r2", "non-finite audio samples")]
    assert "1 samples are NaN or infinite (the first at 3.01 s)" in skips[0].detail
    with pytest.raises(UserError, match=r"r2: non-finite audio samples .*without --strict"):
        screen_examples(examples, count_tokens=lambda e: 1, strict=True)


def test_summarize_skips_counts_by_reason():
    skips = [Skip(f"row{i}", "longer than 30 s", f"{31 + i} s") for i in range(5)]
    skips.append(Skip("row9", "empty transcript"))

    summary = summarize_skips(skips)

    assert summary.splitlines()[0] == "6 skipped"
    assert "5 longer than 30 s: row0 [31 s], row1 [32 s], row2 [33 s], and 2 more" in summary
    assert "1 empty transcript: row9" in summary
    assert summarize_skips([]) == "0 skipped"


def test_forced_format_that_does_not_fit_says_so(tmp_path):
    write_wav(tmp_path / "a.wav")
    with pytest.raises(UserError, match="not a dataset saved with save_to_disk"):
        load_examples(tmp_path, data_format="hf")
    with pytest.raises(UserError, match="no wav.scp; a Kaldi data folder needs wav.scp and text"):
        load_examples(tmp_path, data_format="kaldi")
    with pytest.raises(UserError, match="no metadata.csv or metadata.jsonl"):
        load_examples(tmp_path, data_format="audiofolder")
    with pytest.raises(UserError, match="the jsonl format needs a manifest file, not a folder"):
        load_examples(tmp_path, data_format="jsonl")
