"""`whisper-train pseudo-label`: a model's transcripts as a manifest train reads, resumable.

Most tests label with a stand-in runtime (`ScriptedBackend`: a text per clip, chosen by the
clip's length) so that what is written, resumed and filtered is checked in seconds; the real
tiny.en labels the manifest that `train` then trains on, and the run a signal kills.
"""

from __future__ import annotations

import errno
import json
import signal
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile
from conftest import start_whisper_train, write_tone_dataset

from whisper_train.audio import SAMPLE_RATE
from whisper_train.cli import main
from whisper_train.data.layouts import load_examples
from whisper_train.evaluation.scoring import get_normalizer
from whisper_train.transcription import pseudo_label as pseudo_label_module
from whisper_train.transcription.pseudo_label import PROGRESS_SUFFIX, Progress, pseudo_label
from whisper_train.transcription.transcribe import transcribe_paths
from whisper_train.transcription.transcripts import Segment


class ScriptedBackend:
    """A runtime that writes `text_of(seconds)` for each clip, as one segment (or, for a clip
    over 30 s, one segment every 10 s)."""

    def __init__(self, text_of=lambda seconds: "alpha bravo charlie"):
        self.text_of = text_of
        self.calls = 0

    def transcribe(self, audio: np.ndarray, *, timestamps: bool = True):
        self.calls += 1
        seconds = len(audio) / SAMPLE_RATE
        if seconds <= 30:
            text = self.text_of(seconds)
            return text, [Segment(0.0, seconds, text)] if text else []
        starts = np.arange(0.0, seconds - 1.0, 10.0)
        segments = [
            Segment(float(s), float(min(s + 9.0, seconds)), f"part {i}")
            for i, s in enumerate(starts)
        ]
        return " ".join(s.text for s in segments), segments


@pytest.fixture
def scripted(monkeypatch):
    """Every pseudo-label run of the test decodes with one `ScriptedBackend`."""
    backend = ScriptedBackend()
    monkeypatch.setattr(pseudo_label_module, "load_backend", lambda model, **options: backend)
    return backend


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def write_clips(folder: Path, seconds: list[float]) -> list[Path]:
    """Quiet noise clips of the given lengths (16 kHz WAV), one file each."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i, length in enumerate(seconds):
        path = folder / f"clip{i:03d}.wav"
        samples = 0.01 * rng.standard_normal(round(length * SAMPLE_RATE))
        soundfile.write(path, samples.astype(np.float32), SAMPLE_RATE)
        paths.append(path)
    return paths


# -- the manifest -------------------------------------------------------------------------------
def test_rows_keep_the_transcript_beside_the_model_text_and_their_wer(tmp_path, scripted):
    data = write_tone_dataset(tmp_path / "tones", n=6)
    output = tmp_path / "labels.jsonl"
    result = pseudo_label("any", data, output, progress=False)
    rows = rows_of(output)
    references = {e.audio: e.text for e in load_examples(data)}
    assert result.labelled == len(rows) == 6 and result.already_done == 0
    normalize = get_normalizer("english")
    for row in rows:
        assert row["text"] == "alpha bravo charlie"
        assert row["reference_text"] == references[row["audio"]]
        reference = normalize(row["reference_text"]).split()
        hypothesis = normalize(row["text"]).split()
        # Three words against three: the WER is the share of positions that differ.
        differ = sum(r != h for r, h in zip(reference, hypothesis, strict=True))
        assert row["wer"] == pytest.approx(differ / 3, abs=1e-4)
        assert row["duration"] == pytest.approx(1.2, abs=1e-3)
    # train reads it: the model's text is the training text.
    examples = load_examples(output)
    assert [e.text for e in examples] == ["alpha bravo charlie"] * 6


def test_max_wer_leaves_out_the_disagreeing_clips_and_says_how_many(tmp_path, scripted, capsys):
    data = write_tone_dataset(tmp_path / "tones", n=12)
    output = tmp_path / "labels.jsonl"
    argv = ["pseudo-label", "--model", "m", "--data", str(data), "--output", str(output)]
    assert main([*argv, "--max-wer", "0.5"]) == 0
    said = capsys.readouterr().out
    kept = rows_of(output)
    assert main([*argv[:-1], str(tmp_path / "all.jsonl")]) == 0
    every = rows_of(tmp_path / "all.jsonl")
    over = [row for row in every if row["wer"] > 0.5]
    assert 0 < len(over) < 12  # the words were drawn so that some agree and some do not
    assert sorted(r["audio"] for r in kept) == sorted(r["audio"] for r in every if r["wer"] <= 0.5)
    assert f"--max-wer 0.5: left out {len(over)} of 12 clip(s)" in said


def test_a_clip_where_the_model_writes_nothing_is_not_written(tmp_path, monkeypatch, capsys):
    backend = ScriptedBackend(lambda seconds: "" if seconds < 1.5 else "words here")
    monkeypatch.setattr(pseudo_label_module, "load_backend", lambda model, **options: backend)
    write_clips(tmp_path / "clips", [1.0, 2.0, 1.0, 3.0])
    output = tmp_path / "labels.jsonl"
    assert main(["pseudo-label", "--data", str(tmp_path / "clips"), "--output", str(output)]) == 0
    assert [Path(r["audio"]).name for r in rows_of(output)] == ["clip001.wav", "clip003.wav"]
    assert "left out 2 clip(s) where the model wrote nothing" in capsys.readouterr().out
    # Recorded as done: a rerun decodes none of them again.
    calls = backend.calls
    assert main(["pseudo-label", "--data", str(tmp_path / "clips"), "--output", str(output)]) == 0
    assert backend.calls == calls


def test_a_folder_or_a_manifest_without_text_is_labelled_and_max_wer_is_refused(
    tmp_path, scripted, capsys
):
    paths = write_clips(tmp_path / "clips", [1.0, 2.0])
    manifest = tmp_path / "audio.jsonl"
    manifest.write_text("".join(json.dumps({"audio": str(p)}) + "\n" for p in paths))
    for data in (tmp_path / "clips", manifest):
        output = tmp_path / f"{data.stem}-labels.jsonl"
        assert main(["pseudo-label", "--data", str(data), "--output", str(output)]) == 0
        rows = rows_of(output)
        assert [r["audio"] for r in rows] == [str(p) for p in paths]
        assert all("reference_text" not in r and "wer" not in r for r in rows)
        code = main(
            ["pseudo-label", "--data", str(data), "--output", str(output), "--max-wer", "0.1"]
        )
        assert code == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and "--max-wer 0.1: " in error


def test_a_long_recording_becomes_windows_or_timed_segments_train_reads(tmp_path, scripted):
    [recording] = write_clips(tmp_path / "long", [75.0])
    windows = tmp_path / "windows.jsonl"
    pseudo_label("m", tmp_path / "long", windows, progress=False)
    rows = rows_of(windows)
    assert len(rows) == 3  # segments every 10 s, packed into windows of at most 30 s
    assert all(r["end"] - r["start"] <= 30 for r in rows)
    assert [r.get("previous_text") for r in rows] == [None, rows[0]["text"], rows[1]["text"]]
    assert " ".join(r["text"] for r in rows) == " ".join(f"part {i}" for i in range(8))
    examples = load_examples(windows)
    assert [e.previous_text for e in examples[1:]] == [rows[0]["text"], rows[1]["text"]]

    timed = tmp_path / "timed.jsonl"
    pseudo_label("m", recording, timed, timestamps=True, progress=False)
    assert len(rows_of(timed)) == 8
    # `--data-format subtitles` packs the timed rows into windows with their segment times.
    packed = load_examples(timed, data_format="subtitles")
    assert [len(e.segments) for e in packed] == [3, 3, 2]
    assert packed[1].segments[0] == (0.0, 9.0, "part 3")


# -- bad clips and errors a user can cause --------------------------------------------------------
def test_unreadable_clips_are_named_once_and_the_rest_labelled(tmp_path, scripted, capsys):
    [good] = write_clips(tmp_path / "clips", [1.0])
    broken = tmp_path / "clips" / "broken.wav"
    broken.write_bytes(b"not audio at all")
    manifest = tmp_path / "m.jsonl"
    rows = [{"audio": str(good)}, {"audio": str(broken)}, {"audio": str(tmp_path / "gone.wav")}]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = tmp_path / "labels.jsonl"
    argv = ["pseudo-label", "--data", str(manifest), "--output", str(output)]
    assert main(argv) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("skipped 2 unreadable clip(s)")
    assert "broken.wav" in error and "gone.wav" in error
    assert [r["audio"] for r in rows_of(output)] == [str(good)]
    # Not recorded as done: once the file is there, a rerun labels it.
    write_clips(tmp_path / "later", [2.0])[0].rename(tmp_path / "gone.wav")
    assert main(argv) == 1
    assert [r["audio"] for r in rows_of(output)] == [str(good), str(tmp_path / "gone.wav")]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data", "clips", "--output", "labels.csv"], "--output labels.csv: the labels are a"),
        (
            ["--data", "clips", "--output", "l.jsonl", "--max-wer", "-1"],
            "--max-wer: expected a number of at least 0, such as 0.1, not '-1'",
        ),
        (["--data", "missing", "--output", "l.jsonl"], "missing: not a local file or folder"),
        (["--data", "clips", "--output", "clips"], "--output clips: is a folder"),
        (["--data", "shards", "--output", "l.jsonl"], "--data shards: a stream of shards"),
    ],
)
def test_a_mistake_is_one_line_and_exit_2(tmp_path, scripted, capsys, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    write_clips(tmp_path / "clips", [1.0])
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "train-000000.tar").write_bytes(b"")
    try:
        code = main(["pseudo-label", *flags])
    except SystemExit as parse_error:  # refused by the option's parser, before anything ran
        code = parse_error.code
    assert code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error
    assert scripted.calls == 0


def test_other_settings_against_existing_labels_are_refused_unless_overwrite(
    tmp_path, scripted, capsys
):
    write_clips(tmp_path / "clips", [1.0, 2.0])
    output = tmp_path / "labels.jsonl"
    argv = ["pseudo-label", "--data", str(tmp_path / "clips"), "--output", str(output)]
    assert main([*argv, "--model", "first"]) == 0
    capsys.readouterr()
    assert main([*argv, "--model", "second"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "labelled with --model first, not second" in error
    assert main([*argv, "--model", "first", "--beam-size", "2"]) == 2
    assert "labelled with --beam-size 1, not 2" in capsys.readouterr().err
    assert main([*argv, "--model", "first", "--temperatures", "0"]) == 2
    assert "labelled with --temperatures 0,0.2,0.4,0.6,0.8,1, not 0;" in capsys.readouterr().err
    assert main([*argv, "--model", "second", "--overwrite"]) == 0
    assert len(rows_of(output)) == 2
    header = json.loads(Path(f"{output}{PROGRESS_SUFFIX}").read_text().splitlines()[0])
    assert header["settings"]["model"] == "second"
    # A file pseudo-label did not write is not appended to.
    foreign = tmp_path / "mine.jsonl"
    foreign.write_text('{"audio": "a.wav", "text": "mine"}\n')
    assert main([*argv[:-1], str(foreign)]) == 2
    assert "was not written by pseudo-label" in capsys.readouterr().err
    assert foreign.read_text() == '{"audio": "a.wav", "text": "mine"}\n'


# -- resuming -----------------------------------------------------------------------------------
class HalfWrite:
    """A file whose write puts half the bytes down, then raises `error`."""

    def __init__(self, file, error: BaseException):
        self.file, self.error = file, error

    def write(self, data: bytes):
        self.file.write(data[: len(data) // 2])
        self.file.flush()
        raise self.error


def stop_on_write(monkeypatch, n: int, *, half: bool, error: BaseException) -> None:
    """The n-th write to the labels file raises `error`: with `half`, after half its bytes (a
    line cut short); else after the rows are written and before the clip is recorded."""
    original = Progress._append
    writes = {"labels": 0}

    def append(self, file, text):
        if Path(file.name).suffix == ".jsonl":
            writes["labels"] += 1
            if writes["labels"] == n:
                if half:  # inside the write, where a full disk raises
                    return original(self, HalfWrite(file, error), text)
                original(self, file, text)
                raise error
        original(self, file, text)

    monkeypatch.setattr(Progress, "_append", append)


STOPS = {
    # Ctrl-C (or a kill: nothing after it runs) in the middle of a row, or after a clip's rows
    # and before its record; a disk that fills up in the middle of a row.
    "interrupted-mid-row": (True, KeyboardInterrupt(), 130),
    "interrupted-before-its-record": (False, KeyboardInterrupt(), 130),
    "disk-full-mid-row": (True, OSError(errno.ENOSPC, "No space left on device"), 2),
}


@pytest.mark.parametrize("stop", STOPS)
def test_a_run_stopped_mid_clip_resumes_with_every_clip_exactly_once(
    tmp_path, scripted, monkeypatch, capsys, stop
):
    half, error, code = STOPS[stop]
    write_clips(tmp_path / "clips", [1.0 + i / 10 for i in range(10)])
    output = tmp_path / "labels.jsonl"
    argv = ["pseudo-label", "--data", str(tmp_path / "clips"), "--output", str(output)]
    with monkeypatch.context() as patch:
        stop_on_write(patch, 5, half=half, error=error)
        assert main(argv) == code
    if code == 2:
        said = capsys.readouterr().err
        assert said.count("\n") == 1 and "cannot write (No space left on device)" in said
    assert main(argv) == 0
    audio = [row["audio"] for row in rows_of(output)]
    assert Counter(audio) == Counter(str(p) for p in sorted((tmp_path / "clips").iterdir()))
    assert "4 of 10 clips already labelled (by tiny.en); labelling the other 6" in (
        capsys.readouterr().out
    )
    assert scripted.calls == 5 + 6  # the stopped clip is decoded again, no other
    assert main(argv) == 0
    assert "10 of 10 clips already labelled (by tiny.en); nothing left to label" in (
        capsys.readouterr().out
    )
    assert len(rows_of(output)) == 10


@pytest.mark.long
def test_a_killed_process_resumes_with_every_clip_exactly_once(tmp_path):
    """The real command with the real tiny.en, killed with SIGKILL after 2 clips are recorded,
    then run again to the end."""
    from whisper_train.data import synth

    clips = synth.make_speech_dataset(tmp_path / "speech", n_utterances=8, seed=3)
    output = tmp_path / "labels.jsonl"
    progress = Path(f"{output}{PROGRESS_SUFFIX}")
    argv = ["pseudo-label", "--model", "tiny.en", "--data", str(clips), "--output", str(output)]
    process = start_whisper_train(argv)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if progress.is_file() and progress.read_text().count("\n") >= 3:  # header + 2 clips
            break
        time.sleep(0.05)
    assert process.poll() is None, "it finished before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert main(argv) == 0
    records = [json.loads(line) for line in progress.read_text().splitlines()[1:]]
    expected = {e.audio for e in load_examples(clips)}
    assert Counter(r["clip"] for r in records) == Counter(expected)
    written = [r["clip"] for r in records if r["outcome"] == "written"]
    assert Counter(row["audio"] for row in rows_of(output)) == Counter(written)


# -- it trains ----------------------------------------------------------------------------------
def test_the_real_tiny_en_labels_a_manifest_train_trains_on(tmp_path, tiny_whisper_dir):
    from whisper_train.data import synth

    clips = synth.make_speech_dataset(tmp_path / "speech", n_utterances=4, seed=1)
    output = tmp_path / "labels.jsonl"
    result = pseudo_label("tiny.en", clips, output, progress=False)
    rows = rows_of(output)
    assert result.labelled == len(rows) == 4
    # The labels are what `transcribe` writes with the same model, beside the script's text.
    transcripts = transcribe_paths("tiny.en", [clips], progress=False)
    assert {r["audio"]: r["text"] for r in rows} == {t.source: t.text for t in transcripts}
    references = {e.audio: e.text for e in load_examples(clips)}
    assert all(row["reference_text"] == references[row["audio"]] for row in rows)
    assert all(row["wer"] >= 0 for row in rows)
    run = tmp_path / "run"
    argv = ["train", "--data", str(output), "--model", str(tiny_whisper_dir)]
    argv += ["--output-dir", str(run), "--max-steps", "1", "--batch-size", "2", "--only-train"]
    assert main([*argv, "--nonspeech", "none"]) == 0
    assert (run / "final").is_dir()
