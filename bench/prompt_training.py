"""Prompts in training (--prompt-probability): held-out WER with and without the previous text
as a prompt, and a prompt-biasing check, before and after fine-tuning at each probability.

    .venv/bin/python bench/prompt_training.py [--probabilities 0,0.5] [--seeds 0,1] [--steps 24]

Data (synthesised by espeak-ng as the demo's, `demo.prepare_demo_data`, cached under --work):
128 training and 32 held-out sentences in disjoint voices and content words, each set cut into
"recordings" of 4 consecutive sentences, every sentence but a recording's first given the one
before as its `previous_text` (manifest rows, as a user with segmented recordings writes them).
Training: `whisper-train train --model tiny.en --mode lora` (the demo's LoRA, learning rate
default), batch 8, --steps steps, `--prompt-probability P`, in its own process.

Scores (greedy `generate`, transformers' own prompt path: `prompt_ids=get_prompt_ids(text)`):
  held-out WER       the 32 held-out sentences, no prompt;
  + prev-text WER    the same, each sentence with a previous text given it as the prompt;
  name right         10 sentences naming a made-up surname (5 names x 2 voices, held-out
                     voices): how many transcripts spell the name exactly, without a prompt and
                     with the prompt "Doctor NAME." (base tiny.en: 0/10 without, 10/10 with).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
WHISPER_TRAIN = [sys.executable, "-m", "whisper_train.cli"]
RECORDING_SENTENCES = 4  # consecutive sentences of one "recording"
NAMES = ("Quenzlor", "Vantreska", "Drevanko", "Brumwald", "Kessarine")
NAME_SENTENCES = (
    "Please send the final report to doctor {name} before Friday.",
    "We asked {name} to check the numbers again.",
)


def recordings_manifest(folder: Path, out: Path) -> Path:
    """An audiofolder's rows as a JSONL manifest, every row but each recording's first given the
    row before as its previous_text."""
    lines = (folder / "metadata.csv").read_text().splitlines()
    header = lines[0].split(",")
    rows = [dict(zip(header, line.split(",", len(header) - 1), strict=True)) for line in lines[1:]]
    with out.open("w") as stream:
        for index, row in enumerate(rows):
            entry = {"audio": str(folder / row["file_name"]), "text": row["transcription"]}
            if index % RECORDING_SENTENCES:
                entry["previous_text"] = rows[index - 1]["transcription"]
            stream.write(json.dumps(entry) + "\n")
    return out


def name_clips(folder: Path) -> list[dict]:
    """The biasing check's clips: each name in two sentences, by two held-out voices."""
    import soundfile as sf

    from whisper_train.data import synth

    folder.mkdir(parents=True, exist_ok=True)
    clips = []
    for n, name in enumerate(NAMES):
        for s, sentence in enumerate(NAME_SENTENCES):
            path = folder / f"{name}-{s}.wav"
            if not path.exists():
                voice = synth.HELD_OUT_VOICES[(n + s) % len(synth.HELD_OUT_VOICES)]
                sf.write(path, synth.synthesize(sentence.format(name=name), voice=voice), 16000)
            clips.append({"audio": str(path), "text": sentence.format(name=name), "name": name})
    return clips


def transcribe(model, processor, audio_paths: list[str], prompts: list[str | None]) -> list[str]:
    """Greedy transcripts, each clip with its prompt (None: none) through generate's prompt_ids."""
    import soundfile as sf
    import torch

    texts = []
    for path, prompt in zip(audio_paths, prompts, strict=True):
        audio, _ = sf.read(path, dtype="float32")
        features = processor.feature_extractor(
            audio, sampling_rate=16000, return_tensors="pt"
        ).input_features
        extra = {}
        if prompt:
            extra["prompt_ids"] = torch.tensor(processor.get_prompt_ids(prompt))
        with torch.no_grad():
            ids = model.generate(
                features, max_new_tokens=120, num_beams=1, do_sample=False, **extra
            )
        texts.append(processor.batch_decode(ids, skip_special_tokens=True)[0].strip())
    return texts


def wer(references: list[str], hypotheses: list[str]) -> float:
    from whisper_train.evaluation.scoring import get_normalizer, word_counts

    normalize = get_normalizer("english")
    words = errors = 0
    for reference, hypothesis in zip(references, hypotheses, strict=True):
        n, substitutions, deletions, insertions = word_counts(
            normalize(reference), normalize(hypothesis)
        )
        words += n
        errors += substitutions + deletions + insertions
    return 100.0 * errors / words


def score(model_spec: str, held_out: list[dict], names: list[dict]) -> dict:
    from whisper_train.models import load_model

    model, processor = load_model(model_spec)
    model.eval()
    audio = [row["audio"] for row in held_out]
    references = [row["text"] for row in held_out]
    plain = transcribe(model, processor, audio, [None] * len(held_out))
    prompted = transcribe(model, processor, audio, [row.get("previous_text") for row in held_out])
    name_audio = [clip["audio"] for clip in names]
    without = transcribe(model, processor, name_audio, [None] * len(names))
    with_prompt = transcribe(model, processor, name_audio, [f"Doctor {c['name']}." for c in names])
    spelled = lambda texts: sum(c["name"] in t for c, t in zip(names, texts, strict=True))  # noqa: E731
    return {
        "wer": wer(references, plain),
        "wer_prompted": wer(references, prompted),
        "name_without": spelled(without),
        "name_with": spelled(with_prompt),
        "examples": {"prompted": prompted[1], "name_with": with_prompt[0]},
    }


def train(train_manifest: Path, probability: float, seed: int, steps: int, out: Path) -> float:
    command = [
        *WHISPER_TRAIN, "train",
        "--model", "tiny.en",
        "--data", str(train_manifest),
        "--mode", "lora",
        "--max-steps", str(steps),
        "--batch-size", "8",
        "--seed", str(seed),
        "--prompt-probability", str(probability),
        "--only-train",
        "--output-dir", str(out),
        "--overwrite",
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"training p={probability} seed {seed} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probabilities", default="0,0.5")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--work", type=Path, default=Path("/tmp/whisper-train-prompt-bench"))
    args = parser.parse_args()
    from whisper_train.demo import prepare_demo_data

    args.work.mkdir(parents=True, exist_ok=True)
    sets = prepare_demo_data(
        args.work / "data", train_utterances=128, eval_utterances=32, guard_utterances=1, seed=0
    )
    train_manifest = recordings_manifest(sets["train"], args.work / "train.jsonl")
    held_out_manifest = recordings_manifest(sets["held-out"], args.work / "held-out.jsonl")
    held_out = [json.loads(line) for line in held_out_manifest.read_text().splitlines()]
    names = name_clips(args.work / "names")
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; held-out "
        f"{len(held_out)} sentences ({sum('previous_text' in r for r in held_out)} with a "
        f"previous text), {len(names)} name sentences"
    )
    rows = [("tiny.en (before)", "-", score("tiny.en", held_out, names), None)]
    print(rows[-1])
    for seed in [int(s) for s in args.seeds.split(",")]:
        for probability in [float(p) for p in args.probabilities.split(",")]:
            out = args.work / f"run-p{probability:g}-s{seed}"
            seconds = train(train_manifest, probability, seed, args.steps, out)
            rows.append(
                (
                    f"LoRA p={probability:g}",
                    seed,
                    score(str(out / "final"), held_out, names),
                    seconds,
                )
            )
            print(rows[-1])
    print()
    print(
        "| model | seed | held-out WER | + previous text as prompt | name right, no prompt | name right, prompted | train s |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, seed, result, seconds in rows:
        print(
            f"| {label} | {seed} | {result['wer']:.1f} | {result['wer_prompted']:.1f} | "
            f"{result['name_without']}/{len(names)} | {result['name_with']}/{len(names)} | "
            f"{'-' if seconds is None else f'{seconds:.0f}'} |"
        )


if __name__ == "__main__":
    main()
