"""--report-to: the experiment trackers a run's metrics rows go to besides metrics.jsonl.

TensorBoard is the run log's own writer (`runlog.MetricsLog`: it also hides an interrupted
run's later steps on --resume); MLflow and Weights & Biases are accelerate's trackers
(`Accelerator(log_with=...)`, `init_trackers`, `log`), which log from the main process only.
Each gets the rows of metrics.jsonl under TensorBoard's names (`scalars`) and the resolved
configuration. Their packages are extras (`pip install 'whisper-train[mlflow]'`), checked
before anything loads (`check_installed`); a tracker that cannot start (no server, no key, a
folder it cannot write) is one line naming the setting it needs, before step 1: nothing is
trained yet, so stopping loses nothing, and a run the user asked to watch never goes unwatched
for hours. A tracker that fails later (its server gone, its disk full) is one line and the run
goes on without it: by then hours of training are at stake, and metrics.jsonl has every row.
A --resume'd run is a new run in each tracker, named for the step it resumes from: MLflow keeps
every value logged at a step and W&B drops steps lower than its last, so neither could take the
interrupted run's steps after the checkpoint back.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import tempfile
import traceback
from pathlib import Path

import yaml
from tqdm.auto import tqdm

from whisper_train.errors import UserError

# The trackers accelerate runs, each with the extra that installs its package.
EXTRAS = {"mlflow": "mlflow", "wandb": "wandb"}
# What each needs set when it cannot start.
SETTINGS = {
    "mlflow": "set MLFLOW_TRACKING_URI to a tracking server (http://HOST:5000), or to file:DIR "
    "with MLFLOW_ALLOW_FILE_STORE=true for files on disk",
    "wandb": "run `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to keep the "
    "run on disk (`wandb sync` uploads it later)",
}
PROJECT = "whisper-train"  # MLflow's experiment (MLFLOW_EXPERIMENT_NAME wins), W&B's project


def chosen(report_to: list[str] | None) -> list[str]:
    """The trackers named, each once, in order ("none" names none)."""
    return list(dict.fromkeys(name for name in report_to or [] if name != "none"))


def accelerate_trackers(report_to: list[str] | None) -> list[str]:
    """`Accelerator(log_with=...)`: the trackers accelerate starts (all but TensorBoard)."""
    return [name for name in chosen(report_to) if name in EXTRAS]


def check_installed(report_to: list[str] | None) -> None:
    """Each tracker's package imports, or one line naming the extra that installs it."""
    for name in accelerate_trackers(report_to):
        try:
            importlib.import_module(name)
        except Exception as exc:  # missing, or broken by another package's version
            why = "is not installed" if isinstance(exc, ImportError) else f"does not import ({exc})"
            raise UserError(
                f"--report-to {name}: {name} {why}; install it with "
                f"pip install 'whisper-train[{EXTRAS[name]}]'"
            ) from None


def scalars(row: dict) -> dict[str, float]:
    """A metrics.jsonl row's finite numbers by TensorBoard's names: train/<key> for a step,
    eval/<set>/<key> for an evaluation set (eval/held-out/wer)."""
    scope = f"eval/{row['set']}" if "set" in row else "train"
    return {
        f"{scope}/{key}": value
        for key, value in row.items()
        if key != "step" and isinstance(value, (int, float)) and math.isfinite(value)
    }


def flat_config(config_yaml: str) -> dict:
    """The resolved configuration (whisper-train.yaml) as {group.option: value}: MLflow's
    parameters are flat."""
    values = yaml.safe_load(config_yaml) or {}
    return {
        f"{group}.{key}": ",".join(map(str, value)) if isinstance(value, list) else value
        for group, options in values.items()
        for key, value in options.items()
    }


class Trackers:
    """The trackers of --report-to for one run: started when the run log opens, given each
    row it writes, finished when it closes. Only the main process's are started."""

    def __init__(
        self,
        accelerator,
        report_to: list[str] | None,
        config_yaml: str,
        *,
        resumed_from: int | None = None,
    ):
        """`resumed_from`: on --resume, the checkpoint's step (the new runs' names say it)."""
        self.accelerator = accelerator
        self.names = accelerate_trackers(report_to)
        self.tensorboard = "tensorboard" in chosen(report_to)
        self.config_yaml = config_yaml
        self.resumed_from = resumed_from
        self.started = False

    def start(self, output_dir: Path) -> None:
        """A run in each tracker, named after OUTPUT (a resumed one: "OUTPUT (resumed from step
        N)"), with the configuration as parameters; W&B's files go to OUTPUT/wandb/ unless
        WANDB_DIR says where."""
        if not self.names:
            return
        check_installed(self.names)
        name = output_dir.name
        if self.resumed_from is not None:
            # Told apart from the interrupted run of the same name, whose steps after the
            # checkpoint this run logs again (see the module's docstring).
            name = f"{name} (resumed from step {self.resumed_from})"
        wandb = {"name": name}
        if not os.environ.get("WANDB_DIR"):
            wandb["dir"] = str(output_dir)
        elif "wandb" in self.names:
            _check_wandb_dir(os.environ["WANDB_DIR"])
        try:
            self.accelerator.init_trackers(
                PROJECT,
                config=flat_config(self.config_yaml),
                init_kwargs={"mlflow": {"run_name": name}, "wandb": wandb},
            )
        except Exception as exc:
            name = _tracker_of(exc, self.names)
            self.started = True
            self.finish()  # the ones that did start
            settings = "; ".join(SETTINGS[one] for one in name.split(","))
            raise UserError(
                f"--report-to {name}: could not start ({_first_line(exc)}); {settings}"
            ) from None
        self.started = True

    def log(self, row: dict) -> None:
        """One metrics.jsonl row, at its step. A tracker that fails (its server gone, its disk
        full) is said once and no longer logged to: the run goes on, metrics.jsonl has every
        row, and the other trackers still get every row."""
        if not self.started:
            return
        values = scalars(row)
        if not values:
            return
        # Each tracker on its own, not `accelerator.log`: that stops at the first tracker that
        # raises, and the others would miss the row (or, ended with it, every later row).
        for tracker in list(self.accelerator.trackers):
            try:
                tracker.log(values, step=row["step"])
            except Exception as exc:
                tqdm.write(
                    f"--report-to {tracker.name}: stopped logging at step {row['step']} "
                    f"({_first_line(exc)}); metrics.jsonl has every row"
                )
                self.accelerator.trackers.remove(tracker)
                with contextlib.suppress(Exception):  # a full disk may refuse its end too
                    tracker.finish()

    def finish(self) -> None:
        """End each tracker's run (accelerate's `end_training` does too, but it also leaves the
        process group, which this process may still need)."""
        if not self.started:
            return
        self.started = False
        for tracker in self.accelerator.trackers:
            with contextlib.suppress(Exception):  # a run that cannot end must not end the run
                tracker.finish()
        self.accelerator.trackers.clear()


def _check_wandb_dir(folder: str) -> None:
    """WANDB_DIR is a folder this process can write, or one line naming it. W&B itself would
    fall back to the system's temporary folder, with three warnings (none under WANDB_SILENT):
    an offline run's files there are not where the user looks, and go at the next reboot."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise UserError(
            f"--report-to wandb: WANDB_DIR={folder} is not a folder this run can write "
            f"({exc.strerror or exc}); set WANDB_DIR to one it can, or unset it to keep W&B's "
            "files in --output-dir (OUTPUT/wandb/)"
        ) from None


def _tracker_of(exc: BaseException, names: list[str]) -> str:
    """The tracker whose package raised `exc` (the innermost of its frames), else all named."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        parts = Path(frame.filename).parts
        for name in names:
            if name in parts:
                return name
    module = type(exc).__module__.split(".")[0]
    return module if module in names else ",".join(names)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
