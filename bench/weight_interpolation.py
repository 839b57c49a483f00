"""Fine-tuned weights moved back towards the starting model (WiSE-FT): held-out and guard WER
of theta0 + a * (theta - theta0) for each factor a, every floating tensor of the model.

    PYTHONPATH=src .venv/bin/python bench/weight_interpolation.py --base MODEL --sets DATA_DIR \
        [--factors 1 0.75 0.5] --models FINE_TUNED_MODEL [FINE_TUNED_MODEL ...]

--base is the model the runs started from (a folder, tiny.en, a hub id); each FINE_TUNED_MODEL
a folder of the same architecture (a run's final/). DATA_DIR holds bench/quality.py's synth
sets (held-out/ and guard/, as DIR/data-synth/ of a `--target synth` run). Scored as
bench/time_to_quality.py scores: `evaluate_examples`, generate-based WER, temperature fallback,
the English normaliser. Factor 1 is the fine-tuned model itself (a check against the run's own
scores).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers.utils import logging as transformers_logging

from whisper_train.data.layouts import load_examples
from whisper_train.evaluation.evaluate import evaluate_examples
from whisper_train.models import load_model
from whisper_train.transcription.decoding import DecodingOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True)
    parser.add_argument("--sets", type=Path, required=True)
    parser.add_argument("--factors", type=float, nargs="+", default=[1.0, 0.75, 0.5])
    parser.add_argument("--models", nargs="+", required=True)
    args = parser.parse_args()
    transformers_logging.disable_progress_bar()
    sets = {name: load_examples(str(args.sets / name)) for name in ("held-out", "guard")}
    base, _ = load_model(args.base)
    start = base.state_dict()
    print("| model | factor | held-out WER | guard WER |\n|---|---:|---:|---:|")
    for folder in args.models:
        model, processor = load_model(folder)
        model.eval()
        tuned = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        for factor in args.factors:
            moved = {
                name: start[name] + factor * (tensor - start[name])
                if tensor.is_floating_point()
                else tensor
                for name, tensor in tuned.items()
            }
            model.load_state_dict(moved)
            with torch.no_grad():
                wers = [
                    evaluate_examples(
                        model, processor, examples, normalizer="english", decoding=DecodingOptions()
                    ).wer
                    for examples in sets.values()
                ]
            print(
                f"| {folder} | {factor:g} | {100 * wers[0]:.1f} | {100 * wers[1]:.1f} |", flush=True
            )


if __name__ == "__main__":
    main()
