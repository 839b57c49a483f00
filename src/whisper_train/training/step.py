"""One optimizer step's arithmetic and checks, apart from the recipe's state: how each
micro-batch's loss is weighted (`step_loss_weights`), what a step did (`OptimizerStep`), whether
an update left weights NaN or infinite (`nonfinite_tensors`), and when steps go bad, the errors
that stop the run (`refuse_nonfinite_update`, `too_many_bad_steps`) with the learning rate and
the checkpoint to continue from that they suggest (`lower_learning_rate_advice`)."""

from __future__ import annotations

import collections
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

from whisper_train import runfolder
from whisper_train.config.options import default_learning_rate
from whisper_train.config.record import RunRecord
from whisper_train.data.collate import IGNORE_INDEX
from whisper_train.errors import UserError
from whisper_train.runlog import resume_command
from whisper_train.training import checkpoints


@dataclass
class OptimizerStep:
    """What one optimizer step did: its loss (mean over its micro-batches) and gradient norm,
    and whether it was skipped for a NaN or infinite loss or gradient."""

    loss: float
    grad_norm: float
    skipped: bool


def step_loss_weights(micro_batches: list[dict], accelerator) -> tuple[list[float], float]:
    """(weight of each micro-batch's token-mean loss, label tokens of the whole step).

    A step's loss is the token mean over all its micro-batches on all processes: micro-batch
    m's weight is its label tokens over the step's, summed over the processes with one
    all-reduce (every process calls this once a step, whatever its data). Weighted so, the
    micro-batches' gradients add up to the gradient one process computes on the whole global
    batch at once, however the tokens are spread over micro-batches and processes; with
    --preserve-base the KL term is a token mean too, so the same weights hold.
    """
    counts = [
        float((batch["labels"] != IGNORE_INDEX).sum()) if batch["size"] else 0.0
        for batch in micro_batches
    ]
    total = sum(counts)
    if accelerator.num_processes > 1:
        local = torch.tensor([total], device=accelerator.device, dtype=torch.float64)
        total = float(accelerator.reduce(local, reduction="sum").item())
    return [n / total if total else 0.0 for n in counts], total


# The step's loss is summed in float64, as the host did before it stayed on the device; Apple's
# MPS has no float64.
LOSS_SUM_DTYPE = collections.defaultdict(lambda: torch.float64, mps=torch.float32)


def read_loss_and_norm(loss_sum: torch.Tensor, norm) -> tuple[float, float]:
    """The step's summed loss and gradient norm as floats: the step's one wait for the device
    before its update (whether to apply it depends on both being finite).

    One read instead of one per micro-batch plus one for the norm: each read stops the host
    until the device has run everything queued, and the device then idles while the host
    queues the next kernels (on an H200, whisper-small at batch 16 spent ~45% of its loop so,
    BENCHMARKS.md "Where an unpacked step goes"). A DTensor norm (sharded gradients, --fsdp) is
    made whole first: a collective, which every process runs."""
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if not torch.is_tensor(norm):  # accelerate returns a float where no parameter has a grad
        return float(loss_sum), float(norm)
    both = torch.stack([loss_sum.reshape(()), norm.detach().reshape(()).to(loss_sum)])
    loss_value, norm_value = both.tolist()
    return loss_value, norm_value


def nonfinite_tensors(parameters: list[torch.Tensor], accelerator) -> list[bool]:
    """Which of `parameters` hold a NaN or an infinity: the same answer on every process.

    One fused kernel (the norm of each tensor, `_foreach_norm`: NaN or infinite when the tensor
    holds one, or when it is so large that its norm leaves float32's range, which no trained
    weight comes near), then one host sync. With several processes the flags are all-reduced
    (under --fsdp each process holds a shard of each tensor), so every process takes the same
    decision; every process must call this, with the same parameters in the same order.
    Measured on this project's 2-core CPU (load 9-11, other jobs running, one thread): 2-3 ms
    per check for the tests' tiny model (3.6M parameters; its step ~0.9 s at batch 4), 45-58 ms
    for tiny.en trained in full (38M; its step 10-11 s at batch 4 x 30 s): under 0.6%. The
    max-abs (ord inf) took 29 and 388 ms there; no GPU was measured.
    """
    local = [p.to_local() if hasattr(p, "to_local") else p for p in parameters]  # DTensor shards
    flags = torch.zeros(max(1, len(local)), device=accelerator.device)  # never an empty reduce
    filled = [i for i, tensor in enumerate(local) if tensor.numel()]  # a shard may be empty
    if filled:
        norms = torch._foreach_norm([local[i].detach() for i in filled], 2)
        flags[filled] = (~torch.isfinite(torch.stack(norms))).float().to(flags.device)
    if accelerator.num_processes > 1:
        flags = accelerator.reduce(flags, reduction="sum")
    return (flags > 0).tolist()[: len(local)]


def lower_learning_rate(rate: float, default: float) -> float:
    """A learning rate to suggest after updates blew up: the run's default (`default`) when
    `rate` is above it, else a tenth of `rate`."""
    return default if rate > default else rate / 10


# -- when updates go bad: the refusals and their advice ------------------------------------


def refuse_nonfinite_update(
    model: torch.nn.Module, accelerator, step: int, record: RunRecord, output_dir: Path
) -> None:
    """Stop at `step` when its applied update made a trained weight NaN or infinite.

    An update can do that with a finite loss and gradient (a learning rate far too high); no
    later step can undo it, and every later loss is NaN. Stopping at once means no checkpoint
    holds such weights, and the advice names one that is finite. One fused kernel and, with
    several processes, one small all-reduce (`nonfinite_tensors`, which every process calls).
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    if blown := sum(nonfinite_tensors(trainable, accelerator)):
        raise UserError(
            f"stopped at step {step}: its update made {blown} of {len(trainable)} "
            "trained tensors NaN or infinite (its loss and gradient were finite: "
            f"--learning-rate {record.training.learning_rate:g} is far too high); nothing "
            f"was saved from it. {lower_learning_rate_advice(record, output_dir, step)}"
        )


def too_many_bad_steps(
    step: int,
    bad_steps_in_a_row: int,
    folder: Path,
    *,
    precision: str,
    record: RunRecord,
    output_dir: Path,
) -> UserError:
    """The error that stops a run after `bad_steps_in_a_row` skipped steps, `folder` the
    checkpoint just saved with the weights of the last good step, G.

    They are finite (checked after every update) but gave only NaN or infinite steps since,
    so resuming from them needs another precision (fp16 overflows where bf16 does not); with a
    lower learning rate, resume from before G's update, which may be what broke them."""
    last_good = step - bad_steps_in_a_row
    fp16 = ""
    if precision == "fp16":  # only ever on CUDA (`resolve_precision`)
        command = resume_command(output_dir / runfolder.CONFIG_FILE, folder)
        wider = "bf16" if torch.cuda.is_bf16_supported() else "fp32"
        fp16 = f"With fp16 this is usually overflow: {command} --precision {wider}. Else "
    return UserError(
        f"stopped at step {step}: {bad_steps_in_a_row} optimizer steps in a "
        "row had a NaN or infinite loss or gradient and were skipped; "
        f"{folder} holds the weights from before them (finite, but they gave only "
        f"those steps). {fp16}{lower_learning_rate_advice(record, output_dir, last_good)}"
    )


def lower_learning_rate_advice(record: RunRecord, output_dir: Path, suspect_step: int) -> str:
    """The command that continues with a lower learning rate from the newest checkpoint
    saved before `suspect_step` (whose update may have broken the weights), or that starts
    again when there is none. Every checkpoint holds finite weights (`refuse_nonfinite_update`
    runs after every update); one whose trainer_state.json cannot be read is not named."""
    default = default_learning_rate(record.model.mode, record.model.width)
    lower = lower_learning_rate(record.training.learning_rate, default)
    config_file = output_dir / runfolder.CONFIG_FILE
    earlier = [
        folder
        for folder in checkpoints.list_checkpoints(output_dir)
        if (step := _saved_step(folder)) is not None and step < suspect_step
    ]
    if earlier:
        command = resume_command(config_file, earlier[-1])
        return (
            f"Continue from {earlier[-1].name} (finite weights, saved before step "
            f"{suspect_step}) with a lower learning rate: {command} --learning-rate {lower:g}"
        )
    command = f"whisper-train train --config {shlex.quote(str(config_file))}"
    return (
        f"No checkpoint from before step {suspect_step} is kept: train again with a lower "
        f"learning rate: {command} --learning-rate {lower:g} --overwrite"
    )


def _saved_step(folder: Path) -> int | None:
    """A checkpoint's step from its trainer_state.json; None when that file is damaged (the
    advice then names another checkpoint, or none)."""
    try:
        return checkpoints.TrainerState.read(folder).step
    except (OSError, ValueError, TypeError, UnicodeDecodeError):
        return None
