"""Writing a checkpoint atomically: every file into `checkpoint-<step>.tmp/`, the manifest
last, then one rename; a failure on any process is every process's, said in one line, and the
previous checkpoints stay as they were."""

from __future__ import annotations

import errno
import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from accelerate.utils import gather_object
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict

from whisper_train.errors import UserError, last_line
from whisper_train.runfolder import CONFIG_FILE
from whisper_train.training.checkpoints.format import (
    MANIFEST_FILE,
    SHARDED_DIR,
    STREAM_FILE,
    WEIGHTS_FILE,
    TrainerState,
    list_checkpoints,
)
from whisper_train.training.checkpoints.state_dicts import (
    estimate_checkpoint_bytes,
    shard_options,
    sharded,
    torch_optimizer,
)
from whisper_train.units import format_bytes


def save_checkpoint(
    folder: Path,
    *,
    accelerator,
    model,
    optimizer,
    scheduler,
    state: TrainerState,
    config_yaml: str,
    stream_position: dict | None = None,
) -> Path:
    """Write `folder` (OUTPUT/checkpoint-<step>) atomically. Every process must call this;
    `stream_position` is this process's place in a streamed --data.

    Raises UserError (on every process) when any process could not write; the previous
    checkpoints are left as they were.
    """
    tmp = folder.with_name(folder.name + ".tmp")
    main = accelerator.is_main_process
    needed = estimate_checkpoint_bytes(model)
    # Any exception counts (torch.save raises RuntimeError on a full disk, not OSError): every
    # process must reach the agreement below, or the others would wait there for ever.
    error = None
    if main:
        try:
            _remove(tmp)
            tmp.mkdir(parents=True)
        except Exception as exc:
            error = exc
    accelerator.wait_for_everyone()
    if error is None and tmp.is_dir():
        try:
            _write_contents(tmp, accelerator, model, optimizer, scheduler, state, config_yaml)
            if stream_position is not None:
                name = STREAM_FILE.format(rank=accelerator.process_index)
                (tmp / name).write_text(json.dumps(stream_position) + "\n", encoding="utf-8")
        except Exception as exc:  # disk full, quota, permissions, a serialiser's RuntimeError
            error = exc
    elif error is None:
        error = OSError(f"{tmp} was not created")
    failure = _agree_on_failure(accelerator, error, folder, needed)
    if failure is None and main:
        try:
            # Every process has written its files (the agreement above gathered them all):
            # the manifest can list them, and a rename publishes the whole.
            _write_manifest(tmp)
            _publish(tmp, folder)
        except Exception as exc:
            error = exc
    if failure is None:
        failure = _agree_on_failure(accelerator, error, folder, needed)
    if failure is not None:
        if main:
            _remove(tmp, ignore_errors=True)
        previous = list_checkpoints(folder.parent)
        kept = (
            f"the previous checkpoint {previous[-1]} is intact"
            if previous
            else "no earlier checkpoint"
        )
        remedy = (
            "free some space"
            if "disk full" in failure
            else "free some space or fix permissions"
            if "Error" not in failure  # an OSError's text: "Permission denied", ...
            else "fix the cause"
        )
        # With nothing to resume from, --resume latest would fail: the run starts again.
        then = "resume with --resume latest" if previous else "train again with --overwrite"
        raise UserError(
            f"could not write checkpoint {folder} ({failure}); {kept}; {remedy}, then {then}"
        )
    accelerator.wait_for_everyone()
    return folder


def _write_manifest(folder: Path) -> None:
    """manifest.json: the size of every file in `folder` (`find_damage` compares them)."""
    sizes = {
        str(path.relative_to(folder)): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }
    (folder / MANIFEST_FILE).write_text(
        json.dumps({"files": sizes}, indent=1) + "\n", encoding="utf-8"
    )


def _publish(tmp: Path, folder: Path) -> None:
    """Rename the complete `tmp` to `folder` (replacing the same step saved again)."""
    if folder.exists():  # the same step saved again (a resumed run stopped at once)
        old = folder.with_name(folder.name + ".old")
        _remove(old)
        folder.rename(old)
        tmp.rename(folder)
        _remove(old)
    else:
        tmp.rename(folder)


def _agree_on_failure(accelerator, error: BaseException | None, folder: Path, needed: int):
    """The first process's failure as one line (None when every process succeeded), known to
    every process: all of them run this gather, whatever happened to each."""
    reason = None if error is None else _failure_reason(error, folder, needed)
    if accelerator.num_processes > 1:
        reasons = gather_object([reason])
        failed = [(rank, r) for rank, r in enumerate(reasons) if r is not None]
        if not failed:
            return None
        rank, reason = failed[0]
        return reason if rank == accelerator.process_index else f"process {rank}: {reason}"
    return reason


def _failure_reason(error: BaseException, folder: Path, needed: int) -> str:
    """Why a save failed, in one line; for a full disk, the space free and the space needed."""
    text = getattr(error, "strerror", None) or last_line(error)
    probe = next((p for p in (folder.parent, *folder.parents) if p.exists()), None)
    free = shutil.disk_usage(probe).free if probe is not None else None
    full = getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(
        sign in str(error) for sign in ("No space left", "file write failed", "Disk quota")
    )
    if full or (free is not None and free < needed):
        if free is not None:
            return f"disk full: {text}; {format_bytes(free)} free, a checkpoint needs about {format_bytes(needed)}"
        return f"disk full: {text}; a checkpoint needs about {format_bytes(needed)}"
    return text


def _write_contents(
    tmp: Path, accelerator, model, optimizer, scheduler, state, config_yaml
) -> None:
    # Each process keeps its own random state (dropout masks differ per process).
    torch.save(_rng_state(), tmp / f"rng-{accelerator.process_index}.pt")
    if sharded(model):
        _save_shards(tmp / SHARDED_DIR, model, optimizer)
        if accelerator.is_main_process:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    elif accelerator.is_main_process:
        # Data-parallel replicas are identical: one copy of weights and optimiser state.
        unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
        weights = {
            n: p.detach().cpu().contiguous()
            for n, p in unwrapped.named_parameters()
            if p.requires_grad
        }
        save_file(weights, tmp / WEIGHTS_FILE)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        if accelerator.scaler is not None:
            torch.save(accelerator.scaler.state_dict(), tmp / "scaler.pt")
    if accelerator.is_main_process:
        (tmp / CONFIG_FILE).write_text(config_yaml, encoding="utf-8")
        state.write(tmp)


def _save_shards(folder: Path, model, optimizer) -> None:
    """Every process writes its shard of the trainable weights and optimiser state (a
    collective: every process calls this)."""

    weights, optimizer_state = get_state_dict(
        model, torch_optimizer(optimizer), options=shard_options()
    )
    dcp.save({"model": weights, "optimizer": optimizer_state}, checkpoint_id=str(folder))


def _rng_state() -> dict:
    # NumPy's state holds an ndarray, which weights_only loading refuses: store it as a tensor.
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _remove(path: Path, *, ignore_errors: bool = False) -> None:
    if path.exists():
        shutil.rmtree(path, ignore_errors=ignore_errors)
