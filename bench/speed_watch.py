"""The speed watch: the default path's, the unpacked path's and the cached path's epoch against
the Seq2SeqTrainer's, side by side in one run (`make bench-quick`, a few minutes on 2 cores).

    PYTHONPATH=src .venv/bin/python bench/speed_watch.py [--clips 40] [--batch-size 4]
        [--epochs 2] [--rounds 1] [--rows default,...]

Every row trains the real tiny.en (fp32, no checkpointing, one thread, no evaluation) on the same
clips: espeak-ng sentences of 3-5 s in the demo's voices. A row's figure is its seconds per epoch
after the first (the first holds compilation, the cache's fill and one-off costs), in CPU seconds
of its worker (bench/throughput.py's workers: robust to other jobs on the machine), and its
speech clips per second; non-speech clips ride along where the row trains them (`--nonspeech
auto`, train's default) and are not counted as clips. Run it before a change to a default lands;
BENCHMARKS.md ("The speed watch") holds its current table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import throughput  # bench/ is this script's folder: on sys.path

# name: (worker, scenario, --packing, --nonspeech, what it is)
ROWS = {
    "default": ("whisper-train", "full", "per-clip", "auto", "train's defaults (per-clip packing)"),
    "default-speech-only": (
        "whisper-train",
        "full",
        "per-clip",
        "none",
        "the same, --nonspeech none",
    ),
    "unpacked": ("whisper-train", "full", "off", "auto", "--packing off"),
    "joined": ("whisper-train", "full", "on", "auto", "--packing on"),
    "trainer": ("trainer", "full", "off", "none", "Seq2SeqTrainer (the blog's recipe)"),
    "cached": ("whisper-train", "freeze-encoder", "auto", "auto", "--freeze-encoder, cached"),
    "cached-speech-only": (
        "whisper-train",
        "freeze-encoder",
        "auto",
        "none",
        "the same, --nonspeech none",
    ),
    "trainer-frozen": (
        "trainer",
        "freeze-encoder",
        "off",
        "none",
        "Seq2SeqTrainer, encoder frozen",
    ),
}
# Each row's yardstick: the Trainer doing the same job.
AGAINST = {"full": "trainer", "freeze-encoder": "trainer-frozen"}


def synth_manifest(folder: Path, clips: int) -> Path:
    """`clips` espeak-ng sentences of 3-5 s (the demo's voices), as a JSONL manifest."""
    import csv

    import soundfile

    from whisper_train.data.synth import make_speech_dataset

    speech = make_speech_dataset(folder / "synth", n_utterances=4 * clips, seed=0)
    rows = []
    with (speech / "metadata.csv").open(encoding="utf-8") as stream:
        for row in csv.DictReader(stream):
            path = speech / row["file_name"]
            if 3.0 <= soundfile.info(str(path)).duration <= 5.0:
                rows.append({"audio": str(path), "text": row["transcription"]})
    if len(rows) < clips:
        sys.exit(f"--clips {clips}: the synthesised set has {len(rows)} clips of 3-5 s")
    out = folder / "watch.jsonl"
    out.write_text("".join(json.dumps(row) + "\n" for row in rows[:clips]), encoding="utf-8")
    return out


def epoch_seconds(result: dict) -> float:
    """Seconds per epoch after the first."""
    ends = result.get("epoch_ends_s")
    if ends and len(ends) > 1:
        return (ends[-1] - ends[0]) / (len(ends) - 1)
    return result["epoch_s_after_first"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2, help="the first one is not timed")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each row (median)")
    parser.add_argument(
        "--rows",
        default=",".join(row for row in ROWS if row != "joined"),
        help=f"of {', '.join(ROWS)}",
    )
    parser.add_argument("--model", default="tiny.en")
    args = parser.parse_args()
    rows = args.rows.split(",")
    unknown = [row for row in rows if row not in ROWS]
    if unknown:
        sys.exit(f"--rows: unknown {unknown} (of {', '.join(ROWS)})")
    # What bench/throughput.py's launch() passes to its workers.
    args.checkpointing, args.threads, args.peak_tflops, args.num_workers = "off", 1, 989.0, 0
    args.d_model, args.layers = 384, 4

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        args.manifest = str(synth_manifest(folder, args.clips))
        throughput.set_up_model(args, folder)
        print(
            f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
            f"torch {torch.__version__}; model {args.model}; {args.clips} clips of 3-5 s, batch "
            f"{args.batch_size}, {args.epochs} epochs, {args.rounds} round(s); CPU seconds of "
            "each worker (one thread)",
            flush=True,
        )
        if any(ROWS[row][1] == "freeze-encoder" and ROWS[row][0] != "trainer" for row in rows):
            # The cache of the run's clips (speech and non-speech) filled before any timed run.
            for nonspeech in ("auto", "none"):
                throughput.launch(
                    args, "whisper-train", "freeze-encoder", 1, "auto", "off", nonspeech
                )
        results: dict[str, list[float]] = {row: [] for row in rows}
        for _ in range(args.rounds):
            for row in rows:
                worker, scenario, packing, nonspeech, _ = ROWS[row]
                result = throughput.launch(
                    args, worker, scenario, args.epochs, packing, "off", nonspeech
                )
                results[row].append(epoch_seconds(result))
                print(f"  {row}: {json.dumps(result)}", flush=True)
        seconds = {row: statistics.median(times) for row, times in results.items()}
        print()
        print("| row | what | s / epoch | clips / s | vs the Trainer's epoch |")
        print("|---|---|---|---|---|")
        for row in rows:
            worker, scenario, packing, nonspeech, what = ROWS[row]
            yardstick = seconds.get(AGAINST[scenario])
            ratio = f"{yardstick / seconds[row]:.2f}x" if yardstick else "-"
            print(
                f"| {row} | {what} | {seconds[row]:.2f} | {args.clips / seconds[row]:.2f} | "
                f"{ratio} |"
            )


if __name__ == "__main__":
    main()
