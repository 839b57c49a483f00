"""Decoding speed of a teacher, students cut from it, and speculative decoding (the teacher
verifying a student's drafts), side by side in one run.

    PYTHONPATH=src .venv/bin/python bench/decoding_speed.py [--teachers tiny.en,base]
        [--students 2,4] [--clips 8] [--rounds 2] [--batch-sizes 1,8]

1. Clips: the first `--clips` English clips of ../shared/realspeech (LibriVox, then LJ Speech,
   then AN4; real recordings of 2 to 10 s).
2. Models: each teacher as `--model` reads it (tiny.en: 4 decoder layers; base: 6), and students
   of `--students` decoder layers made from it by `student.student_from_teacher` (its encoder
   and evenly spaced decoder layers, first and last kept), UNTRAINED: their speed is a
   distilled student's speed, their text is not (the table gives their WER against the
   references); a student as deep as its teacher is skipped.
3. Decoding: greedy, no timestamps, no temperature fallback and no no-speech test (one plain
   `generate` call: `transcription.decoding.generate_decoded` with those options), at each
   `--batch-sizes`; and speculative decoding (`--assistant`): the teacher with each student
   drafting, which transformers runs one clip a call, so its figure stands for every batch size.
4. Interleaved: every round decodes all the clips once with every variant, in turn, so that
   load from elsewhere on a shared machine falls on all of them alike; times are summed over
   the rounds. tokens/s counts the generated tokens (<|endoftext|> included, the prompt not).

Printed: per variant clips/s, tokens/s, the speed-up over the teacher at batch 1 (the ratio is
what to read on a shared machine), WER against the references, and for speculative decoding
the clips whose text equals the teacher's own greedy text and the student's agreement: the
share of the teacher's tokens that the student, fed the teacher's text, predicts itself (what
the speed-up rests on: each disagreement costs a rejected draft).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
from common import REALSPEECH  # noqa: E402  (bench/ is this script's folder: on sys.path)

# Greedy, nothing else: the one plain generate call per batch.
MAX_LENGTH = 225  # evaluate's default --generation-max-length


def english_clips(n: int) -> list[tuple[str, str]]:
    """(audio path, reference text) of the first `n` English real clips, LibriVox first."""
    rows = [json.loads(line) for line in (REALSPEECH / "manifest.jsonl").open()]
    order = ("librivox", "ljspeech", "an4")
    rows.sort(key=lambda r: next(i for i, name in enumerate(order) if name in r["audio"]))
    return [(str(REALSPEECH / r["audio"]), r["text"]) for r in rows if r["language"] == "en"][:n]


def decode(model, processor, features, batch_size: int, assistant=None):
    """Greedy texts and generated-token count of every clip, `batch_size` clips a call."""
    from whisper_train.transcription.decoding import DecodingOptions, generate_decoded

    plain = DecodingOptions(temperatures=(0.0,), no_speech_threshold=None)
    texts, tokens = [], 0
    for first in range(0, features.shape[0], batch_size):
        decoded = generate_decoded(
            model,
            {"input_features": features[first : first + batch_size]},
            processor.tokenizer,
            max_length=MAX_LENGTH,
            options=plain,
            assistant=assistant,
        )
        texts += [item.text for item in decoded]
        tokens += sum(len(item.tokens) + 1 for item in decoded)  # + <|endoftext|>
    return texts, tokens


def agreement(teacher, student, processor, features) -> float:
    """Share of the teacher's greedy tokens the student predicts itself, teacher-forced on the
    teacher's text (the acceptance rate a drafter of one token would have)."""
    import torch

    agreed = total = 0
    with torch.inference_mode():
        for row in range(features.shape[0]):
            clip = features[row : row + 1]
            ids = teacher.generate(clip, max_length=MAX_LENGTH)
            eot = teacher.generation_config.eos_token_id
            # The decoder prompt (<|startoftranscript|>, language, task, <|notimestamps|>).
            prompt = next(i for i, t in enumerate(ids[0].tolist()) if t <= eot)
            guess = student(input_features=clip, decoder_input_ids=ids[:, :-1]).logits.argmax(-1)
            agreed += int((guess[0, prompt - 1 :] == ids[0, prompt:]).sum())
            total += ids.shape[1] - prompt
    return agreed / max(total, 1)


def bench_teacher(spec: str, clips, args) -> list[dict]:
    import torch

    from whisper_train.audio import load_audio
    from whisper_train.evaluation.scoring import get_normalizer, score
    from whisper_train.models import load_model
    from whisper_train.student import student_from_teacher
    from whisper_train.transcription.assistant import make_assistant
    from whisper_train.transcription.backends import set_language

    teacher, processor = load_model(spec)
    teacher.eval()
    set_language(teacher, "en", "transcribe")  # base: no detection step in the timings
    audio = [load_audio(path) for path, _ in clips]
    references = [text for _, text in clips]
    features = processor.feature_extractor(
        audio, sampling_rate=16_000, return_tensors="pt"
    ).input_features
    depth = teacher.config.decoder_layers
    students = {n: student_from_teacher(teacher, n).eval() for n in args.students if n < depth}
    variants = []  # (name, layers, model, batch size, assistant)
    for batch_size in args.batch_sizes:
        variants.append((f"teacher b{batch_size}", depth, teacher, batch_size, None))
        for n, student in students.items():
            variants.append((f"student-{n} b{batch_size}", n, student, batch_size, None))
    for n, student in students.items():
        helper = make_assistant(teacher, processor, student, processor, f"student-{n}")
        variants.append((f"teacher + student-{n} drafting", depth, teacher, 1, helper))
    seconds = {name: 0.0 for name, *_ in variants}
    results: dict[str, tuple[list[str], int]] = {}
    torch.set_num_threads(args.threads)
    decode(teacher, processor, features[:1], 1)  # warm-up: first-call allocations
    for _ in range(args.rounds):
        for name, _, model, batch_size, helper in variants:
            started = time.perf_counter()
            results[name] = decode(model, processor, features, batch_size, helper)
            seconds[name] += time.perf_counter() - started
    normalizer = get_normalizer("english")
    teacher_texts = results[f"teacher b{args.batch_sizes[0]}"][0]
    base_rate = len(clips) * args.rounds / seconds[f"teacher b{args.batch_sizes[0]}"]
    rows = []
    for name, layers, _, _, helper in variants:
        texts, tokens = results[name]
        clips_per_s = len(clips) * args.rounds / seconds[name]
        row = {
            "teacher": spec,
            "variant": name,
            "decoder layers": layers,
            "clips/s": clips_per_s,
            "tokens/s": tokens * args.rounds / seconds[name],
            "vs teacher b1": clips_per_s / base_rate,
            "WER": score(references, texts, normalizer=normalizer).wer,
        }
        if helper is not None:
            n = helper.model.config.decoder_layers
            same = sum(a == b for a, b in zip(texts, teacher_texts, strict=True))
            row["same text"] = f"{same}/{len(texts)}"
            row["agreement"] = agreement(teacher, students[n], processor, features)
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'teacher':8} {'variant':30} {'layers':>6} {'clips/s':>8} {'tokens/s':>9} "
        f"{'vs b1':>6} {'WER %':>6} {'same text':>9} {'agree':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        agree = f"{100 * r['agreement']:.0f}%" if "agreement" in r else ""
        print(
            f"{r['teacher']:8} {r['variant']:30} {r['decoder layers']:>6} {r['clips/s']:>8.2f} "
            f"{r['tokens/s']:>9.1f} {r['vs teacher b1']:>5.2f}x {100 * r['WER']:>6.1f} "
            f"{r.get('same text', ''):>9} {agree:>6}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teachers", default="tiny.en,base", help="Comma-separated --model specs.")
    parser.add_argument("--students", default="2,4", help="Student depths (decoder layers).")
    parser.add_argument("--clips", type=int, default=8, help="English real clips to decode.")
    parser.add_argument("--rounds", type=int, default=2, help="Passes over the clips, interleaved.")
    parser.add_argument("--batch-sizes", default="1,8", help="Clips a generate call.")
    parser.add_argument("--threads", type=int, default=2, help="torch threads.")
    args = parser.parse_args()
    import soundfile

    args.students = [int(n) for n in args.students.split(",")]
    args.batch_sizes = [int(n) for n in args.batch_sizes.split(",")]
    clips = english_clips(args.clips)
    seconds = sum(soundfile.info(path).duration for path, _ in clips)
    print(
        f"{len(clips)} English clips of {REALSPEECH} (~{seconds:.0f} s at 16 kHz), greedy, no "
        f"timestamps, {args.rounds} interleaved rounds, {args.threads} torch threads, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; untrained students",
        flush=True,
    )
    rows = []
    for spec in args.teachers.split(","):
        rows += bench_teacher(spec, clips, args)
        print_table(rows)
        print(flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    sys.exit(main())
