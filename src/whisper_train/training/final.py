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


@dataclass(frozen=True)
class FinalRule:
    """What a model must hold to go to final/, said once so that a step and an average of
    checkpoints are judged alike (`judge.RunEvaluations.final_rule`): the lowest WER on
    `primary_set` among the models whose guard WER was measured and stayed within
    `max_regression` points of its start (`guard_start`), and whose words per minute on each
    of `nonspeech_sets` stayed within `max_nonspeech_rise` of that set's start."""

    primary_set: str
    guard: str | None = None
    max_regression: float | None = None
    guard_start: int = 0
    nonspeech_sets: Sequence[str] = ()
    max_nonspeech_rise: float = 0.0


def _scored_steps(evaluations: list[dict], rule: FinalRule) -> dict[int, float]:
    """The primary set's WER at each trained step (not step 0) it was scored at."""
    primary = rule.primary_set
    return {
        row["step"]: row["wer"]
        for row in evaluations
        if row.get("set", primary) == primary and row["step"] > 0 and math.isfinite(row["wer"])
    }


def _holds_guard(evaluations: list[dict], step: int, rule: FinalRule) -> bool:
    if rule.guard is None:
        return True
    regression = guard_regression(evaluations, rule.guard, step, rule.guard_start)
    return regression is not None and regression <= rule.max_regression


def ranked_steps(evaluations: list[dict], rule: FinalRule) -> list[int]:
    """The evaluated steps that hold `rule`, best first: lowest WER, the later step on a tie
    (`--average-by best` averages the first N)."""
    allowed = {
        step: wer
        for step, wer in _scored_steps(evaluations, rule).items()
        if _holds_guard(evaluations, step, rule)
        and _nonspeech_holds(evaluations, step, rule.nonspeech_sets, rule.max_nonspeech_rise)
    }
    return sorted(allowed, key=lambda step: (allowed[step], -step))


def choose_final_step(evaluations: list[dict], rule: FinalRule) -> FinalChoice:
    """The evaluated step whose model final/ holds, as `load_best_model_at_end` users expect:
    the best of `ranked_steps` by `rule`. Without evaluations: the last step. If no step
    holds: the last one, and the reason says so."""
    scored = _scored_steps(evaluations, rule)
    if not scored:
        return FinalChoice(None, "the last step (no evaluation scored a trained step)")
    if not any(_holds_guard(evaluations, step, rule) for step in scored):
        return FinalChoice(
            max(scored),
            f"the last evaluated step: no evaluation stayed within {rule.max_regression:g} "
            f"points of {rule.guard} WER at its start (step {rule.guard_start})",
        )
    ranked = ranked_steps(evaluations, rule)
    if not ranked:
        return FinalChoice(
            max(scored),
            f"the last evaluated step: no evaluation stayed within {rule.max_nonspeech_rise:g} "
            f"words per minute of its start on the non-speech set "
            f"{', '.join(map(repr, rule.nonspeech_sets))}",
        )
    best = ranked[0]
    reason = (
        f"the lowest {rule.primary_set} WER ({100 * scored[best]:.2f}%) of {len(scored)} evaluated"
    )
    reason += " steps" if len(scored) > 1 else " step"
    if rule.guard is not None:
        reason += (
            f", guard set {rule.guard!r} within {rule.max_regression:g} points of its start "
            f"(step {rule.guard_start})"
        )
    if rule.nonspeech_sets:
        reason += (
            f", non-speech set {', '.join(map(repr, rule.nonspeech_sets))} within "
            f"{rule.max_nonspeech_rise:g} words per minute of its start"
        )
    return FinalChoice(best, reason)


def choose_with_average(
    evaluations: list[dict],
    averaged: list[dict],
    steps: tuple[int, ...],
    chosen: FinalChoice,
    rule: FinalRule,
) -> FinalChoice:
    """`chosen` (the step `choose_final_step` chose), or the average of the checkpoints of
    `steps` (scored as `averaged`, a row per set) where it wins by the same `rule`, the
    chosen step winning a tie."""
    rows = [r for r in evaluations if r["step"] != _AVERAGE]
    rows += [{**row, "step": _AVERAGE} for row in averaged]
    if choose_final_step(rows, rule).step != _AVERAGE:
        return chosen
    primary = rule.primary_set
    wer = next(r["wer"] for r in averaged if r.get("set", primary) == primary)
    was = next(
        (r["wer"] for r in evaluations if r["step"] == chosen.step and r.get("set") == primary),
        None,
    )
    against = f" against step {chosen.step}'s {100 * was:.2f}%" if was is not None else ""
    reason = (
        f"the average of the checkpoints of steps {', '.join(map(str, steps))}: "
        f"{primary} WER {100 * wer:.2f}%{against}"
    )
    if rule.guard is not None:
        reason += f", guard set {rule.guard!r} within {rule.max_regression:g} points of its start"
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
