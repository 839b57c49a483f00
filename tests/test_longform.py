"""Long-form evaluation: recordings over 30 s decoded in sequential windows, as `transcribe`
decodes them, and scored over their whole reference."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import jiwer
import numpy as np
import pytest
import soundfile
from conftest import metric_rows, write_tone_dataset

from whisper_train.config import RunConfig, long_form_sets, named_sets
from whisper_train.data.examples import Example
from whisper_train.data.layouts import load_examples
from whisper_train.data.recordings import load_recordings
from whisper_train.errors import UserError
from whisper_train.evaluation import longform
from whisper_train.evaluation.evaluate import evaluate_examples, report_to_dict
from whisper_train.evaluation.scoring import get_normalizer
from whisper_train.transcription.decoding import NO_FALLBACK
from whisper_train.transcription.longform import DecodedSegment, transcribe_long_form

RATE = 16_000
# espeak-ng sentences with 2 s pauses: about 47 s, so two windows at least.
SENTENCES = [
    "we will meet at the station at seven in the morning",
    "open the door and turn on the light in the kitchen",
    "the quick brown fox jumps over the lazy dog",
    "she sells sea shells by the sea shore",
    "my brother plays football every saturday afternoon",
    "the train to london leaves from platform four",
    "turn left at the church and walk for five minutes",
    "there are twelve eggs in the box on the table",
    "please call stella and ask her to bring these things",
    "the children played in the garden until dark",
]


@pytest.fixture(scope="module")
def spoken_recording(tmp_path_factory) -> tuple[Path, str, list[float]]:
    """A folder holding talk.wav (SENTENCES spoken by espeak-ng, 2 s apart) and talk.txt; the
    reference, and each sentence's end in seconds."""
    from whisper_train.data.synth import synthesize

    folder = tmp_path_factory.mktemp("recordings")
    pieces, ends, at = [], [], 0
    for sentence in SENTENCES:
        speech = synthesize(sentence)
        pieces += [speech, np.zeros(2 * RATE, dtype=np.float32)]
        at += len(speech)
        ends.append(at / RATE)
        at += 2 * RATE
    soundfile.write(folder / "talk.wav", np.concatenate(pieces), RATE)
    reference = " ".join(SENTENCES)
    (folder / "talk.txt").write_text(reference + "\n", encoding="utf-8")
    return folder, reference, ends


@pytest.fixture(scope="module")
def tiny_en():
    """The real tiny.en: a random model's timestamps send long-form decoding round the same
    window many times (tests/test_transcribe.py), so long-form decoding is tested on it."""
    from whisper_train.models import load_model

    return load_model("tiny.en")


def _noise(path: Path, seconds: float) -> Path:
    rng = np.random.default_rng(0)
    soundfile.write(
        path, (0.01 * rng.standard_normal(int(RATE * seconds))).astype(np.float32), RATE
    )
    return path


# -- how a user says "long-form", and how its recordings are read ----------------------------


def test_a_set_is_tagged_long_form_beside_its_language():
    entries = ["talks:long=t/", "calls:en:long=c/", "other:long:de=o/", "plain=p/", "bare/"]
    assert long_form_sets(entries, "--eval-data") == {"talks", "calls", "other"}
    # The tag leaves the name, path and language as they were.
    assert named_sets(entries, "--eval-data") == {
        "talks": ("t/", None),
        "calls": ("c/", "en"),
        "other": ("o/", "de"),
        "plain": ("p/", None),
        "eval": ("bare/", None),
    }
    with pytest.raises(UserError, match="NAME:long=PATH"):
        named_sets(["x:en:de=p/"], "--eval-data")


def test_a_recording_folder_is_read_one_whole_recording_per_transcript(tmp_path):
    """talk.srt's cues span 70 s: training's subtitles layout cuts them into 30 s windows; a
    long-form set keeps one example of the whole recording with every cue's text."""
    _noise(tmp_path / "talk.wav", 70.0)
    (tmp_path / "talk.srt").write_text(
        "1\n00:00:01,000 --> 00:00:20,000\nfirst part\n\n"
        "2\n00:00:25,000 --> 00:00:45,000\n<i>second</i> part\n\n"
        "3\n00:00:50,000 --> 00:01:09,000\nthird part\n",
        encoding="utf-8",
    )
    _noise(tmp_path / "memo.wav", 40.0)
    (tmp_path / "memo.txt").write_text("a memo\non two lines\n", encoding="utf-8")
    (tmp_path / "README.txt").write_text("not a transcript", encoding="utf-8")

    assert len(load_examples(tmp_path)) == 3  # training: windows of at most 30 s
    examples = load_recordings(tmp_path)
    assert [(Path(e.audio).name, e.text, e.start, e.end) for e in examples] == [
        ("memo.wav", "a memo on two lines", None, None),
        ("talk.wav", "first part second part third part", None, None),
    ]
    _noise(tmp_path / "orphan.wav", 1.0)
    with pytest.raises(UserError, match=r"orphan\.wav: no transcript of the same name"):
        load_recordings(tmp_path)


# -- scoring ------------------------------------------------------------------------------


def test_a_joined_recording_is_scored_whole_against_its_reference(tmp_path, monkeypatch):
    """A 70 s recording in an ordinary manifest: decoded long-form with all 70 s of its audio
    (not its first 30 s only), and its WER, insertion and deletion rates are
    jiwer's over the whole normalised reference. The decoder is a stub whose transcript drops
    one sentence (a lost window) and repeats another (a doubled one)."""
    # Punctuated and capitalised as references are: the English normaliser makes them words.
    reference = "Alpha, bravo, charlie. Delta echo foxtrot! Golf hotel india juliet kilo lima mike."
    # "delta echo foxtrot" lost (a skipped window), "lima mike" said twice (a doubled one).
    hypothesis = "alpha bravo charlie golf hotel india juliet kilo lima mike lima mike"
    heard = []

    def stub(model, processor, audio, **options):
        heard.append(len(audio))
        return {"segments": [[]]}

    monkeypatch.setattr(longform, "generate_long_form", stub)
    segments = [DecodedSegment(0.0, 70.0, hypothesis, [])]
    monkeypatch.setattr(longform, "decoded_segments", lambda output, tokenizer: segments)
    long_clip = _noise(tmp_path / "joined.wav", 70.0)
    short_clip = _noise(tmp_path / "short.wav", 2.0)
    examples = [Example(str(short_clip), "hello"), Example(str(long_clip), reference)]
    from tiny_models import make_tiny_whisper

    model, processor = make_tiny_whisper()
    report = evaluate_examples(
        model, processor, examples, max_length=4, decoding=NO_FALLBACK, normalizer="english"
    )

    assert heard == [70 * RATE], "the stub decodes the long clip only, and all of it"
    assert report.long_form == [False, True] and report.audio[1] == str(long_clip)
    normalise = get_normalizer("english")
    truth = jiwer.process_words(normalise(reference), normalise(hypothesis))
    row = report.scores.rows[1]
    # By hand: 13 reference words, 3 deleted and 2 inserted, nothing substituted.
    assert (truth.substitutions, truth.deletions, truth.insertions) == (0, 3, 2)
    assert row.reference_words == 13 and (row.deletions, row.insertions) == (3, 2)
    assert row.wer == jiwer.wer(normalise(reference), normalise(hypothesis)) == 5 / 13
    # The set's rates add the short clip's counts (one reference word) to the recording's.
    short = report.scores.rows[0]
    assert report.scores.deletion_rate == (3 + short.deletions) / 14
    assert report.scores.insertion_rate == (2 + short.insertions) / 14
    assert report.pauses is None, "no cue times, no pauses to score"


def test_pauses_are_where_the_cues_say_nobody_speaks():
    """Gaps of at least 2 s between cues once 0.5 s is taken off each end that meets a cue
    (subtitle and segment times are good to a few hundred ms); the lead-in and the tail count."""
    cues = [(3.0, 10.0, "a"), (11.0, 20.0, "b"), (24.0, 30.0, "c"), (29.0, 31.0, "d")]
    assert longform.pauses(cues, 40.0) == [(0.0, 2.5), (20.5, 23.5), (31.5, 40.0)]
    # A 1 s breath between cues, 2.5 s of lead-in (2 s once trimmed), no tail: no pause but one.
    assert longform.pauses([(2.5, 5.0, "a"), (6.0, 9.8, "b")], 10.0) == [(0.0, 2.0)]
    assert longform.pauses([], 5.0) == [(0.0, 5.0)]
    # A segment belongs to the span its middle lies in: speech that spills past a cue is not
    # counted, a hallucination inside a pause is.
    segments = [
        DecodedSegment(2.0, 10.0, "first words", []),  # middle 6.0: speech
        DecodedSegment(21.0, 23.0, "Thank you.", []),  # middle 22.0: in the pause
        DecodedSegment(30.0, 34.0, "and then", []),  # middle 32.0: in the tail
    ]
    spans = longform.pauses(cues, 40.0)
    assert longform.text_in_pauses(segments, spans) == ["", "Thank you.", "and then"]


def test_words_written_in_a_recordings_pauses_are_counted_per_minute(tmp_path, monkeypatch):
    """A recording with subtitles: the text of the decoded segments in its pauses, per minute
    of pause, in the report (report.json's figures) and in a training row alike."""
    audio = _noise(tmp_path / "talk.wav", 40.0)
    (tmp_path / "talk.srt").write_text(
        "1\n00:00:00,000 --> 00:00:10,000\nhello there\n\n"
        "2\n00:00:20,000 --> 00:00:30,000\ngood night\n",
        encoding="utf-8",
    )
    (example,) = load_recordings(tmp_path)
    assert example.segments == ((0.0, 10.0, "hello there"), (20.0, 30.0, "good night"))
    segments = [
        DecodedSegment(0.0, 9.0, "hello there", []),
        DecodedSegment(12.0, 14.0, "thank you for watching", []),  # a pause of 9 s
        DecodedSegment(20.0, 30.0, "good night", []),
    ]  # nothing in the tail's 9.5 s
    monkeypatch.setattr(longform, "generate_long_form", lambda *a, **k: {})
    monkeypatch.setattr(longform, "decoded_segments", lambda output, tokenizer: segments)
    from tiny_models import make_tiny_whisper

    model, processor = make_tiny_whisper()
    found = longform.decode_recordings(model, processor, [example])
    assert found.texts == ["hello there thank you for watching good night"]
    assert found.pause_texts == ["thank you for watching", ""]
    assert found.pause_seconds == [9.0, 9.5]
    report = evaluate_examples(model, processor, [example], long_form=True)
    assert report.audio == [str(audio)] and report.scores.wer == 4 / 4  # 4 words inserted
    figures = report_to_dict(report)
    assert figures["pause_minutes"] == round(18.5 / 60, 4) and figures["pause_words"] == 4
    assert figures["pause_words_per_minute"] == round(4 / (18.5 / 60), 4)
    # A training row of the set (one process) carries the same figures.
    one_process = SimpleNamespace(num_processes=1, unwrap_model=lambda m: m)
    loader = [longform.collate_recordings([(0, example)])]
    row = longform.run_long_form_evaluation(model, loader, processor, one_process, None, 3)
    assert {key: row[key] for key in figures if key.startswith("pause")} == {
        key: value for key, value in figures.items() if key.startswith("pause")
    }
    assert row["step"] == 3 and row["wer"] == 1.0


def test_previous_text_conditioning_reaches_generate_only_when_asked(tiny_en, monkeypatch):
    model, processor = tiny_en
    seen = []

    def fake_generate(**kwargs):
        seen.append(kwargs)
        return {"segments": [[]]}

    monkeypatch.setattr(model, "generate", fake_generate)
    audio = np.zeros(40 * RATE, dtype=np.float32)
    transcribe_long_form(model, processor, audio)
    transcribe_long_form(model, processor, audio, condition_on_previous_text=True)
    assert "condition_on_prev_tokens" not in seen[0]  # transformers' default: off
    assert seen[1]["condition_on_prev_tokens"] is True
    # Both are the long-form path: every frame of the 40 s, with timestamps.
    assert all(kw["input_features"].shape[-1] == 4000 and kw["return_timestamps"] for kw in seen)


# -- evaluate, as users run it ------------------------------------------------------------


@pytest.mark.speech
@pytest.mark.long
def test_evaluate_scores_a_long_set_as_transcribe_decodes_it(spoken_recording, tiny_en, tmp_path):
    """`evaluate --data talks:long=DIR --baseline`: exit 0; the JSON says one recording was
    decoded long-form; its transcript is `transcribe`'s, word for word (the same decoding);
    it covers the speech after 30 s; report.md compares deletion rates."""
    from whisper_train.cli import main
    from whisper_train.transcription.transcribe import transcribe_paths

    folder, reference, ends = spoken_recording
    out = tmp_path / "report"
    argv = ["evaluate", "--model", "tiny.en", "--data", f"talks:long={folder}"]
    assert main([*argv, "--baseline", "tiny.en", "--output", f"{out}/"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["n"] == 1 and report["long_form_recordings"] == 1
    assert report["condition_on_previous_text"] is False
    (utterance,) = report["utterances"]
    assert utterance["long_form"] is True
    (transcript,) = transcribe_paths(tiny_en, [folder / "talk.wav"], progress=False)
    assert utterance["hypothesis"] == transcript.text
    # Scored on its first window only, every word spoken after 30 s would be a deletion.
    after_30_s = sum(len(s.split()) for s, end in zip(SENTENCES, ends, strict=True) if end > 30)
    words = len(reference.split())
    assert after_30_s / words > 0.25
    # tiny.en on espeak-ng speech: ~7% WER here, against > 25% for the first window alone.
    assert report["wer"] < 0.2 and report["deletion_rate"] < 0.1
    assert "garden" in utterance["normalized_hypothesis"]  # the last sentence, at ~45 s
    comparison = (out / "report.md").read_text()
    assert "deletion rate" in comparison and "1 recordings decoded long-form" in comparison


def _srt_time(seconds: float) -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d},{ms % 1000:03d}"


# Its assertions (the pauses' length from the cues, the figures reported) hold for any spoken
# audio: CI's second speech pass leaves it out.
@pytest.mark.speech
@pytest.mark.any_speech
def test_evaluate_reports_the_words_written_in_a_recordings_pauses(
    spoken_recording, tmp_path, capsys
):
    """The recording of the tests above with 12 s of room noise after its last sentence and an
    .srt of its sentences: `evaluate` prints and writes what tiny.en wrote in the pauses."""
    from whisper_train.cli import main

    folder, _, ends = spoken_recording
    speech, rate = soundfile.read(folder / "talk.wav", dtype="float32")
    speech = speech[: round(ends[-1] * rate)]
    noise = 10 ** (-40 / 20) * np.random.default_rng(1).standard_normal(12 * rate)
    recordings = tmp_path / "talks"
    recordings.mkdir()
    soundfile.write(recordings / "talk.wav", np.concatenate([speech, noise]), rate)
    starts = [0.0] + [end + 2.0 for end in ends[:-1]]
    cues = zip(starts, ends, SENTENCES, strict=True)
    (recordings / "talk.srt").write_text(
        "\n".join(
            f"{i}\n{_srt_time(a)} --> {_srt_time(b)}\n{text}\n"
            for i, (a, b, text) in enumerate(cues, start=1)
        ),
        encoding="utf-8",
    )
    out = tmp_path / "report"
    assert (
        main(
            [
                "evaluate",
                "--model",
                "tiny.en",
                "--data",
                f"talks:long={recordings}",
                "--output",
                f"{out}/",
            ]
        )
        == 0
    )
    report = json.loads((out / "report.json").read_text())
    # The 2 s between sentences are breaths (1 s once trimmed); the tail is the one pause.
    assert report["pause_minutes"] == round(11.5 / 60, 4)
    words = report["pause_words"]
    assert report["pause_words_per_minute"] == round(words / (11.5 / 60), 4)
    line = f"in the pauses between subtitle cues (1 pause(s), 0.2 min): {words / (11.5 / 60):.1f}"
    assert line in capsys.readouterr().out


# -- during training: a long-form set as the guard ----------------------------------------


@pytest.mark.speech
@pytest.mark.long
def test_a_long_form_set_guards_a_training_run(spoken_recording, tmp_path):
    """`--eval-data talks:long=DIR --guard talks`: the recording is scored whole at the start
    and at the end (clips 1, no validation loss), beside an ordinary set, and final/ is chosen
    with it as the guard."""
    from whisper_train.training.train import train

    folder, _, _ = spoken_recording
    tones = write_tone_dataset(tmp_path / "tones", n=6)
    config = RunConfig()
    config.update(
        {
            "data": str(tones),
            "model": "tiny.en",
            "mode": "lora",
            "output_dir": str(tmp_path / "out"),
            "max_steps": 1,
            "batch_size": 2,
            "seed": 0,
            "eval_data": [f"tones={tones}", f"talks:long={folder}"],
            "guard": "talks",
            "generation_max_length": 8,
            "temperatures": "0",
            "condition_on_previous_text": True,
        }
    )
    result = train(config)
    rows = [row for row in metric_rows(Path(result.output_dir)) if row.get("set") == "talks"]
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        assert row["long_form"] is True and row["clips"] == 1
        assert math.isnan(row["eval_loss"])
        # One LoRA step at the default rate barely moves tiny.en: still ~7% on this speech.
        assert row["wer"] < 0.2 and 0 <= row["deletion_rate"] < 0.1
    assert result.final_step == 1


@pytest.mark.speech
@pytest.mark.same_audio
@pytest.mark.long
def test_two_processes_score_a_long_form_guard_as_one_when_one_has_no_recording(
    spoken_recording, tmp_path
):
    """--nproc 2 with a long-form set of one recording: process 1's share is empty (the
    unusable share every multi-process test runs). Both processes run the same collectives and
    finish; the recording is scored once, with the WER one process gives it before training."""
    from conftest import train_in_subprocess

    from whisper_train.training.train import train

    folder, _, _ = spoken_recording
    tones = write_tone_dataset(tmp_path / "tones", n=6)
    common = {
        "data": str(tones),
        "model": "tiny.en",
        "mode": "lora",
        "max_steps": 1,
        "batch_size": 1,
        "seed": 0,
        "eval_data": [f"tones={tones}", f"talks:long={folder}"],
        "guard": "talks",
        "generation_max_length": 8,
        "temperatures": "0",
    }
    config = RunConfig()
    config.update({**common, "output_dir": str(tmp_path / "one")})
    one = [row for row in metric_rows(Path(train(config).output_dir)) if row.get("set") == "talks"]
    flags = [
        f"--{key.replace('_', '-')}={value}" for key, value in common.items() if key != "eval_data"
    ]
    flags += [f"--eval-data={spec}" for spec in common["eval_data"]]
    two = tmp_path / "two"
    train_in_subprocess([*flags, "--nproc=2", f"--output-dir={two}"])
    rows = [row for row in metric_rows(two) if row.get("set") == "talks"]
    assert [row["step"] for row in rows] == [0, 1]
    assert all(row["clips"] == 1 and row["long_form"] for row in rows)
    # Step 0 is the untrained tiny.en in both runs: the same decoding of the same recording.
    assert rows[0]["wer"] == one[0]["wer"] and one[0]["wer"] < 0.2
