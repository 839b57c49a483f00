"""Training checkpoints: what `OUTPUT/checkpoint-<step>/` holds, and writing it atomically.

Reading one back (and choosing which) is `resume`'s; which ones stay on disk is `retention`'s.
The other names a run writes into OUTPUT are `runfolder`'s.

A checkpoint holds everything needed to continue a run exactly where it stopped:

    trainable.safetensors  the weights that train: all of them for full fine-tuning, the decoder
                           for freeze-encoder, only the adapters for LoRA (the frozen rest is read
                           from --model again on resume)
    optimizer.pt           optimiser state (tensors and numbers only: loaded with weights_only)
    scheduler.pt           learning-rate scheduler state
    scaler.pt              fp16 loss-scaler state (fp16 runs only)
    rng-<rank>.pt          Python, NumPy and torch random states of each process
    stream-<rank>.json     a streamed --data only: each process's place in its stream (epoch,
                           rows each data-loader worker handed out; `streaming.StreamPosition`)
    trainer_state.json     step, epoch, steps trained in the epoch, bad-step counters,
                           evaluations so far, the guard's start, world size
    whisper-train.yaml     the options of the run and its record (`config.record`), which a
                           --resume compares with its own
    manifest.json          written last: every file's size, so that a truncated or missing
                           file is found before anything is loaded (`resume.find_damage`)

Every file is written into `checkpoint-<step>.tmp/` and the folder is renamed when complete, so a
crash or a full disk mid-write never leaves a checkpoint that looks usable and is not; a failed
write removes the temporary folder and leaves the previous checkpoints untouched. What a rename
cannot rule out (a power cut before the files reached the disk, a partial copy)
`resume.find_damage` finds cheaply: `--resume latest` then skips to the newest intact one.

Loading never runs code from the checkpoint (`resume`): weights come from safetensors, and
every `.pt` file is read with `torch.load(..., weights_only=True)`.

Under --fsdp each process holds a shard of the weights and of the optimiser state: they are
saved instead as `sharded/`, a torch.distributed.checkpoint folder to which every process writes
its own shard (the trainable weights and the optimiser state, by parameter name), and read back
the same way; a resume needs the same number of processes, as any resume does. The rest of the
folder is as above.
"""

from __future__ import annotations

import errno
import json
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from whisper_train.errors import UserError
from whisper_train.runfolder import CHECKPOINT_PREFIX as PREFIX
from whisper_train.runfolder import CONFIG_FILE
from whisper_train.units import format_bytes

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
STREAM_FILE = "stream-{rank}.json"
WEIGHTS_FILE = "trainable.safetensors"
SHARDED_DIR = (
    "sharded"  # --fsdp: the weights' and optimiser's shards (torch.distributed.checkpoint)
)
_NAME = re.compile(rf"^{PREFIX}(\d+)$")
# Adam keeps two float32 moments per trainable weight, beside the weight itself.
_ADAM_COPIES = 3


@dataclass
class TrainerState:
    """Where a run stands; saved in every checkpoint as trainer_state.json."""

    step: int = 0  # optimizer steps taken, skipped (bad) steps included
    epoch: int = 0  # the epoch in progress
    steps_in_epoch: int = 0  # steps of this epoch's plan already trained (data read whole)
    # The clips this epoch trained before its plan was redone on a resume with other clips a
    # step (`step_plan.encode_clips`; empty: never redone): the plan leaves them out.
    trained_before_replan: str = ""
    # Saved before steps were planned (checkpoints of earlier versions): micro-batches of the
    # epoch each process had consumed. Read only, to convert (`resume.convert_position`).
    batches_in_epoch: int = 0
    # The guard set and the step whose WER of it later ones are held against: step 0, or the
    # step a --resume first gave that guard at ({"set", "step"}; None: no guard yet).
    guard_start: dict | None = None
    bad_steps_in_a_row: int = 0  # consecutive steps with a NaN/infinite loss or gradient
    skipped_steps: int = 0  # all bad steps of the run
    skipped_clips: int = 0  # clips that could not be decoded
    world_size: int = 1  # processes that trained; resuming needs the same number
    evaluations: list[dict] = field(default_factory=list)  # {"step", "eval_loss", "wer"}

    @classmethod
    def read(cls, folder: Path) -> TrainerState:
        values = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in values.items() if k in known})

    def write(self, folder: Path) -> None:
        (folder / STATE_FILE).write_text(
            json.dumps(asdict(self), indent=1) + "\n", encoding="utf-8"
        )


# -- finding checkpoints ------------------------------------------------------------------


def checkpoint_step(folder: Path) -> int | None:
    match = _NAME.match(folder.name)
    return int(match.group(1)) if match else None


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first (a `.tmp` folder never counts)."""
    if not output_dir.is_dir():
        return []
    found = [
        p
        for p in output_dir.iterdir()
        if checkpoint_step(p) is not None and (p / STATE_FILE).is_file()
    ]
    return sorted(found, key=checkpoint_step)


def checkpoint_folders(run_dir: Path) -> list[Path]:
    """Every checkpoint-<step> folder, oldest first, intact or not (`list_checkpoints` counts
    only those with a trainer_state.json)."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if checkpoint_step(p) is not None and p.is_dir()]
    return sorted(found, key=checkpoint_step)


# -- size ---------------------------------------------------------------------------------


def estimate_checkpoint_bytes(model: torch.nn.Module) -> int:
    """Bytes of one checkpoint: trainable weights and Adam's two moments, in float32."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return _ADAM_COPIES * 4 * trainable + (1 << 20)  # + RNG, scheduler, state: well under 1 MiB


# -- saving --------------------------------------------------------------------------------


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
        from accelerate.utils import gather_object

        reasons = gather_object([reason])
        failed = [(rank, r) for rank, r in enumerate(reasons) if r is not None]
        if not failed:
            return None
        rank, reason = failed[0]
        return reason if rank == accelerator.process_index else f"process {rank}: {reason}"
    return reason


def _failure_reason(error: BaseException, folder: Path, needed: int) -> str:
    """Why a save failed, in one line; for a full disk, the space free and the space needed."""
    text = getattr(error, "strerror", None) or _last_line(error)
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


def _last_line(error: BaseException) -> str:
    """The error's type and its last line: torch's RuntimeErrors put the cause last, after a
    line naming the C++ source ("[enforce fail at inline_container.cc:664] ...")."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1].strip()}" if lines else type(error).__name__


def _write_contents(
    tmp: Path, accelerator, model, optimizer, scheduler, state, config_yaml
) -> None:
    # Each process keeps its own random state (dropout masks differ per process).
    torch.save(_rng_state(), tmp / f"rng-{accelerator.process_index}.pt")
    if _sharded(model):
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


def _sharded(model) -> bool:
    from whisper_train.memory import is_sharded

    return is_sharded(model)


def _shard_options(*, loading: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # The trainable weights only, as trainable.safetensors holds: the frozen rest (LoRA's base)
    # is read from --model again. Loading, the frozen ones are absent by design (not strict);
    # a trainable one missing from the checkpoint fails in `dcp.load` already.
    return StateDictOptions(ignore_frozen_params=True, strict=not loading)


def _torch_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # inside accelerate's wrapper


def _save_shards(folder: Path, model, optimizer) -> None:
    """Every process writes its shard of the trainable weights and optimiser state (a
    collective: every process calls this)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optimizer_state = get_state_dict(
        model, _torch_optimizer(optimizer), options=_shard_options()
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
