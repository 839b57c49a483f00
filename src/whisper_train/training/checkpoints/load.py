"""Reading a checkpoint back: finding what is damaged cheaply before anything loads
(`find_damage`), the record and options it was saved with (`saved_record`), and loading it
(`load_checkpoint`, `load_weights`, `read_stream_position`), every failure one line naming the
file and the checkpoint to use instead (`earlier_advice`).

Loading never runs code from the checkpoint: weights come from safetensors, and every `.pt` file
is read with `torch.load(..., weights_only=True)`.
"""

from __future__ import annotations

import json
import random
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from whisper_train.config import read_yaml
from whisper_train.config.record import RunRecord
from whisper_train.errors import UserError, last_line, unpickling_refusal
from whisper_train.runfolder import CONFIG_FILE
from whisper_train.training.checkpoints.find import earlier_advice
from whisper_train.training.checkpoints.format import (
    SHARDED_DIR,
    STATE_FILE,
    STREAM_FILE,
    WEIGHTS_FILE,
    TrainerState,
)
from whisper_train.training.checkpoints.state_dicts import shard_options, sharded, torch_optimizer


def saved_record(folder: Path) -> tuple[RunRecord | None, dict]:
    """(the record checkpoint `folder` was saved with, its options as asked): the record is None
    for a checkpoint of a whisper-train that kept none (its options then stand in for it)."""
    saved_file = folder / CONFIG_FILE
    if not saved_file.is_file():
        return None, {}
    text = saved_file.read_text(encoding="utf-8")
    try:
        record = RunRecord.from_yaml(text)
        # Read as --config reads it (YAML 1.2 booleans): a plain `packing: on` is "on".
        options = read_yaml(text) or {}
    except (ValueError, TypeError, yaml.YAMLError) as exc:
        raise UserError(
            f"--resume {folder}: its {CONFIG_FILE} is damaged ({exc}); {earlier_advice(folder)}"
        ) from None
    return record, options if isinstance(options, dict) else {}


# -- loading -------------------------------------------------------------------------------


def load_checkpoint(folder: Path, *, accelerator, model, optimizer, scheduler) -> TrainerState:
    """Restore weights, optimiser, scheduler, scaler and this process's random state, as the
    checkpoint holds them (what a resume then lets change is `resume.restore_from`'s).

    Call after `accelerator.prepare` and after all other set-up, right before the loop: the
    random state is restored last, so set-up that draws random numbers (LoRA initialisation)
    does not shift it.
    """
    with _loading(folder / STATE_FILE):
        state = TrainerState.read(folder)
    same_processes = state.world_size == accelerator.num_processes
    # Another number of processes is the record's to allow (`config.record.resume_changes`);
    # a checkpoint saved before records were kept has no clips a step to continue on them.
    if not same_processes and saved_record(folder)[0] is None:
        raise UserError(
            f"--resume {folder}: saved by {state.world_size} process(es) of an earlier "
            f"whisper-train, this run has {accelerator.num_processes}; resume with --nproc "
            f"{state.world_size}"
        )
    with _loading(folder / "scheduler.pt"):
        saved_schedule = _load_pt(folder / "scheduler.pt")
    groups = len(optimizer.param_groups)
    _check_rate_groups(folder, len(saved_schedule.get("base_lrs", [None] * groups)), groups)
    if sharded(model):
        _load_shards(folder, model, optimizer)
    else:
        _load_weights(folder, accelerator.unwrap_model(model, keep_torch_compile=False))
        with _loading(folder / "optimizer.pt"):
            optimizer.load_state_dict(_load_pt(folder / "optimizer.pt"))
    with _loading(folder / "scheduler.pt"):
        scheduler.load_state_dict(saved_schedule)
    if accelerator.scaler is not None and (folder / "scaler.pt").is_file():
        with _loading(folder / "scaler.pt"):
            accelerator.scaler.load_state_dict(_load_pt(folder / "scaler.pt"))
    # On as many processes, each continues its own random state. On another number, each
    # takes process 0's: the same state on every process, as `set_seed` starts a run. What a
    # step trains does not draw from it (the data's order, augmentation and prompts are seeded
    # by (seed, epoch, clip)), so the run continues exactly where the model draws nothing
    # either; with dropout, layerdrop, LoRA dropout or SpecAugment on, its masks after the
    # resume are other draws (no run on another process count draws the same ones anyway:
    # each process draws for its own clips).
    rank = accelerator.process_index if same_processes else 0
    rng_file = folder / f"rng-{rank}.pt"
    with _loading(rng_file):
        _set_rng_state(_load_pt(rng_file))
    return state


def _check_rate_groups(folder: Path, saved: int, groups: int) -> None:
    """The checkpoint's optimizer must hold this run's parameter groups (a record says so
    first: `config.record`); a record-less checkpoint's are counted here. The encoder has
    groups of its own where its rate differs from the rest's (--encoder-lr-scale not 1)."""
    if saved == groups:
        return
    raise UserError(
        f"--resume {folder}: the checkpoint's optimizer has {saved} learning-rate groups and "
        f"this run's {groups}: it gave the encoder "
        f"{'one rate with the rest' if saved < groups else 'a rate of its own'}; "
        "resume with the --encoder-lr-scale it trained with "
        f"({'1' if saved < groups else 'not 1'})"
    )


@contextmanager
def _loading(path: Path):
    """A failure to read or apply `path` of a checkpoint, as one line naming it (UserError):
    what `find_damage` cannot see (bytes changed in place) shows only here."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        raise UserError(
            f"--resume {path.parent}: {path.name} could not be loaded ({_load_error(exc)}): "
            f"the file is damaged or not this run's; {earlier_advice(path.parent)}"
        ) from None


def _load_error(error: BaseException) -> str:
    """The line of a loading error that says what went wrong: torch.load's refusal of a
    pickled object (weights_only) puts it in the middle of advice to load it unsafely."""
    return unpickling_refusal(error) or last_line(error)


def read_stream_position(folder: Path, rank: int) -> dict:
    """Process `rank`'s saved place in a streamed --data (see `save_checkpoint`)."""
    path = folder / STREAM_FILE.format(rank=rank)
    if not path.is_file():
        raise UserError(
            f"--resume {folder}: no {path.name}: it was saved by a run that did not stream its "
            "--data; resume with the --data that run used"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def load_weights(folder: Path, *, accelerator, model, weights: dict | None = None) -> None:
    """Only the trained weights of checkpoint `folder` into `model` (the best step's, at the end
    of a run), or `weights` in their place (`training.averaging`'s average, of checkpoints of
    which `folder` is one); optimiser, scheduler and random state are left as they are."""
    if sharded(model):
        _load_shards(folder, model, None)
    else:
        _load_weights(folder, accelerator.unwrap_model(model, keep_torch_compile=False), weights)


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Checkpoint `folder`'s trainable weights by parameter name (a checkpoint saved without
    --fsdp: sharded/ is read only into a sharded model)."""
    with _loading(folder / WEIGHTS_FILE):
        return load_file(folder / WEIGHTS_FILE)


def _load_weights(folder: Path, model: torch.nn.Module, saved: dict | None = None) -> None:
    if saved is None:
        saved = read_weights(folder)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(saved) != set(trainable):
        raise UserError(
            f"--resume {folder}: its weights do not match this model ({len(saved)} saved, "
            f"{len(trainable)} trainable tensors); resume with the same --model, --mode, "
            "--lora-* and --cache-encoder options (LoRA with the cache adapts the decoder only)"
        )
    with torch.no_grad():
        for name, param in trainable.items():
            if saved[name].shape != param.shape:
                raise UserError(
                    f"--resume {folder}: {name} has shape {tuple(saved[name].shape)}, "
                    f"the model {tuple(param.shape)}; resume with the same --model"
                )
            param.copy_(saved[name])


def _load_pt(path: Path):  # inside `_loading(path)`: its failures are one line
    if not path.is_file():
        raise UserError(
            f"--resume {path.parent}: {path.name} is missing; the checkpoint is incomplete"
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def _load_shards(folder: Path, model, optimizer) -> None:
    """Read `folder`'s sharded/ back into this process's shards of `model` and, when given,
    `optimizer` (a collective)."""
    if not (folder / SHARDED_DIR).is_dir():
        raise UserError(
            f"--resume {folder}: no {SHARDED_DIR}/ folder: it was saved without --fsdp; "
            "resume without --fsdp"
        )
    options = shard_options()
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=options)}
        with _loading(folder / SHARDED_DIR):
            dcp.load(state, checkpoint_id=str(folder / SHARDED_DIR))
        set_model_state_dict(model, state["model"], options=shard_options(loading=True))
        return
    inner = torch_optimizer(optimizer)
    weights, optimizer_state = get_state_dict(model, inner, options=options)
    state = {"model": weights, "optimizer": optimizer_state}
    with _loading(folder / SHARDED_DIR):
        dcp.load(state, checkpoint_id=str(folder / SHARDED_DIR))
    set_state_dict(
        model,
        inner,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=shard_options(loading=True),
    )


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
