"""--average-checkpoints N: at the end of a run, the trained weights of its last N checkpoints
averaged (`average_weights`: all of them for full fine-tuning, the decoder's for
freeze-encoder, the adapters for LoRA, DoRA's magnitudes included), evaluated like a step, and
kept as final/ only where the judge says the average wins (`average_at_end`).

The last N, as icefall's --avg does, not the best N by WER as ESPnet's valid.acc.ave: the
average is judged on the run's own evaluation sets, and checkpoints chosen by their WER there
would be chosen twice by the same clips; the last N also need no evaluation at every save, and
rotation (`training.retention`) keeps the newest --save-total-limit anyway.
"""

from __future__ import annotations

from pathlib import Path

import torch

from whisper_train.config.record import RunRecord
from whisper_train.runlog import say
from whisper_train.training import checkpoints
from whisper_train.training.checkpoints.load import load_weights, read_weights
from whisper_train.training.final import FinalChoice


def checkpoints_to_average(output_dir: Path, count: int, last_step: int) -> list[Path]:
    """The newest `count` checkpoints of the run up to `last_step`, oldest first (fewer where
    the run saved fewer)."""
    found = [
        folder
        for folder in checkpoints.list_checkpoints(output_dir)
        if checkpoints.checkpoint_step(folder) <= last_step
    ]
    return found[-count:]


def average_weights(folders: list[Path]) -> dict[str, torch.Tensor]:
    """The mean of the trainable weights of checkpoints `folders`, by parameter name, in each
    weight's saved dtype. Summed in float32 (at least): N float32 weights averaged are within
    N units in the last place of their exact mean."""
    sums: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for folder in folders:
        for name, weight in read_weights(folder).items():
            if name not in sums:
                dtypes[name] = weight.dtype
                sums[name] = weight.to(torch.promote_types(weight.dtype, torch.float32)).clone()
            else:
                sums[name] += weight
    return {name: (total / len(folders)).to(dtypes[name]) for name, total in sums.items()}


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
    """With --average-checkpoints N: the last N checkpoints' weights averaged into `model`,
    scored on every evaluation set (`judge.evaluate_average`), and the judge's choice between
    the average and `chosen` (the best single step). Where the average loses, `model` holds
    the last step's weights again, as it did before. Every process calls this."""
    count = record.output.average_checkpoints
    if not count:
        return chosen
    folders = checkpoints_to_average(output_dir, count, last_step)
    steps = tuple(checkpoints.checkpoint_step(folder) for folder in folders)
    if len(folders) < count or steps[-1] != last_step:
        say(
            accelerator,
            f"--average-checkpoints {count}: the run ended with {len(folders)} checkpoint(s) "
            f"(steps {', '.join(map(str, steps)) or 'none'}, the last step {last_step}): "
            "nothing averaged",
        )
        return chosen
    say(accelerator, f"averaging the checkpoints of steps {', '.join(map(str, steps))}")
    averaged = average_weights(folders)
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
        load_weights(folders[-1], accelerator=accelerator, model=model)
    return choice


__all__ = ["average_at_end", "average_weights", "checkpoints_to_average"]
