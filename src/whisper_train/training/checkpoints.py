"""Training checkpoints: `OUTPUT/checkpoint-<step>/`, written atomically, loaded safely.

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
    trainer_state.json     step, epoch, batches consumed in the epoch, bad-step counters,
                           evaluations so far, world size
    whisper-train.yaml     the resolved configuration of the run
    manifest.json          written last: every file's size, so that a truncated or missing
                           file is found before anything is loaded (`find_damage`)

Every file is written into `checkpoint-<step>.tmp/` and the folder is renamed when complete, so a
crash or a full disk mid-write never leaves a checkpoint that looks usable and is not; a failed
write removes the temporary folder and leaves the previous checkpoints untouched. What a rename
cannot rule out (a power cut before the files reached the disk, a partial copy) `find_damage`
finds cheaply: `--resume latest` then skips to the newest intact checkpoint.

Loading never runs code from the checkpoint: weights come from safetensors, and every `.pt` file
is read with `torch.load(..., weights_only=True)`.

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
import zipfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from whisper_train.config import read_yaml
from whisper_train.errors import UserError
from whisper_train.runfolder import ABANDONED_PREFIX, CONFIG_FILE, METRICS_FILE
from whisper_train.runfolder import CHECKPOINT_PREFIX as PREFIX
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
    batches_in_epoch: int = 0  # micro-batches of this epoch already consumed (per process)
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


@dataclass
class ResumePoint:
    """The checkpoint a --resume continues from, and a line for each newer one it skipped."""

    folder: Path
    skipped: list[str] = field(default_factory=list)


def resolve_resume(resume: str, output_dir: Path) -> Path:
    """`--resume latest` → the newest intact checkpoint in --output-dir; a path → that
    checkpoint (or the newest intact one inside a run folder). See `find_resume`."""
    return find_resume(resume, output_dir).folder


def find_resume(resume: str, output_dir: Path) -> ResumePoint:
    """The checkpoint to resume from, checked with `find_damage` before anything is loaded.

    'latest' (or a run folder) skips damaged checkpoints, newest first, naming each in
    `skipped`; a damaged checkpoint named itself, or no intact one at all, is a UserError.
    """
    run_dir = output_dir
    if resume != "latest":
        path = Path(resume)
        if (checkpoint_step(path) is not None and path.is_dir()) or (path / STATE_FILE).is_file():
            problem = find_damage(path)
            if problem is not None:
                raise UserError(
                    f"--resume {resume}: the checkpoint is damaged: {problem}; "
                    f"{_earlier_advice(path)}"
                )
            return ResumePoint(path)
        run_dir = path
    candidates = checkpoint_folders(run_dir)[::-1]  # newest first
    if not candidates:
        if resume == "latest":
            raise UserError(
                f"--resume: no checkpoint-<step> folder in --output-dir {output_dir}; "
                "pass --resume PATH to a checkpoint, or start without --resume"
            )
        raise UserError(
            f"--resume {resume}: not a checkpoint folder (no {STATE_FILE}) and holds none; "
            f"pass a checkpoint-<step> folder or 'latest'"
        )
    skipped, problems = [], []
    for folder in candidates:
        problem = find_damage(folder)
        if problem is None:
            return ResumePoint(folder, skipped)
        problems.append(problem)
        skipped.append(f"--resume: skipping {folder}, it is damaged: {problem}")
    older = len(candidates) - 1
    others = f" (and the {older} older one{'s' if older > 1 else ''})" if older else ""
    raise UserError(
        f"--resume {resume}: no intact checkpoint in {run_dir}: {candidates[0].name}: "
        f"{problems[0]}{others}; start afresh with --overwrite (it moves this run aside)"
    )


def checkpoint_folders(run_dir: Path) -> list[Path]:
    """Every checkpoint-<step> folder, oldest first, intact or not (`list_checkpoints` counts
    only those with a trainer_state.json)."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if checkpoint_step(p) is not None and p.is_dir()]
    return sorted(found, key=checkpoint_step)


def _earlier_advice(folder: Path) -> str:
    """What to do instead of resuming from the damaged `folder`: the newest intact checkpoint
    before it, else a fresh start."""
    step = checkpoint_step(folder)
    for earlier in checkpoint_folders(folder.parent)[::-1]:
        if step is not None and checkpoint_step(earlier) < step and find_damage(earlier) is None:
            return f"resume from an earlier one with --resume {earlier}"
    return "no earlier intact checkpoint: start afresh with --overwrite (it moves this run aside)"


def find_damage(folder: Path) -> str | None:
    """What is wrong with checkpoint `folder`, naming the file (None when it looks intact).

    Cheap: sizes against manifest.json, the files each process needs, safetensors' header,
    the zip directory at the end of each .pt file (torch.save writes a zip archive: a truncated
    one has lost it). Nothing is loaded; what these checks cannot see (bytes changed in place)
    fails when loaded, as one line too (`load_checkpoint`).
    """
    manifest = folder / MANIFEST_FILE
    if manifest.is_file():
        try:
            sizes = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return f"{MANIFEST_FILE} is damaged (not the JSON a save writes)"
        for name, size in sizes.items():
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            actual = path.stat().st_size
            if actual != size:
                how = "truncated" if actual < size else "changed"
                return f"{name} is {how}: {actual} bytes, {size} when saved"
    if not (folder / STATE_FILE).is_file():
        return f"{STATE_FILE} is missing (an incomplete checkpoint)"
    try:
        state = TrainerState.read(folder)
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        return f"{STATE_FILE} is damaged ({type(exc).__name__}: {exc})"
    needed = [f"rng-{rank}.pt" for rank in range(state.world_size)] + ["scheduler.pt"]
    if not (folder / SHARDED_DIR).is_dir():
        needed += [WEIGHTS_FILE, "optimizer.pt"]
    for name in needed:
        if not (folder / name).is_file():
            return f"{name} is missing"
    problem = _safetensors_damage(folder / WEIGHTS_FILE)
    if problem is not None:
        return f"{WEIGHTS_FILE} is {problem}"
    for path in sorted(folder.glob("*.pt")):
        try:
            zipfile.ZipFile(path).close()
        except (zipfile.BadZipFile, OSError) as exc:
            return f"{path.name} is damaged or truncated (not a complete torch file: {exc})"
    for path in sorted(folder.glob("*.json")):
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            return f"{path.name} is damaged or truncated (not JSON)"
    return None


def _safetensors_damage(path: Path) -> str | None:
    """A safetensors file is 8 bytes of header length, a JSON header giving each tensor's byte
    range, then the data: a file shorter than the header says is truncated."""
    if not path.is_file():
        return None  # --fsdp: no such file (sharded/ is checked against the manifest)
    size = path.stat().st_size
    with path.open("rb") as file:
        length = int.from_bytes(file.read(8), "little") if size >= 8 else None
        if length is None or length > size - 8:
            return f"truncated: {size} bytes, too short for its own header"
        try:
            header = json.loads(file.read(length))
            end = max(
                (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                default=0,
            )
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "damaged (its header is not safetensors' JSON)"
    if 8 + length + end > size:
        return f"truncated: {size} bytes, {8 + length + end} when saved"
    return None


# -- space ---------------------------------------------------------------------------------


def estimate_checkpoint_bytes(model: torch.nn.Module) -> int:
    """Bytes of one checkpoint: trainable weights and Adam's two moments, in float32."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return _ADAM_COPIES * 4 * trainable + (1 << 20)  # + RNG, scheduler, state: well under 1 MiB


def peak_disk_bytes(
    model: torch.nn.Module, *, checkpoints_kept: int, already_saved: int, final_bytes: int
) -> int:
    """The most disk a run's checkpoints and final model take beyond what is there already.

    `rotate_checkpoints` runs after a save is complete, so at each save `checkpoints_kept`
    (--save-total-limit, plus the best one) are on disk while the next one is written; at the
    end the last rotation has run before final/ is written. `already_saved`: checkpoints of
    the run being resumed, on disk already, that count towards the kept ones.
    """
    one = estimate_checkpoint_bytes(model)
    return max(0, checkpoints_kept - already_saved) * one + max(one, final_bytes)


def check_free_space(output_dir: Path, needed: int, *, what: str) -> None:
    """A clear error before training rather than a failure hours later."""
    probe = output_dir if output_dir.exists() else next(p for p in output_dir.parents if p.exists())
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise UserError(
            f"--output-dir {output_dir}: {format_bytes(free)} free, but {what} need about {format_bytes(needed)}; "
            "free some space or choose another --output-dir"
        )


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


def rotate_checkpoints(
    output_dir: Path, *, keep_last: int, keep_step: int | None, saved_step: int
) -> None:
    """Delete all but the newest `keep_last` checkpoints up to `saved_step` (the one just
    saved) and the one of `keep_step` (the best evaluated step, which final/ will hold:
    `final.choose_final_step`). A checkpoint after `saved_step` is never the newest, and is
    not deleted: only a run abandoned by a resume leaves one, and the resume moves those aside
    (`set_aside_later_checkpoints`)."""
    found = [p for p in list_checkpoints(output_dir) if checkpoint_step(p) <= saved_step]
    keep = set(found[-keep_last:])
    keep.update(p for p in found if keep_step is not None and checkpoint_step(p) == keep_step)
    for folder in found:
        if folder not in keep:
            _delete_checkpoint(folder)


def _delete_checkpoint(folder: Path) -> None:
    """Its markers first: a deletion killed half-way leaves a folder no resume takes for a
    checkpoint (`list_checkpoints` needs trainer_state.json), not one with files missing."""
    for marker in (MANIFEST_FILE, STATE_FILE):
        (folder / marker).unlink(missing_ok=True)
    _remove(folder, ignore_errors=True)


def set_aside_later_checkpoints(output_dir: Path, step: int) -> Path | None:
    """Move the checkpoints after `step` (of the run a resume from `step` abandons, or damaged
    ones it skipped) into OUTPUT/abandoned-after-step-<step>/, with their rows of
    metrics.jsonl: they would otherwise count as the newest (`--resume latest`, rotation).
    Nothing is deleted. Returns that folder, None when there was nothing to move."""
    # Only checkpoint-<step> folders count as checkpoints: a `.tmp` one (an interrupted write)
    # is removed when this run saves that step, as after any crash.
    later = [p for p in checkpoint_folders(output_dir) if checkpoint_step(p) > step]
    if not later:
        return None
    aside, n = output_dir / f"{ABANDONED_PREFIX}{step}", 2
    while aside.exists():
        aside, n = output_dir / f"{ABANDONED_PREFIX}{step}-{n}", n + 1
    aside.mkdir()
    for folder in later:
        folder.rename(aside / folder.name)
    truncate_metrics(output_dir / METRICS_FILE, step, dropped_to=aside / METRICS_FILE)
    return aside


# -- loading -------------------------------------------------------------------------------

# Options an exact resume depends on: they fix which clips make each batch and in what order
# (the data-order state in the checkpoint counts batches of them), so a resume that changed one
# would silently train on other data than the run it continues. Refused on --resume, naming the
# checkpoint's value. The learning rate and its schedule (--learning-rate, --lr-scheduler,
# --warmup-steps, --max-steps, --epochs) are instead applied from the resume point: see
# `load_checkpoint`.
FIXED_ON_RESUME = (
    ("train", "batch_size", "--batch-size"),
    ("train", "gradient_accumulation", "--gradient-accumulation"),
    ("train", "seed", "--seed"),
    ("train", "group_by_length", "--group-by-length"),
    ("train", "fsdp", "--fsdp"),  # sharded/ or trainable.safetensors: one or the other
    ("data", "data", "--data"),
    ("data", "data_format", "--data-format"),
    ("data", "train_subset", "--train-subset"),
    ("data", "eval_split", "--eval-split"),
    ("data", "packing", "--packing"),  # windows, not clips, are what the data order counts
    ("data", "packing_timestamps", "--packing-timestamps"),  # where windows end
)


def check_resume_options(folder: Path, config) -> None:
    """Refuse (UserError, one line) a --resume whose FIXED_ON_RESUME options differ from those
    `folder` was saved with; the first difference is named with the checkpoint's value."""
    saved_file = folder / CONFIG_FILE
    if not saved_file.is_file():
        return  # a checkpoint of an older version: nothing to compare with
    # Read as --config reads it (YAML 1.2 booleans): a plain `packing: on` is "on", not True.
    saved = read_yaml(saved_file.read_text(encoding="utf-8")) or {}
    for group, name, flag in FIXED_ON_RESUME:
        if name not in saved.get(group, {}):
            continue
        before, now = saved[group][name], getattr(getattr(config, group), name)
        if name == "data" and before and now and _same_path(before, now):
            continue
        if before != now:
            raise UserError(
                f"--resume {folder}: {flag} {now} differs from the checkpoint's {before}, and "
                f"an exact resume depends on it; resume with {flag} {before}, or start a new run "
                "(a new --output-dir) to change it"
            )


def _same_path(a: str, b: str) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def _apply_new_learning_rate(optimizer, scheduler, new_base_lrs: list[float]) -> None:
    """After loading, the scheduler holds the checkpoint's base learning rates; a --resume with
    another --learning-rate scales each group from this step on: the schedule keeps its shape
    (warmup, decay) and the rate at step s becomes the new base times the schedule at s."""
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate wraps the scheduler
    if not hasattr(inner, "base_lrs") or list(inner.base_lrs) == list(new_base_lrs):
        return
    for index, (group, old, new) in enumerate(
        zip(optimizer.param_groups, inner.base_lrs, new_base_lrs, strict=True)
    ):
        scale = new / old if old else 0.0
        group["lr"] = group["lr"] * scale if old else new
        group["initial_lr"] = new
        inner.base_lrs[index] = new
    inner._last_lr = [group["lr"] for group in optimizer.param_groups]


def load_checkpoint(folder: Path, *, accelerator, model, optimizer, scheduler) -> TrainerState:
    """Restore weights, optimiser, scheduler, scaler and this process's random state.

    Call after `accelerator.prepare` and after all other set-up, right before the loop: the
    random state is restored last, so set-up that draws random numbers (LoRA initialisation)
    does not shift it.
    """
    with _loading(folder / STATE_FILE):
        state = TrainerState.read(folder)
    if state.world_size != accelerator.num_processes:
        raise UserError(
            f"--resume {folder}: saved by {state.world_size} process(es), this run has "
            f"{accelerator.num_processes}; resume with --nproc {state.world_size}"
        )
    # This run's base learning rates (its --learning-rate), before the checkpoint's replace
    # them: a changed one applies from the resume point.
    new_base_lrs = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
    if _sharded(model):
        _load_shards(folder, model, optimizer)
    else:
        _load_weights(folder, accelerator.unwrap_model(model, keep_torch_compile=False))
        with _loading(folder / "optimizer.pt"):
            optimizer.load_state_dict(_load_pt(folder / "optimizer.pt"))
    with _loading(folder / "scheduler.pt"):
        scheduler.load_state_dict(_load_pt(folder / "scheduler.pt"))
    _apply_new_learning_rate(optimizer, scheduler, new_base_lrs)
    if accelerator.scaler is not None and (folder / "scaler.pt").is_file():
        with _loading(folder / "scaler.pt"):
            accelerator.scaler.load_state_dict(_load_pt(folder / "scaler.pt"))
    rng_file = folder / f"rng-{accelerator.process_index}.pt"
    with _loading(rng_file):
        _set_rng_state(_load_pt(rng_file))
    return state


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
            f"the file is damaged or not this run's; {_earlier_advice(path.parent)}"
        ) from None


def _load_error(error: BaseException) -> str:
    """The line of a loading error that says what went wrong: torch.load's refusal of a
    pickled object (weights_only) puts it in the middle of advice to load it unsafely."""
    for line in str(error).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.strip().split(". ")[0]
    return _last_line(error)


def read_stream_position(folder: Path, rank: int) -> dict:
    """Process `rank`'s saved place in a streamed --data (see `save_checkpoint`)."""
    path = folder / STREAM_FILE.format(rank=rank)
    if not path.is_file():
        raise UserError(
            f"--resume {folder}: no {path.name}: it was saved by a run that did not stream its "
            "--data; resume with the --data that run used"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def load_weights(folder: Path, *, accelerator, model) -> None:
    """Only the trained weights of checkpoint `folder` into `model` (the best step's, at the end
    of a run); optimiser, scheduler and random state are left as they are."""
    if _sharded(model):
        _load_shards(folder, model, None)
    else:
        _load_weights(folder, accelerator.unwrap_model(model, keep_torch_compile=False))


def _load_weights(folder: Path, model: torch.nn.Module) -> None:
    with _loading(folder / WEIGHTS_FILE):
        saved = load_file(folder / WEIGHTS_FILE)
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


def _load_shards(folder: Path, model, optimizer) -> None:
    """Read `folder`'s sharded/ back into this process's shards of `model` and, when given,
    `optimizer` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if not (folder / SHARDED_DIR).is_dir():
        raise UserError(
            f"--resume {folder}: no {SHARDED_DIR}/ folder: it was saved without --fsdp; "
            "resume without --fsdp"
        )
    options = _shard_options()
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=options)}
        with _loading(folder / SHARDED_DIR):
            dcp.load(state, checkpoint_id=str(folder / SHARDED_DIR))
        set_model_state_dict(model, state["model"], options=_shard_options(loading=True))
        return
    inner = _torch_optimizer(optimizer)
    weights, optimizer_state = get_state_dict(model, inner, options=options)
    state = {"model": weights, "optimizer": optimizer_state}
    with _loading(folder / SHARDED_DIR):
        dcp.load(state, checkpoint_id=str(folder / SHARDED_DIR))
    set_state_dict(
        model,
        inner,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_shard_options(loading=True),
    )


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


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def truncate_metrics(metrics_file: Path, step: int, *, dropped_to: Path | None = None) -> None:
    """Drop metrics lines past `step`, so a resumed run's file reads like one run; with
    `dropped_to`, the rows past `step` are written there instead of lost."""
    if not metrics_file.is_file():
        return
    kept, dropped = [], []
    for line in metrics_file.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # half a line: the crash came while it was being written
            continue
        if isinstance(row, dict) and row.get("step", 0) <= step:
            kept.append(line)
        else:
            dropped.append(line)
    if dropped_to is not None:
        if not dropped:
            return
        dropped_to.write_text("".join(line + "\n" for line in dropped), encoding="utf-8")
    metrics_file.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def _remove(path: Path, *, ignore_errors: bool = False) -> None:
    if path.exists():
        shutil.rmtree(path, ignore_errors=ignore_errors)
