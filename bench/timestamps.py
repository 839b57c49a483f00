"""Do timestamps survive text-only fine-tuning? Segment boundaries of a long real recording,
transcribed with `--format srt` by the base model and by models fine-tuned the demo's way.

    OMP_NUM_THREADS=1 .venv/bin/python bench/timestamps.py [--modes full,lora] [--model tiny.en]
        [--labels text-only,packed-text-only,packed-timestamps] [--epochs 1]

1. The recording: real clips from ../shared/realspeech (LibriVox's five consecutive sentences of
   Sense and Sensibility, then LJ Speech clips in manifest order) joined with `--pause` seconds
   of silence until it lasts `--seconds`; each join's time (the middle of its pause) is known.
2. Fine-tuning: `whisper-train demo`'s training set (demo.prepare_demo_data: espeak-ng sentences
   in the training voices and words), text-only labels (no --timestamps, packing off; `--labels
   default` packs per clip, the default now), the demo's run settings (batch 8, 10 warm-up
   steps, default learning rate of each mode), one epoch per mode. No evaluation during training: the recording is the evaluation.
   `--labels` adds packed runs (LABELS): the clips packed into 30 s windows, one window a step,
   with or without each clip's span as time tokens in the labels.
3. `transcribe --format srt` of the recording (transcribe.transcribe_paths, the transformers
   backend with the temperature fallback) with the base model and each fine-tuned final/.

Printed per model: segments, how many are timed (shorter than the 30 s window: a model that no
longer predicts timestamps closes each window with one segment spanning it), WER of the text
against the clips' transcripts, the share of its segment boundaries (starts and ends) within
0.5 s and 1.0 s of one of the base model's, the share of the base's boundaries it reproduces
within 0.5 s, and how many joins have one of its boundaries within 0.5 s. CPU seconds (user +
system, this process and its children), as the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
from common import REALSPEECH, cpu_seconds  # noqa: E402  (bench/ is this script's folder: on sys.path)

TOLERANCES_S = (0.5, 1.0)
# How the training labels are built. text-only: one clip a row, no time tokens, unpacked (the
# default until packing per clip); default: the same labels packed per clip (`--packing auto`);
# packed-text-only: clips packed into 30 s windows, one window a step (about as many clips a
# step as 8 unpacked); packed-timestamps: the same windows, half of them labelled with each
# clip's span as time tokens (--packing on --timestamps; labels.py's 50% mix).
LABELS = {
    "text-only": {"batch_size": 8, "packing": "off", "timestamps": False},
    "default": {"batch_size": 8, "packing": "auto", "timestamps": False},
    "packed-text-only": {"batch_size": 1, "packing": "on", "timestamps": False},
    "packed-timestamps": {"batch_size": 1, "packing": "on", "timestamps": True},
}
WINDOW_S = 30.0


@dataclass
class Recording:
    path: Path
    duration: float
    joins: list[float]  # seconds: the middle of each pause between two clips
    text: str


def joined_clips(
    *, seconds: float, pause: float
) -> tuple[np.ndarray, list[int], list[np.ndarray], list[str]]:
    """LibriVox's clips first (one reader, consecutive sentences), then LJ Speech's, joined by
    `pause` s of silence until the recording is `seconds` long: (the recording, each clip's
    first sample in it, the clips, their texts). bench/word_timestamps.py joins the same."""
    from whisper_train.audio import SAMPLE_RATE, load_audio

    rows = [json.loads(line) for line in (REALSPEECH / "manifest.jsonl").open()]
    picked = [r for r in rows if "librivox" in r["audio"]] + [
        r for r in rows if "ljspeech" in r["audio"]
    ]
    silence = np.zeros(round(pause * SAMPLE_RATE), dtype=np.float32)
    pieces, starts, clips, texts, at = [], [], [], [], 0
    for row in picked:
        if at / SAMPLE_RATE >= seconds:
            break
        audio = load_audio(str(REALSPEECH / row["audio"]))
        if pieces:
            pieces.append(silence)
            at += len(silence)
        starts.append(at)
        pieces.append(audio)
        clips.append(audio)
        texts.append(row["text"])
        at += len(audio)
    return np.concatenate(pieces), starts, clips, texts


def build_recording(folder: Path, *, seconds: float, pause: float) -> Recording:
    import soundfile

    from whisper_train.audio import SAMPLE_RATE

    audio, starts, _, texts = joined_clips(seconds=seconds, pause=pause)
    gap = round(pause * SAMPLE_RATE)
    joins = [(start - gap / 2) / SAMPLE_RATE for start in starts[1:]]  # mid-pause
    path = folder / "long-recording.wav"
    soundfile.write(path, audio, SAMPLE_RATE)
    return Recording(path, len(audio) / SAMPLE_RATE, joins, " ".join(texts))


def cpu_model() -> str:
    for line in (
        Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    ):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def fine_tune(
    mode: str,
    data_dir: Path,
    output_dir: Path,
    *,
    epochs: float,
    model: str,
    labels: str = "text-only",
    learning_rate: float | None = None,
    preserve_base: float = 0.0,
) -> Path:
    """The demo's training run (demo.run_demo's settings), without its evaluation sets, with
    `labels` one of LABELS."""
    from whisper_train.config import RunConfig
    from whisper_train.training.train import train

    config = RunConfig()
    config.update(
        {
            "data": str(data_dir),
            "model": model,
            "mode": mode,
            "epochs": epochs,
            **LABELS[labels],
            "learning_rate": learning_rate,  # None: the mode's default
            "preserve_base": preserve_base,
            "warmup_steps": 10,
            "logging_steps": 8,
            "only_train": True,
            "output_dir": str(output_dir),
            "overwrite": True,
            "seed": 0,
        }
    )
    return Path(train(config).final_dir)


def transcribe_srt(model: str | Path, recording: Recording, output_dir: Path):
    from whisper_train.transcription.transcribe import transcribe_paths

    (transcript,) = transcribe_paths(
        str(model), [recording.path], format="srt", output_dir=output_dir, progress=False
    )
    if transcript.error:
        raise SystemExit(f"{model}: {transcript.error}")
    return transcript


def boundaries(segments) -> np.ndarray:
    return np.array(sorted({round(t, 2) for s in segments for t in (s.start, s.end)}))


def share_within(times: np.ndarray, reference: np.ndarray, tolerance: float) -> float:
    """Share of `times` with a `reference` time within `tolerance` seconds."""
    if len(times) == 0 or len(reference) == 0:
        return 0.0
    nearest = np.abs(times[:, None] - reference[None, :]).min(axis=1)
    return float(np.mean(nearest <= tolerance))


def median_offset(times: np.ndarray, reference: np.ndarray, duration: float) -> float:
    """Median signed distance (s) from each inner boundary of `times` (not the recording's
    start or end) to the nearest `reference` boundary: positive when later."""
    inner = times[(times > 0.05) & (times < duration - 0.05)]
    if len(inner) == 0 or len(reference) == 0:
        return float("nan")
    offsets = inner[:, None] - reference[None, :]
    return float(np.median(offsets[np.arange(len(inner)), np.abs(offsets).argmin(axis=1)]))


def word_error_rate(reference: str, hypothesis: str) -> float:
    import jiwer
    from whisper_normalizer.english import EnglishTextNormalizer

    normalise = EnglishTextNormalizer()
    return jiwer.wer(normalise(reference), normalise(hypothesis))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--modes", default="full,lora", help="comma-separated --mode values")
    parser.add_argument("--seconds", type=float, default=75.0, help="length of the recording")
    parser.add_argument("--pause", type=float, default=0.5, help="silence between clips, s")
    parser.add_argument("--train-utterances", type=int, default=192, help="the demo's 192")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--learning-rate", type=float, default=None, help="default: the mode's")
    parser.add_argument(
        "--preserve-base", type=float, default=0.0, help="train's --preserve-base weight"
    )
    parser.add_argument(
        "--labels",
        default="text-only",
        help=f"comma-separated, of {', '.join(LABELS)} (see LABELS)",
    )
    parser.add_argument(
        "--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "wt-timestamps"
    )
    args = parser.parse_args()
    if not REALSPEECH.is_dir():
        raise SystemExit(f"needs the real recordings in {REALSPEECH}")
    from whisper_train.demo import prepare_demo_data

    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    recording = build_recording(work, seconds=args.seconds, pause=args.pause)
    data = prepare_demo_data(
        work / "data",
        train_utterances=args.train_utterances,
        eval_utterances=1,
        guard_utterances=1,
        seed=0,
    )
    print(f"command: {' '.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}")
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        f"Python {platform.python_version()}"
    )
    print(
        f"recording: {recording.duration:.1f} s, {len(recording.joins) + 1} clips, "
        f"{len(recording.joins)} joins ({args.pause} s pauses), {recording.path}"
    )

    models: list[tuple[str, str | Path, float]] = [(f"{args.model} (base)", args.model, 0.0)]
    for mode in args.modes.split(","):
        for labels in args.labels.split(","):
            started = cpu_seconds()
            final = fine_tune(
                mode,
                data["train"],
                work / f"run-{mode}-{labels}",
                epochs=args.epochs,
                model=args.model,
                labels=labels,
                learning_rate=args.learning_rate,
                preserve_base=args.preserve_base,
            )
            models.append((f"{mode}, {labels}", final, cpu_seconds() - started))

    header = (
        "| model | segments (timed) | WER % | its boundaries within 0.5 s / 1.0 s of base's "
        "| base's within 0.5 s of its | median offset from base's, s "
        "| joins with a boundary within 0.5 s | train CPU s | transcribe CPU s |"
    )
    lines = [header, "|" + "---|" * 9]
    base_times = None
    for label, model, train_cpu in models:
        started = cpu_seconds()
        folder = label.replace(", ", "-").split()[0]
        transcript = transcribe_srt(model, recording, work / "srt" / folder)
        transcribe_cpu = cpu_seconds() - started
        times = boundaries(transcript.segments)
        if base_times is None:
            base_times = times
        timed = sum(1 for s in transcript.segments if s.end - s.start < WINDOW_S - 0.5)
        joins = np.array(recording.joins)
        near = [share_within(times, base_times, tol) for tol in TOLERANCES_S]
        line = (
            f"| {label} | {len(transcript.segments)} ({timed}) "
            f"| {100 * word_error_rate(recording.text, transcript.text):.1f} "
            f"| {100 * near[0]:.0f}% / {100 * near[1]:.0f}% "
            f"| {100 * share_within(base_times, times, 0.5):.0f}% "
            f"| {median_offset(times, base_times, recording.duration):+.2f} "
            f"| {round(share_within(joins, times, 0.5) * len(joins))} of {len(joins)} "
            f"| {train_cpu:.0f} | {transcribe_cpu:.0f} |"
        )
        lines.append(line)
        print(line, flush=True)
        for segment in transcript.segments:
            print(f"    {segment.start:7.2f} {segment.end:7.2f}  {segment.text[:70]}")
    print()
    print("\n".join(lines))


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"wall: {(time.perf_counter() - started) / 60:.1f} min")
