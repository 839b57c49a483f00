"""`check-data`: each kind of problem is found in a generated dataset, and the exit codes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile
from tiny_models import english_tokenizer

from whisper_train.checkdata import check_data, format_report, write_histogram_png
from whisper_train.cli import main


def write_wav(path: Path, seconds: float, *, rate: int = 16_000, channels: int = 1, hz=440.0):
    t = np.arange(int(seconds * rate)) / rate
    mono = 0.2 * np.sin(2 * np.pi * hz * t)
    soundfile.write(path, np.stack([mono] * channels, axis=1) if channels > 1 else mono, rate)


def write_manifest(folder: Path, rows: list[dict]) -> Path:
    manifest = folder / "train.jsonl"
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return manifest


@pytest.fixture
def clean_data(tmp_path) -> Path:
    tmp_path = tmp_path / "clean"
    tmp_path.mkdir()
    for index, seconds in enumerate([1.0, 2.0, 6.0]):
        write_wav(tmp_path / f"clip{index}.wav", seconds, hz=300 + 100 * index)
    return write_manifest(
        tmp_path,
        [
            {"audio": "clip0.wav", "text": "one clip", "language": "en"},
            {"audio": "clip1.wav", "text": "another clip", "language": "en"},
            {"audio": "clip2.wav", "text": "a third", "language": "en"},
        ],
    )


@pytest.fixture
def messy_data(tmp_path) -> Path:
    tmp_path = tmp_path / "messy"
    tmp_path.mkdir()
    write_wav(tmp_path / "good.wav", 1.0)
    write_wav(tmp_path / "stereo44.wav", 2.0, rate=44_100, channels=2, hz=500)
    write_wav(tmp_path / "long.wav", 31.0, hz=600)
    shutil.copy(tmp_path / "good.wav", tmp_path / "good-copy.wav")
    (tmp_path / "broken.wav").write_bytes(b"this is not audio at all")
    write_wav(tmp_path / "quiet.wav", 1.5, hz=700)
    write_wav(tmp_path / "cjk.wav", 3.0, hz=800)
    write_wav(tmp_path / "bell.wav", 1.0, hz=900)
    return write_manifest(
        tmp_path,
        [
            {"audio": "good.wav", "text": "hello there"},  # line 1
            {"audio": "stereo44.wav", "text": "Hello   there", "language": "de"},  # 2: dup text
            {"audio": "long.wav", "text": "far too long"},  # 3
            {"audio": "good-copy.wav", "text": "a copy"},  # 4: same bytes as good.wav
            {"audio": "broken.wav", "text": "unreadable"},  # 5
            {"audio": "missing.wav", "text": "not there"},  # 6
            {"audio": "quiet.wav", "text": "   "},  # 7: empty label
            {"audio": "good.wav", "text": "listed twice"},  # 8: same file again
            {"audio": "bell.wav", "text": "bell\u0007 and zero\u200bwidth"},  # 9: control chars
            {"audio": "cjk.wav", "text": "語" * 300},  # 10: short in characters, long in tokens
        ],
    )


def found(report, kind: str) -> dict[str, str]:
    """{origin: detail} of one kind; origins shortened to `train.jsonl:N` / the file name."""
    return {Path(f.origin).name: f.detail for f in report.findings if f.kind == kind}


def test_clean_data_reports_totals_formats_and_no_problems(clean_data):
    report = check_data(clean_data)

    assert report.clips == 3
    assert report.total_seconds == pytest.approx(9.0, abs=0.01)
    assert report.sample_rates == {16_000: 3} and report.channels == {1: 3}
    assert report.languages == {"en": 3}
    assert report.problems == [] and report.notes == []
    # 1, 2 and 6 s: ten half-second bins from 1 to 6 s.
    histogram = report.histogram()
    assert [(start, end) for start, end, _ in histogram][:2] == [(1.0, 1.5), (1.5, 2.0)]
    assert histogram[-1][1] == 6.0 and len(histogram) == 10
    assert [count for _, _, count in histogram] == [1, 0, 1, 0, 0, 0, 0, 0, 0, 1]
    text = format_report(report)
    assert "3 clips" in text and "0 problems" in text and "#" in text


def test_each_kind_of_problem_is_found_in_its_row(messy_data):
    report = check_data(messy_data, model=english_tokenizer())
    name = messy_data.name

    assert set(found(report, "unreadable")) == {f"{name}:5", f"{name}:6"}
    assert "file not found" in found(report, "unreadable")[f"{name}:6"]
    assert set(found(report, "too_long")) == {f"{name}:3"}
    assert set(found(report, "empty_label")) == {f"{name}:7"}
    duplicates = found(report, "duplicate_audio")
    assert f"{name}:8" in duplicates  # good.wav listed twice
    assert any(origin.endswith("good-copy.wav") for origin in duplicates)  # same bytes
    assert len(duplicates) == 2
    # Two control/format characters, both first seen in row 9.
    bad = [f for f in report.findings if f.kind == "bad_characters"]
    assert {Path(f.origin).name for f in bad} == {f"{name}:9"} and len(bad) == 2
    assert set(found(report, "long_label")) == {f"{name}:10"}
    # Notes, not problems: "hello there" and "Hello   there" are the same transcript.
    assert set(found(report, "duplicate_text")) == {f"{name}:1"}
    assert report.sample_rates == {16_000: 6, 44_100: 1} and report.channels == {1: 6, 2: 1}
    assert report.languages == {"unspecified": 9, "de": 1}


def test_without_a_tokenizer_labels_are_measured_in_characters(messy_data):
    report = check_data(messy_data)
    # 300 CJK characters are over 448 tokens, but only a tokenizer can tell.
    assert found(report, "long_label") == {}
    assert "pass --model" in format_report(report)


def test_rare_characters_are_a_note_in_a_large_dataset(tmp_path):
    write_wav(tmp_path / "long.wav", 60.0)
    rows = [{"audio": "long.wav", "text": f"row {i}", "start": i, "end": i + 1} for i in range(59)]
    rows[7]["text"] = "Stra\u00dfe"
    report = check_data(write_manifest(tmp_path, rows), data_format="jsonl")

    assert report.clips == 59 and report.problems == []
    assert [f.detail.split()[0] for f in report.notes] == ["'ß'"]


def test_exit_codes_json_and_png(messy_data, clean_data, tmp_path, capsys):
    assert main(["check-data", str(clean_data), "--strict"]) == 0
    assert main(["check-data", str(messy_data)]) == 0  # problems are warnings
    capsys.readouterr()
    assert main(["check-data", str(messy_data), "--strict", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["clips"] == 10 and report["counts"]["too_long"] == 1

    png = tmp_path / "hist.png"
    assert main(["check-data", str(clean_data), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main(["check-data", str(tmp_path / "nowhere.jsonl")]) == 2
    assert "nowhere.jsonl" in capsys.readouterr().err


def test_histogram_png_marks_the_30_s_window(clean_data, tmp_path, monkeypatch):
    """A red dashed line at 30 s, named "30 s window" in the legend, in view even when every
    clip is far shorter (here 1-6 s), and drawn in the saved PNG's pixels."""
    from matplotlib.figure import Figure
    from matplotlib.image import imread

    figures = []
    real_savefig = Figure.savefig

    def keep_figure(figure, *args, **kwargs):
        figures.append(figure)
        return real_savefig(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep_figure)
    path = write_histogram_png(check_data(clean_data), tmp_path / "h.png")
    (figure,) = figures
    (axes,) = figure.axes
    (mark,) = [line for line in axes.get_lines() if line.get_label() == "30 s window"]
    assert list(mark.get_xdata()) == [30, 30] and mark.get_linestyle() == "--"
    assert axes.get_xlim()[0] < 30 < axes.get_xlim()[1]
    assert "30 s window" in [text.get_text() for text in axes.get_legend().get_texts()]

    # The pixels: the column at x = 30 s (give or take a pixel of rounding; the line is ~2 px
    # wide), from the bottom of the plot to its top.
    image = imread(path)  # (rows, columns, RGBA) in [0, 1], row 0 at the top
    scale = image.shape[1] / figure.bbox.width  # saving may use another dpi than the figure
    column = round(axes.transData.transform((30, 0))[0] * scale)
    bottom, top = (round(image.shape[0] - y * scale) for y in (axes.bbox.y0, axes.bbox.y1))
    strip = image[top:bottom, column - 1 : column + 2, :3]
    # Red is (1, 0, 0); the bounds take anti-aliased edges and leave out the blue bars (C0 is
    # (0.12, 0.47, 0.71)), black and white. "--" dashes are 3.7 on, 1.6 off: ~70% of the rows
    # are red (66% measured, dash ends blurred); without the line none is.
    red = (strip[..., 0] > 0.8) & (strip[..., 1] < 0.3) & (strip[..., 2] < 0.3)
    assert red.any(axis=1).mean() > 0.5


def test_histogram_bins_suit_the_durations(tmp_path):
    """One-second clips are not lumped into one wide bin; bins span the data in round widths."""
    for index, seconds in enumerate([0.8, 0.9, 1.0, 1.0, 1.1, 1.3]):
        write_wav(tmp_path / f"c{index}.wav", seconds, hz=300 + 50 * index)
    rows = [{"audio": f"c{index}.wav", "text": f"clip {index}"} for index in range(6)]
    report = check_data(write_manifest(tmp_path, rows))

    histogram = report.histogram()
    assert [(start, end) for start, end, _ in histogram] == [
        (0.8, 0.9),
        (0.9, 1.0),
        (1.0, 1.1),
        (1.1, 1.2),
        (1.2, 1.3),
    ]
    assert [count for _, _, count in histogram] == [1, 1, 2, 1, 1]  # the last bin holds 1.3 s
    text = format_report(report)
    assert "  1.0-1.1 s      2 ####" in text
    as_json = report.to_dict()["histogram"]
    assert as_json[2] == {"start_s": 1.0, "end_s": 1.1, "clips": 2}


@pytest.mark.parametrize(
    "shortest,longest", [(1.0, 1.0), (0.3, 29.7), (1.0, 31.0), (2.0, 3600.0), (0.0, 0.0)]
)
def test_histogram_edges_are_round_few_and_cover_the_data(shortest, longest):
    from whisper_train.checkdata import histogram_edges

    edges = histogram_edges(shortest, longest)
    widths = np.diff(edges)
    assert 1 <= len(widths) <= 13 and np.allclose(widths, widths[0])
    # The data lies inside, and no bin at either end is past it.
    assert edges[0] <= shortest < edges[1] and edges[-1] >= longest
    assert len(widths) == 1 or edges[-2] < longest
    mantissa = widths[0] / 10 ** np.floor(np.log10(widths[0]))
    assert any(np.isclose(mantissa, m) for m in (1, 2, 2.5, 5))


def test_label_lengths_in_tokens_are_reported_with_a_model(messy_data, tmp_path, capsys):
    report = check_data(messy_data, model=english_tokenizer())
    summary = report.label_summary()
    # Nine non-empty labels: eight short ones and 300 CJK characters (over 448 tokens).
    assert len(report.label_tokens) == 9
    # Decoder positions, as train counts them: "hello there" is 2 tokens + <|startoftranscript|>
    # <|notimestamps|> + <|endoftext|>, less the one position the shift to labels drops.
    assert summary == {"min": 4, "median": 4, "max": 603, "over_limit": 1, "limit": 448}
    text = format_report(report)
    assert (
        f"min {summary['min']}, median {summary['median']:g}, max {summary['max']} tokens" in text
    )
    assert "1 over 448" in text

    # The command line says the same, in text and in JSON.
    tokenizer_dir = tmp_path / "tok"
    english_tokenizer().save_pretrained(tokenizer_dir)
    assert main(["check-data", str(messy_data), "--model", str(tokenizer_dir)]) == 0
    out = capsys.readouterr().out
    assert f"tokenizer: min {summary['min']}, median" in out and "1 over 448" in out
    assert main(["check-data", str(messy_data), "--model", str(tokenizer_dir), "--json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert as_json["label_token_summary"] == summary
    assert sorted(as_json["label_tokens"]) == sorted(report.label_tokens)


def test_without_a_model_no_token_figures_are_claimed(clean_data):
    report = check_data(clean_data)
    assert report.label_summary() is None and report.to_dict()["label_token_summary"] is None
    text = format_report(report)
    assert "labels measured in characters (pass --model" in text
    assert text.count("median") == 1  # the durations' only


def _flac_that_does_not_decode(path: Path) -> None:
    """A FLAC whose header reads (16 kHz, 1 s) but whose frames are zeroed: decoding fails."""
    write_wav(path, 1.0)  # soundfile picks FLAC from the suffix
    data = path.read_bytes()
    path.write_bytes(data[:200] + bytes(len(data) - 200))


def test_clips_that_open_but_do_not_decode_are_problems(tmp_path):
    from test_audio import encode_with_pyav, speech_band_signal

    soundfile.write(tmp_path / "call.wav", speech_band_signal(1.0, 8_000), 8_000, subtype="GSM610")
    encode_with_pyav(tmp_path / "phone.m4a", speech_band_signal(1.0, 16_000), 16_000, "ipod", "aac")
    _flac_that_does_not_decode(tmp_path / "zeroed.flac")
    rows = [{"audio": n, "text": "words"} for n in ("call.wav", "phone.m4a", "zeroed.flac")]

    report = check_data(write_manifest(tmp_path, rows))

    # The GSM WAV and the M4A decode and count; the FLAC's header opened, its samples do not.
    assert list(found(report, "unreadable")) == ["train.jsonl:3"]
    assert "zeroed.flac" in found(report, "unreadable")["train.jsonl:3"]
    assert report.sample_rates == {8_000: 1, 16_000: 2}
    assert report.total_seconds == pytest.approx(2.0, abs=0.1)


def test_a_sample_of_each_format_is_decoded_and_every_clip_under_strict(tmp_path):
    from whisper_train.checkdata import DECODED_PER_FORMAT

    for index in range(DECODED_PER_FORMAT):
        write_wav(tmp_path / f"good{index}.flac", 1.0)
    _flac_that_does_not_decode(tmp_path / "late.flac")  # after the sample of FLACs
    names = [f"good{index}.flac" for index in range(DECODED_PER_FORMAT)] + ["late.flac"]
    manifest = write_manifest(tmp_path, [{"audio": n, "text": "words"} for n in names])

    assert found(check_data(manifest), "unreadable") == {}
    strict = found(check_data(manifest, strict=True), "unreadable")
    assert list(strict) == [f"train.jsonl:{len(names)}"]
    assert main(["check-data", str(manifest), "--strict"]) == 1


def _float_wav_with_nan(path: Path, seconds: float = 1.0, *, at: float = 0.5) -> None:
    """A float WAV that reads and decodes, with one NaN and one +inf sample from `at` s."""
    t = np.arange(int(seconds * 16_000)) / 16_000
    samples = (0.2 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    samples[int(at * 16_000)] = np.nan
    samples[int(at * 16_000) + 1] = np.inf
    soundfile.write(path, samples, 16_000, subtype="FLOAT")


def test_float_clips_with_nan_or_inf_samples_are_problems_with_or_without_strict(tmp_path):
    from whisper_train.checkdata import DECODED_PER_FORMAT

    # More float WAVs than the sample decoded per format: the bad one comes after them.
    names = [f"good{index}.wav" for index in range(DECODED_PER_FORMAT)] + ["nan.wav"]
    for name in names[:-1]:
        soundfile.write(tmp_path / name, np.full(16_000, 0.1, np.float32), 16_000, subtype="FLOAT")
    _float_wav_with_nan(tmp_path / "nan.wav", at=0.25)
    manifest = write_manifest(tmp_path, [{"audio": n, "text": "words"} for n in names])

    for strict in (False, True):
        problems = found(check_data(manifest, strict=strict), "non_finite")
        assert list(problems) == [f"train.jsonl:{len(names)}"]
        assert (
            "2 samples are NaN or infinite (the first at 0.25 s)"
            in problems[f"train.jsonl:{len(names)}"]
        )
    assert main(["check-data", str(manifest), "--strict"]) == 1
