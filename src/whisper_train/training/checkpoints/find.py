"""Finding a checkpoint to continue from before anything loads: what is wrong with one
(`find_damage`, cheap checks of its files against manifest.json), and which one a `--resume`
names (`find_resume`: the newest intact one for 'latest' or a run folder, skipping damaged ones
in one line each). Light by design: the process that launches `--nproc N` workers asks this
without loading torch's model libraries."""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from whisper_train.errors import UserError
from whisper_train.training.checkpoints.format import (
    MANIFEST_FILE,
    SHARDED_DIR,
    STATE_FILE,
    WEIGHTS_FILE,
    TrainerState,
    checkpoint_folders,
    checkpoint_step,
)

# -- before anything loads -------------------------------------------------------------------


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


def earlier_advice(folder: Path) -> str:
    """What to do instead of resuming from the damaged `folder`: the newest intact checkpoint
    before it, else a fresh start."""
    step = checkpoint_step(folder)
    for earlier in checkpoint_folders(folder.parent)[::-1]:
        if step is not None and checkpoint_step(earlier) < step and find_damage(earlier) is None:
            return f"resume from an earlier one with --resume {earlier}"
    return "no earlier intact checkpoint: start afresh with --overwrite (it moves this run aside)"


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
                    f"{earlier_advice(path)}"
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
