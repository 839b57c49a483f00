"""Each runtime on real speech: WER of whisper-train's export against the same runtime on the
original weights, export time and file size.

    python bench/deploy.py --data ../shared/realspeech/manifest.jsonl [--model tiny.en] [--stride 3]

For every format (hf, ct2 float32 / int8, ggml f16, openai f16) the model is exported with
`whisper_train.deploy.export.save_export` (timed), then every clip is decoded by the format's own
runtime the export-check way (its row's `greedy`, formats/runtimes.py: no timestamps, no
previous text, the same suppression) and scored with Whisper's English normaliser. "original" is the same runtime on
the original weights where they exist in that runtime's format (the tiny.en package is
CTranslate2, so faster-whisper); for the others the source row is transformers on the same
weights, decoded the same way. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from whisper_train.audio import load_audio
from whisper_train.data.layouts import load_examples
from whisper_train.deploy.export import save_export
from whisper_train.evaluation.evaluate import score
from whisper_train.formats.registry import export_format
from whisper_train.formats.runtimes import transformers_greedy
from whisper_train.models import load_model, resolve_alias

EXPORTS = (
    ("hf", "float32"),
    ("ct2", "float32"),
    ("ct2", "int8"),
    ("ggml", "float16"),
    ("openai", "float16"),
)


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--limit", type=int, default=None, help="only the first N clips")
    parser.add_argument("--stride", type=int, default=1, help="every Nth clip (all sources)")
    args = parser.parse_args()

    examples = load_examples(args.data)[:: args.stride][: args.limit]
    audio = [load_audio(e.audio, start=e.start, end=e.end) for e in examples]
    references = [e.text for e in examples]
    language = None  # tiny.en is English-only; a multilingual model would take examples' language
    model, processor = load_model(args.model)

    def wer(texts):
        return 100 * score(references, texts).wer

    rows = []
    started = time.perf_counter()
    source = transformers_greedy(model, processor, audio, language)
    rows.append(("transformers (source weights)", "-", f"{wer(source):.2f}", "-", "-", "-"))
    print(f"source decoded in {time.perf_counter() - started:.0f} s", flush=True)
    original = Path(resolve_alias(args.model))
    if (original / "model.bin").is_file():
        texts = export_format("ct2").greedy(original, audio, language)
        rows.append(("faster-whisper (original package)", "float16", f"{wer(texts):.2f}", "-"))
        rows[-1] += ("-", "-")
    with tempfile.TemporaryDirectory(prefix="bench-deploy-") as tmp:
        for format, quantization in EXPORTS:
            output = Path(tmp) / f"{format}-{quantization}"
            started = time.perf_counter()
            save_export(model, processor, output, format=format, quantization=quantization)
            seconds = time.perf_counter() - started
            exported = export_format(format)
            texts = exported.greedy(exported.runtime_input(output), audio, language)
            differing = sum(a != b for a, b in zip(texts, source, strict=True))
            rows.append(
                (
                    f"{exported.runtime} (export --format {format})",
                    quantization,
                    f"{wer(texts):.2f}",
                    f"{seconds:.1f}",
                    f"{folder_size(output) / 1e6:.1f}",
                    f"{differing}/{len(texts)}",
                )
            )
            print(rows[-1], flush=True)
    print(f"\n{len(examples)} clips of {args.data}, model {args.model}\n")
    print("| runtime | precision | WER % | export s | folder MB | clips differing from source |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
