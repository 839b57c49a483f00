"""Pictures and a markdown page from training metrics and evaluation reports (matplotlib Agg, the
`plots` extra: without it, no picture).

`write_curves_png` draws OUTPUT/metrics.jsonl: one line per optimizer step
`{"step", "loss", "lr", "epoch"}` and one per evaluation `{"step", "eval_loss", "wer"}`
(WER as a fraction). `write_comparison` puts a baseline and a fine-tuned model side by side.
"""

from __future__ import annotations

import json
from pathlib import Path

from whisper_train.errors import UserError
from whisper_train.plots import missing as plots_missing
from whisper_train.plots import plt


def read_metrics(metrics_jsonl: str | Path) -> list[dict]:
    """The JSON lines of a metrics file; a half-written last line (run still going) is ignored."""
    path = Path(metrics_jsonl)
    if not path.is_file():
        raise UserError(f"{path}: no such metrics file; point at a training run's metrics.jsonl")
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(row["step"], row[key]) for row in rows if row.get(key) is not None and "step" in row]
    return [p[0] for p in points], [p[1] for p in points]


def write_curves_png(metrics_jsonl: str | Path, path: str | Path) -> Path | None:
    """Training loss (and eval loss) by step on the left, WER (%) by step on the right."""
    rows = read_metrics(metrics_jsonl)
    if plots_missing(path):
        return None
    figure, (loss_axes, wer_axes) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("loss", "training loss"), ("eval_loss", "eval loss")):
        steps, values = _series(rows, key)
        if steps:
            loss_axes.plot(steps, values, marker="." if key == "eval_loss" else None, label=label)
    loss_axes.set(xlabel="optimizer step", ylabel="loss", title="Loss")
    loss_axes.legend(loc="upper right")
    steps, wers = _series(rows, "wer")
    if steps:
        wer_axes.plot(steps, [100 * w for w in wers], marker="o", color="tab:red")
    else:
        wer_axes.text(
            0.5, 0.5, "no evaluation yet", ha="center", va="center", transform=wer_axes.transAxes
        )
    wer_axes.set(xlabel="optimizer step", ylabel="WER (%)", title="Word error rate (generate)")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _pct(value: float) -> str:
    return f"{100 * value:.2f}%"


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def changed_utterances(before, after) -> tuple[list[tuple], list[tuple]]:
    """(improved, worsened): (audio, reference, before hyp, after hyp, errors before, after),
    matched by clip, sorted by the size of the change, largest first."""
    before_rows = dict(zip(before.audio, before.scores.rows, strict=True))
    improved, worsened = [], []
    for audio, row in zip(after.audio, after.scores.rows, strict=True):
        old = before_rows.get(audio)
        if old is None or old.errors == row.errors:
            continue
        entry = (audio, row.reference, old.hypothesis, row.hypothesis, old.errors, row.errors)
        (improved if row.errors < old.errors else worsened).append(entry)
    improved.sort(key=lambda e: e[5] - e[4])
    worsened.sort(key=lambda e: e[4] - e[5])
    return improved, worsened


def write_comparison(
    before, after, *, markdown_path: str | Path, png_path: str | Path, top: int = 10
) -> tuple[Path, Path | None]:
    """report.md (figures side by side; the utterances that got better and worse) and
    report.png (WER and CER before vs after) from two `EvalReport`s on the same data."""
    figures = [
        ("WER", "wer"),
        ("CER", "cer"),
        ("orthographic WER", "orthographic_wer"),
        ("insertion rate", "insertion_rate"),
        ("deletion rate", "deletion_rate"),  # with insertions: long-form windows lost or doubled
        ("repeated 3-gram rate", "repeated_ngram_rate"),
        ("empty outputs", "empty_output_rate"),
    ]
    improved, worsened = changed_utterances(before, after)
    lines = [
        "# Evaluation: before and after",
        "",
        f"{after.scores.n} utterances, normalizer `{after.normalizer}`"
        + (
            f"; {after.long_form_recordings} recordings decoded long-form (30 s windows with "
            f"timestamps, {'with' if after.condition_on_previous_text else 'without'} the "
            "previous text), each scored over its whole reference."
            if getattr(after, "long_form_recordings", 0)
            else "."
        ),
        "",
        f"| | before (`{before.model}`) | after (`{after.model}`) |",
        "|---|---|---|",
    ]
    for label, key in figures:
        lines.append(
            f"| {label} | {_pct(getattr(before.scores, key))} | {_pct(getattr(after.scores, key))} |"
        )
    lines += ["", f"{len(improved)} utterances got better, {len(worsened)} got worse.", ""]
    for title, entries in (("Got better", improved), ("Got worse", worsened)):
        lines += [f"## {title}", ""]
        if not entries:
            lines += ["None.", ""]
            continue
        lines += ["| clip | reference | before | after | errors |", "|---|---|---|---|---|"]
        for audio, reference, old, new, old_errors, new_errors in entries[:top]:
            lines.append(
                f"| {_escape(Path(audio).name)} | {_escape(reference)} | {_escape(old)} | "
                f"{_escape(new)} | {old_errors} → {new_errors} |"
            )
        lines.append("")
    markdown_path, png_path = Path(markdown_path), Path(png_path)
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    markdown_path.write_text("\n".join(lines), encoding="utf-8")
    if plots_missing(png_path):
        return markdown_path, None
    figure, axes = plt.subplots(figsize=(6, 4))
    labels = ["WER", "CER"]
    width = 0.38
    positions = range(len(labels))
    for offset, (name, report) in ((-width / 2, ("before", before)), (width / 2, ("after", after))):
        values = [100 * report.scores.wer, 100 * report.scores.cer]
        bars = axes.bar([p + offset for p in positions], values, width, label=name)
        axes.bar_label(bars, fmt="%.1f")
    axes.set_xticks(list(positions), labels)
    axes.set(ylabel="%", title="Before vs after fine-tuning")
    axes.legend()
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
    return markdown_path, png_path
