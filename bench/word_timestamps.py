"""Word timestamps before and after fine-tuning, with the base's alignment heads and with heads
found again: how far each model's word start times are from where the words start.

    OMP_NUM_THREADS=1 .venv/bin/python bench/word_timestamps.py [--modes lora,full]
        [--seconds 75] [--pause 1.0] [--head-clips 24]

1. The recording: real clips from ../shared/realspeech (LibriVox's consecutive sentences, then
   LJ Speech's, as bench/timestamps.py) joined with `--pause` seconds of digital silence until
   it lasts `--seconds`. Two references:
   * onsets (model-free): where each clip's speech starts in the recording: its offset plus the
     first 10 ms frame within 30 dB of the clip's loudest frame. The first word of each clip
     starts there; the hypothesis word taken as that first word is the one matched to the
     clip's first reference word by a word-level alignment of normalised text (clips whose
     first word the model got wrong are left out and counted).
   * base words: the base model's (tiny.en with OpenAI's alignment heads) word start times;
     every word a model shares with it (same alignment) is compared.
2. Fine-tuning: as bench/timestamps.py (the demo's 192 synthesised training sentences, text-only
   labels, each mode's default learning rate, one epoch = 24 steps).
3. Heads found again: `find_alignment_heads` on `--head-clips` of the training clips, the
   reference being the base model's word times on those clips (what a user has: no human word
   times, the base model they started from), then the same recording timed with them.

Every model runs through `transcribe_paths(..., word_timestamps=True)` on the transformers
backend (transformers' DTW over generation_config.alignment_heads), temperature fallback off.
"""

from __future__ import annotations

import argparse
import difflib
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REALSPEECH, cpu_seconds  # noqa: E402
from timestamps import cpu_model, fine_tune, joined_clips  # noqa: E402

ONSET_DB = -30.0  # a 10 ms frame within this of the clip's loudest frame is speech


@dataclass
class Recording:
    path: Path
    duration: float
    onsets: list[float]  # where each clip's speech starts, seconds into the recording
    clip_texts: list[str]  # each clip's reference transcript
    text: str


def speech_onset(audio: np.ndarray, rate: int) -> float:
    frame = rate // 100
    frames = audio[: len(audio) // frame * frame].reshape(-1, frame)
    level = 10 * np.log10((frames.astype(np.float64) ** 2).mean(axis=1) + 1e-12)
    return float(np.argmax(level > level.max() + ONSET_DB) * 0.01)


def normalise(word: str) -> str:
    return re.sub(r"[^a-z0-9']", "", word.lower())


def build_recording(folder: Path, *, seconds: float, pause: float) -> Recording:
    import soundfile

    from whisper_train.audio import SAMPLE_RATE

    audio, starts, clips, texts = joined_clips(seconds=seconds, pause=pause)
    onsets = [
        start / SAMPLE_RATE + speech_onset(clip, SAMPLE_RATE)
        for start, clip in zip(starts, clips, strict=True)
    ]
    path = folder / "word-times-recording.wav"
    soundfile.write(path, audio, SAMPLE_RATE)
    return Recording(path, len(audio) / SAMPLE_RATE, onsets, texts, " ".join(texts))


def transcribe_words(model, path: Path):
    """[(normalised word, start)] and the text, through transcribe's transformers backend."""
    from whisper_train.transcription.decoding import NO_FALLBACK
    from whisper_train.transcription.transcribe import transcribe_paths

    (transcript,) = transcribe_paths(
        model, [path], word_timestamps=True, progress=False, decoding=NO_FALLBACK
    )
    if transcript.error:
        raise SystemExit(f"{path}: {transcript.error}")
    words = [(normalise(w.word), w.start) for s in transcript.segments for w in s.words or ()]
    return [(w, t) for w, t in words if w], transcript.text


def matched_starts(words, reference):
    """(starts, reference starts) of the words a word-level alignment pairs up."""
    matcher = difflib.SequenceMatcher(None, [w for w, _ in words], [w for w, _ in reference])
    pairs = [
        (words[block.a + k][1], reference[block.b + k][1])
        for block in matcher.get_matching_blocks()
        for k in range(block.size)
    ]
    return np.array(pairs).reshape(-1, 2)


def onset_errors(words, recording: Recording) -> tuple[np.ndarray, int]:
    """|first word start - clip onset| per clip whose first word the model wrote."""
    reference_words = [normalise(w) for w in recording.text.split()]
    reference_words = [w for w in reference_words if w]
    # Each clip's first word: its position in the joined reference.
    firsts, position = [], 0
    for clip_text, onset in zip(recording.clip_texts, recording.onsets, strict=True):
        firsts.append((position, onset))
        position += len([w for w in map(normalise, clip_text.split()) if w])
    matcher = difflib.SequenceMatcher(None, [w for w, _ in words], reference_words)
    hypothesis_of = {}
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            hypothesis_of[block.b + k] = words[block.a + k][1]
    errors = [abs(hypothesis_of[p] - onset) for p, onset in firsts if p in hypothesis_of]
    return np.array(errors), len(firsts) - len(errors)


def base_examples(base_model, processor, clips) -> list:
    """The base model's word times on each training clip, as find_alignment_heads' reference."""
    from whisper_train.transcription.backends import TransformersBackend
    from whisper_train.transcription.decoding import NO_FALLBACK
    from whisper_train.transcription.word_timestamps import AlignmentExample

    backend = TransformersBackend(base_model, processor, word_timestamps=True, decoding=NO_FALLBACK)
    examples = []
    for audio in clips:
        _, segments = backend.transcribe(audio)
        examples.append(AlignmentExample(audio, [w for s in segments for w in s.words or ()]))
    return examples


def stats(errors: np.ndarray) -> str:
    if len(errors) == 0:
        return "- / -"
    return f"{np.median(errors):.2f} / {np.percentile(errors, 90):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--modes", default="lora,full")
    parser.add_argument("--seconds", type=float, default=75.0)
    parser.add_argument("--pause", type=float, default=1.0)
    parser.add_argument("--head-clips", type=int, default=24, help="training clips to find heads")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument(
        "--reuse-runs", action="store_true", help="time the work dir's earlier runs again"
    )
    parser.add_argument(
        "--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "wt-word-timestamps"
    )
    args = parser.parse_args()
    if not REALSPEECH.is_dir():
        raise SystemExit(f"needs the real recordings in {REALSPEECH}")
    from whisper_train.audio import load_audio
    from whisper_train.data.layouts import load_examples
    from whisper_train.demo import prepare_demo_data
    from whisper_train.models import load_model
    from whisper_train.transcription.word_timestamps import (
        default_alignment_heads,
        find_alignment_heads,
    )

    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    recording = build_recording(work, seconds=args.seconds, pause=args.pause)
    data = prepare_demo_data(
        work / "data", train_utterances=192, eval_utterances=1, guard_utterances=1, seed=0
    )
    print(f"command: {' '.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}")
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        f"Python {platform.python_version()}"
    )
    print(
        f"recording: {recording.duration:.1f} s, {len(recording.onsets)} clips, "
        f"{args.pause} s pauses"
    )
    train_clips = [load_audio(e.audio) for e in load_examples(data["train"])[: args.head_clips]]
    base_model, base_processor = load_model(args.model)
    examples = base_examples(base_model, base_processor, train_clips)
    print(f"head search: {len(train_clips)} training clips, base model's word times")

    base = (base_model, base_processor)  # the transformers backend, as every row below
    base_words, _ = transcribe_words(base, recording.path)
    rows_out = []

    def measure(label, model, heads_note, train_cpu=0.0, search_cpu=0.0):
        started = cpu_seconds()
        words, text = transcribe_words(model, recording.path)
        onset, missed = onset_errors(words, recording)
        pairs = matched_starts(words, base_words)
        from_base = np.abs(pairs[:, 0] - pairs[:, 1]) if len(pairs) else np.array([])
        line = (
            f"| {label} | {heads_note} | {stats(onset)} ({len(onset)} clips) "
            f"| {stats(from_base)} ({len(from_base)} words) "
            f"| {train_cpu:.0f} | {search_cpu:.0f} | {cpu_seconds() - started:.0f} |"
        )
        rows_out.append(line)
        print(line, flush=True)

    base_heads = base_model.generation_config.alignment_heads
    measure(f"{args.model} (base)", base, f"OpenAI's {base_heads}")
    for mode in args.modes.split(","):
        started = cpu_seconds()
        final = work / f"run-{mode}" / "final"
        if not (args.reuse_runs and final.is_dir()):
            final = fine_tune(
                mode, data["train"], work / f"run-{mode}", epochs=args.epochs, model=args.model
            )
        train_cpu = cpu_seconds() - started
        model, processor = load_model(str(final))
        carried = model.generation_config.alignment_heads
        label = f"{mode}, {args.epochs:g} epoch"
        measure(label, (model, processor), f"base's, carried {carried}", train_cpu)
        # What a model that names no heads gets (a checkpoint whose generation config lost
        # them): every runtime's default, all heads of the upper half of the decoder.
        model.generation_config.alignment_heads = default_alignment_heads(model)
        measure(label, (model, processor), "none named: upper half (runtimes' default)")
        started = cpu_seconds()
        search = find_alignment_heads(model, processor, examples)
        search_cpu = cpu_seconds() - started
        model.generation_config.alignment_heads = search.heads
        print(f"  found {search.heads}: median {search.error_s:.3f} s on {search.words} words")
        measure(label, (model, processor), f"found {search.heads}", 0, search_cpu)

    print()
    print(
        "| model | alignment heads | first word of each clip vs its onset: median / p90 |s| "
        "| word starts vs base's: median / p90 |s| | train CPU s | head search CPU s "
        "| transcribe CPU s |"
    )
    print("|" + "---|" * 7)
    print("\n".join(rows_out))


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"wall: {(time.perf_counter() - started) / 60:.1f} min")
