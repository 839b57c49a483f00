"""What a training run shows while it runs and leaves behind when it ends.

- `MetricsLog`: OUTPUT/metrics.jsonl (one JSON line per optimizer step and per evaluation),
  TensorBoard events and the other trackers of --report-to (`trackers`);
- `ProgressTable` and `step_line`: the `Step | Training Loss | Validation Loss | WER` table and
  the plain progress lines a log file gets instead of a bar;
- `StopRequest`: SIGINT / SIGTERM become "finish this step, save, exit";
- `TrainResult`: what `train()` returns, also written to OUTPUT/result.json for `--nproc`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shlex
import signal
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NoReturn

import torch
from tqdm.auto import tqdm

from whisper_train import runfolder
from whisper_train.errors import UserError
from whisper_train.files import write_atomically
from whisper_train.trackers import Trackers, scalars


def progress_bars_wanted() -> bool:
    """Progress bars only on a terminal: in a log file or CI output their \r redraws pile up
    into one long unreadable line."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


# `make setup` leaves TensorBoard out (the `tensorboard` extra: ~60 MB of a demo's venv).
TENSORBOARD_MISSING = (
    "--report-to tensorboard: TensorBoard is not installed, so no OUTPUT/tensorboard/ logs "
    "(metrics.jsonl holds every figure); pip install -e '.[tensorboard]' turns them on"
)


# The longest line a run prints before its first step: one a terminal shows whole. Each start
# line says what a user needs; its detail (`say(..., detail=...)`) is printed with -v, and every
# resolved setting is in OUTPUT/whisper-train.yaml.
START_LINE_CHARS = 120


def say(accelerator, message: str, *, detail: str | None = None) -> None:
    """One line from the main process, printed above any progress bar; `detail` (the rest of
    the story) under it with -v (whisper_train's logging at DEBUG)."""
    if not accelerator.is_main_process:
        return
    tqdm.write(message)
    if detail and logging.getLogger("whisper_train").isEnabledFor(logging.DEBUG):
        tqdm.write(f"  {detail}")


@dataclass
class TrainResult:
    output_dir: Path
    final_dir: Path | None
    steps: int
    train_examples: int
    eval_examples: int
    skipped_clips: int
    # One row per evaluation set per evaluation: {"step", "set", "eval_loss", "wer", ...}
    evaluations: list[dict] = field(default_factory=list)
    skipped_steps: int = 0  # optimizer steps skipped for a NaN or infinite loss or gradient
    final_step: int | None = None  # the evaluated step final/ holds
    final_reason: str = ""  # why that step: best WER, within the guard's limit, or the last
    primary_set: str = "eval"  # the evaluation set whose WER picked it
    # The steps whose checkpoints final/ holds averaged (--average-checkpoints; their rows in
    # `evaluations` are marked `averaged`); None: final/ holds `final_step`'s own weights.
    final_averaged: list[int] | None = None
    # The guard set and the step its WER was held against ({"set", "step"}; None: no guard).
    guard_start: dict | None = None
    # The run's record (`config.record.RunRecord.to_dict`): every decision it acted on.
    record: dict = field(default_factory=dict)

    def wer_at(self, step: int | None, eval_set: str | None = None) -> float | None:
        """The WER of `eval_set` (default: the primary set) at `step`, if it was evaluated."""
        return self._wer_of(step, eval_set, None)

    def _wer_of(self, step: int | None, eval_set: str | None, averaged: list | None):
        eval_set = eval_set or self.primary_set
        found = [
            row["wer"]
            for row in self.evaluations
            if row["step"] == step and row.get("set", self.primary_set) == eval_set
            if row.get("averaged") == averaged  # an average's rows are no step's own
        ]
        return found[-1] if found else None

    @property
    def final_wer(self) -> float | None:
        """The primary set's WER of the model in final/."""
        return self._wer_of(self.final_step, None, self.final_averaged)


def write_result(result: TrainResult) -> None:
    """result.json, written whole or not at all (`whisper-train average` rewrites it)."""
    values = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(result).items()}
    write_atomically(result.output_dir / runfolder.RESULT_FILE, json.dumps(values, indent=1) + "\n")


def read_result(output_dir: Path) -> TrainResult:
    values = json.loads((output_dir / runfolder.RESULT_FILE).read_text(encoding="utf-8"))
    values["output_dir"] = Path(values["output_dir"])
    values["final_dir"] = Path(values["final_dir"]) if values["final_dir"] else None
    return TrainResult(**values)


class MetricsLog:
    """OUTPUT/metrics.jsonl (one JSON line per optimizer step and per evaluation) + TensorBoard
    + the other trackers of --report-to (`trackers.Trackers`, given the rows metrics.jsonl gets).

    A write that fails (a full disk, a quota) does not stop the run here: the first failure is
    kept (`failure`) and the rows from then on wait (`unwritten`); the loop sees it at the end
    of the step (`StopRequest`), saves a checkpoint and stops with one line. Nothing written
    before is lost: a row is appended whole or not at all.
    """

    def __init__(
        self,
        output_dir: Path,
        *,
        enabled: bool,
        purge_step: int | None = None,
        trackers: Trackers | None = None,
    ):
        """`purge_step`: on --resume, the first step after the checkpoint; TensorBoard then
        hides the events the interrupted run logged from that step on, as metrics.jsonl is cut
        back (without it, both runs' steps after the checkpoint show, one over the other).
        `trackers`: --report-to's (started here; None: TensorBoard alone)."""
        self.enabled = enabled
        self.trackers = trackers
        self.path = output_dir / runfolder.METRICS_FILE
        self.fd: int | None = None
        self.writer = None
        self.failure: OSError | None = None
        self.failed_path = self.path  # metrics.jsonl, or TensorBoard's folder
        self.reported = False  # whether the failure was said (`StopRequest.stop`)
        self.unwritten: list[dict] = []
        if not enabled:
            return
        if trackers is not None:
            trackers.start(output_dir)  # one line if one cannot start, before anything opens
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if trackers is not None and not trackers.tensorboard:
            return
        folder = output_dir / runfolder.TENSORBOARD_DIR
        try:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_writer_threads()  # before its thread starts: it may fail at once
            self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge_step)
            # Its first event written now: a folder it cannot write (another user's, a file in
            # the way) is met here, before step 1, not as a traceback or as a stop after step 1
            # that advises freeing space.
            self.writer.flush()
        except ImportError:  # the `tensorboard` extra: never fail a run over logging
            self.writer = None
            print(TENSORBOARD_MISSING, file=sys.stderr, flush=True)
        except OSError as exc:
            self.writer = None
            self.close()  # the other trackers' runs, started above, end
            raise UserError(
                f"--report-to tensorboard: cannot write {folder} ({exc.strerror or exc}); make "
                "it a folder this run can write, or leave tensorboard out of --report-to"
            ) from None

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        if self.failure is not None:
            self.unwritten.append(row)
            return
        try:
            _append_whole(self.fd, (json.dumps(row) + "\n").encode("utf-8"))
        except OSError as exc:
            self.failure = exc
            self.unwritten.append(row)
            return
        if self.trackers is not None:
            self.trackers.log(row)
        if self.writer is None:
            return
        try:
            # eval/<set>/wer for each evaluation set, train/loss for the steps
            for key, value in scalars(row).items():
                self.writer.add_scalar(key, value, row["step"])
            # Its thread writes the events: a failure there shows at this flush, this step.
            self.writer.flush()
        except OSError as exc:  # the row is in metrics.jsonl; TensorBoard's thread is gone
            self.failure, self.failed_path = exc, Path(self.writer.log_dir)
            self.writer = None

    def write_unwritten(self) -> int:
        """Try the rows that waited once more (after the checkpoint: space may be back); the
        number still unwritten."""
        while self.unwritten and self.fd is not None:
            try:
                _append_whole(self.fd, (json.dumps(self.unwritten[0]) + "\n").encode("utf-8"))
            except OSError:
                break
            self.unwritten.pop(0)
        return len(self.unwritten)

    def close(self) -> None:
        # A failure the loop did not stop for (in the last evaluation, after it): say so.
        if self.failure is not None and not self.reported:
            missing = self.write_unwritten()
            tqdm.write(
                f"could not write {self.failed_path} ({self.failure.strerror or self.failure})"
                + (f": its last {missing} row(s) are missing" if missing else "")
            )
            self.reported = True
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.trackers is not None:
            self.trackers.finish()
        if self.writer:
            with contextlib.suppress(OSError):  # a full disk: said already, or said at the stop
                self.writer.close()
            self.writer = None


def _append_whole(fd: int, data: bytes) -> None:
    """Append `data` to `fd` (opened O_APPEND) whole, or cut the file back to where it was."""
    end = os.lseek(fd, 0, os.SEEK_END)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, end)  # frees space: a half line would end the file otherwise
        raise


# TensorBoard's writer threads: an OSError that ends one is the run's to report (MetricsLog
# sees it at the next flush, and the run stops with one line), not a traceback on stderr.
# Known by their class, not registered once started: a folder it cannot write ends the thread
# at its first event, before the writer's constructor returns. Any other TensorBoard writer in
# the process loses nothing: its thread's error is raised again at its next flush or close.
def _quiet_writer_threads() -> None:
    if getattr(threading.excepthook, "_whisper_train", False):
        return
    previous = threading.excepthook

    def excepthook(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(
            args.exc_type, OSError
        ):
            return
        previous(args)

    excepthook._whisper_train = True
    threading.excepthook = excepthook


class ProgressTable:
    """The live `Step | Training Loss | Validation Loss | WER <set> ...` table, printed above
    the bar: the validation loss of the primary evaluation set, a WER column per set."""

    def __init__(self, enabled: bool, primary_set: str = "eval"):
        self.enabled = enabled
        self.primary_set = primary_set
        self.header_printed = False
        self.last_train_loss = float("nan")

    def row(self, evaluations: list[dict]) -> None:
        """One evaluation: a row per set of the same step."""
        if not self.enabled or not evaluations:
            return
        # A non-speech set has no WER: its column is the words per minute the model invented.
        wer_headers = [
            f"words/min {row['set']}"
            if "words_per_minute" in row
            else ("WER" if len(evaluations) == 1 else f"WER {row['set']}")
            for row in evaluations
        ]
        if not self.header_printed:
            columns = ["Step".rjust(6), "Training Loss", "Validation Loss"]
            tqdm.write(" | ".join(columns + [h.rjust(7) for h in wer_headers]))
            self.header_printed = True
        primary = next((r for r in evaluations if r["set"] == self.primary_set), evaluations[0])
        train_loss = "-" if math.isnan(self.last_train_loss) else f"{self.last_train_loss:.4f}"
        wers = [
            (
                f"{row['words_per_minute']:.1f}"
                if "words_per_minute" in row
                else f"{100 * row['wer']:.2f}%"
            ).rjust(max(7, len(header)))
            for row, header in zip(evaluations, wer_headers, strict=True)
        ]
        tqdm.write(
            " | ".join(
                [
                    f"{primary['step']:>6}",
                    f"{train_loss:>13}",
                    f"{primary.get('eval_loss', math.nan):>15.4f}",
                ]
                + wers
            )
        )


def step_line(step: int, total: int, loss: float, lr: float) -> str:
    """The plain progress line for logs: `step 20/300  loss 1.2345  lr 1.00e-05`."""
    shown = "-" if math.isnan(loss) else f"{loss:.4f}"  # every step of the window was skipped
    return f"step {step}/{total}  loss {shown}  lr {lr:.2e}"


def resume_command(config_file: Path, checkpoint: Path) -> str:
    """The command line that continues from `checkpoint` (the saved config holds every option)."""
    return (
        f"whisper-train train --config {shlex.quote(str(config_file))} "
        f"--resume {shlex.quote(str(checkpoint))}"
    )


class TrainingInterrupted(SystemExit):
    """SIGINT or SIGTERM stopped the run after a checkpoint; exits 130 or 143 (128 + signal)."""


class StopRequest:
    """SIGINT / SIGTERM ask the loop to finish the step in progress, save and exit.

    A second signal stops at once (KeyboardInterrupt). With several processes the request is
    shared at every step (a max-reduce of one number), so all of them stop after the same step
    even when the signal reached them at different moments.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, accelerator, metrics: MetricsLog | None = None):
        """`metrics`: the run log; a write of it that failed (a full disk) stops the run too,
        with one line (`stop`)."""
        self.accelerator = accelerator
        self.metrics = metrics
        self.signum = 0
        self.log_failed = False
        self.previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for signum in self.SIGNALS:
            self.previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def _handle(self, signum, frame) -> None:
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum
        # With several processes the line waits for their agreement (`requested`): torchrun
        # also sends SIGTERM to the others when a process dies, and those cannot save.
        if self.accelerator.is_main_process and self.accelerator.num_processes == 1:
            self._announce("finishing this step, then saving a checkpoint")

    def _announce(self, what: str) -> None:
        name = signal.Signals(self.signum).name
        print(f"\n{name}: {what} (send it again to stop at once)", file=sys.stderr, flush=True)

    def requested(self) -> bool:
        """Whether to save and stop after this step: a signal, or a failed write of the run
        log (process 0's), on any process. Every process calls this once a step."""
        failed = int(self.metrics is not None and self.metrics.failure is not None)
        if self.accelerator.num_processes > 1:
            # torch's MAX, not accelerate's reduce: before accelerate 1.14 (this project takes
            # 1.3 on) that summed for any reduction but "mean": two processes that both caught
            # SIGINT agreed on signal 4 and exited 132.
            flags = torch.tensor([self.signum, failed], device=self.accelerator.device)
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            self.signum, failed = (int(flag) for flag in flags.tolist())
            if self.signum and not failed and self.accelerator.is_main_process:
                self._announce("saving a checkpoint after this step")
        self.log_failed = bool(failed)
        return bool(self.signum or self.log_failed)

    @property
    def reason(self) -> str:
        """The checkpoint's line (`recipe.save_checkpoint`); none for a failed log: `stop`
        says it all in one line."""
        return "" if self.log_failed else "interrupted"

    def stop(self, checkpoint: Path, config_file: Path) -> NoReturn:
        """After the checkpoint: say how to continue and exit (128 + signal; 2 for a log that
        could not be written, as a UserError)."""
        command = resume_command(config_file, checkpoint)
        if not self.log_failed:
            say(self.accelerator, f"to continue: {command}")
            raise TrainingInterrupted(self.exit_code)
        if not self.accelerator.is_main_process:
            raise SystemExit(2)  # process 0, whose log it is, says why
        failure, path = self.metrics.failure, self.metrics.failed_path
        missing = self.metrics.write_unwritten()
        self.metrics.reported = True
        lost = f" ({missing} rows of the last steps are not in {path.name})" if missing else ""
        raise UserError(
            f"could not write {path} ({failure.strerror or failure}); stopped after saving "
            f"{checkpoint}{lost}; free some space, then continue with: {command}"
        )

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
