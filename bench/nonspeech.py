"""Text where nobody speaks, before and after the no-speech test: tiny.en on the built-in
non-speech set, decoded by whisper-train's own decoding (transformers) and by faster-whisper,
with --no-speech-threshold off and at its default 0.6; and, as the price on speech, WER on
real recordings (../shared/realspeech, when present) with the test off and on.

    PYTHONPATH=src .venv/bin/python bench/nonspeech.py [--speech-clips 20] [--realspeech DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from whisper_train.audio import load_audio
from whisper_train.data.examples import Example
from whisper_train.data.nonspeech import load_nonspeech
from whisper_train.evaluation.evaluate import evaluate_examples
from whisper_train.evaluation.nonspeech import evaluate_nonspeech_examples, score_nonspeech
from whisper_train.models import load_model, resolve_alias
from whisper_train.transcription.backends import CTranslate2Backend
from whisper_train.transcription.decoding import DecodingOptions

REALSPEECH = Path(__file__).resolve().parents[1] / ".." / "shared" / "realspeech"
SETTINGS = {"off": DecodingOptions(no_speech_threshold=None), "0.6": DecodingOptions()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speech-clips", type=int, default=20)
    parser.add_argument("--realspeech", type=Path, default=REALSPEECH)
    args = parser.parse_args()
    examples = load_nonspeech("builtin")
    model, processor = load_model("tiny.en")
    rows = []
    for label, options in SETTINGS.items():
        started = time.perf_counter()
        report = evaluate_nonspeech_examples(model, processor, examples, decoding=options)
        rows.append(("transformers", label, report.scores, time.perf_counter() - started))
        print(json.dumps({"decoder": "transformers", "no_speech": label, "texts": report.texts}))
    for label, options in SETTINGS.items():
        started = time.perf_counter()
        backend = CTranslate2Backend(Path(resolve_alias("tiny.en")), decoding=options)
        clips = [load_audio(e.audio) for e in examples]
        texts = [backend.transcribe(audio, timestamps=False)[0] for audio in clips]
        scores = score_nonspeech(texts, [len(a) / 16_000 for a in clips])
        rows.append(("faster-whisper", label, scores, time.perf_counter() - started))
        print(json.dumps({"decoder": "faster-whisper", "no_speech": label, "texts": texts}))
    minutes = rows[0][2].seconds / 60
    print(f"\nbuilt-in non-speech set: {rows[0][2].clips} clips, {minutes:.2f} min (tiny.en)")
    print("| decoder | --no-speech-threshold | words/min | clips with text | seconds |")
    print("|---|---|---|---|---|")
    for decoder, label, s, seconds in rows:
        print(
            f"| {decoder} | {label} | {s.words_per_minute:.1f} | {s.clips_with_text} of "
            f"{s.clips} | {seconds:.0f} |"
        )
    manifest = args.realspeech / "manifest.jsonl"
    if not manifest.exists():
        return
    lines = manifest.read_text().splitlines()[: args.speech_clips]
    speech = []
    for line in lines:
        row = json.loads(line)
        speech.append(Example(audio=str(args.realspeech / row["audio"]), text=row["text"]))
    print(f"\nreal speech ({len(speech)} clips of ../shared/realspeech), transformers decoding")
    print("| --no-speech-threshold | WER | utterances emptied as silence |")
    print("|---|---|---|")
    for label, options in SETTINGS.items():
        report = evaluate_examples(model, processor, speech, decoding=options)
        emptied = sum(d.no_speech for d in report.decoded)
        print(f"| {label} | {100 * report.wer:.2f}% | {emptied} |")


if __name__ == "__main__":
    main()
