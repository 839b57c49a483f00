"""Clips per second: whisper-train's batched `LogMel` vs transformers' `WhisperFeatureExtractor`.

    .venv/bin/python bench/features.py [--rounds 5] [--threads 2] [--seconds 30,5]

Clips of noise (the spectrogram's cost does not depend on the content) 30 s long, the goal's
case, and 5 s long, about a Common Voice clip (all are padded to 30 s), batch sizes 1, 8 and 32.
Four ways to get the same (batch, 80, 3000) log-mel features:

    LogMel            whisper-train: STFT of the frames that see audio, one clip at a time
    WFE batch         WhisperFeatureExtractor called once on the batch (its torch path)
    WFE per clip      called once per clip, as the fine-tuning blog's `dataset.map` does
    WFE numpy         its numpy path, per clip (what it runs without torch, and what the
                      path BENCHMARKS.md's "WFE numpy" column measures); a private
                      method, called here only to time it

Runs alternate (LogMel, WFE batch, WFE per clip, LogMel, ...) so that load from other processes
hits all of them alike; the table gives the median clips/s of `--rounds` rounds and the ratios.
On CUDA, LogMel also runs on the GPU (features computed where the model trains).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import WhisperFeatureExtractor  # noqa: E402

from whisper_train.data.features import LogMel  # noqa: E402

SAMPLES_30S = 30 * 16_000


def clips_per_second(function, clips: list[np.ndarray]) -> float:
    start = time.perf_counter()
    function(clips)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return len(clips) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--seconds", default="30,5", help="clip lengths to time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    extractor = WhisperFeatureExtractor(feature_size=80)
    log_mel = LogMel(extractor)
    methods = {
        "LogMel": log_mel,
        "WFE batch": lambda clips: extractor(clips, sampling_rate=16_000, return_tensors="pt"),
        "WFE per clip": lambda clips: [
            extractor(clip, sampling_rate=16_000, return_tensors="pt") for clip in clips
        ],
    }
    methods["WFE numpy"] = lambda clips: [
        extractor._np_extract_fbank_features(
            np.pad(clip, (0, SAMPLES_30S - len(clip)))[None], "cpu"
        )  # padded to 30 s first, as the extractor's __call__ does
        for clip in clips
    ]
    if torch.cuda.is_available():
        gpu_mel = LogMel(extractor, device="cuda")
        methods["LogMel on CUDA"] = gpu_mel

    rng = np.random.default_rng(0)
    # Agreement first: the speed-up is worthless if the numbers differ.
    check = [rng.standard_normal(SAMPLES_30S).astype(np.float32) * 0.1 for _ in range(2)]
    reference = extractor(check, sampling_rate=16_000, return_tensors="pt").input_features
    print(f"max |LogMel - WFE| on log-mel: {(log_mel(check) - reference).abs().max().item():.2e}")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch threads {args.threads}, cuda {torch.cuda.is_available()}"
    )

    print(
        f"\n{'clip':>5} | {'batch':>5} | "
        + " | ".join(f"{name:>14}" for name in methods)
        + " | LogMel / WFE batch | LogMel / WFE per clip | LogMel / numpy"
    )
    for seconds in [float(s) for s in args.seconds.split(",")]:
        for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
            n = int(seconds * 16_000)
            clips = [rng.standard_normal(n).astype(np.float32) * 0.1 for _ in range(batch_size)]
            for function in methods.values():  # warm-up (allocator, FFT plans)
                function(clips)
            rates: dict[str, list[float]] = {name: [] for name in methods}
            for _ in range(args.rounds):
                for name, function in methods.items():
                    rates[name].append(clips_per_second(function, clips))
            median = {name: statistics.median(values) for name, values in rates.items()}
            print(
                f"{seconds:>4g}s | {batch_size:>5} | "
                + " | ".join(f"{median[n]:>10.1f} c/s" for n in methods)
                + f" | {median['LogMel'] / median['WFE batch']:>17.2f}x"
                + f" | {median['LogMel'] / median['WFE per clip']:>20.2f}x"
                + f" | {median['LogMel'] / median['WFE numpy']:>13.2f}x"
            )


if __name__ == "__main__":
    main()
