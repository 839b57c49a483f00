"""Every door as guarded as train: what `train` refuses in one line, `transcribe`,
`evaluate` and `export` refuse in the same one line, exit 2, no traceback, nothing lost."""

from __future__ import annotations

import io
import json
import struct
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from tiny_models import tiny_en_dir

from whisper_train.cli import main


def _cli(*args: str) -> tuple[int, list[str], str]:
    """`whisper-train ARGS` in this process: (exit code, its `error:` lines, all it printed)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out):
        code = main(list(args))
    text = out.getvalue() + err.getvalue()
    return code, [line for line in err.getvalue().splitlines() if line.startswith("error:")], text


def _one_line(*args: str) -> str:
    code, errors, text = _cli(*args)
    assert code == 2, text[-3000:]
    assert len(errors) == 1 and "Traceback" not in text, text[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("audio") / "tone.wav"
    t = np.arange(16_000) / 16_000
    sf.write(path, (0.2 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16_000)
    return path


# -- 1. a model file transcribe's runtimes would trust: refused by our own reader first ----------


class _RunsCode:
    """Pickles as a call of os.system: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def _model_pt(folder: Path, extra: dict) -> Path:
    folder.mkdir()
    path = folder / "model.pt"
    dims = {"n_mels": 80, "n_vocab": 51864, "n_audio_ctx": 1500, "n_audio_state": 64}
    torch.save({"dims": dims, "model_state_dict": {"w": torch.zeros(512)}, **extra}, path)
    return path


def test_transcribe_refuses_a_model_pt_carrying_a_pickled_program_in_one_line(tmp_path, clip):
    marker = tmp_path / "the-pickle-ran"
    path = _model_pt(tmp_path / "openai", {"extra": _RunsCode(marker)})
    line = _one_line("transcribe", str(clip), "--model", str(path))
    assert str(path) in line and "Weights only load failed" in line
    # What was refused, said once: not torch's paragraphs of advice to load it unsafely.
    assert line.count("unsupported GLOBAL posix.system") == 1 and "weights_only" not in line
    assert not marker.exists()


def test_transcribe_refuses_a_model_pt_cut_in_half_in_one_line(tmp_path, clip):
    path = _model_pt(tmp_path / "openai", {})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    for model in (path, path.parent):
        line = _one_line("transcribe", str(clip), "--model", str(model))
        assert str(path) in line and "not a readable openai-whisper checkpoint" in line


def _ct2_string(text: str, length: int | None = None) -> bytes:
    encoded = text.encode() + b"\0"
    return struct.pack("<H", len(encoded) if length is None else length) + encoded


def _variable(name: str, shape: tuple[int, ...], dtype_id: int, n_bytes: int) -> bytes:
    body = _ct2_string(name) + struct.pack(f"<B{len(shape)}I", len(shape), *shape)
    return body + struct.pack("<BI", dtype_id, n_bytes) + bytes(min(n_bytes, 64))


_HEADER = struct.pack("<I", 6) + _ct2_string("WhisperSpec") + struct.pack("<I", 1)
# model.bin bodies after the header, and what the one line says of each.
CRAFTED_CT2 = {
    "truncated": (struct.pack("<I", 1) + _variable("a", (64,), 0, 256), "is truncated"),
    "petabyte": (
        struct.pack("<I", 1) + _variable("a", (2**16, 2**16, 2**16), 0, 0),
        "needs 1125899906842624 bytes",
    ),
    "2^32-1 variables": (struct.pack("<I", 2**32 - 1), "is truncated"),
    "unknown dtype": (struct.pack("<I", 1) + _variable("a", (4,), 9, 16), "unknown dtype id 9"),
    "65535-byte name": (struct.pack("<I", 1) + _ct2_string("a", 65535), "is truncated"),
}


def _ct2_folder(folder: Path, model_bin: bytes | None, config: str = "{}") -> Path:
    folder.mkdir()
    source = tiny_en_dir()
    (folder / "tokenizer.json").symlink_to(source / "tokenizer.json")
    if model_bin is None:
        (folder / "model.bin").symlink_to(source / "model.bin")
    else:
        (folder / "model.bin").write_bytes(_HEADER + model_bin + struct.pack("<I", 0))
    (folder / "config.json").write_text(config)
    return folder


@pytest.mark.parametrize("case", list(CRAFTED_CT2))
def test_transcribe_reads_a_crafted_ctranslate2_folder_as_train_does(case, tmp_path, clip):
    body, says = CRAFTED_CT2[case]
    folder = _ct2_folder(tmp_path / "ct2", body)
    line = _one_line("transcribe", str(clip), "--model", str(folder))
    assert str(folder / "model.bin") in line and says in line


def test_transcribe_refuses_a_ctranslate2_folder_with_a_garbage_config_in_one_line(tmp_path, clip):
    folder = _ct2_folder(tmp_path / "ct2", None, config="\x00garbage{")
    line = _one_line("transcribe", str(clip), "--model", str(folder))
    assert str(folder / "config.json") in line and "not a JSON object" in line


# -- 2. an output that cannot be written: one line before any work -----------------------------


def _not_reached(*args, **kwargs):
    raise AssertionError("the work started before the output was checked")


def test_transcribe_into_an_output_dir_that_is_a_file_is_one_line_before_the_model_loads(
    tmp_path, clip, monkeypatch
):
    from whisper_train.transcription import transcribe

    monkeypatch.setattr(transcribe, "load_backend", _not_reached)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    line = _one_line("transcribe", str(clip), "--output-dir", str(a_file))
    assert f"--output-dir {a_file}: is a file" in line
    assert a_file.read_text() == "mine"


def test_evaluate_with_a_report_under_a_file_is_one_line_before_the_evaluation(
    tmp_path, tone_dataset, tiny_whisper_dir, monkeypatch
):
    from whisper_train.evaluation import evaluate

    monkeypatch.setattr(evaluate, "evaluate_examples", _not_reached)
    a_file = tmp_path / "FILE"
    a_file.write_text("mine")
    report = a_file / "rep.json"
    line = _one_line(
        "evaluate", "--model", str(tiny_whisper_dir), "--data", str(tone_dataset),
        "--output", str(report),
    )  # fmt: skip
    assert f"--output {report}: {a_file} is a file" in line


@pytest.mark.parametrize("command", ["train", "export", "transcribe"])
def test_an_output_in_proc_is_one_line_before_any_work(
    command, tmp_path, clip, tone_dataset, tiny_whisper_dir
):
    model = ["--model", str(tiny_whisper_dir)]
    argv = {
        "train": ["train", "--data", str(tone_dataset), *model, "--output-dir", "/proc/x"],
        "export": ["export", *model, "--output", "/proc/x", "--no-check"],
        "transcribe": ["transcribe", str(clip), *model, "--output-dir", "/proc/x"],
    }[command]
    line = _one_line(*argv)
    assert "/proc/x: nothing can be written in /proc" in line


# -- 3. a lock that cannot lock ----------------------------------------------------------------


def _flock_without_locks(monkeypatch) -> None:
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)


def test_an_output_dir_that_cannot_lock_is_one_line_saying_what_it_means(
    tmp_path, tone_dataset, tiny_whisper_dir, monkeypatch
):
    _flock_without_locks(monkeypatch)
    monkeypatch.delenv("WHISPER_TRAIN_NO_LOCK", raising=False)
    out = tmp_path / "nfs" / "run"
    line = _one_line(
        "train", "--data", str(tone_dataset), "--model", str(tiny_whisper_dir),
        "--output-dir", str(out),
    )  # fmt: skip
    assert f"--output-dir {out}: its file system cannot lock" in line
    assert "No locks available" in line and "a second run" in line
    assert "WHISPER_TRAIN_NO_LOCK=1" in line
    assert not (tmp_path / "nfs").exists()  # nothing left behind by the refused run


def test_whisper_train_no_lock_runs_in_a_folder_that_cannot_lock_and_says_so(
    tmp_path, monkeypatch, caplog
):
    from whisper_train.runfolder import RunLock

    _flock_without_locks(monkeypatch)
    monkeypatch.setenv("WHISPER_TRAIN_NO_LOCK", "1")
    with caplog.at_level("WARNING"), RunLock(tmp_path / "run") as lock:
        assert lock.fd is None
    [warning] = [r.getMessage() for r in caplog.records if "cannot lock" in r.getMessage()]
    assert "running anyway" in warning and "\n" not in warning


# -- 4. a screening cache is verified, never believed --------------------------------------------


def _screen_tones(tone_dataset, cache):
    from whisper_train.data.layouts import load_examples
    from whisper_train.data.screening import screen

    return screen(
        load_examples(tone_dataset),
        count_all=lambda examples: [len(e.text.split()) for e in examples],
        cache_folder=cache,
    )


def _edited(entry: Path, kept: list[int], *, checksum_too: bool) -> None:
    import json

    from whisper_train.data import screening

    stored = json.loads(entry.read_text())
    stored.update(kept=kept, label_tokens=[3] * len(kept))
    if checksum_too:  # as someone who read this code would: the contents still must verify
        stored["checksum"] = screening._checksum({k: stored[k] for k in screening._STORED})
    entry.write_text(json.dumps(stored))


@pytest.mark.parametrize("checksum_too", [False, True], ids=["edited", "checksum recomputed"])
@pytest.mark.parametrize("kept", [[999], [-1] * 7], ids=["index 999", "-1 seven times"])
def test_an_edited_screening_cache_is_screened_again_and_said_in_one_line(
    kept, checksum_too, tmp_path, tone_dataset, caplog
):
    cache = tmp_path / "screening"
    fresh = _screen_tones(tone_dataset, cache)
    [entry] = cache.glob("*.json")
    _edited(entry, kept, checksum_too=checksum_too)
    with caplog.at_level("INFO"):
        again = _screen_tones(tone_dataset, cache)
    assert again == fresh  # every clip, once each: not the edited indices
    [said] = [r.getMessage() for r in caplog.records if "does not verify" in r.getMessage()]
    assert str(entry) in said and "screening again" in said and "\n" not in said
    caplog.clear()
    with caplog.at_level("INFO"):
        assert _screen_tones(tone_dataset, cache) == fresh  # rewritten: reused from now on
    assert any("as screened before (cached)" in r.getMessage() for r in caplog.records)


# -- 5. word times: no cue of no length, nothing past the audio, no library warning -------------


def test_words_the_alignment_put_at_the_end_of_silence_share_its_time():
    from whisper_train.transcription.word_timestamps import Word, fit_into_segment

    # What 10 s of silence gave: six words, each at start = end = 10.0 s (one of them NaN).
    at_the_end = [Word(f" w{i}", 10.0, 10.0) for i in range(5)] + [Word(" x", np.nan, np.nan)]
    words = fit_into_segment(at_the_end, 0.0, 10.0)
    assert [w.word for w in words] == [w.word for w in at_the_end]
    assert all(0.0 <= w.start < w.end <= 10.0 for w in words)
    assert all(a.end <= b.start for a, b in zip(words[:-1], words[1:], strict=True))


def test_a_tenth_of_a_second_gives_no_cue_of_no_length():
    from whisper_train.transcription.transcripts import Segment
    from whisper_train.transcription.word_timestamps import Word, fit_into_segment, highlighted_cues

    words = fit_into_segment([Word(" you", 0.08, 0.12), Word(".", 0.12, 0.12)], 0.0, 0.1)
    segment = Segment(0.0, 0.1, "you.", tuple(words))
    cues = highlighted_cues([segment])
    assert cues and all(0.0 <= start < end <= 0.1 for start, end, _ in cues)


def test_transcribing_prints_no_torch_warning_when_a_window_has_one_token(
    monkeypatch, tiny_whisper
):
    import warnings

    from whisper_train.transcription import backends

    def one_token_window(*args, **kwargs):
        torch.zeros(1, 3).std(dim=0)  # what transformers' token times do over one token
        raise StopIteration

    monkeypatch.setattr(backends, "generate_long_form", one_token_window)
    backend = backends.TransformersBackend(*tiny_whisper, word_timestamps=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(StopIteration):
            backend.transcribe(np.full(1600, 0.01, dtype=np.float32))  # not silence
    assert not [w for w in caught if "std()" in str(w.message)]


# -- 6. lesser doors -------------------------------------------------------------------------------


def test_a_negative_learning_rate_is_one_line_about_the_value(tmp_path, tone_dataset):
    line = _one_line(
        "train", "--data", str(tone_dataset), "--model", "tiny.en",
        "--output-dir", str(tmp_path / "out"), "--learning-rate", "-1e-5",
    )  # fmt: skip
    assert line.startswith("error: --learning-rate -1e-05: expected a finite number above 0")


def test_a_fifo_a_folder_and_a_device_given_as_audio_are_named_as_what_they_are(
    tmp_path, tiny_whisper_dir
):
    import os

    from whisper_train.audio import load_audio
    from whisper_train.errors import AudioError

    fifo = tmp_path / "pipe.wav"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.wav"
    folder.mkdir()
    expected = {fifo: "a named pipe (FIFO)", folder: "a folder", Path("/dev/zero"): "a device"}
    for path, says in expected.items():
        with pytest.raises(AudioError, match=r"not an audio file") as caught:
            load_audio(path)
        assert caught.value.reason.startswith(says)
    code, _, text = _cli("transcribe", str(fifo), "/dev/zero", "--model", str(tiny_whisper_dir))
    assert code == 2 and "Traceback" not in text and "not found" not in text
    assert f"skipped {fifo}: a named pipe (FIFO)" in text
    assert "skipped /dev/zero: a device" in text


def test_pseudo_label_on_a_full_disk_is_one_line_and_the_same_command_continues(
    tmp_path, clip, monkeypatch
):
    from conftest import fill_disk_on_write

    from whisper_train.transcription import pseudo_label
    from whisper_train.transcription.transcripts import Segment

    class Runtime:  # what the model writes is not what this is about: the writes are
        def transcribe(self, audio, *, timestamps=True):
            return "a tone", [Segment(0.0, 1.0, "a tone")]

    monkeypatch.setattr(pseudo_label, "load_backend", lambda model, **options: Runtime())
    output = tmp_path / "labels.jsonl"
    argv = ("pseudo-label", "--model", "tiny.en", "--data", str(clip), "--output", str(output))
    checked = pseudo_label.check_output_path

    def then_full(*args, **kwargs):  # the disk fills once the output was found writable
        checked(*args, **kwargs)
        fill_disk_on_write(patch)

    with monkeypatch.context() as patch:
        patch.setattr(pseudo_label, "check_output_path", then_full)
        line = _one_line(*argv)
    assert line.startswith(f"error: --output {output}: cannot write (No space left on device)")
    code, _, text = _cli(*argv)
    assert code == 0, text[-3000:]
    records = (tmp_path / "labels.jsonl.progress").read_text().splitlines()[1:]
    assert [json.loads(record)["clip"] for record in records] == [str(clip)]
    assert [json.loads(row)["text"] for row in output.read_text().splitlines()] == ["a tone"]
