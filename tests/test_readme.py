"""The README's transformers-pipeline snippet runs as printed, with whisper-train's dependencies.

The snippet is read from README.md (the ```python block that builds the ASR pipeline), pointed at
a tiny seeded model and a 44.1 kHz stereo WAV, and executed. ffmpeg and torchaudio are made
unavailable to the pipeline, as on a user's machine with only whisper-train installed, so a
snippet that passes a file name or an array at the wrong rate or in the wrong layout fails here.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
from tiny_models import make_tiny_whisper

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = 'pipeline("automatic-speech-recognition"'


def pipeline_snippet() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)
    found = [block for block in blocks if MARKER in block]
    assert len(found) == 1, f"README.md needs exactly one ```python block with {MARKER}"
    return found[0]


def fill_in(snippet: str, placeholder: str, value: Path) -> str:
    assert snippet.count(f'"{placeholder}"') == 1, f"the snippet no longer uses {placeholder!r}"
    return snippet.replace(f'"{placeholder}"', repr(str(value)))


@pytest.fixture
def saved_tiny_model(tmp_path) -> Path:
    """A tiny seeded model saved with its processor, as in a run's final/ folder."""
    model, processor = make_tiny_whisper()
    # A random model never says <|endoftext|>: stop generation early so the test stays fast.
    model.generation_config.max_length = 8
    folder = tmp_path / "final"
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def test_readme_pipeline_snippet_transcribes_a_44k_stereo_wav(
    saved_tiny_model, tmp_path, monkeypatch
):
    from transformers.pipelines import automatic_speech_recognition as asr_module

    def no_ffmpeg(*args, **kwargs):
        raise AssertionError("the snippet handed the pipeline a file: that needs ffmpeg")

    monkeypatch.setattr(asr_module, "ffmpeg_read", no_ffmpeg)
    monkeypatch.setattr(asr_module, "is_torchaudio_available", lambda: False)

    rate, seconds = 44_100, 1.5
    t = np.arange(int(rate * seconds)) / rate
    # Two different channels: a stereo array the pipeline would read as (channels, samples).
    stereo = np.stack([0.3 * np.sin(2 * np.pi * 440 * t), 0.1 * np.sin(2 * np.pi * 660 * t)], 1)
    wav = tmp_path / "recording-44k-stereo.wav"
    soundfile.write(wav, stereo.astype(np.float32), rate)

    code = fill_in(pipeline_snippet(), "OUTPUT/final", saved_tiny_model)
    code = fill_in(code, "recording.wav", wav)
    printed: list = []
    namespace = {"print": printed.append}
    exec(compile(code, "README.md (pipeline snippet)", "exec"), namespace)

    assert len(printed) == 1 and isinstance(printed[0], str)
    result = namespace["asr"]({"raw": namespace["audio"], "sampling_rate": 16_000})
    assert isinstance(result, dict) and result["text"] == printed[0]
    # What the snippet handed over is mono 16 kHz audio of the file's length.
    audio = namespace["audio"]
    assert audio.ndim == 1 and abs(audio.size - 16_000 * seconds) <= 16


# -- the README's other commands: make targets, extras, files ----------------------------------

REPO = README.parent


def test_every_make_command_the_readme_prints_is_a_target():
    """`make demo`, `make test`, ...: each a target of the Makefile (what a dry run would find)."""
    printed = set(re.findall(r"^make ([\w-]+)", README.read_text(encoding="utf-8"), re.M))
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    assert {"demo", "test"} <= printed and printed <= targets, printed - targets


def _extras() -> set[str]:
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+) = \[", section, re.M))


def test_every_extra_a_user_is_told_to_install_exists():
    """`pip install 'whisper-train[lhotse]'` in the README, `pip install -e '.[plots]'` in a
    run's one line: each names an extra of pyproject.toml."""
    texts = [README, *(REPO / "docs").glob("*.md"), *(REPO / "src").rglob("*.py")]
    named = set()
    for path in texts:
        named |= set(re.findall(r"(?:whisper-train|\.)\[([\w,-]+)\]", path.read_text("utf-8")))
    named = {extra for group in named for extra in group.split(",")}
    assert {"lhotse", "tensorboard", "plots"} <= named  # the reader finds them
    assert named <= _extras(), named - _extras()


def test_every_file_the_readme_names_exists():
    """docs/*.md links, bench/ scripts, configs, examples: a renamed file fails here."""
    text = README.read_text(encoding="utf-8")
    named = set(re.findall(r"\]\(([\w./-]+)\)", text))  # markdown links
    named |= set(re.findall(r"`((?:docs|bench|configs|examples|tests|\.ci)/[\w./-]+)`", text))
    assert len(named) >= 10
    missing = sorted(path for path in named if not (REPO / path).exists())
    assert not missing, missing


# -- what `make setup` leaves out is said in one line, and nothing fails for it -----------------


def test_a_run_without_tensorboard_says_so_once_and_logs_metrics(tmp_path, capsys, monkeypatch):
    from whisper_train.runlog import MetricsLog

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not installed
    log = MetricsLog(tmp_path, enabled=True)
    log.write({"step": 1, "loss": 1.0})
    log.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "TensorBoard is not installed" in err[0] and "[tensorboard]" in err[0]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
    assert not (tmp_path / "tensorboard").exists()


def test_without_matplotlib_each_picture_not_drawn_is_one_line(tmp_path, capsys, monkeypatch):
    from whisper_train import plots
    from whisper_train.checkdata import DataReport, write_histogram_png
    from whisper_train.evaluation.report import write_curves_png

    monkeypatch.setattr(plots, "plt", None)  # not installed
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert write_curves_png(tmp_path / "metrics.jsonl", tmp_path / "curves.png") is None
    report = DataReport(path=str(tmp_path), durations=[1.0, 2.0])
    assert write_histogram_png(report, tmp_path / "histogram.png") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(":")[0] for line in err] == ["matplotlib is not installed"] * 2
    assert "curves.png" in err[0] and "histogram.png" in err[1] and "[plots]" in err[0]
    assert not list(tmp_path.glob("*.png"))


def test_without_faster_whisper_a_ctranslate2_model_runs_in_transformers(
    tiny_en_ct2_dir, capsys, monkeypatch
):
    """`make setup` leaves the faster-whisper extra out: transcribing tiny.en (a CTranslate2
    folder) then runs it in transformers, which reads its files, and says so in one line."""
    from whisper_train.transcription.backends import TransformersBackend
    from whisper_train.transcription.transcribe import load_backend

    for module in ("faster_whisper", "ctranslate2"):
        monkeypatch.setitem(sys.modules, module, None)  # not installed
    backend = load_backend(str(tiny_en_ct2_dir))
    assert isinstance(backend, TransformersBackend)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "faster-whisper is not installed" in err[0], err
    assert "'whisper-train[faster-whisper]'" in err[0] and "transformers runs it" in err[0]


def test_without_faster_whisper_a_ct2_export_is_refused_before_any_work(
    tiny_whisper_dir, tmp_path, monkeypatch
):
    """CTranslate2's converter writes the export, so --no-check cannot help: one line naming
    the extra, and nothing written."""
    from whisper_train.deploy.export import export_model
    from whisper_train.errors import UserError

    for module in ("faster_whisper", "ctranslate2"):
        monkeypatch.setitem(sys.modules, module, None)
    for check in (True, False):
        with pytest.raises(UserError, match=r"whisper-train\[faster-whisper\]") as error:
            export_model(str(tiny_whisper_dir), format="ct2", output=tmp_path / "ct2", check=check)
        assert "\n" not in str(error.value) and "--no-check" not in str(error.value)
        assert not (tmp_path / "ct2").exists()
