"""The export check on real models at every precision, and on deliberately broken exports:
does it pass what is intact and fail what is broken, in each runtime?

    python bench/export_check.py --model tiny.en [--clips 12]
    python bench/export_check.py --model base

For each (format, precision) the model is exported with `save_export` and checked with
`check_export` against one `score_source` of the intact model on the check's 12 synthesised
clips. Per row: the greedy-transcript verdict the check used before (words differing vs
max(2, rate x words), rate 1% float32, 2% float16, 5% int8) and the teacher-forced verdict it
uses now (mean |Δ log p| per token vs `logprob_tolerance`, and the vocabulary's spelling).
Broken rows export a damaged copy: a converter that swapped the decoder's first q and k
projections, one that wrote a square weight transposed, and file edits (ggml's mel filters
written untransposed, its vocabulary shifted by one token; ct2's tokenizer.json shifted).
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import struct
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from whisper_train.deploy.export import save_export
from whisper_train.deploy.parity import check_clips, check_export, check_language, score_source
from whisper_train.models import load_model

EXPORTS = (
    ("ct2", "float32"),
    ("ct2", "float16"),
    ("ct2", "int8"),
    ("ct2", "int8_float16"),
    ("ggml", "float16"),
    ("openai", "float32"),
    ("openai", "float16"),
)
OLD_RATE = {"float32": 0.01, "float16": 0.02, "int8": 0.05, "int8_float16": 0.05}


def swap_decoder_q_k(model):
    attention = model.model.decoder.layers[0].self_attn
    with torch.no_grad():
        q = attention.q_proj.weight.clone()
        attention.q_proj.weight.copy_(attention.k_proj.weight)
        attention.k_proj.weight.copy_(q)


def transpose_out_proj(model):
    weight = model.model.encoder.layers[0].self_attn.out_proj.weight
    with torch.no_grad():
        weight.copy_(weight.T.clone())


def ggml_filters_untransposed(output: Path, model, processor):
    path = output / "ggml-model.bin"
    data = bytearray(path.read_bytes())
    filters = np.asarray(processor.feature_extractor.mel_filters, dtype="<f4")  # (201, n_mels)
    start = 4 + 11 * 4 + 8
    data[start : start + filters.nbytes] = filters.tobytes()  # the bank's memory order, not .T
    path.write_bytes(bytes(data))


def ggml_vocabulary_shifted(output: Path, model, processor):
    path = output / "ggml-model.bin"
    data = path.read_bytes()
    n_mels = model.config.num_mel_bins
    start = 4 + 11 * 4 + 8 + 4 * n_mels * 201
    (count,) = struct.unpack("<i", data[start : start + 4])
    offset, tokens = start + 4, []
    for _ in range(count):
        (length,) = struct.unpack("<I", data[offset : offset + 4])
        tokens.append(data[offset + 4 : offset + 4 + length])
        offset += 4 + length
    shifted = tokens[1:] + tokens[:1]
    body = b"".join(struct.pack("<I", len(t)) + t for t in shifted)
    path.write_bytes(data[: start + 4] + body + data[offset:])


def ct2_tokenizer_shifted(output: Path, model, processor):
    path = output / "tokenizer.json"
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    vocab = tokenizer["model"]["vocab"]
    n = len(vocab)
    tokenizer["model"]["vocab"] = {token: (i + 1) % n for token, i in vocab.items()}
    path.write_text(json.dumps(tokenizer), encoding="utf-8")


BROKEN = {
    "ct2": (
        ("float16", "q/k swapped", swap_decoder_q_k, None),
        ("float16", "weight transposed", transpose_out_proj, None),
        ("int8", "q/k swapped", swap_decoder_q_k, None),
        ("float16", "tokenizer shifted", None, ct2_tokenizer_shifted),
    ),
    "ggml": (
        ("float16", "q/k swapped", swap_decoder_q_k, None),
        ("float16", "weight transposed", transpose_out_proj, None),
        ("float16", "mel filters untransposed", None, ggml_filters_untransposed),
        ("float16", "vocabulary shifted", None, ggml_vocabulary_shifted),
    ),
    "openai": (
        ("float16", "q/k swapped", swap_decoder_q_k, None),
        ("float16", "weight transposed", transpose_out_proj, None),
    ),
}


def old_verdict(check) -> str:
    if check.runtime_error is not None:
        return "error"
    allowed = max(2, math.floor(OLD_RATE[check.quantization] * check.words))
    verdict = "pass" if check.word_errors <= allowed else "FAIL"
    return f"{verdict} ({check.word_errors}/{check.words} words, allowed {allowed})"


def new_verdict(check) -> str:
    verdict = "pass" if check.passed else "FAIL"
    if check.runtime_error is not None:
        return f"{verdict} ({check.runtime_error[:60]})"
    worst = max(float(clip.deviations.max(initial=0.0)) for clip in check.clips)
    spelled = len(check.clips) - len(check.misspelled)
    return (
        f"{verdict} (mean {check.deviation:.4f}, max {worst:.3f}, allowed {check.tolerance}; "
        f"spelled {spelled}/{len(check.clips)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--clips", type=int, default=12)
    parser.add_argument("--no-broken", action="store_true")
    args = parser.parse_args()

    model, processor = load_model(args.model)
    clips = check_clips(None, args.clips)
    started = time.perf_counter()
    source = score_source(model, processor, clips, check_language(model, processor, clips))
    print(
        f"source scored in {time.perf_counter() - started:.0f} s: {sum(map(len, source.tokens))} tokens"
    )
    rows = []
    cases = [(f, q, "intact", None, None) for f, q in EXPORTS]
    if not args.no_broken:
        cases += [(f, q, name, b, e) for f, specs in BROKEN.items() for q, name, b, e in specs]
    for format, quantization, name, break_model, edit_file in cases:
        exported = model
        if break_model is not None:
            exported = copy.deepcopy(model)
            break_model(exported)
        with tempfile.TemporaryDirectory() as folder:
            output = Path(folder)
            save_export(
                copy.deepcopy(exported), processor, output, format=format, quantization=quantization
            )
            if edit_file is not None:
                edit_file(output, model, processor)
            started = time.perf_counter()
            check = check_export(source, format, output, quantization)
            seconds = time.perf_counter() - started
        row = f"| {args.model} | {format} {quantization} | {name} | {old_verdict(check)} | {new_verdict(check)} | {seconds:.0f} s |"
        print(row, flush=True)
        rows.append(row)
    print(
        "\n| model | export | file | check before (greedy words) | check now (teacher-forced) | check time |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
