"""Peak memory and time of `whisper-train transcribe` on long recordings: a
recording is read and decoded a part at a time (`transcription.longform.transcribe_in_pieces`),
so its peak RSS should not grow with its length.

    OMP_NUM_THREADS=2 .venv/bin/python bench/longform_memory.py [--minutes 10 60]
        [--model tiny.en] [--before /work/main/src] [--speech-minutes 1]

1. Recordings of `--minutes`: in every 5 minutes, `--speech-minutes` of espeak-ng sentences
   (data.synth) 2 s apart, then silence (a loaded 2-core machine decodes speech at about real
   time with tiny.en: the silence keeps an hour's recording within the time a bench can take),
   written as 16-bit 16 kHz WAV.
2. Each transcribed by `python -m whisper_train transcribe REC --model MODEL --format json
   --output-dir DIR` in a fresh process (this checkout's sources, and with `--before SRC` that
   tree's sources too): peak RSS of the process (ru_maxrss from wait4), wall and CPU seconds.

Printed: one row per (sources, minutes): peak RSS in MB, wall and CPU seconds (user + system:
the machine may be shared), and the transcript's segment count and where its last segment ends
(a check that the whole recording was decoded).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SENTENCES = [
    "we will meet at the station at seven in the morning",
    "open the door and turn on the light in the kitchen",
    "the quick brown fox jumps over the lazy dog",
    "my brother plays football every saturday afternoon",
    "the train to london leaves from platform four",
    "there are twelve eggs in the box on the table",
]
RATE = 16_000
PERIOD_MINUTES = 5


def write_recording(path: Path, minutes: float, speech_minutes: float) -> None:
    """`minutes` of speech and silence (`speech_minutes` of speech in every PERIOD_MINUTES),
    written block by block."""
    import soundfile

    sys.path.insert(0, str(REPO / "src"))
    from whisper_train.data.synth import synthesize

    spoken = [np.concatenate([synthesize(s), np.zeros(2 * RATE, np.float32)]) for s in SENTENCES]
    total, written, index = int(minutes * 60 * RATE), 0, 0
    period, speech = PERIOD_MINUTES * 60 * RATE, int(speech_minutes * 60 * RATE)
    with soundfile.SoundFile(path, "w", RATE, 1, subtype="PCM_16") as out:
        while written < total:
            into = written % period
            if into < speech:
                block = spoken[index % len(spoken)]
                index += 1
            else:  # nobody speaks until the next period
                block = np.zeros(period - into, np.float32)
            block = block[: total - written]
            out.write(block)
            written += len(block)


def run(sources: Path, recording: Path, model: str, out: Path) -> tuple[float, float, float]:
    """(peak RSS in MB, wall seconds, CPU seconds) of one transcribe process."""
    env = {**os.environ, "PYTHONPATH": str(sources), "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "whisper_train", "transcribe", str(recording)]
    argv += [f"--model={model}", "--format=json", f"--output-dir={out}"]
    started = time.perf_counter()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = process.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"transcribe failed ({sources}):\n{stderr[-2000:]}")
    return usage.ru_maxrss / 1024, seconds, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, nargs="+", default=[10, 60])
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--before", type=Path, help="another tree's src/ to compare")
    parser.add_argument("--before-minutes", type=float, nargs="+", help="(default: --minutes)")
    parser.add_argument("--speech-minutes", type=float, default=1.0, help="in every 5 minutes")
    args = parser.parse_args()
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores; model "
        f"{args.model}; {args.speech_minutes:g} min of speech in every {PERIOD_MINUTES}; "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )
    print("| sources | minutes | peak RSS (MB) | wall (s) | CPU (s) | segments | last ends (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    trees = [("this tree", REPO / "src", args.minutes)]
    if args.before is not None:
        trees.append(("before", args.before, args.before_minutes or args.minutes))
    with tempfile.TemporaryDirectory() as tmp:
        for minutes in sorted({m for _, _, wanted in trees for m in wanted}):
            recording = Path(tmp) / f"talk-{minutes:g}min.wav"
            write_recording(recording, minutes, args.speech_minutes)
            for name, sources, wanted in trees:
                if minutes not in wanted:
                    continue
                out = Path(tmp) / f"{name}-{minutes:g}".replace(" ", "-")
                rss, seconds, cpu = run(sources, recording, args.model, out)
                found = json.loads((out / f"{recording.stem}.json").read_text(encoding="utf-8"))
                segments = found["segments"]
                last = segments[-1]["end"] if segments else 0.0
                print(
                    f"| {name} | {minutes:g} | {rss:.0f} | {seconds:.0f} | {cpu:.0f} | "
                    f"{len(segments)} | {last:.0f} |",
                    flush=True,
                )
            recording.unlink()


if __name__ == "__main__":
    main()
