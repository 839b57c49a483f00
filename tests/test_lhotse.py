"""lhotse CutSet manifests as --data and --eval-data: one example a cut, read whole or streamed,
checked by check-data, refused in one line where whisper-train would train on other audio than
the cut describes, and a missing lhotse named with its extra."""

from __future__ import annotations

import gzip
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr
import torch
from conftest import losses_and_evaluations
from tiny_models import english_tokenizer

import whisper_train.training.recipe as recipe_module
from whisper_train.audio import SAMPLE_RATE, load_audio
from whisper_train.checkdata import check_data, label_encoder_for
from whisper_train.cli import main
from whisper_train.data import streaming
from whisper_train.data.examples import Skip
from whisper_train.data.layouts import LAYOUTS, load_examples
from whisper_train.training.train import train

# The recordings: a 6 s one at 16 kHz that three cuts take windows of, a 2 s one at 44.1 kHz,
# and one deleted after its cut was made. Each is a chirp, so a window taken at the wrong
# offset differs from the right one in every sample.
LONG_RATE, HIGH_RATE = 16_000, 44_100
CUTS = {  # cut id: (recording, start s, duration s, supervisions as (start, text, language))
    "long-a": ("long", 0.5, 1.2, [(0.0, "alpha bravo", "en")]),
    # two supervisions, written out of time order: one example, their texts in time order
    "long-b": ("long", 2.0, 1.1, [(0.6, "delta", "en"), (0.0, "charlie", "English")]),
    "long-silent": ("long", 3.5, 1.0, []),  # no supervision: an empty transcript, skipped
    "high": ("high", 0.25, 1.0, [(0.0, "echo foxtrot", None)]),
    "gone": ("gone", 0.0, 1.0, [(0.0, "golf hotel", "en")]),  # its recording is deleted
}
TRAINED = {"alpha bravo", "charlie delta", "echo foxtrot"}


def _chirp(rate: int, seconds: float) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.3 * np.sin(2 * np.pi * (200 * t + 150 * t**2))).astype(np.float32)


def write_cuts(folder: Path, cuts: dict = CUTS, name: str = "cuts.jsonl.gz") -> Path:
    """The recordings and a cut manifest of `cuts` in `folder`; recording paths relative to it
    (as `Recording.from_file(..., relative_path_depth=1)` writes them)."""
    from lhotse import CutSet, MonoCut, Recording, SupervisionSegment

    folder.mkdir(parents=True, exist_ok=True)
    recordings = {}
    for rec_id, rate, seconds in (
        ("long", LONG_RATE, 6.0),
        ("high", HIGH_RATE, 2.0),
        ("gone", LONG_RATE, 1.0),
    ):
        sf.write(folder / f"{rec_id}.wav", _chirp(rate, seconds), rate)
        recordings[rec_id] = Recording.from_file(folder / f"{rec_id}.wav", relative_path_depth=1)
    made = []
    for cut_id, (rec_id, start, duration, sups) in cuts.items():
        supervisions = [
            SupervisionSegment(
                id=f"{cut_id}-{i}",
                recording_id=rec_id,
                start=sup_start,
                duration=duration - sup_start,
                text=text,
                language=language,
            )
            for i, (sup_start, text, language) in enumerate(sups)
        ]
        made.append(
            MonoCut(
                id=cut_id,
                start=start,
                duration=duration,
                channel=0,
                recording=recordings[rec_id],
                supervisions=supervisions,
            )
        )
    manifest = folder / name
    CutSet.from_cuts(made).to_file(manifest)
    (folder / "gone.wav").unlink(missing_ok=True)
    return manifest


def write_cut_windows(folder: Path, n: int, seconds: float) -> Path:
    """One recording of `n` tones of `seconds` each (its pitch changes at each) at 22.05 kHz,
    and a cut manifest of `n` cuts, one a tone, each with a 3-word supervision."""
    from lhotse import CutSet, MonoCut, Recording, SupervisionSegment

    rate, words = 22_050, ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]
    rng = np.random.default_rng(2)
    folder.mkdir(parents=True, exist_ok=True)
    t = np.arange(int(rate * seconds)) / rate
    tones = [0.2 * np.sin(2 * np.pi * (220 + 60 * i) * t) for i in range(n)]
    sf.write(folder / "session.wav", np.concatenate(tones).astype(np.float32), rate)
    recording = Recording.from_file(folder / "session.wav", relative_path_depth=1)
    cuts = []
    for i in range(n):
        text = " ".join(rng.choice(words, 3))
        supervision = SupervisionSegment(
            id=f"s{i}", recording_id=recording.id, start=0.0, duration=seconds, text=text
        )
        cuts.append(
            MonoCut(
                id=f"c{i}",
                start=i * seconds,
                duration=seconds,
                channel=0,
                recording=recording,
                supervisions=[supervision],
            )
        )
    manifest = folder / "cuts.jsonl.gz"
    CutSet.from_cuts(cuts).to_file(manifest)
    return manifest


@pytest.fixture(scope="module")
def cuts_file(tmp_path_factory) -> Path:
    return write_cuts(tmp_path_factory.mktemp("cuts"))


@pytest.fixture(scope="module")
def label_encoder():
    return label_encoder_for(english_tokenizer())


def _reference(manifest: Path, cut_id: str) -> np.ndarray:
    """The cut's samples as lhotse reads them (its own slice of the file, at the file's rate),
    resampled to 16 kHz by soxr at whisper-train's quality."""
    from lhotse import load_manifest

    cut = load_manifest(manifest)[cut_id]
    rate = cut.recording.sampling_rate
    # lhotse resolves relative paths against the current folder: read it from the manifest's.
    samples = cut.with_recording_path_prefix(str(manifest.parent)).load_audio().mean(axis=0)
    return soxr.resample(samples, rate, SAMPLE_RATE, quality="HQ")


def test_each_cut_is_one_example_of_its_recordings_window(cuts_file, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # relative recording paths resolve against the manifest
    examples = load_examples(cuts_file)
    by_cut = {e.origin.split("(cut ")[1].rstrip(")"): e for e in examples}
    assert list(by_cut) == list(CUTS)
    assert {cut: e.text for cut, e in by_cut.items()} == {
        "long-a": "alpha bravo",
        "long-b": "charlie delta",
        "long-silent": "",
        "high": "echo foxtrot",
        "gone": "golf hotel",
    }
    # The first supervision's language in time order; lhotse recipes write names ("English"),
    # which the label encoder takes as it takes "en".
    assert [by_cut[c].language for c in ("long-a", "long-b", "high")] == ["en", "English", None]
    for cut_id in ("long-a", "long-b", "high"):
        example = by_cut[cut_id]
        _, start, duration, _ = CUTS[cut_id]
        assert (example.start, example.end) == pytest.approx((start, start + duration))
        audio = load_audio(example.audio, start=example.start, end=example.end)
        expected = _reference(cuts_file, cut_id)
        assert len(audio) == len(expected) == round(duration * SAMPLE_RATE)
        # The same frames (lhotse's slice and whisper-train's agree to the sample) through the
        # same soxr filter: equal but for float32 rounding (measured: 0.0). A slice one frame
        # off differs by up to 0.3 * 2*pi*f/rate (measured: 0.083 for long-a, whose chirp
        # reaches 710 Hz at 16 kHz; 0.025 for the 44.1 kHz recording).
        np.testing.assert_allclose(audio, expected, rtol=0, atol=1e-6)
    # And the 44.1 kHz window against the chirp itself at 16 kHz: soxr HQ's passband (to 95% of
    # 8 kHz, 0.01 dB ripple) passes the chirp's 200-800 Hz unchanged but for the filter's edge
    # transient, so away from the first and last 5 ms the samples are the chirp's to 1e-3.
    _, start, duration, _ = CUTS["high"]
    high = load_audio(by_cut["high"].audio, start=start, end=start + duration)
    t = start + np.arange(len(high)) / SAMPLE_RATE
    chirp = 0.3 * np.sin(2 * np.pi * (200 * t + 150 * t**2))
    edge = SAMPLE_RATE // 200
    np.testing.assert_allclose(high[edge:-edge], chirp[edge:-edge], rtol=0, atol=1e-3)


def test_a_cut_manifest_is_detected_by_content_and_a_plain_jsonl_stays_a_manifest(tmp_path):
    plain = tmp_path / "plain" / "manifest.jsonl"
    plain.parent.mkdir()
    sf.write(plain.parent / "a.wav", _chirp(LONG_RATE, 1.0), LONG_RATE)
    plain.write_text('{"audio": "a.wav", "text": "alpha", "duration": 1.0}\n')
    uncompressed = write_cuts(tmp_path / "cuts", name="cuts.jsonl")
    detected = lambda path: next(n for n, lay in LAYOUTS.items() if lay.detect(path))  # noqa: E731
    assert detected(plain) == "jsonl" and detected(uncompressed) == "lhotse"
    assert [e.text for e in load_examples(plain)] == ["alpha"]
    assert len(load_examples(uncompressed)) == len(CUTS)


def test_a_folder_of_cut_manifests_is_read_by_name(tmp_path):
    folder = tmp_path / "manifests"
    write_cuts(folder, {"long-a": CUTS["long-a"]}, name="demo_cuts_train.jsonl.gz")
    write_cuts(folder, {"high": CUTS["high"]}, name="demo_cuts_dev.jsonl.gz")
    assert [e.text for e in load_examples(f"{folder}:dev")] == ["echo foxtrot"]
    assert [e.text for e in load_examples(f"{folder}:train")] == ["alpha bravo"]
    with pytest.raises(Exception, match="demo_cuts_dev.jsonl.gz, demo_cuts_train.jsonl.gz"):
        load_examples(folder)


def test_training_on_cuts_trains_on_exactly_their_usable_clips(
    cuts_file, tiny_run_config, monkeypatch
):
    trained, real = [], recipe_module.loss_terms

    def recording(model, batch, **kwargs):
        trained.extend(batch["texts"])
        return real(model, batch, **kwargs)

    monkeypatch.setattr(recipe_module, "loss_terms", recording)
    config = tiny_run_config(
        data=str(cuts_file), eval_split=0, max_steps=2, batch_size=8, only_train=False
    )
    config.update({"eval_data": [f"dev={cuts_file}"], "eval_steps": 2})
    result = train(config)
    # Two steps of the whole data each: the silent cut and the missing recording never train.
    assert Counter(trained) == Counter({text: 2 for text in TRAINED})
    assert result.steps == 2
    # The same cuts as an evaluation set: scored on the 3 usable clips.
    _, evaluations = losses_and_evaluations(result.output_dir)
    assert [(row["set"], row["clips"]) for row in evaluations] == [("dev", 3)]


def _stream_items(source, label_encoder, *, rank=0, world_size=1, workers=0):
    stream = streaming.training_stream(
        source,
        label_encoder,
        rank=rank,
        world_size=world_size,
        seed=0,
        shuffle_buffer=4,
        max_label_tokens=448,
        batch_size=2,
    )
    stream.set_epoch(0)
    loader = torch.utils.data.DataLoader(
        stream, batch_size=None, num_workers=workers, collate_fn=lambda triples: triples
    )
    return [item for batch in loader for _, _, item in batch]


def test_streamed_cuts_are_the_read_whole_examples_split_over_ranks_and_workers(
    cuts_file, label_encoder
):
    source = streaming.stream_source(cuts_file, streaming=True)
    assert source.kind == "lhotse"
    whole = {
        e.text: load_audio(e.audio, start=e.start, end=e.end)
        for e in load_examples(cuts_file)
        if e.text in TRAINED
    }
    items = []
    for rank in range(2):
        items += _stream_items(source, label_encoder, rank=rank, world_size=2, workers=2)
    clips = [item for item in items if not isinstance(item, Skip)]
    assert Counter(item["text"] for item in clips) == Counter(TRAINED)  # each once
    for item in clips:
        np.testing.assert_array_equal(item["audio"], whole[item["text"]])
    skipped = {item.origin.split("(cut ")[1].rstrip(")"): item.reason for item in items
               if isinstance(item, Skip)}  # fmt: skip
    assert skipped == {"long-silent": "empty transcript", "gone": "unreadable audio"}


def test_check_data_reports_cut_counts_hours_and_the_missing_recording(cuts_file, capsys):
    report = check_data(cuts_file)
    assert report.clips == len(CUTS)
    readable = sum(CUTS[c][2] for c in ("long-a", "long-b", "long-silent", "high"))
    assert report.total_seconds == pytest.approx(readable, abs=1e-3)
    problems = Counter((f.kind, f.origin.split("(cut ")[1].rstrip(")")) for f in report.problems)
    assert problems == Counter({("unreadable", "gone"): 1, ("empty_label", "long-silent"): 1})
    assert main(["check-data", str(cuts_file)]) == 0  # problems are warnings without --strict
    assert main(["check-data", str(cuts_file), "--strict"]) == 1


def _one_line_exit_2(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: "), err
    return err


def test_without_lhotse_the_error_names_the_extra(cuts_file, tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "lhotse" or m.startswith("lhotse.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lhotse", None)  # `import lhotse` raises ImportError
    err = _one_line_exit_2(["check-data", str(cuts_file)], capsys)
    assert "pip install 'whisper-train[lhotse]'" in err
    out = str(tmp_path / "out")
    argv = ["train", "--data", str(cuts_file), "--model", "tiny.en", "--output-dir", out]
    for extra in ([], ["--streaming", "--only-train"]):
        assert "pip install 'whisper-train[lhotse]'" in _one_line_exit_2([*argv, *extra], capsys)


def _refused_cuts(kind: str, folder: Path) -> Path:
    from lhotse import CutSet, load_manifest

    manifest = write_cuts(folder, {"long-a": CUTS["long-a"], "high": CUTS["high"]})
    cuts = load_manifest(manifest)
    first, second = cuts["long-a"], cuts["high"]
    if kind == "mixed":
        first = first.mix(second.resample(LONG_RATE))
    elif kind == "speed":
        first = first.perturb_speed(1.1)
    elif kind == "channel":
        stereo = np.stack([_chirp(LONG_RATE, 6.0), _chirp(LONG_RATE, 6.0)[::-1]], axis=1)
        sf.write(folder / "stereo.wav", stereo, LONG_RATE)
        from lhotse import MonoCut, Recording

        recording = Recording.from_file(folder / "stereo.wav", relative_path_depth=1)
        first = MonoCut(id="left", start=0.5, duration=1.0, channel=0, recording=recording)
    target = folder / f"{kind}.jsonl.gz"
    CutSet.from_cuts([second, first]).to_file(target)
    return target


@pytest.mark.parametrize(
    ("kind", "named"),
    [("mixed", "MixedCut"), ("speed", "transformed (Speed)"), ("channel", "channel 0 of the 2")],
)
def test_cuts_whose_audio_is_not_a_file_window_are_refused_in_one_line(
    kind, named, tmp_path, capsys
):
    manifest = _refused_cuts(kind, tmp_path)
    err = _one_line_exit_2(["check-data", str(manifest)], capsys)
    assert named in err and "save_audios" in err and f"{manifest}:2" in err


def test_a_damaged_cut_manifest_is_one_line(cuts_file, tmp_path, capsys):
    truncated = tmp_path / "truncated.jsonl.gz"
    data = gzip.compress(gzip.decompress(cuts_file.read_bytes()))
    truncated.write_bytes(data[: len(data) // 2])
    err = _one_line_exit_2(["check-data", str(truncated)], capsys)
    assert str(truncated) in err and "CutSet.to_file" in err
    not_cuts = tmp_path / "recordings.jsonl.gz"
    not_cuts.write_bytes(gzip.compress(b'{"id": "r", "sources": [], "sampling_rate": 16000}\n'))
    err = _one_line_exit_2(["check-data", str(not_cuts)], capsys)
    assert "not a lhotse cut" in err and "CutSet.from_manifests" in err
