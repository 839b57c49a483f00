"""`whisper-train demo`: the whole path, offline, in a few CPU minutes, and an honest score.

1. Synthesise three sets of English sentences with espeak-ng (`synth.py`): grammatical templates
   (function words shared by every set) filled with content words from a 3,400-word vocabulary.
   - train: voices of TRAIN_VOICES, content words from the training part of the vocabulary;
   - held-out: voices of HELD_OUT_VOICES (no accent and no speaker variant of training) and
     content words from the held-out part of the vocabulary (no word family of training): what
     fine-tuning taught that carries over, not what it memorised;
   - guard: general sentences from the whole vocabulary in espeak-ng's default voice, unused by
     training: what the model already knew, which fine-tuning must keep.
2. Fine-tune with `train`, the same run a user starts, with both sets as `--eval-data` and the
   guard as `--guard`: they are scored before step 1 and after the last step (generate-based WER
   with the temperature fallback, repeated 3-grams for loops), and final/ is the last step only
   if the guard kept within `--max-regression` of its start.
3. Print each set's figures before and after, side by side.

LoRA (adapters in the encoder and the decoder) rather than freeze-encoder: a decoder trained
on cached encoder outputs cannot change how the encoder hears new voices. No step between the
first and the last is evaluated: picking the best of several evaluations by held-out WER would
tune on the held-out set.

Everything lands in one folder: `data/` (synthesised once, reused by a next demo with the same
plan) and `run/` (the training run; a second demo moves the first's aside to `run.old-<time>`,
as `train --overwrite` does).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from whisper_train.config import RunConfig
from whisper_train.train import TrainResult, train

SETS = ("train", "held-out", "guard")
SCORED_SETS = ("held-out", "guard")
# Three times the longest sentence's 21 tokens: enough to show a loop without letting one hold
# up a batch of greedy decoding for the default 225 tokens.
MAX_TOKENS = 64


@dataclass
class DemoResult:
    """What the demo printed: the training run (its evaluations hold every figure) and where
    the data is."""

    train: TrainResult
    data_dirs: dict[str, Path]
    seconds: float

    def scores(self, eval_set: str, step: int | None) -> dict:
        """The metrics row of `eval_set` at `step` (wer, repeated_ngram_rate, ...)."""
        rows = [r for r in self.train.evaluations if r["step"] == step and r["set"] == eval_set]
        return rows[-1]

    @property
    def before(self) -> dict[str, dict]:
        return {name: self.scores(name, 0) for name in SCORED_SETS}

    @property
    def after(self) -> dict[str, dict]:
        return {name: self.scores(name, self.train.final_step) for name in SCORED_SETS}


def run_demo(
    *,
    output_dir: str | Path = "whisper-train-demo",
    model: str = "tiny.en",
    train_utterances: int = 192,
    eval_utterances: int = 40,
    guard_utterances: int = 40,
    epochs: float = 1,
    learning_rate: float | None = None,
    mode: str = "lora",
    seed: int = 0,
) -> DemoResult:
    """Synthesise, fine-tune with held-out and guard sets scored before and after; prints the
    comparison and returns it."""
    output_dir = Path(output_dir)
    started = time.perf_counter()
    data_dirs = prepare_demo_data(
        output_dir / "data",
        train_utterances=train_utterances,
        eval_utterances=eval_utterances,
        guard_utterances=guard_utterances,
        seed=seed,
    )
    config = RunConfig()
    config.update(
        {
            "data": str(data_dirs["train"]),
            "eval_data": [f"{name}={data_dirs[name]}" for name in SCORED_SETS],
            "guard": "guard",
            "model": model,
            "mode": mode,
            "epochs": epochs,
            "batch_size": 8,
            "learning_rate": learning_rate,
            "warmup_steps": 10,
            "logging_steps": 8,
            "generation_max_length": MAX_TOKENS,
            "output_dir": str(output_dir / "run"),
            "overwrite": True,
            "seed": seed,
        }
    )
    result = train(config)
    demo = DemoResult(result, data_dirs, time.perf_counter() - started)
    print_comparison(demo, model=model, mode=mode)
    return demo


def prepare_demo_data(
    data_dir: Path, *, train_utterances: int, eval_utterances: int, guard_utterances: int, seed: int
) -> dict[str, Path]:
    """Synthesise (or reuse) `train/`, `held-out/` and `guard/` under `data_dir`."""
    from whisper_train import synth

    train_words, held_out_words = synth.split_vocabulary()
    plans = {
        "train": dict(
            n_utterances=train_utterances, seed=seed, voices=synth.TRAIN_VOICES, words=train_words
        ),
        "held-out": dict(
            n_utterances=eval_utterances,
            seed=seed + 1,
            voices=synth.HELD_OUT_VOICES,
            words=held_out_words,
        ),
        # The default voice at its default speed and pitch, words from the whole vocabulary.
        "guard": dict(
            n_utterances=guard_utterances,
            seed=seed + 2,
            voices=(synth.GUARD_VOICE,),
            speed_wpm_range=(synth.DEFAULT_SPEED_WPM, synth.DEFAULT_SPEED_WPM),
            pitch_range=(synth.DEFAULT_PITCH, synth.DEFAULT_PITCH),
        ),
    }
    return {name: _synthesised(data_dir / name, plans[name]) for name in SETS}


def _synthesised(folder: Path, plan: dict) -> Path:
    """Synthesise once: a next demo reuses the clips when it would say the same things."""
    from whisper_train import synth

    planned = synth.plan_utterances(**plan)
    plan_file = folder / "plan.json"
    metadata = folder / synth.METADATA_FILE
    if (
        metadata.is_file()
        and plan_file.is_file()
        and json.loads(plan_file.read_text(encoding="utf-8")) == planned
    ):
        return folder
    tqdm.write(f"synthesising {len(planned)} utterances into {folder} ...")
    synth.make_speech_dataset(folder, **plan)
    plan_file.write_text(json.dumps(planned, indent=1) + "\n", encoding="utf-8")
    return folder


def print_comparison(demo: DemoResult, *, model: str, mode: str) -> None:
    """The demo's closing table: each figure before and after fine-tuning."""
    from whisper_train import synth

    before, after, result = demo.before, demo.after, demo.train

    def row(label: str, name: str, key: str) -> str:
        was, now = before[name][key], after[name][key]
        return f"  {label:<36} {100 * was:7.1f}%  {100 * now:7.1f}%  {100 * (now - was):+7.1f}"

    sizes = {name: _count(demo.data_dirs[name]) for name in SCORED_SETS}
    print()
    print(f"  {'':<36} {'before':>8}  {'after':>8}  {'points':>7}")
    print(row(f"held-out WER ({sizes['held-out']} utterances)", "held-out", "wer"))
    print(row("held-out repeated 3-grams (loops)", "held-out", "repeated_ngram_rate"))
    print(row(f"guard WER ({sizes['guard']} utterances)", "guard", "wer"))
    print(row("guard repeated 3-grams (loops)", "guard", "repeated_ngram_rate"))
    print()
    print(
        "held-out: speakers and content words that training never saw: espeak-ng accents "
        f"{', '.join(synth.HELD_OUT_ACCENTS)} with variants {', '.join(synth.HELD_OUT_VARIANTS)}"
    )
    print(f"guard: general sentences in espeak-ng's default voice, {synth.GUARD_VOICE}")
    print(
        f"before: {model}; after: step {result.final_step} of {result.steps} of --mode {mode} "
        f"({result.final_reason}) on {result.train_examples} utterances in accents "
        f"{', '.join(synth.TRAIN_ACCENTS)} with {len(synth.TRAIN_VARIANTS)} other variants"
    )
    print(f"fine-tuned model: {result.final_dir}   (whole demo: {demo.seconds / 60:.1f} min)")
    print(
        f"try it: whisper-train evaluate --model {result.final_dir} "
        f"--data {demo.data_dirs['held-out']}"
    )


def _count(folder: Path) -> int:
    """Utterances in a synthesised set (its metadata rows)."""
    from whisper_train import synth

    with (folder / synth.METADATA_FILE).open(encoding="utf-8") as stream:
        return sum(1 for _ in stream) - 1
