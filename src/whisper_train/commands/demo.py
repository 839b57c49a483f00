"""`whisper-train demo`: synthesise speech, fine-tune tiny.en on it, compare WER (demo.py)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="Offline end-to-end demo: synthesise speech, fine-tune tiny.en, compare WER.",
        description="Synthesise a small English dataset, evaluate tiny.en on held-out utterances, "
        "fine-tune it, evaluate again and print both WERs. Runs offline in a few minutes on a CPU.",
    )
    parser.add_argument(
        "--output-dir",
        default="whisper-train-demo",
        help="Holds the synthesised data/ and the training run/ (its model in run/final/).",
    )
    parser.add_argument("--model", default="tiny.en", help="Model to fine-tune [default: tiny.en].")
    parser.add_argument(
        "--train-utterances", type=int, default=128, help="Synthesised utterances to train on."
    )
    parser.add_argument(
        "--eval-utterances",
        type=int,
        default=32,
        help="Held-out utterances scored before and after fine-tuning.",
    )
    parser.add_argument("--epochs", type=float, default=4, help="Passes over the training set.")
    parser.add_argument(
        "--seed", type=int, default=0, help="Seeds the synthesised data and training."
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """0 when the demo finished; `run_demo` prints its own progress and both WERs."""
    from whisper_train.demo import run_demo

    run_demo(
        output_dir=args.output_dir,
        model=args.model,
        train_utterances=args.train_utterances,
        eval_utterances=args.eval_utterances,
        epochs=args.epochs,
        seed=args.seed,
    )
    return 0
