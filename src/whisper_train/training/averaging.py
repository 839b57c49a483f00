"""--average-checkpoints N: at the end of a run, the trained weights of N of its checkpoints
averaged (`average_weights`: all of them for full fine-tuning, the decoder's for
freeze-encoder, the adapters for LoRA, DoRA's magnitudes included), evaluated like a step, and
kept as final/ only where the judge says the average wins (`average_at_end`).

Which N (`--average-by`, `checkpoints_to_average`): the last N by default, as icefall's --avg
does; or the best N by the run's own rule, as ESPnet's valid.acc.ave (`final.ranked_steps`).
The last N are the default: the average is judged on the run's own evaluation sets, and
checkpoints chosen by their WER there are chosen twice by the same clips; the last N also need
no evaluation at every save, and rotation (`training.retention`) keeps the newest anyway.
"""

from __future__ import annotations

from pathlib import Path

import torch

from whisper_train.config.record import RunRecord
from whisper_train.errors import UserError
from whisper_train.formats.hf import nonfinite_names
from whisper_train.runlog import say
from whisper_train.training import checkpoints
from whisper_train.training.checkpoints.load import load_weights, read_weights
from whisper_train.training.final import FinalChoice, ranked_steps


def checkpoints_to_average(
    output_dir: Path, count: int, last_step: int, *, ranked: list[int] | None = None
) -> list[Path]:
    """The checkpoints of the run up to `last_step` to average, oldest first: the newest
    `count`, or with `ranked` (the evaluated steps best first: `final.ranked_steps`) the
    `count` best of those on disk (fewer where the run saved fewer)."""
    found = [
        folder
        for folder in checkpoints.list_checkpoints(output_dir)
        if checkpoints.checkpoint_step(folder) <= last_step
    ]
    if ranked is None:
        return found[-count:]
    by_step = {checkpoints.checkpoint_step(folder): folder for folder in found}
    best = [step for step in ranked if step in by_step][:count]
    return [by_step[step] for step in sorted(best)]


def average_weights(
    folders: list[Path], shapes: dict[str, tuple[int, ...]] | None = None
) -> dict[str, torch.Tensor]:
    """The mean of the trainable weights of checkpoints `folders`, by parameter name, in each
    weight's saved dtype. Summed in float32 (at least): N float32 weights averaged are within
    N units in the last place of their exact mean.

    Each checkpoint must hold finite weights of the same names and shapes as `shapes` (the
    model's trainable parameters; None: the newest checkpoint's, which the average is loaded
    with), or a UserError names it (`refuse_unaverageable`): one NaN makes the mean NaN, and a
    tensor of another shape cannot be added."""
    weights = [read_weights(folder) for folder in folders]
    if shapes is None:
        shapes = {name: tuple(weight.shape) for name, weight in weights[-1].items()}
    for folder, saved in zip(folders, weights, strict=True):
        refuse_unaverageable(folder, saved, shapes)
    sums: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for saved in weights:
        for name, weight in saved.items():
            if name not in sums:
                dtypes[name] = weight.dtype
                sums[name] = weight.to(torch.promote_types(weight.dtype, torch.float32)).clone()
            else:
                sums[name] += weight
    return {name: (total / len(folders)).to(dtypes[name]) for name, total in sums.items()}


def refuse_unaverageable(
    folder: Path, saved: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]
) -> None:
    """One line naming checkpoint `folder` where its weights `saved` cannot join an average:
    names or shapes other than `shapes`, or a NaN or infinite tensor (`nonfinite_names`, the
    check that loading a model makes)."""
    remedy = (
        "this checkpoint cannot be averaged; average others (--average-by, "
        "--average-checkpoints) or delete it"
    )
    if set(saved) != set(shapes):
        raise UserError(
            f"{folder}: its weights are not this model's ({len(saved)} tensors, the model "
            f"{len(shapes)} trainable): {remedy}"
        )
    for name, weight in saved.items():
        if tuple(weight.shape) != tuple(shapes[name]):
            raise UserError(
                f"{folder}: {name} has shape {tuple(weight.shape)}, the model "
                f"{tuple(shapes[name])}: {remedy}"
            )
    if blown := nonfinite_names(list(saved.items())):
        raise UserError(
            f"{folder}: {len(blown)} of {len(saved)} trained tensors hold NaN or infinite "
            f"values ({', '.join(blown[:2])}{', ...' if len(blown) > 2 else ''}): {remedy}"
        )


def average_at_end(
    *,
    record: RunRecord,
    output_dir: Path,
    last_step: int,
    chosen: FinalChoice,
    model,
    judge,
    accelerator,
) -> FinalChoice:
    """With --average-checkpoints N: N checkpoints' weights (--average-by) averaged into `model`,
    scored on every evaluation set (`judge.evaluate_average`), and the judge's choice between
    the average and `chosen` (the best single step). Where the average loses, `model` holds
    the last step's weights again, as it did before. Every process calls this."""
    count, by = record.output.average_checkpoints, record.output.average_by
    if not count:
        return chosen
    ranked = ranked_steps(judge.rows, judge.final_rule()) if by == "best" else None
    folders = checkpoints_to_average(output_dir, count, last_step, ranked=ranked)
    steps = tuple(checkpoints.checkpoint_step(folder) for folder in folders)
    if len(folders) < count or (ranked is None and steps[-1] != last_step):
        which = "evaluated checkpoint(s) that hold the run's rule" if ranked else "checkpoint(s)"
        say(
            accelerator,
            f"--average-checkpoints {count} --average-by {by}: the run ended with "
            f"{len(folders)} {which} (steps {', '.join(map(str, steps)) or 'none'}, the last "
            f"step {last_step}): nothing averaged",
        )
        return chosen
    try:
        averaged = average_weights(folders)
    except UserError as refused:  # the run's final/ is still to be written: keep its step
        say(accelerator, f"--average-checkpoints {count}: nothing averaged: {refused}")
        return chosen
    say(accelerator, f"averaging the checkpoints of steps {', '.join(map(str, steps))}")
    load_weights(folders[-1], accelerator=accelerator, model=model, weights=averaged)
    judge.evaluate_average(model, last_step, steps)
    choice = judge.choice_with_average(chosen, steps)
    if choice.averaged is None:
        say(
            accelerator,
            f"the average of steps {', '.join(map(str, steps))} does not beat step "
            f"{chosen.step if chosen.step is not None else last_step} by the run's rule "
            f"({chosen.reason}): final/ keeps that step",
        )
        last = output_dir / f"{checkpoints.PREFIX}{last_step}"
        load_weights(last, accelerator=accelerator, model=model)
    return choice


__all__ = [
    "average_at_end",
    "average_weights",
    "checkpoints_to_average",
    "refuse_unaverageable",
]
