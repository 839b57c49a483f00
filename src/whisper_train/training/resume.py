"""Resuming a run: which checkpoint `--resume` continues from (`find_resume`: damaged ones
found cheaply and skipped), the options an exact resume may not change, loading a checkpoint
back (`load_checkpoint`, `load_weights`), and tidying the run folder to the resume point (later
checkpoints set aside, metrics.jsonl cut back). What a checkpoint holds and how it is written is
`checkpoints`'.

Loading never runs code from the checkpoint: weights come from safetensors, and every `.pt` file
is read with `torch.load(..., weights_only=True)`.
"""

from __future__ import annotations

import json
import random
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors.torch import load_file

from whisper_train.config import field_owners, read_yaml
from whisper_train.config.options import PACKING_AUTO
from whisper_train.config.record import (
    MUST_EQUAL,
    REPLANS,
    SLICES,
    RunRecord,
    flag_of,
    options_recorded,
    same_path,
)
from whisper_train.errors import UserError
from whisper_train.runfolder import ABANDONED_PREFIX, CONFIG_FILE, METRICS_FILE
from whisper_train.training.checkpoints import (
    MANIFEST_FILE,
    SHARDED_DIR,
    STATE_FILE,
    STREAM_FILE,
    WEIGHTS_FILE,
    TrainerState,
    _last_line,
    _shard_options,
    _sharded,
    _torch_optimizer,
    checkpoint_folders,
    checkpoint_step,
)

# -- finding the checkpoint to resume from -------------------------------------------------


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


# -- loading -------------------------------------------------------------------------------


# -- the checkpoint's record -----------------------------------------------------------------


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
            f"--resume {folder}: its {CONFIG_FILE} is damaged ({exc}); {_earlier_advice(folder)}"
        ) from None
    return record, options if isinstance(options, dict) else {}


def check_recordless_options(folder: Path, options: dict, config) -> None:
    """A checkpoint saved before runs kept records: the options whose record fields an exact
    resume depends on (`MUST_EQUAL`, and `REPLANS`, which needs the checkpoint's plan) must
    equal its saved ones; the first that differs is refused in one line."""
    classes = {f.name: f.metadata["resume"] for kind in SLICES.values() for f in fields(kind)}
    for option, recorded in options_recorded().items():
        if not any(classes[name.split(".")[1]] in (MUST_EQUAL, REPLANS) for name in recorded):
            continue
        group = field_owners()[option]
        if option not in options.get(group, {}):
            continue
        before, now = options[group][option], getattr(getattr(config, group), option)
        if option == "data" and before and now and same_path(before, now):
            continue
        if option == "packing" and now == PACKING_AUTO:
            continue  # auto takes the checkpoint's (`config.resolve.choose_packing`)
        if before != now:
            flag = flag_of(option)
            raise UserError(
                f"--resume {folder}: {flag} {now} differs from the checkpoint's {before}, and "
                f"an exact resume depends on it; resume with {flag} {before}, or start a new run "
                "(a new --output-dir) to change it"
            )


def recordless_packing(options: dict) -> str | None:
    """The packing a record-less checkpoint trained with (its saved --packing; that version
    wrote auto's choice there), None when it says none."""
    packing = options.get("data", {}).get("packing")
    return None if packing in (None, PACKING_AUTO) else str(packing)


def convert_position(state: TrainerState, folder: Path) -> None:
    """A record-less checkpoint's place in its epoch, in micro-batches consumed, as steps: its
    run planned unpacked steps as this version does (--gradient-accumulation micro-batches of
    --batch-size clips), so steps = micro-batches / accumulation; a packed run planned its
    steps otherwise, and is refused (`saved_record`'s options say which)."""
    _, options = saved_record(folder)
    train = options.get("train", {})
    if options.get("data", {}).get("packing", "off") not in ("off", False):
        raise UserError(
            f"--resume {folder}: it was saved by an earlier whisper-train, which planned a "
            "packed run's steps otherwise; resume it with that version, or start a new run"
        )
    accumulation = max(1, int(train.get("gradient_accumulation", 1)))
    state.steps_in_epoch = state.batches_in_epoch // accumulation


def _check_rate_groups(folder: Path, saved: int, new_base_lrs: list[float]) -> None:
    """The checkpoint's optimizer must hold this run's parameter groups (its record's learning
    rates say so first: `config.record`); a record-less checkpoint's are counted here."""
    if saved == len(new_base_lrs):
        return
    raise UserError(
        f"--resume {folder}: the checkpoint's optimizer has {saved} learning-rate groups and "
        f"this run's {len(new_base_lrs)}: it gave the encoder "
        f"{'one rate with the rest' if saved < len(new_base_lrs) else 'a rate of its own'}; "
        "resume with the --encoder-lr-scale it trained with "
        f"({'1' if saved < len(new_base_lrs) else 'not 1'})"
    )


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


def load_checkpoint(
    folder: Path, *, accelerator, model, optimizer, scheduler, training=None
) -> TrainerState:
    """Restore weights, optimiser, scheduler, scaler and this process's random state.

    What the run's record lets change takes effect from here: the optimizer's groups keep this
    run's weight decay (`optimizer.load_state_dict` would restore the checkpoint's) and the
    schedule this run's base learning rates (`_apply_new_learning_rate`); `training` (the
    record's slice) is what they came from.

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
    # This run's base learning rates (its --learning-rate) and weight decay, before the
    # checkpoint's replace them: a changed one applies from the resume point.
    new_base_lrs = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
    new_decay = [g["weight_decay"] for g in optimizer.param_groups]
    with _loading(folder / "scheduler.pt"):
        saved_schedule = _load_pt(folder / "scheduler.pt")
    _check_rate_groups(folder, len(saved_schedule.get("base_lrs", new_base_lrs)), new_base_lrs)
    if _sharded(model):
        _load_shards(folder, model, optimizer)
    else:
        _load_weights(folder, accelerator.unwrap_model(model, keep_torch_compile=False))
        with _loading(folder / "optimizer.pt"):
            optimizer.load_state_dict(_load_pt(folder / "optimizer.pt"))
    with _loading(folder / "scheduler.pt"):
        scheduler.load_state_dict(saved_schedule)
    _apply_new_learning_rate(optimizer, scheduler, new_base_lrs)
    for group, decay in zip(optimizer.param_groups, new_decay, strict=True):
        group["weight_decay"] = decay
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


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- the run folder at the resume point ----------------------------------------------------


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
