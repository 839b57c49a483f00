"""check-data's transcript checks: empty labels, labels longer than the decoder's 448 positions
(in train's tokens with a model, else estimated from characters), transcripts that occur more
than once, and characters a tokenizer handles badly or a dataset uses rarely.
"""

from __future__ import annotations

import unicodedata
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from whisper_train.checkdata.report import DataReport, Finding
from whisper_train.data.examples import Example
from whisper_train.data.labels import MAX_DECODER_TOKENS, LabelEncoder
from whisper_train.errors import UserError

# Without a tokenizer, labels are measured in characters: English BPE averages ~4 characters a
# token, so 2 characters a token is a cautious bound for "probably over 448 tokens".
CHARS_PER_TOKEN_ESTIMATE = 2
# A character used in this few rows of a dataset at least RARE_MIN_ROWS long is likely a typo.
RARE_MAX_ROWS = 2
RARE_MIN_ROWS = 50
# Unicode categories that never belong in a transcript: control, format (zero-width joiners,
# bidi marks), private use, surrogates, unassigned.
BAD_CATEGORIES = {"Cc", "Cf", "Co", "Cs", "Cn"}


def check_labels(
    examples: Sequence[Example], encoder: LabelEncoder | None, report: DataReport
) -> None:
    texts: dict[str, list[str]] = defaultdict(list)
    for example in examples:
        origin = example.origin or example.audio
        text = example.text.strip()
        if not text:
            report.findings.append(Finding("empty_label", origin, example.audio))
            continue
        texts[" ".join(text.casefold().split())].append(origin)
        if encoder is not None:
            n_tokens = _decoder_tokens(encoder, example)
            report.label_tokens.append(n_tokens)
            if n_tokens > MAX_DECODER_TOKENS:
                report.findings.append(Finding("long_label", origin, f"{n_tokens} tokens"))
        elif len(text) > MAX_DECODER_TOKENS * CHARS_PER_TOKEN_ESTIMATE:
            report.findings.append(
                Finding(
                    "long_label", origin, f"{len(text)} characters (pass --model to count tokens)"
                )
            )
    for text, origins in texts.items():
        if len(origins) > 1:
            shown = text if len(text) <= 40 else text[:37] + "..."
            report.findings.append(
                Finding(
                    "duplicate_text",
                    origins[0],
                    f"{shown!r} x{len(origins)}: {', '.join(origins[1:4])}",
                )
            )


def _decoder_tokens(encoder: LabelEncoder, example: Example) -> int:
    """The decoder positions of `example`'s label, as train's screening counts them.

    A row train would refuse outright for its language (none for a multilingual model, or one
    an English-only model cannot write) is counted with English instead: a multilingual prefix
    holds one language token whichever it is, an English-only one none.
    """
    try:
        return encoder.decoder_tokens(example)
    except UserError:
        return encoder.decoder_tokens(replace(example, language="en"))


def check_characters(examples: Sequence[Example], tokenizer: Any, report: DataReport) -> None:
    """Control/format characters, tokenizer round-trip failures, and characters used rarely."""
    rows_with: dict[str, list[str]] = defaultdict(list)
    for example in examples:
        for char in set(example.text):
            rows_with[char].append(example.origin or example.audio)
    for char, origins in sorted(rows_with.items()):
        name = _describe(char)
        if unicodedata.category(char) in BAD_CATEGORIES:
            report.findings.append(
                Finding("bad_characters", origins[0], f"{name} in {len(origins)} rows")
            )
        elif tokenizer is not None and not _round_trips(tokenizer, char):
            report.findings.append(
                Finding("bad_characters", origins[0], f"{name} does not survive the tokenizer")
            )
        elif (
            len(examples) >= RARE_MIN_ROWS
            and len(origins) <= RARE_MAX_ROWS
            and not (char.isascii() and char.isprintable())
        ):
            report.findings.append(
                Finding("rare_characters", origins[0], f"{name} in {len(origins)} rows")
            )


def _describe(char: str) -> str:
    label = unicodedata.name(char, f"U+{ord(char):04X}")
    return f"{char!r} ({label})" if char.isprintable() else f"U+{ord(char):04X} ({label})"


def _round_trips(tokenizer: Any, char: str) -> bool:
    ids = tokenizer.encode(char, add_special_tokens=False)
    return tokenizer.decode(ids) == char
