"""`whisper-train average RUN_DIR`: a finished run's checkpoints averaged after the fact (the
last N, or the best N by the run's own rule), the average evaluated on the run's own
evaluation sets as its steps were (`judge.RunEvaluations`, the sets and loaders the run made
from its record), and written where asked, or put in final/ only where the run's rule says it
beats what final/ holds (`average_run`).

final/ is replaced whole (`formats.hf.save_model_folder`: the previous one is kept until the
new one is in place), then result.json; a kill between the two leaves final/ the average and
result.json the step, and running the command again writes the same average and result.json.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState

from whisper_train import memory, runfolder
from whisper_train.config.record import RunRecord
from whisper_train.config.resolve import SavedChoices
from whisper_train.config.run import RunConfig
from whisper_train.errors import UserError
from whisper_train.evaluation.scoring import get_normalizer
from whisper_train.files import check_output_path
from whisper_train.runlog import ProgressTable, TrainResult, read_result, say, write_result
from whisper_train.training import checkpoints, model_card
from whisper_train.training.averaging import average_weights, checkpoints_to_average
from whisper_train.training.checkpoints.load import load_weights
from whisper_train.training.datasets import Datasets, evaluation_loaders, language_targets
from whisper_train.training.final import FinalChoice, ranked_steps, save_final
from whisper_train.training.finish import full_precision_base
from whisper_train.training.judge import RunEvaluations, rule_of
from whisper_train.training.setup_phases import gather_facts


@dataclass
class AverageOutcome:
    """What `average_run` did: the steps averaged, its rows (a row per set), whether it beat
    final/ by the run's rule, and where the average was written (None: nowhere)."""

    steps: tuple[int, ...]
    rows: list[dict]
    wins: bool
    reason: str
    written: Path | None


@dataclass
class RunOutputs:
    """A finished run as the average is written beside it: its folder, record, result and
    sets (the model card's)."""

    run_dir: Path
    record: RunRecord
    result: TrainResult
    datasets: Datasets


class _NoLog:
    """The average's rows are result.json's (where final/ takes it), not metrics.jsonl's."""

    def write(self, row: dict) -> None:
        pass


def read_run(run_dir: Path) -> tuple[RunRecord, TrainResult]:
    """A finished run's record and result, or one line saying what `run_dir` is not."""
    config_file, result_file = run_dir / runfolder.CONFIG_FILE, run_dir / runfolder.RESULT_FILE
    if not run_dir.is_dir() or not config_file.is_file() or not result_file.is_file():
        raise UserError(
            f"{run_dir}: not a finished whisper-train run (no {runfolder.CONFIG_FILE} and "
            f"{runfolder.RESULT_FILE}): give the --output-dir of a train run that finished"
        )
    try:
        record = RunRecord.from_yaml(config_file.read_text(encoding="utf-8"))
        result = read_result(run_dir)
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(
            f"{run_dir}: its {runfolder.CONFIG_FILE} or {runfolder.RESULT_FILE} is damaged "
            f"({exc}); average the run's checkpoints by hand or train it again"
        ) from None
    if record is None:
        raise UserError(
            f"{run_dir}: written by a whisper-train that kept no record of its decisions; "
            "train it again with this version to average its checkpoints"
        )
    return record, result


def pick_checkpoints(
    run_dir: Path, record: RunRecord, result: TrainResult, *, count: int, by: str
) -> list[Path]:
    """The `count` checkpoints to average (`by` "last" or "best"), each intact, or one line
    naming what is missing or damaged and what to do."""
    single = [row for row in result.evaluations if not row.get("averaged")]
    rule = rule_of(record.evaluation, (result.guard_start or {}).get("step", 0))
    ranked = ranked_steps(single, rule) if by == "best" else None
    folders = checkpoints_to_average(run_dir, count, result.steps, ranked=ranked)
    if len(folders) < count:
        steps = ", ".join(str(checkpoints.checkpoint_step(f)) for f in folders) or "none"
        which = "evaluated checkpoints that hold the run's rule" if ranked is not None else ""
        raise UserError(
            f"{run_dir}: {len(folders)} {which or 'checkpoints'} (steps {steps}), fewer than "
            f"--average-checkpoints {count}: average fewer, or train with --save-steps and "
            "--save-total-limit that keep as many"
        )
    for folder in folders:
        damage = checkpoints.find_damage(folder)
        if damage is not None:
            raise UserError(
                f"{folder}: {damage}: this checkpoint cannot be averaged; average others "
                "(--average-by, --average-checkpoints) or delete it"
            )
    return folders


def average_run(
    run_dir: Path, *, count: int | None = None, by: str | None = None, output: Path | None = None
) -> AverageOutcome:
    """Average `count` checkpoints of finished run `run_dir` (`by` "last" or "best"; None:
    the run's own --average-checkpoints and --average-by), score the average on the run's
    evaluation sets, and write it to `output` (a new model folder), or with no `output`
    replace final/ (and result.json, the model card) where it wins by the run's rule. One
    line says which.

    Holds the run folder's lock (`runfolder.RunLock`, the one `train` holds) throughout: a
    `train --resume` in the folder would rotate the checkpoints being read and write final/
    and result.json over the average's (or the average over its)."""
    run_dir = Path(run_dir)
    read_run(run_dir)  # not a run: refused before a lock file is made in the folder
    lock = runfolder.RunLock(
        run_dir, named="average", remedy="wait for it to end or stop it, then average again"
    )
    with lock:
        return _average_run(run_dir, count=count, by=by, output=output)


def _average_run(
    run_dir: Path, *, count: int | None, by: str | None, output: Path | None
) -> AverageOutcome:
    if output is not None:
        check_output_path(output, "--output", folder=True)
        if Path(output).exists() and any(Path(output).iterdir()):
            raise UserError(f"--output {output}: not empty; choose a new folder")
    record, result = read_run(run_dir)
    count = count or record.output.average_checkpoints
    by = by or record.output.average_by
    if count is None or count < 2:
        raise UserError(
            f"{run_dir}: --average-checkpoints {count or 'N'}: give 2 or more checkpoints to "
            "average" + ("" if count else " (the run averaged none)")
        )
    folders = pick_checkpoints(run_dir, record, result, count=count, by=by)
    steps = tuple(checkpoints.checkpoint_step(folder) for folder in folders)
    config = RunConfig()
    config.update({**record.asked, "resume": None})
    # The model (with any language the run added) and its sets, as the run gathered them.
    facts = gather_facts(
        config,
        process=PartialState(),
        saved=SavedChoices.of(record),
    )
    model, processor, datasets = facts.model, facts.processor, facts.datasets
    label_encoder = facts.label_encoder
    m = record.model
    model = memory.prepare_model(model, mode=m.mode, checkpointing="off", lora=m.lora)
    AcceleratorState._reset_state(reset_partial_state=False)
    precision = memory.resolve_precision(record.memory.precision, PartialState().device)
    accelerator = Accelerator(mixed_precision=precision.mixed_precision)
    model = model.to(accelerator.device)
    # Checked against the model: a checkpoint of another shape or with a NaN is named in one
    # line before anything is evaluated or written (final/ is never replaced with one).
    trainable = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    averaged = average_weights(folders, trainable)
    load_weights(folders[-1], accelerator=accelerator, model=model, weights=averaged)
    multilingual = facts.multilingual
    loaders, languages = evaluation_loaders(
        record,
        processor=processor,
        label_encoder=label_encoder,
        datasets=datasets,
        encoder_cache=None,
        accelerator=accelerator,
        targets=language_targets(record, model),
    )
    judge = RunEvaluations(
        record.evaluation,
        loaders=loaders,
        languages=languages if multilingual else dict.fromkeys(languages),
        processor=processor,
        normalizer=None if multilingual else get_normalizer("english"),
        accelerator=accelerator,
        metrics=_NoLog(),
        table=ProgressTable(True, record.evaluation.primary),
        rows=[row for row in result.evaluations if not row.get("averaged")],
        guard_start=result.guard_start,
    )
    say(accelerator, f"averaging the checkpoints of steps {', '.join(map(str, steps))}")
    rows = judge.evaluate_average(model, steps[-1], steps)
    held = _final_candidate(judge, result)
    choice = judge.choice_with_average(held, steps)
    wins = choice.averaged == steps
    run = RunOutputs(run_dir, record, result, datasets)
    if output is not None:
        written = _save(
            model, processor, Path(output), run=run, choice=choice, rows=rows, final=False
        )
        verdict = "beats" if wins else "does not beat"
        say(
            accelerator,
            f"{written}: the average of steps {', '.join(map(str, steps))}; it {verdict} "
            f"final/ by the run's rule ({choice.reason if wins else held.reason}): final/ "
            "unchanged",
        )
    elif wins:
        final_dir = run_dir / runfolder.FINAL_DIR
        written = _save(model, processor, final_dir, run=run, choice=choice, rows=rows, final=True)
        say(accelerator, f"final/: replaced by {choice.reason}")
    else:
        written = None
        say(
            accelerator,
            f"final/ kept: the average of steps {', '.join(map(str, steps))} does not beat it "
            f"by the run's rule ({held.reason}); --output DIR writes the average anyway",
        )
    return AverageOutcome(steps, rows, wins, choice.reason, written)


def _final_candidate(judge: RunEvaluations, result: TrainResult) -> FinalChoice:
    """What final/ holds, as a candidate of the run's rule: its step, or the average it holds
    already (its rows, as a step after every trained one: it keeps a tie)."""
    held = FinalChoice(result.final_step, result.final_reason)
    if result.final_averaged:
        step = max(row["step"] for row in judge.rows) + 1
        judge.rows += [
            {**row, "step": step}
            for row in result.evaluations
            if row.get("averaged") == result.final_averaged
        ]
        held = FinalChoice(step, result.final_reason)
    return held


def _save(model, processor, folder: Path, *, run: RunOutputs, choice, rows, final: bool) -> Path:
    """The average as a model folder at `folder` with its model card; as the run's `final`
    model, result.json too (after final/: see the module's note)."""
    record, result = run.record, run.result
    steps = ", ".join(map(str, rows[0]["averaged"]))
    reason = choice.reason
    if not choice.averaged:  # written where asked, though it does not beat the run's final/
        reason = (
            f"the average of the checkpoints of steps {steps}, which does not beat the run's "
            f"final/ by its rule ({choice.reason})"
        )
    updated = replace(
        result,
        output_dir=run.run_dir,
        final_step=rows[0]["step"],
        final_reason=reason,
        final_averaged=list(rows[0]["averaged"]),
        evaluations=[r for r in result.evaluations if not r.get("averaged")] + rows,
    )
    written = save_final(
        full_precision_base(model, record.model),
        processor,
        folder,
        pin_language=record.data.pin_language,
        config_yaml=record.to_yaml(),
        card=model_card.run_card(record, updated, run.datasets.train),
    )
    if final:
        updated.final_dir = written
        write_result(updated)
    return written


__all__ = ["AverageOutcome", "average_run", "pick_checkpoints", "read_run"]
