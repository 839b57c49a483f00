"""Long-form WER of real speech: clips joined into recordings, decoded as `transcribe` decodes
(sequential 30 s windows with timestamps), with and without previous-text conditioning, beside
the WER of the same clips decoded one by one.

    OMP_NUM_THREADS=1 .venv/bin/python bench/longform.py [--model tiny.en] [--seconds 90]
        [--pause 0.5]

1. Recordings: the clips of ../shared/realspeech in manifest order (LibriVox, LJ Speech, AN4),
   joined with `--pause` seconds of silence into recordings of about `--seconds` (a clip starts
   a new recording once the current one is that long); each recording's reference is its clips'
   transcripts joined. Written as REC.wav + REC.txt: a long-form set (`NAME:long=DIR`).
2. Decoded by `evaluation.evaluate_examples` with `long_form=True` (the recording whole), with
   `condition_on_previous_text` off (transcribe's default) and on; and the clips themselves
   one by one (short-form, one 30 s window each). Same normaliser (english), same temperature
   fallback (openai-whisper's defaults), greedy.

Printed: WER, insertion and deletion rates (of reference words), and CPU seconds (user +
system: the machine may be shared). What the figures rest on is printed above the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
from common import REALSPEECH, cpu_seconds  # noqa: E402  (bench/ is this script's folder: on sys.path)


def build_recordings(folder: Path, *, seconds: float, pause: float) -> tuple[list, float]:
    """REC.wav + REC.txt per recording in `folder`; (the clips as Examples, total seconds)."""
    import soundfile

    from whisper_train.audio import SAMPLE_RATE, load_audio
    from whisper_train.data.examples import Example

    rows = [json.loads(line) for line in (REALSPEECH / "manifest.jsonl").open()]
    order = ("librivox", "ljspeech", "an4")
    rows.sort(key=lambda r: next(i for i, name in enumerate(order) if name in r["audio"]))
    silence = np.zeros(round(pause * SAMPLE_RATE), dtype=np.float32)
    clips, recordings, current = [], [], []

    def close() -> None:
        if current:
            recordings.append(list(current))
            current.clear()

    for row in rows:
        path = str(REALSPEECH / row["audio"])
        clips.append(Example(audio=path, text=row["text"]))
        current.append((load_audio(path), row["text"]))
        if sum(len(a) for a, _ in current) / SAMPLE_RATE >= seconds:
            close()
    close()
    total = 0.0
    for number, recording in enumerate(recordings):
        pieces = [p for audio, _ in recording for p in (audio, silence)][:-1]
        audio = np.concatenate(pieces)
        total += len(audio) / SAMPLE_RATE
        soundfile.write(folder / f"rec{number:02d}.wav", audio, SAMPLE_RATE)
        (folder / f"rec{number:02d}.txt").write_text(
            " ".join(text for _, text in recording) + "\n", encoding="utf-8"
        )
    return clips, total


def main() -> None:
    from timestamps import cpu_model  # bench/ is this script's folder: on sys.path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--seconds", type=float, default=90.0, help="length of each recording")
    parser.add_argument("--pause", type=float, default=0.5, help="silence between clips, s")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "wt-lf")
    args = parser.parse_args()
    if not REALSPEECH.is_dir():
        raise SystemExit(f"needs the real recordings in {REALSPEECH}")
    from whisper_train.data.recordings import load_recordings
    from whisper_train.evaluation.evaluate import evaluate_examples
    from whisper_train.models import load_model

    folder = args.work_dir / "recordings"
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        old.unlink()
    clips, total = build_recordings(folder, seconds=args.seconds, pause=args.pause)
    recordings = load_recordings(folder)
    model, processor = load_model(args.model)
    print(f"command: {' '.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}")
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        f"Python {platform.python_version()}"
    )
    print(
        f"data: {len(clips)} real clips ({REALSPEECH}) joined into {len(recordings)} recordings "
        f"of ~{args.seconds:g} s ({args.pause:g} s pauses), {total / 60:.1f} min in all"
    )
    runs = [
        ("long-form, previous text off", recordings, True, False),
        ("long-form, previous text on", recordings, True, True),
        ("per clip (one window each)", clips, False, False),
    ]
    lines = [
        "| decoding | items | WER % | insertions % | deletions % | reference words | CPU s |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, examples, long_form, previous in runs:
        started = cpu_seconds()
        report = evaluate_examples(
            model,
            processor,
            examples,
            normalizer="english",
            model_name=args.model,
            long_form=long_form,
            condition_on_previous_text=previous,
        )
        s = report.scores
        lines.append(
            f"| {label} | {s.n} | {100 * s.wer:.1f} | {100 * s.insertion_rate:.1f} "
            f"| {100 * s.deletion_rate:.1f} | {s.reference_words} "
            f"| {cpu_seconds() - started:.0f} |"
        )
        print(lines[-1], flush=True)
        if long_form:
            for audio, row in zip(report.audio, s.rows, strict=True):
                print(
                    f"    {Path(audio).name}: WER {100 * row.wer:.1f}%, "
                    f"{row.deletions} deleted, {row.insertions} inserted of "
                    f"{row.reference_words} words"
                )
    print()
    print("\n".join(lines))


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"wall: {(time.perf_counter() - started) / 60:.1f} min")
