"""Pseudo-labelling speed: clips and seconds of audio `whisper-train pseudo-label` labels a second.

    PYTHONPATH=src .venv/bin/python bench/pseudo_label.py [--model tiny.en] [--data MANIFEST]
        [--settings fallback,greedy]

Labels the real recordings (the manifest of `common.REALSPEECH`, or --data: any input
`pseudo-label` reads) with --model, once per decoding setting, each into a fresh output, through
the library function the command calls (`transcription.pseudo_label.pseudo_label`). Settings:
`fallback` is the command's default (greedy, then temperatures 0.2 ... 1.0 for a clip whose text
loops or is unlikely); `greedy` is `--temperatures 0`. Printed per setting: clips, seconds of
audio, wall seconds of decoding, CPU seconds of the whole call (`common.cpu_seconds`, model load
included: on a machine other work shares, steadier than wall time), clips/s and audio
seconds/s by wall time, audio seconds per CPU second, the mean WER against the data's own text
(where it has one) and how many clips `--max-wer 0.1` would leave out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REALSPEECH, cpu_seconds  # noqa: E402

from whisper_train.transcription.decoding import NO_FALLBACK, DecodingOptions  # noqa: E402
from whisper_train.transcription.pseudo_label import pseudo_label  # noqa: E402

SETTINGS = {"fallback": DecodingOptions(), "greedy": NO_FALLBACK}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--data", default=str(REALSPEECH / "manifest.jsonl"))
    parser.add_argument("--settings", default="fallback,greedy")
    args = parser.parse_args()
    print(f"model {args.model}; data {args.data}; {os.cpu_count()} CPU cores; load {_load()}")
    header = (
        "| decoding | clips | audio s | wall s | CPU s | clips/s | audio s/s | audio s/CPU s "
        "| mean WER | over 0.1 |"
    )
    print(header)
    print("|---" * 10 + "|")
    for name in args.settings.split(","):
        with tempfile.TemporaryDirectory() as folder:
            output = Path(folder) / "labels.jsonl"
            cpu = cpu_seconds()
            result = pseudo_label(
                args.model, args.data, output, decoding=SETTINGS[name], progress=False
            )
            cpu = cpu_seconds() - cpu
            wers = [row["wer"] for row in _rows(output) if row.get("wer") is not None]
        decoded = result.labelled + result.no_speech
        mean_wer = f"{sum(wers) / len(wers):.3f}" if wers else "-"
        over = sum(wer > 0.1 for wer in wers) if wers else "-"
        print(
            f"| {name} | {decoded} | {result.audio_seconds:.1f} | {result.seconds:.1f} "
            f"| {cpu:.1f} | {decoded / result.seconds:.2f} "
            f"| {result.audio_seconds / result.seconds:.1f} | {result.audio_seconds / cpu:.1f} "
            f"| {mean_wer} | {over} |"
        )
    print(f"load after: {_load()}")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
