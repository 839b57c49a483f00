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

`--language es` is the second demo: OpenAI's multilingual base (`--model base`, the
`multilingual` extra) fine-tuned on Spanish (Castilian voices and one part of a Spanish
lexicon; `synth.SPANISH_WORDS`), held-out Latin American voices and words, and the same
English guard, stated English (`guard:en=`) so that it is scored in English, and its language
identification counted before and after (fine-tuning on one language can make a model answer
every clip in it).

Everything lands in one folder: `data/` (synthesised once, reused by a next demo with the same
plan) and `run/` (the training run; a second demo moves the first's aside to `run.old-<time>`,
as `train --overwrite` does).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from whisper_train.choices import NONSPEECH_AUTO
from whisper_train.config import NONSPEECH, RunConfig
from whisper_train.data import synth
from whisper_train.data.nonspeech import BUILTIN_SECONDS, write_builtin_set
from whisper_train.errors import UserError
from whisper_train.files import check_output_path
from whisper_train.training.train import TrainResult, train

SETS = ("train", "held-out", "guard")
# Clips where nobody speaks (`data.nonspeech`'s built-in set, six of its clips: 24 s, a few
# seconds to decode): the text a fine-tune invents on silence, noise, hum and tones.
NONSPEECH_SET = "nonspeech"
NONSPEECH_CLIPS = (
    "digital-silence",
    "white-noise-40dB",
    "hum-50Hz",
    "tone-425Hz-hold",
    "beeps-1kHz",
    "chords",
)
SCORED_SETS = ("held-out", "guard", NONSPEECH_SET)
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


DEMO_LANGUAGES = ("en", "es")


def run_demo(
    *,
    output_dir: str | Path = "whisper-train-demo",
    model: str | None = None,
    language: str = "en",
    train_utterances: int = 192,
    eval_utterances: int = 40,
    guard_utterances: int = 40,
    epochs: float = 1,
    learning_rate: float | None = None,
    mode: str = "lora",
    seed: int = 0,
    nonspeech: str | None = NONSPEECH_AUTO,
) -> DemoResult:
    """Synthesise, fine-tune with held-out and guard sets scored before and after; prints the
    comparison and returns it. `language` en: tiny.en on English; es: the multilingual base on
    Spanish, with the English guard scored in English. `model` None: the language's default.
    `nonspeech`: --nonspeech of the run (clips where nobody speaks mixed into training; auto,
    its default, the built-in ones)."""
    if language not in DEMO_LANGUAGES:
        raise UserError(f"--language {language}: the demo speaks {' or '.join(DEMO_LANGUAGES)}")
    model = model or ("tiny.en" if language == "en" else "base")
    output_dir = Path(output_dir)
    check_output_path(output_dir, "--output-dir", folder=True)  # before minutes of synthesis
    started = time.perf_counter()
    data_dirs = prepare_demo_data(
        output_dir / "data",
        train_utterances=train_utterances,
        eval_utterances=eval_utterances,
        guard_utterances=guard_utterances,
        seed=seed,
        language=language,
    )
    config = demo_config(
        data_dirs,
        output_dir / "run",
        model=model,
        language=language,
        epochs=epochs,
        learning_rate=learning_rate,
        mode=mode,
        seed=seed,
        nonspeech=nonspeech,
    )
    result = train(config)
    demo = DemoResult(result, data_dirs, time.perf_counter() - started)
    print_comparison(demo, model=model, mode=mode, language=language)
    return demo


def demo_config(
    data_dirs: dict[str, Path],
    run_dir: Path,
    *,
    model: str,
    language: str = "en",
    epochs: float = 1,
    learning_rate: float | None = None,
    mode: str = "lora",
    seed: int = 0,
    nonspeech: str | None = NONSPEECH_AUTO,
) -> RunConfig:
    """The demo's training run (bench/nonspeech.py trains it too)."""
    # The guard is English whatever the demo's language: stated, so it is decoded in English.
    guard = "guard" if language == "en" else "guard:en"
    config = RunConfig()
    config.update(
        {
            "data": str(data_dirs["train"]),
            "eval_data": [
                f"held-out={data_dirs['held-out']}",
                f"{guard}={data_dirs['guard']}",
                f"{NONSPEECH_SET}:{NONSPEECH}={data_dirs[NONSPEECH_SET]}",
            ],
            "nonspeech": nonspeech,
            "guard": "guard",
            "model": model,
            "mode": mode,
            "epochs": epochs,
            "batch_size": 8,
            "learning_rate": learning_rate,
            "warmup_steps": 10,
            "logging_steps": 8,
            "generation_max_length": MAX_TOKENS,
            "output_dir": str(run_dir),
            "overwrite": True,
            "seed": seed,
        }
    )
    return config


def prepare_demo_data(
    data_dir: Path,
    *,
    train_utterances: int,
    eval_utterances: int,
    guard_utterances: int,
    seed: int,
    language: str = "en",
) -> dict[str, Path]:
    """Synthesise (or reuse) `train/`, `held-out/` and `guard/` under `data_dir` (Spanish
    train/ and held-out/ under `data_dir/es` for `language` es, with a `language` column)."""
    if language == "es":
        train_words, held_out_words = synth.split_spanish_words()
        train_voices, held_out_voices = synth.SPANISH_TRAIN_VOICES, synth.SPANISH_HELD_OUT_VOICES
        spoken = {"language": "es"}
    else:
        train_words, held_out_words = synth.split_vocabulary()
        train_voices, held_out_voices = synth.TRAIN_VOICES, synth.HELD_OUT_VOICES
        spoken = {}
    folders = {name: data_dir / name for name in SETS}
    if language == "es":
        folders.update({name: data_dir / "es" / name for name in ("train", "held-out")})
    plans = {
        name: dict(n_utterances=n, seed=seed + offset, voices=voices, words=words, **spoken)
        for name, n, offset, voices, words in (
            ("train", train_utterances, 0, train_voices, train_words),
            ("held-out", eval_utterances, 1, held_out_voices, held_out_words),
        )
    }
    # The default voice at its default speed and pitch, words from the whole vocabulary.
    plans["guard"] = dict(
        n_utterances=guard_utterances,
        seed=seed + 2,
        voices=(synth.GUARD_VOICE,),
        speed_wpm_range=(synth.DEFAULT_SPEED_WPM, synth.DEFAULT_SPEED_WPM),
        pitch_range=(synth.DEFAULT_PITCH, synth.DEFAULT_PITCH),
    )
    folders = {name: _synthesised(folders[name], plans[name]) for name in SETS}
    folders[NONSPEECH_SET] = write_builtin_set(data_dir / NONSPEECH_SET, NONSPEECH_CLIPS)
    return folders


def _synthesised(folder: Path, plan: dict) -> Path:
    """Synthesise once: a next demo reuses the clips when it would say the same things."""
    planned = synth.plan_utterances(**{k: v for k, v in plan.items() if k != "language"})
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


def print_comparison(demo: DemoResult, *, model: str, mode: str, language: str = "en") -> None:
    """The demo's closing table: each figure before and after fine-tuning; then what each set
    holds, what trained, and the command that tries the fine-tuned model."""
    before, after, result = demo.before, demo.after, demo.train

    def row(label: str, name: str, key: str) -> str:
        was, now = before[name][key], after[name][key]
        if key == "words_per_minute":  # a rate, not a share
            return f"  {label:<36} {was:8.1f}  {now:8.1f}  {now - was:+7.1f}"
        return f"  {label:<36} {100 * was:7.1f}%  {100 * now:7.1f}%  {100 * (now - was):+7.1f}"

    held_out, guard = (_count(demo.data_dirs[name]) for name in ("held-out", "guard"))
    loops = ("held-out repeated 3-grams (loops)", "held-out", "repeated_ngram_rate")
    if language == "es":
        rows = [
            (f"held-out Spanish WER ({held_out})", "held-out", "wer"),
            loops,
            ("held-out language ID (es)", "held-out", "language_id_accuracy"),
            (f"English guard WER ({guard}, in English)", "guard", "wer"),
            ("English guard language ID (en)", "guard", "language_id_accuracy"),
        ]
        sets = [
            "held-out: Spanish speakers and content words that training never saw: espeak-ng "
            f"{', '.join(synth.SPANISH_HELD_OUT_ACCENTS)} with variants "
            f"{', '.join(synth.HELD_OUT_VARIANTS)}; language ID: the language the model detects "
            "in each clip, whatever it was told to decode in",
            f"guard: general English sentences in espeak-ng's default voice, {synth.GUARD_VOICE}",
        ]
        trained_on = (
            f"espeak-ng {', '.join(synth.SPANISH_TRAIN_ACCENTS)} with "
            f"{len(synth.TRAIN_VARIANTS)} variants"
        )
        try_it = f"transcribe --model {result.final_dir} {demo.data_dirs['held-out']}/utt_00000.wav"
    else:
        rows = [
            (f"held-out WER ({held_out} utterances)", "held-out", "wer"),
            loops,
            (f"guard WER ({guard} utterances)", "guard", "wer"),
            ("guard repeated 3-grams (loops)", "guard", "repeated_ngram_rate"),
        ]
        sets = [
            "held-out: speakers and content words that training never saw: espeak-ng accents "
            f"{', '.join(synth.HELD_OUT_ACCENTS)} with variants "
            f"{', '.join(synth.HELD_OUT_VARIANTS)}",
            f"guard: general sentences in espeak-ng's default voice, {synth.GUARD_VOICE}",
            f"where nobody speaks: {', '.join(NONSPEECH_CLIPS)} (`data.nonspeech`, synthesised)",
        ]
        trained_on = (
            f"accents {', '.join(synth.TRAIN_ACCENTS)} with {len(synth.TRAIN_VARIANTS)} other "
            "variants"
        )
        try_it = f"evaluate --model {result.final_dir} --data {demo.data_dirs['held-out']}"
    seconds = len(NONSPEECH_CLIPS) * BUILTIN_SECONDS
    rows.append(
        (f"words/min where nobody speaks ({seconds:.0f} s)", NONSPEECH_SET, "words_per_minute")
    )
    print()
    print(f"  {'':<36} {'before':>8}  {'after':>8}  {'points':>7}")
    for label, name, key in rows:
        print(row(label, name, key))
    print()
    for line in sets:
        print(line)
    print(
        f"before: {model}; after: step {result.final_step} of {result.steps} of --mode {mode} "
        f"({result.final_reason}) on {result.train_examples} utterances in {trained_on}"
    )
    print(f"fine-tuned model: {result.final_dir}   (whole demo: {demo.seconds / 60:.1f} min)")
    print(f"try it: {this_command()} {try_it}")


def this_command() -> str:
    """whisper-train as this process was started, so that printed advice works when pasted:
    `whisper-train` where that name on PATH is this script, else the script's own path (the
    Quickstart's `.venv/bin/whisper-train`), else `python -m whisper_train`."""
    script = Path(sys.argv[0])
    if script.name != "whisper-train":
        return f"{shlex.quote(sys.executable)} -m whisper_train"
    on_path = shutil.which("whisper-train")
    if on_path and Path(on_path).resolve() == script.resolve():
        return "whisper-train"
    return shlex.quote(os.path.relpath(script))


def _count(folder: Path) -> int:
    """Utterances in a synthesised set (its metadata rows)."""
    with (folder / synth.METADATA_FILE).open(encoding="utf-8") as stream:
        return sum(1 for _ in stream) - 1
