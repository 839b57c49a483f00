"""`whisper-train demo`: synthesise speech, fine-tune tiny.en on it, score it on unseen speakers
and words and on a guard set, before and after (demo.py)."""

from __future__ import annotations

import argparse

from whisper_train.config import MODES


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="Offline end-to-end demo: synthesise speech, fine-tune tiny.en, compare WER.",
        description="Synthesise English sentences with espeak-ng, fine-tune tiny.en on some "
        "voices and words, and print WER and loop rate before and after on speakers and words "
        "that training never saw, and WER on a guard set of general sentences in the default "
        "voice. Runs offline in under ten minutes on two CPU cores.",
    )
    parser.add_argument(
        "--output-dir",
        default="whisper-train-demo",
        help="Holds the synthesised data/ and the training run/ (its model in run/final/, every "
        "score in run/metrics.jsonl).",
    )
    parser.add_argument(
        "--language",
        choices=("en", "es"),
        default="en",
        help="en: tiny.en on English; es: OpenAI's multilingual base (the `multilingual` extra) "
        "on Spanish, held-out Latin American voices and words, and an English guard scored in "
        "English with its language identification before and after.",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="Model to fine-tune (default: tiny.en for --language en, base for es).",
    )
    parser.add_argument(
        "--train-utterances", type=int, default=192, help="Synthesised utterances to train on."
    )
    parser.add_argument(
        "--eval-utterances",
        type=int,
        default=40,
        help="Held-out utterances (unseen speakers and words) scored before and after.",
    )
    parser.add_argument(
        "--guard-utterances",
        type=int,
        default=40,
        help="Guard utterances (general sentences, default voice) scored before and after.",
    )
    parser.add_argument("--epochs", type=float, default=1, help="Passes over the training set.")
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=None,
        help="Peak learning rate (default: train's for the mode: 1.5e-4 for lora, 3e-5 for "
        "freeze-encoder, 2e-5 for full on tiny with the encoder at 2.5x, lower for wider "
        "models).",
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="lora",
        help="What to train: lora (adapters in encoder and decoder), freeze-encoder (the "
        "decoder on cached encoder outputs: faster, but it cannot learn new voices) or full.",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="Seeds the synthesised data and training."
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """0 when the demo finished; `run_demo` prints its own progress and the comparison."""
    from whisper_train.demo import run_demo

    run_demo(
        output_dir=args.output_dir,
        model=args.model,
        language=args.language,
        train_utterances=args.train_utterances,
        eval_utterances=args.eval_utterances,
        guard_utterances=args.guard_utterances,
        epochs=args.epochs,
        learning_rate=args.learning_rate,
        mode=args.mode,
        seed=args.seed,
    )
    return 0
