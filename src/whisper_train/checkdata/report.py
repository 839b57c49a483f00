"""check-data's report: what `check_data` found (`Finding`s, kept as problems or notes, in a
`DataReport`), the duration histogram's round bins, and the report as text or as a PNG.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from whisper_train.audio import CHUNK_LENGTH
from whisper_train.data.labels import MAX_DECODER_TOKENS
from whisper_train.plots import missing as plots_missing
from whisper_train.plots import plt

# Histogram bins: round widths (1, 2, 2.5 or 5 times a power of ten) spanning the data, at most
# HISTOGRAM_MAX_BINS of them; bins are sized as if the data spanned at least
# HISTOGRAM_MIN_SPAN_SECONDS, so they are never narrower than a tenth of a second (finer bins
# only scatter clips of the same length over several bars).
HISTOGRAM_MAX_BINS = 12
HISTOGRAM_MIN_SPAN_SECONDS = 1.0
BAR_WIDTH = 40
LISTED_PER_KIND = 5  # rows named per problem kind in the text report

PROBLEM_KINDS = {
    "unreadable": "unreadable or missing audio",
    "non_finite": "audio with NaN or infinite samples",
    "too_long": f"clips over {CHUNK_LENGTH} s",
    "past_end": "windows past the end of the file",
    "empty_label": "empty transcripts",
    "long_label": f"labels over {MAX_DECODER_TOKENS} tokens",
    "duplicate_audio": "the same audio twice",
    "bad_characters": "characters the tokenizer handles badly",
}
NOTE_KINDS = {
    "duplicate_text": "transcripts that occur more than once",
    "rare_characters": "rare characters",
}


@dataclass(frozen=True)
class Finding:
    """One thing wrong (a problem) or worth a look (a note), tied to the row it came from."""

    kind: str  # a key of PROBLEM_KINDS or NOTE_KINDS
    origin: str  # "train.jsonl:12", or the audio path
    detail: str = ""


@dataclass
class DataReport:
    """Everything `check_data` found; `format_report` prints it, `to_dict` serialises it."""

    path: str
    clips: int = 0
    total_seconds: float = 0.0
    durations: list[float] = field(default_factory=list)  # seconds, one per readable clip
    sample_rates: dict[int, int] = field(default_factory=dict)  # Hz → files
    channels: dict[int, int] = field(default_factory=dict)  # channel count → files
    languages: dict[str, int] = field(default_factory=dict)  # code (or "unspecified") → clips
    # Clips with no language while --model is multilingual: `train` needs --language for them.
    without_language: int = 0
    tokenizer: str | None = None  # name of the tokenizer that measured labels, if any
    # Decoder positions per non-empty label, prefix included (`LabelEncoder.decoder_tokens`, as
    # train's screening counts them); empty without a tokenizer.
    label_tokens: list[int] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def hours(self) -> float:
        return self.total_seconds / 3600

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.kind in PROBLEM_KINDS]

    @property
    def notes(self) -> list[Finding]:
        return [f for f in self.findings if f.kind in NOTE_KINDS]

    def counts(self) -> dict[str, int]:
        """{kind: number of findings}, problems and notes alike."""
        return dict(Counter(f.kind for f in self.findings))

    def histogram(self) -> list[tuple[float, float, int]]:
        """[(bin start in s, bin end in s, clips)] over the shortest to the longest clip, in at
        most HISTOGRAM_MAX_BINS bins of a round width; empty bins inside the range included."""
        if not self.durations:
            return []
        edges = histogram_edges(min(self.durations), max(self.durations))
        counts, _ = np.histogram(self.durations, bins=edges)
        return [
            (float(start), float(end), int(count))
            for start, end, count in zip(edges[:-1], edges[1:], counts, strict=True)
        ]

    def label_summary(self) -> dict[str, Any] | None:
        """Label lengths in tokens (min, median, max, how many over the decoder's limit), or
        None when no tokenizer measured them."""
        if not self.label_tokens:
            return None
        return {
            "min": min(self.label_tokens),
            "median": statistics.median(self.label_tokens),
            "max": max(self.label_tokens),
            "over_limit": sum(n > MAX_DECODER_TOKENS for n in self.label_tokens),
            "limit": MAX_DECODER_TOKENS,
        }

    def to_dict(self) -> dict[str, Any]:
        result = asdict(self)
        result["durations"] = [round(seconds, 3) for seconds in self.durations]
        result["hours"] = round(self.hours, 4)
        result["histogram"] = [
            {"start_s": round(start, 6), "end_s": round(end, 6), "clips": n}
            for start, end, n in self.histogram()
        ]
        result["label_token_summary"] = self.label_summary()
        result["problem_count"] = len(self.problems)
        result["counts"] = self.counts()
        return result


def _round_ticks(low: float, high: float, bins: int) -> np.ndarray:
    """Multiples of the narrowest round step (1, 2, 2.5 or 5 times a power of ten) whose
    ticks from at or below `low` to at or above `high` make at most `bins` bins: an axis's
    tick rule, without matplotlib (the `plots` extra)."""
    exponent = math.floor(math.log10((high - low) / bins))
    for power in range(exponent, exponent + 3):
        for mantissa in (1, 2, 2.5, 5):
            step = mantissa * 10.0**power
            first, last = math.floor(low / step), math.ceil(high / step)
            if last - first <= bins:
                return np.arange(first, last + 1) * step
    raise AssertionError("a step of 100 times the span fits in one bin")


def histogram_edges(shortest: float, longest: float) -> np.ndarray:
    """Bin edges of a round width from at or below `shortest` to at or above `longest`."""
    high = max(longest, shortest + HISTOGRAM_MIN_SPAN_SECONDS)
    ticks = np.round(
        _round_ticks(shortest, high, HISTOGRAM_MAX_BINS), 9
    )  # 0.30000000000000004 → 0.3, so a clip of 0.3 s starts a bin
    # The locator may add ticks beyond the data (and the minimum span adds more): keep one edge
    # at or outside each end; numpy's last bin includes its right edge.
    first = max(i for i, tick in enumerate(ticks) if tick <= shortest)
    last = min(i for i, tick in enumerate(ticks) if tick >= longest and i > first)
    return ticks[first : last + 1]


# -- text report ------------------------------------------------------------------------------
def format_report(report: DataReport) -> str:
    """A plain-text report: totals, histogram bars, formats, then problems and notes."""
    lines = [
        f"{report.path}: {report.clips} clips, {report.hours:.2f} h ({report.total_seconds:.1f} s)",
    ]
    if report.durations:
        lines.append(
            f"durations: min {min(report.durations):.1f} s, median "
            f"{sorted(report.durations)[len(report.durations) // 2]:.1f} s, "
            f"max {max(report.durations):.1f} s"
        )
        histogram = report.histogram()
        peak = max(count for _, _, count in histogram)
        # As many decimals as the bin width needs (0.1 → 1, 2.5 → 1, 50 → 0), aligned.
        decimals = max(len(f"{end:g}".partition(".")[2]) for _, end, _ in histogram)
        width = len(f"{histogram[-1][1]:.{decimals}f}")
        for start, end, count in histogram:
            bar = "#" * math.ceil(BAR_WIDTH * count / peak) if count else ""
            span = f"{start:{width}.{decimals}f}-{end:{width}.{decimals}f} s"
            lines.append(f"  {span} {count:6d} {bar}")
    lines.append("sample rates: " + _counts(report.sample_rates, " Hz") + " (files)")
    lines.append("channels: " + _counts(report.channels, "") + " (files)")
    lines.append("languages: " + _counts(report.languages, ""))
    if report.without_language:
        lines.append(
            f"  {report.without_language} clip(s) state no language and --model is "
            "multilingual: set one with `train --language CODE` (e.g. --language es) or a "
            "`language` column; `train` stops on them without it"
        )
    lines.append(_label_line(report))

    for title, kinds in (("problems", PROBLEM_KINDS), ("notes", NOTE_KINDS)):
        found = [f for f in report.findings if f.kind in kinds]
        lines.append(f"{len(found)} {title}" + (":" if found else ""))
        for kind, description in kinds.items():
            of_kind = [f for f in found if f.kind == kind]
            if not of_kind:
                continue
            lines.append(f"  {len(of_kind)} {description}")
            for finding in of_kind[:LISTED_PER_KIND]:
                lines.append(f"    {finding.origin}: {finding.detail}")
            if len(of_kind) > LISTED_PER_KIND:
                lines.append(
                    f"    ... and {len(of_kind) - LISTED_PER_KIND} more (--json lists all)"
                )
    return "\n".join(lines)


def _label_line(report: DataReport) -> str:
    if not report.tokenizer:
        return "labels measured in characters (pass --model to count tokens)"
    summary = report.label_summary()
    if summary is None:
        return f"labels measured with {report.tokenizer}: no non-empty labels"
    return (
        f"labels measured with {report.tokenizer}: min {summary['min']}, median "
        f"{summary['median']:g}, max {summary['max']} tokens (decoder positions, prefix "
        f"included, as train counts them), {summary['over_limit']} over {MAX_DECODER_TOKENS}"
    )


def _counts(counts: dict[Any, int], unit: str) -> str:
    if not counts:
        return "none"
    ordered = sorted(counts.items(), key=lambda item: (-item[1], str(item[0])))
    return ", ".join(f"{key}{unit}: {count}" for key, count in ordered)


def write_histogram_png(report: DataReport, path: str | Path) -> Path | None:
    """Save the duration histogram as a PNG (matplotlib, no display needed); None without
    matplotlib (one line says so)."""
    histogram = report.histogram()
    if plots_missing(path):
        return None
    figure, axes = plt.subplots(figsize=(7, 3.5))
    axes.bar(
        [start for start, _, _ in histogram],
        [count for _, _, count in histogram],
        width=[end - start for start, end, _ in histogram],
        align="edge",
        edgecolor="black",
    )
    axes.axvline(CHUNK_LENGTH, color="red", linestyle="--", label=f"{CHUNK_LENGTH} s window")
    axes.set_xlabel("clip duration (s)")
    axes.set_ylabel("clips")
    axes.set_title(f"{Path(report.path).name}: {report.clips} clips, {report.hours:.2f} h")
    axes.legend()
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
