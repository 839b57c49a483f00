"""Decoding speed of a teacher, students cut from it, and speculative decoding (the teacher
verifying a student's drafts), side by side in one run.

    PYTHONPATH=src .venv/bin/python bench/decoding_speed.py [--teachers tiny.en,base]
        [--students 2,4] [--distilled TEACHER=MODEL ...] [--data PATH] [--clips 8]
        [--rounds 2] [--batch-sizes 1,8] [--threads 2]

1. Clips: the first `--clips` English clips of ../shared/realspeech (LibriVox, then LJ Speech,
   then AN4; real recordings of 2 to 10 s), or of `--data` (any layout `--data` reads, e.g. the
   held-out set `whisper-train demo` synthesises).
2. Models: each teacher as `--model` reads it (tiny.en: 4 decoder layers; base: 6), and students
   of `--students` decoder layers made from it by `student.student_from_teacher` (its encoder
   and evenly spaced decoder layers, first and last kept), UNTRAINED: their speed is a
   distilled student's speed, their text is not (the table gives their WER against the
   references); a student as deep as its teacher is skipped. `--distilled TEACHER=MODEL` adds a
   trained student of that teacher (a `whisper-train distill` run's final/), named
   `distilled-N` (N its decoder layers).
3. Decoding: greedy, no timestamps, no temperature fallback and no no-speech test (one plain
   `generate` call: `transcription.decoding.generate_decoded` with those options), at each
   `--batch-sizes`; and speculative decoding (`--assistant`): the teacher with each student
   drafting, which transformers runs one clip a call, so its figure stands for every batch size.
4. Interleaved: every round decodes all the clips once with every variant, in turn, so that
   load from elsewhere on a shared machine falls on all of them alike; wall and CPU seconds
   (this process's, `common.cpu_seconds`) are summed over the rounds. tokens/s counts the
   generated tokens (<|endoftext|> included, the prompt not).

Printed: per variant clips/s, tokens/s, CPU seconds a clip, the speed-up over the teacher at
batch 1 by wall time and by CPU time (the ratios are what to read on a shared machine; with
`--threads 1` and OMP_NUM_THREADS=1 the CPU ratio is the steadier one), WER against the
references, and for speculative decoding the clips whose text equals the teacher's own greedy
text and the student's agreement: the share of the teacher's tokens (and <|endoftext|>) that the
student, fed the teacher's text, predicts itself (what the speed-up rests on: each disagreement
costs a rejected draft). Last, the teacher's encoder alone at batch 1: every clip is padded to
30 s, so its pass costs the same however short the speech, and a student that keeps it is at
most the teacher's time over the encoder's faster.
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
from common import REALSPEECH, cpu_seconds  # noqa: E402  (bench/ is this script's folder)

# Greedy, nothing else: the one plain generate call per batch.
MAX_LENGTH = 225  # evaluate's default --generation-max-length


def data_clips(path: str, n: int) -> list[tuple[str, str]]:
    """(audio path, reference text) of the first `n` examples of the data at `path`."""
    from whisper_train.data.layouts import load_examples

    return [(str(example.audio), example.text) for example in load_examples(path)[:n]]


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

    from whisper_train.formats.runtimes import prompt_ids
    from whisper_train.models import is_multilingual

    eot = teacher.generation_config.eos_token_id
    # The decoder prompt (<|startoftranscript|>, [<|en|> <|transcribe|>,] <|notimestamps|>):
    # generate returns the generated tokens alone.
    prompt = prompt_ids(processor.tokenizer, is_multilingual(teacher), "en")
    agreed = total = 0
    with torch.inference_mode():
        for row in range(features.shape[0]):
            clip = features[row : row + 1]
            generated = teacher.generate(clip, max_length=MAX_LENGTH)[0].tolist()
            # the text tokens and <|endoftext|>, the student's to predict
            targets = [token for token in generated if token < eot] + [eot]
            ids = torch.tensor([prompt + targets])
            guess = student(input_features=clip, decoder_input_ids=ids[:, :-1]).logits.argmax(-1)
            agreed += int((guess[0, len(prompt) - 1 :] == ids[0, len(prompt) :]).sum())
            total += len(targets)
    return agreed / max(total, 1)


def encode(model, features, batch_size: int) -> None:
    """The encoder alone over every clip, `batch_size` clips a call: what every variant pays
    before its first token, and all that a student sharing the teacher's encoder cannot cut."""
    import torch

    with torch.inference_mode():
        for first in range(0, features.shape[0], batch_size):
            model.model.encoder(features[first : first + batch_size])


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
    students = {  # name: (model, processor)
        f"student-{n}": (student_from_teacher(teacher, n).eval(), processor)
        for n in args.students
        if n < depth
    }
    for distilled_spec in args.distilled.get(spec, []):
        distilled, distilled_processor = load_model(distilled_spec)
        set_language(distilled, "en", "transcribe")
        name = f"distilled-{distilled.config.decoder_layers}"
        students[name] = (distilled.eval(), distilled_processor)
    variants = []  # (name, layers, model, batch size, assistant, student name)
    for batch_size in args.batch_sizes:
        variants.append((f"teacher b{batch_size}", depth, teacher, batch_size, None, None))
        for name, (student, _) in students.items():
            layers = student.config.decoder_layers
            variants.append((f"{name} b{batch_size}", layers, student, batch_size, None, None))
    for name, (student, student_processor) in students.items():
        helper = make_assistant(teacher, processor, student, student_processor, name)
        variants.append((f"teacher + {name} drafting", depth, teacher, 1, helper, name))
    seconds = {name: 0.0 for name, *_ in variants}
    cpu = {name: 0.0 for name, *_ in variants}
    encoder_seconds = encoder_cpu = 0.0
    results: dict[str, tuple[list[str], int]] = {}
    torch.set_num_threads(args.threads)
    decode(teacher, processor, features[:1], 1)  # warm-up: first-call allocations
    for _ in range(args.rounds):
        for name, _, model, batch_size, helper, _ in variants:
            started, cpu_started = time.perf_counter(), cpu_seconds()
            results[name] = decode(model, processor, features, batch_size, helper)
            seconds[name] += time.perf_counter() - started
            cpu[name] += cpu_seconds() - cpu_started
        started, cpu_started = time.perf_counter(), cpu_seconds()
        encode(teacher, features, 1)
        encoder_seconds += time.perf_counter() - started
        encoder_cpu += cpu_seconds() - cpu_started
    normalizer = get_normalizer("english")
    baseline = f"teacher b{args.batch_sizes[0]}"
    teacher_texts = results[baseline][0]
    rows = []
    for name, layers, _, _, helper, student_name in variants:
        texts, tokens = results[name]
        clips_per_s = len(clips) * args.rounds / seconds[name]
        row = {
            "teacher": spec,
            "variant": name,
            "decoder layers": layers,
            "clips/s": clips_per_s,
            "tokens/s": tokens * args.rounds / seconds[name],
            "CPU s/clip": cpu[name] / (len(clips) * args.rounds),
            "vs teacher b1": seconds[baseline] / seconds[name],
            "vs teacher b1 CPU": cpu[baseline] / cpu[name],
            "WER": score(references, texts, normalizer=normalizer).wer,
        }
        if helper is not None:
            same = sum(a == b for a, b in zip(texts, teacher_texts, strict=True))
            row["same text"] = f"{same}/{len(texts)}"
            student = students[student_name][0]
            row["agreement"] = agreement(teacher, student, processor, features)
        rows.append(row)
    # The encoder's pass alone: the time no decoder, however shallow, takes away (a student
    # with the teacher's encoder is at most the teacher's time over this one's faster).
    rows.append(
        {
            "teacher": spec,
            "variant": "encoder alone b1",
            "decoder layers": 0,
            "clips/s": len(clips) * args.rounds / encoder_seconds,
            "tokens/s": 0.0,
            "CPU s/clip": encoder_cpu / (len(clips) * args.rounds),
            "vs teacher b1": seconds[baseline] / encoder_seconds,
            "vs teacher b1 CPU": cpu[baseline] / encoder_cpu,
        }
    )
    return rows


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'teacher':8} {'variant':32} {'layers':>6} {'clips/s':>8} {'tokens/s':>9} "
        f"{'CPU s/clip':>10} {'vs b1':>6} {'vs b1 CPU':>9} {'WER %':>6} {'same text':>9} "
        f"{'agree':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        agree = f"{100 * r['agreement']:.0f}%" if "agreement" in r else ""
        wer = f"{100 * r['WER']:.1f}" if "WER" in r else ""
        print(
            f"{r['teacher']:8} {r['variant']:32} {r['decoder layers']:>6} {r['clips/s']:>8.2f} "
            f"{r['tokens/s']:>9.1f} {r['CPU s/clip']:>10.3f} {r['vs teacher b1']:>5.2f}x "
            f"{r['vs teacher b1 CPU']:>8.2f}x {wer:>6} "
            f"{r.get('same text', ''):>9} {agree:>6}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teachers", default="tiny.en,base", help="Comma-separated --model specs.")
    parser.add_argument(
        "--students", default="2,4", help="Depths (decoder layers) of untrained students to cut."
    )
    parser.add_argument(
        "--distilled",
        action="append",
        default=[],
        metavar="TEACHER=MODEL",
        help="A distilled student of TEACHER (one of --teachers), e.g. a distill run's final/.",
    )
    parser.add_argument("--data", default=None, help="Clips to decode (default: real English).")
    parser.add_argument("--clips", type=int, default=8, help="Clips to decode.")
    parser.add_argument("--rounds", type=int, default=2, help="Passes over the clips, interleaved.")
    parser.add_argument("--batch-sizes", default="1,8", help="Clips a generate call.")
    parser.add_argument("--threads", type=int, default=2, help="torch threads.")
    args = parser.parse_args()
    import soundfile

    args.students = [int(n) for n in args.students.split(",") if n]
    args.batch_sizes = [int(n) for n in args.batch_sizes.split(",")]
    distilled: dict[str, list[str]] = {}
    for pair in args.distilled:
        teacher, _, model = pair.partition("=")
        distilled.setdefault(teacher, []).append(model)
    args.distilled = distilled
    clips = data_clips(args.data, args.clips) if args.data else english_clips(args.clips)
    seconds = sum(soundfile.info(path).duration for path, _ in clips)
    print(
        f"{len(clips)} clips of {args.data or REALSPEECH} (~{seconds:.0f} s), greedy, no "
        f"timestamps, {args.rounds} interleaved rounds, {args.threads} torch threads, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; student-N "
        "untrained, distilled-N trained",
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
