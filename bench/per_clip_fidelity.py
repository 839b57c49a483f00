"""How close is a per-clip packed step to the unpacked step on the same clips?

    PYTHONPATH=src .venv/bin/python bench/per_clip_fidelity.py [--mode full|lora]
        [--context CONTEXT ...] [--clips 32] [--same-loudness] [--data DIR] [--work-dir DIR]

Whether `--packing per-clip` learns as much per clip seen as unpacked training (BENCHMARKS.md
"Each clip alone, its padding sampled"): a training run of each encoder context takes minutes to
an hour and two seeds of the 32-sentence sets spread ~3 points. This asks the question a step at a time, with no training
and no noise from the data's order: from the same weights, on the same clips, how far is the
gradient of one per-clip packed step from the gradient unpacked training takes on those clips
(each clip alone, padded to 30 s, its own log-mel; the loss is the mean over the same label
tokens, so the two have the same scale)? Per parameter group: the cosine between the two and
the ratio of their norms, and each step's loss. A context whose every cosine is 1 and every
ratio 1 trains as unpacked does, per clip seen, whatever the rate.

The clips are the training set of the demo's sets at the bench's size (`bench/quality.py
--target synth`: 128 sentences, synthesised into --work-dir unless --data names an audiofolder),
the first --clips in the order listed, laid into windows as each context's training lays them
(`data.packing.PackedWindow`: its gap, or each clip's own padding; up to 30 s). The model is the
real tiny.en in float32, in training mode (it has no dropout), no checkpointing: the gradients
are what the optimizer would be given.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

import numpy as np
import soundfile
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from whisper_train.data.collate import IGNORE_INDEX, SpeechCollator
from whisper_train.data.features import LogMel
from whisper_train.data.labels import LabelEncoder
from whisper_train.data.packing import (
    PackedWindow,
    per_clip_gap_seconds,
    per_clip_padding_stride,
    window_label,
)
from whisper_train.memory import loss_terms, prepare_model
from whisper_train.memory.clip_attention import ENCODER_CONTEXT, ENCODER_CONTEXTS
from whisper_train.models import load_model

# Parameter groups, by the first part of a parameter's name that matches (in this order).
GROUPS = (
    ("encoder layers", "encoder.layers"),
    ("encoder input", "encoder."),
    ("cross-attention", "encoder_attn."),
    ("decoder layers", "decoder.layers"),
    ("decoder input", "decoder."),
)


def group_of(name: str) -> str:
    return next((group for group, part in GROUPS if part in name), "other")


def read_clips(folder: Path) -> list[tuple[np.ndarray, str]]:
    with (folder / "metadata.csv").open(encoding="utf-8") as stream:
        rows = list(csv.DictReader(stream))
    clips = []
    for row in rows:
        audio, rate = soundfile.read(folder / row["file_name"], dtype="float32")
        assert rate == 16000, f"{row['file_name']}: {rate} Hz"
        clips.append((audio, row["transcription" if "transcription" in row else "text"]))
    return clips


def same_loudness(clips: list, log_mel: LogMel) -> list:
    """`clips` scaled so that each one's loudest log-mel bin is the first clip's (power in
    log10: a factor k on the samples adds 2 log10 k; the features are (log10 + 4) / 4)."""
    peaks = [4 * float(log_mel([audio]).max()) - 4 for audio, _ in clips]
    return [
        (audio * 10 ** ((peaks[0] - peak) / 2), text)
        for (audio, text), peak in zip(clips, peaks, strict=True)
    ]


def windows_of(clips: list, count: int) -> list[list[int]]:
    """The clips of the first `count` clips, in listed order, in windows as the encoder context
    in $WHISPER_TRAIN_PER_CLIP_ENCODER lays them (its gap, its clips' own padding): each
    window filled while the next clip fits."""

    def new_window():
        return PackedWindow(per_clip_gap_seconds(), per_clip_padding_stride())

    windows, window, members = [], new_window(), []
    for index, (audio, text) in enumerate(clips[:count]):
        if len(window) and not window.fits(audio):
            windows.append(members)
            window, members = new_window(), []
        window.add(audio, text)
        members.append(index)
    return windows + [members]


def labelled(clips, members, labels) -> list[dict]:
    items = []
    for index in members:
        audio, text = clips[index]
        tokens, n_prefix = window_label(
            labels, [text], [(0.0, len(audio) / 16000)], language=None, timestamps=False
        )
        items.append(
            {"audio": audio, "tokens": tokens, "n_prefix": n_prefix, "text": text, "index": index}
        )
    return items


def packed_window(items: list[dict], collator) -> dict:
    """One per-clip packed window of `items`, laid out as `windows_of` lays them."""
    window = PackedWindow(per_clip_gap_seconds(), per_clip_padding_stride())
    clips = []
    for item in items:
        window.add(item["audio"], item["text"])
        clips.append({**item, "seconds": window.spans[-1]})
    return collator([{"audio": window.audio(), "clips": clips}])


def summed_gradient(model, batches) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss per label token, gradient of the loss summed over label tokens) of `batches`
    taken together: each micro-batch's mean weighted by its label tokens."""
    total: dict[str, torch.Tensor] = {}
    loss_sum, tokens = 0.0, 0
    for batch in batches:
        model.zero_grad(set_to_none=True)
        loss = loss_terms(model, batch).loss
        count = int((batch["labels"] != IGNORE_INDEX).sum())
        (loss * count).backward()
        loss_sum, tokens = loss_sum + float(loss.detach()) * count, tokens + count
        for name, p in model.named_parameters():
            if p.grad is not None:
                total[name] = total.get(name, 0) + p.grad.detach().flatten()
    return loss_sum / tokens, total


def compare(reference: dict, other: dict) -> dict[str, tuple[float, float]]:
    """Per group (and "all"): (cosine, norm ratio) of `other` against `reference`."""
    rows = {}
    for group in [g for g, _ in GROUPS] + ["all"]:
        names = [n for n in reference if group == "all" or group_of(n) == group]
        if not names:
            continue
        ref = torch.cat([reference[n] for n in names]).double()
        got = torch.cat([other[n] for n in names]).double()
        cos = float(ref @ got / (ref.norm() * got.norm()).clamp_min(1e-30))
        rows[group] = (cos, float(got.norm() / ref.norm().clamp_min(1e-30)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--mode", default="full", choices=("full", "lora", "freeze-encoder"))
    parser.add_argument("--context", action="append", choices=ENCODER_CONTEXTS)
    parser.add_argument("--clips", type=int, default=32, help="the first N training clips")
    parser.add_argument("--data", type=Path, help="an audiofolder (metadata.csv + WAVs)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/per-clip-fidelity"))
    parser.add_argument(
        "--same-loudness",
        action="store_true",
        help="scale each clip's audio so that its loudest log-mel bin is the first clip's: a "
        "window's log-mel floor (its loudest bin minus 80 dB) is then each clip's own",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.data is None:
        from quality import synth_sets

        args.data = synth_sets(args.work_dir / "data-synth")["train"]
    model, processor = load_model(args.model)
    model = prepare_model(model, mode=args.mode, checkpointing="off")
    model.train()
    labels = LabelEncoder(processor.tokenizer, multilingual=False)
    collator = SpeechCollator(
        processor.tokenizer.pad_token_id, log_mel=LogMel(processor.feature_extractor)
    )
    clips = read_clips(args.data)[: args.clips]
    if args.same_loudness:
        clips = same_loudness(clips, collator.log_mel)
    contexts = args.context or list(ENCODER_CONTEXTS)
    items = labelled(clips, range(len(clips)), labels)
    unpacked = [collator(items[at : at + 8]) for at in range(0, len(items), 8)]
    reference_loss, reference = summed_gradient(model, unpacked)
    print(f"{args.model}, {args.mode}; the first {len(clips)} clips of {args.data}")
    print()
    print(
        "The gradient of a pass over the clips (the loss summed over their label tokens), "
        "packed per clip in each context, against unpacked's (batches of 8): cosine / norm "
        "ratio per parameter group; loss per label token (unpacked's "
        f"{reference_loss:.3f})"
    )
    print()
    groups = [g for g, _ in GROUPS if any(group_of(n) == g for n in reference)] + ["all"]
    print("| context | clips a window | loss | " + " | ".join(groups) + " |")
    print("|---|---:|---:|" + "---:|" * len(groups))
    for context in contexts:
        os.environ[ENCODER_CONTEXT] = context
        windows = windows_of(clips, len(clips))
        batches = [packed_window([items[i] for i in members], collator) for members in windows]
        loss, grads = summed_gradient(model, batches)
        rows = compare(reference, grads)
        cells = [f"{rows[g][0]:.3f} / {rows[g][1]:.2f}" for g in groups]
        per_window = len(clips) / len(windows)
        print(f"| {context} | {per_window:.1f} | {loss:.3f} | " + " | ".join(cells) + " |")
        os.environ.pop(ENCODER_CONTEXT, None)


if __name__ == "__main__":
    main()
