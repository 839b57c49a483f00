"""The run folder (`--output-dir`): what whisper-train writes there, and where its model is.

Everything a run writes into OUTPUT is named here (`RUN_ENTRIES`): a new run refuses a folder
holding any of it unless told to `--resume` the run or to move it aside (`--overwrite`,
`move_aside`; the refusal itself is `train.claim_output_dir`). Files with other names are the
user's and never touched. A run's model is `OUTPUT/final/`: `final_model_dir` is the one place
that turns a `--model` path naming a run folder into that model folder. One run at a time
trains in a folder: `RunLock` (OUTPUT/.whisper-train.lock) refuses a second.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import socket
import time
from pathlib import Path

from whisper_train.errors import UserError
from whisper_train.files import check_output_path

log = logging.getLogger(__name__)

CONFIG_FILE = "whisper-train.yaml"  # the resolved configuration (also in every checkpoint)
METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"
LAUNCH_FILE = "launch.yaml"  # the configuration handed to the --nproc worker processes
FINAL_DIR = "final"  # the trained model
CURVES_FILE = "curves.png"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"  # --report-to wandb's run files (W&B makes it in OUTPUT unless WANDB_DIR)
# Earlier versions kept encoder outputs here; they now live in the shared cache (user_cache_dir).
ENCODER_CACHE_DIR = "encoder-cache"
EVALUATION_DIR = "evaluation"  # `whisper-train evaluate` reports about this run
REPORT_FILES = ("report.json", "report.baseline.json", "report.md", "report.png")
CHECKPOINT_PREFIX = "checkpoint-"  # OUTPUT/checkpoint-<step>/ (`checkpoints`)
# OUTPUT/abandoned-after-step-<step>[-n]/: the later checkpoints of a run that a resume from
# <step> abandoned (`resume.set_aside_later_checkpoints`)
ABANDONED_PREFIX = "abandoned-after-step-"
# Held by the run training in the folder (`RunLock`). Not a run entry: it marks no earlier run
# and stays in place when --overwrite moves one aside (the new run holds it then).
LOCK_FILE = ".whisper-train.lock"
# Written by process 0 of a run of several processes, read by all of them, removed before step 1:
# every process must see the folder process 0 writes in (`launch.check_shared_run_folder`).
# Not a run entry either: it marks no run.
SHARED_MARK_FILE = ".whisper-train.shared"
# Set to 1: train in a folder whose file system cannot lock (`RunLock`), unprotected.
NO_LOCK_VARIABLE = "WHISPER_TRAIN_NO_LOCK"
RUN_ENTRIES = frozenset(
    {
        CONFIG_FILE,
        METRICS_FILE,
        RESULT_FILE,
        LAUNCH_FILE,
        FINAL_DIR,
        FINAL_DIR + ".tmp",  # a final model whose write was interrupted
        CURVES_FILE,
        TENSORBOARD_DIR,
        WANDB_DIR,
        ENCODER_CACHE_DIR,
        EVALUATION_DIR,
        *REPORT_FILES,
    }
)


def user_cache_dir(name: str) -> Path:
    """What runs share, kept between them: `name` (encoder, screening, hf-audio) under
    $WHISPER_TRAIN_CACHE, else $XDG_CACHE_HOME/whisper-train, else ~/.cache/whisper-train."""
    root = os.environ.get("WHISPER_TRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "whisper-train"
    )
    return Path(root) / name


def encoder_cache_dir(flag_value: str | None) -> Path:
    """The frozen encoder's cache: `--encoder-cache-dir` when given, else `encoder` in the
    user's whisper-train cache (`user_cache_dir`)."""
    return Path(flag_value).expanduser() if flag_value else user_cache_dir("encoder")


# Complete checkpoints, the leftovers of an interrupted write or replacement, and the later
# checkpoints a resume set aside.
_CHECKPOINT_ENTRY = re.compile(
    rf"^({CHECKPOINT_PREFIX}\d+(\.tmp|\.old)?|{ABANDONED_PREFIX}\d+(-\d+)?)$"
)
# A folder holding either of these is a model itself (transformers' config.json, also in a
# CTranslate2 folder; peft's adapter_config.json), whatever else it holds.
_MODEL_FILES = ("config.json", "adapter_config.json")


def final_model_dir(path: Path) -> Path | None:
    """`path/final` when `path` is a run folder (OUTPUT) whose model is there, else None.

    A run folder has a `final/` folder and holds no model itself. Every `--model` path goes
    through this (`models.model_folder`), so loading, transcribing, exporting, checking data
    and placing evaluation reports all agree on what a run folder is.
    """
    path = Path(path)
    if (path / FINAL_DIR).is_dir() and not any((path / f).exists() for f in _MODEL_FILES):
        return path / FINAL_DIR
    return None


def run_folder_of(model_dir: Path) -> Path | None:
    """The run folder a `--model` path belongs to: OUTPUT itself, or OUTPUT for OUTPUT/final."""
    model_dir = Path(model_dir)
    if final_model_dir(model_dir) is not None:
        return model_dir
    if model_dir.name == FINAL_DIR and (model_dir.parent / CONFIG_FILE).is_file():
        return model_dir.parent
    return None


def run_entries(output_dir: Path) -> list[Path]:
    """The files and folders of `output_dir` that whisper-train wrote (an earlier run's)."""
    if not output_dir.is_dir():
        return []
    return sorted(
        p for p in output_dir.iterdir() if p.name in RUN_ENTRIES or _CHECKPOINT_ENTRY.match(p.name)
    )


def aside_path(path: Path) -> Path:
    """A free sibling name for `path`'s old contents: `<path>.old-<date>-<time>[-n]`."""
    path = path.resolve()  # `--output-dir .` has no name of its own
    stem = f"{path.name}.old-{time.strftime('%Y%m%d-%H%M%S')}"
    candidate, n = path.with_name(stem), 2
    while candidate.exists():
        candidate, n = path.with_name(f"{stem}-{n}"), n + 1
    return candidate


def move_aside(output_dir: Path, entries: list[Path]) -> Path:
    """Move `entries` (of `output_dir`) into a new `<output_dir>.old-<date>-<time>/`; returns it.

    Renames within one file system: nothing is copied, nothing deleted. Raises UserError naming
    where the entries moved so far are when a rename fails (read-only parent folder).
    """
    aside = aside_path(output_dir)
    moved = 0
    try:
        aside.mkdir()
        for entry in entries:
            entry.rename(aside / entry.name)
            moved += 1
    except OSError as exc:
        where = f"; {moved} of them are already in {aside}" if moved else ""
        raise UserError(
            f"--overwrite: could not move the earlier run in {output_dir} aside to {aside} "
            f"({exc.strerror or exc}){where}; move or delete it yourself, or choose another "
            "--output-dir"
        ) from None
    return aside


def check_writable(output_dir: Path) -> None:
    """`--output-dir` must be (or be creatable as) a folder this run can write in."""
    check_output_path(output_dir, "--output-dir", folder=True)


class RunLock:
    """One run at a time in `output_dir`: an OS lock (flock) on OUTPUT/.whisper-train.lock.

    Taken before the folder is claimed (`train.claim_output_dir`) and held until the run ends,
    so two runs started together cannot both claim the folder and write into it. With
    `--nproc` the launching process holds it for all its processes (and hands it to torchrun:
    `fd`). The kernel releases an flock when the last descriptor of it closes, so a run that was
    killed (SIGKILL, a crash, a lost power) leaves no stale lock behind: the file stays, the lock
    does not. The file holds the holder's PID and host, for the refusal of a second run.

    flock directly rather than the `filelock` package: filelock 3.x opens the lock file with
    O_TRUNC, so each refused contender would erase the holder's PID and host; and torchrun must
    inherit the very descriptor (`launch.launch_data_parallel`).
    """

    def __init__(
        self,
        output_dir: Path,
        *,
        named: str = "--output-dir",
        remedy: str = "wait for it to end, stop it, or choose another --output-dir",
    ):
        self.output_dir = Path(output_dir)
        self.named, self.remedy = named, remedy  # the refusal's: the folder as given, what to do
        self.path = self.output_dir / LOCK_FILE
        self.fd: int | None = None
        self.created: list[Path] = []  # the folders acquire() made, innermost first

    def acquire(self) -> None:
        """Take the lock, or raise UserError naming the run that holds it."""
        try:
            import fcntl
        except ImportError:  # Windows: no flock; runs there are not kept apart
            return
        self.created = [
            folder for folder in (self.output_dir, *self.output_dir.parents) if not folder.exists()
        ]
        self.output_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
            os.close(fd)
            if exc.errno in (errno.ENOLCK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                self._without_lock(exc)  # a file system without locks (some network mounts)
                return
            raise UserError(
                f"{self.named} {self.output_dir} is in use by another whisper-train run "
                f"({holder or 'starting now'}); {self.remedy}"
            ) from None
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(fd, f"PID {os.getpid()} on {socket.gethostname()}, since {started}\n".encode(), 0)
        self.fd = fd

    def _without_lock(self, exc: OSError) -> None:
        """A folder whose file system cannot lock: refused in one line saying what that means,
        unless $WHISPER_TRAIN_NO_LOCK=1 asks to run in it anyway (then said once, as a warning):
        a silent run there is one that a second run into the folder writes over unseen."""
        what = (
            f"--output-dir {self.output_dir}: its file system cannot lock {LOCK_FILE} "
            f"({exc.strerror or exc}; NFS without a lock daemon does this), so a second run "
            "into this folder would not be refused"
        )
        if os.environ.get(NO_LOCK_VARIABLE) == "1":
            log.warning("%s; running anyway, as %s=1 asks", what, NO_LOCK_VARIABLE)
            return
        if self.created:  # a refused run leaves no folder it made for its lock
            with contextlib.suppress(OSError):
                self.path.unlink()
                for folder in self.created:
                    folder.rmdir()
        raise UserError(
            f"{what}; choose an --output-dir on a local disk, or set {NO_LOCK_VARIABLE}=1 to run "
            "without the lock (keeping other runs out of the folder is then yours)"
        )

    def release(self) -> None:
        """Empty the file (nobody holds it now) and let the lock go. The file is not deleted: a
        contender that opened it just before would lock a deleted file while a third run
        created a new one."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):  # the lock goes all the same
            os.ftruncate(self.fd, 0)
            # A run that stopped before writing anything (refused at setup) leaves no folder
            # it made for its lock: the user asked for a run, not for an empty folder. Removed
            # while still locked; a contender that opened the file in this instant locks a
            # removed file and starts into a new folder, as if it had come a moment later.
            if self.created and [p.name for p in self.output_dir.iterdir()] == [LOCK_FILE]:
                self.path.unlink()
                for folder in self.created:
                    folder.rmdir()  # innermost first; one holding anything else stays
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
