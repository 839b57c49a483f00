"""What a run leaves behind: which evaluated step final/ holds (`choose_final_step`, with the
guard set's veto), final/ itself (`save_final`), and the before/after report of
--compare-baseline (`compare_with_baseline`)."""

from __future__ import annotations

import gc
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from whisper_train import runfolder
from whisper_train.data.examples import Example
from whisper_train.data.labels import configure_generation
from whisper_train.evaluation.evaluate import evaluate_examples, write_report_json
from whisper_train.evaluation.report import write_comparison
from whisper_train.formats.hf import save_model_folder
from whisper_train.models import is_multilingual, load_model
from whisper_train.training.model_card import CARD_FILE
from whisper_train.transcription.decoding import DecodingOptions


@dataclass
class FinalChoice:
    """Which evaluated step final/ holds, and why (written to result.json)."""

    step: int | None
    reason: str
    # The checkpoints' steps whose weights final/ holds averaged (`training.averaging`), the
    # last of them `step`; None: one step's own weights.
    averaged: tuple[int, ...] | None = None


# The average of several checkpoints among the candidates of `choose_final_step`: a step no
# trained step has (each is a whole number from 1), earlier than all of them, so that it loses
# every tie (the later step wins one) and is kept only where it is strictly better.
_AVERAGE = 0.5


def guard_regression(
    evaluations: list[dict], guard: str | None, step: int, start: int = 0
) -> float | None:
    """Points (percent) of WER the guard set lost at `step` against its `start` (step 0, or
    the step a --resume first gave the guard at); None without a guard or its two
    evaluations."""
    if guard is None:
        return None
    wer = {row["step"]: row["wer"] for row in evaluations if row.get("set") == guard}
    if start not in wer or step not in wer or not math.isfinite(wer[step]):
        return None
    return 100 * (wer[step] - wer[start])


def nonspeech_rise(evaluations: list[dict], name: str, step: int) -> tuple[float, int] | None:
    """Words per minute the non-speech set `name` gained at `step` over its start (the first
    step it was measured at: step 0, or the step a --resume first gave it at), and that start;
    None before its start or where it was not measured at `step`."""
    measured = {
        row["step"]: row["words_per_minute"] for row in evaluations if row.get("set") == name
    }
    starts = [measured_at for measured_at in measured if measured_at != _AVERAGE]
    if not starts or step not in measured:
        return None
    start = min(starts)  # the average of checkpoints is scored last, whatever its number
    return measured[step] - measured[start], start


def _nonspeech_holds(
    evaluations: list[dict], step: int, names: Sequence[str], max_rise: float
) -> bool:
    """Every non-speech set was measured at `step` and stayed within `max_rise` words per
    minute of its start."""
    for name in names:
        rise = nonspeech_rise(evaluations, name, step)
        if rise is None or rise[0] > max_rise:
            return False
    return True


def choose_final_step(
    evaluations: list[dict],
    *,
    primary_set: str,
    guard: str | None,
    max_regression: float | None,
    guard_start: int = 0,
    nonspeech_sets: Sequence[str] = (),
    max_nonspeech_rise: float = 0.0,
) -> FinalChoice:
    """The evaluated step whose model final/ holds, as `load_best_model_at_end` users expect:
    the lowest WER on `primary_set` among trained steps (not step 0) whose guard WER was
    measured and stayed within `max_regression` points of its start (`guard_start`), and
    whose words per minute on each of `nonspeech_sets` stayed within `max_nonspeech_rise` of
    that set's start; the later step on a tie. Without evaluations: the last step. If no step
    holds: the last one, and the reason says so."""
    scored = {
        row["step"]: row["wer"]
        for row in evaluations
        if row.get("set", primary_set) == primary_set
        and row["step"] > 0
        and math.isfinite(row["wer"])
    }
    if not scored:
        return FinalChoice(None, "the last step (no evaluation scored a trained step)")
    held = {
        step: wer
        for step, wer in scored.items()
        if guard is None
        or (
            (regression := guard_regression(evaluations, guard, step, guard_start)) is not None
            and regression <= max_regression
        )
    }
    if not held:
        return FinalChoice(
            max(scored),
            f"the last evaluated step: no evaluation stayed within {max_regression:g} points "
            f"of {guard} WER at its start (step {guard_start})",
        )
    allowed = {
        step: wer
        for step, wer in held.items()
        if _nonspeech_holds(evaluations, step, nonspeech_sets, max_nonspeech_rise)
    }
    if not allowed:
        return FinalChoice(
            max(scored),
            f"the last evaluated step: no evaluation stayed within {max_nonspeech_rise:g} "
            f"words per minute of its start on the non-speech set "
            f"{', '.join(map(repr, nonspeech_sets))}",
        )
    best = min(allowed, key=lambda step: (allowed[step], -step))
    reason = f"the lowest {primary_set} WER ({100 * allowed[best]:.2f}%) of {len(scored)} evaluated"
    reason += " steps" if len(scored) > 1 else " step"
    if guard is not None:
        reason += (
            f", guard set {guard!r} within {max_regression:g} points of its start "
            f"(step {guard_start})"
        )
    if nonspeech_sets:
        reason += (
            f", non-speech set {', '.join(map(repr, nonspeech_sets))} within "
            f"{max_nonspeech_rise:g} words per minute of its start"
        )
    return FinalChoice(best, reason)


def choose_with_average(
    evaluations: list[dict],
    averaged: list[dict],
    steps: tuple[int, ...],
    chosen: FinalChoice,
    *,
    primary_set: str,
    guard: str | None,
    max_regression: float | None,
    guard_start: int = 0,
    nonspeech_sets: Sequence[str] = (),
    max_nonspeech_rise: float = 0.0,
) -> FinalChoice:
    """`chosen` (the step `choose_final_step` chose), or the average of the checkpoints of
    `steps` (scored as `averaged`, a row per set) where it wins by the same rule: the lowest
    `primary_set` WER among the models whose guard stayed within `max_regression` points of
    its start and whose non-speech sets within `max_nonspeech_rise`, the chosen step winning a
    tie."""
    rows = [r for r in evaluations if r["step"] != _AVERAGE]
    rows += [{**row, "step": _AVERAGE} for row in averaged]
    best = choose_final_step(
        rows,
        primary_set=primary_set,
        guard=guard,
        max_regression=max_regression,
        guard_start=guard_start,
        nonspeech_sets=nonspeech_sets,
        max_nonspeech_rise=max_nonspeech_rise,
    )
    if best.step != _AVERAGE:
        return chosen
    wer = next(r["wer"] for r in averaged if r.get("set", primary_set) == primary_set)
    was = next(
        (r["wer"] for r in evaluations if r["step"] == chosen.step and r.get("set") == primary_set),
        None,
    )
    against = f" against step {chosen.step}'s {100 * was:.2f}%" if was is not None else ""
    reason = (
        f"the average of the checkpoints of steps {', '.join(map(str, steps))}: "
        f"{primary_set} WER {100 * wer:.2f}%{against}"
    )
    if guard is not None:
        reason += f", guard set {guard!r} within {max_regression:g} points of its start"
    return FinalChoice(steps[-1], reason, averaged=tuple(steps))


def save_final(
    model,
    processor,
    final_dir: Path,
    *,
    pin_language: bool,
    config_yaml: str,
    card: str | None = None,
) -> Path:
    """final/: a self-describing model folder (full weights with LoRA merged, processor, the
    run's whisper-train.yaml, its model card README.md), written by the one model-folder
    writer (atomically)."""
    if hasattr(model, "merge_and_unload"):  # peft: merge the adapters into full 32-bit weights
        model = model.merge_and_unload()
    model.config.use_cache = True  # inference default; training turned the cache off
    if not pin_language:
        # --language chose the training prefixes; the saved model detects each clip's language,
        # as the base did (transformers' pipeline, `transcribe`, exports), unless pinned.
        model.generation_config.language = None
    extra_files = {runfolder.CONFIG_FILE: config_yaml}
    if card is not None:
        extra_files[CARD_FILE] = card
    return save_model_folder(model, processor, final_dir, extra_files=extra_files)


def compare_with_baseline(
    base_model: str,
    final_dir: Path,
    examples: list[Example],
    output_dir: Path,
    *,
    language: str | None,
    task: str,
    batch_size: int,
    max_length: int,
    decoding: DecodingOptions,
    attn_implementation: str,
) -> None:
    """The starting model and the fine-tuned one on the same utterances (an evaluation set,
    decoded in `language`, else each clip's detected one): report.md / report.png."""
    reports = []
    normalizer = None  # the baseline's choice (`normalizer_for`), then the same for both
    for spec in (base_model, str(final_dir)):
        # One model at a time beside the training model: the first is freed before the second
        # loads (on a GPU sized for the run, two more full models may not fit).
        model = processor = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        model, processor = load_model(spec, attn_implementation=attn_implementation)
        if torch.cuda.is_available():
            model = model.to("cuda")
        configure_generation(
            model.generation_config,
            language=None,
            task=task,
            multilingual=is_multilingual(model),
        )
        reports.append(
            evaluate_examples(
                model,
                processor,
                examples,
                batch_size=batch_size,
                normalizer=normalizer,
                language=language,
                max_length=max_length,
                model_name=spec,
                decoding=decoding,
            )
        )
        normalizer = reports[-1].normalizer
    model = processor = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    before, after = reports
    json_file, baseline_file, markdown, png = (output_dir / n for n in runfolder.REPORT_FILES)
    write_report_json(after, json_file)
    write_report_json(before, baseline_file)
    write_comparison(before, after, markdown_path=markdown, png_path=png)
    tqdm.write(
        f"baseline WER {100 * before.wer:.2f}% -> fine-tuned {100 * after.wer:.2f}%; see {markdown}"
    )
