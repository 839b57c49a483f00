"""How long reading a lhotse CutSet manifest takes: N one-second cuts of one recording, written
with lhotse and read back whole by `load_examples` (the read-whole path of `--data cuts.jsonl.gz`).

    OMP_NUM_THREADS=1 .venv/bin/python bench/lhotse_read.py [--cuts 20000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile
from lhotse import CutSet, MonoCut, Recording, SupervisionSegment

from whisper_train.data.layouts import load_examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuts", type=int, default=20_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        soundfile.write(folder / "rec.wav", np.zeros(16_000 * 60, dtype=np.float32), 16_000)
        recording = Recording.from_file(folder / "rec.wav")
        cuts = [
            MonoCut(
                id=f"c{i}",
                start=i % 50,
                duration=1.0,
                channel=0,
                recording=recording,
                supervisions=[
                    SupervisionSegment(
                        id=f"s{i}",
                        recording_id=recording.id,
                        start=0,
                        duration=1.0,
                        text="hello world",
                        language="en",
                    )
                ],
            )
            for i in range(args.cuts)
        ]
        manifest = folder / "cuts.jsonl.gz"
        CutSet.from_cuts(cuts).to_file(manifest)
        start = time.perf_counter()
        examples = load_examples(str(manifest))
        seconds = time.perf_counter() - start
    print(
        f"{len(examples)} examples from {args.cuts} cuts in {seconds:.2f} s "
        f"({1e6 * seconds / args.cuts:.0f} us a cut)"
    )


if __name__ == "__main__":
    main()
