"""The fine-tuning recipe: one run, in named phases.

    recipe = FineTuneRecipe(config)
    recipe.setup()    # accelerator, model and labels, data, memory, loaders, optimisation, restore
    recipe.train()    # each step's micro-batches (`data.source`) → `_train_step`; then
                      #   `_after_step`: log, bad-step guard, stop if asked, evaluate, save
    result = recipe.finish()   # last evaluation, OUTPUT/final/, result.json, curves, report

The setup phases are the functions of `setup_phases`, the end's helpers those of `finish`;
what a step's checks refuse and advise is `step`'s. Where things are decided: which utterances
train and evaluate in `training.datasets`; their order, packing and each process's share in
`data.source` (read whole or streamed: the recipe does not know which); memory (freezing, LoRA,
checkpointing, precision, optimiser) in `whisper_train.memory`; what a checkpoint holds in
`checkpoints`, resuming from one in `resume`, which ones stay in `retention`; what the run
prints and logs in `runlog`; the loss in `memory.training_loss`. At the end `OUTPUT/final/`
holds a model folder that `transformers.pipeline("automatic-speech-recognition", model=...)`
loads.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import time
from pathlib import Path

import torch
from accelerate.utils import send_to_device
from tqdm.auto import tqdm

from whisper_train import memory, runfolder
from whisper_train.config import RunConfig
from whisper_train.data.loaders import default_num_workers
from whisper_train.data.source import stand_in_batch
from whisper_train.evaluation.evaluate import run_evaluation
from whisper_train.evaluation.longform import run_long_form_evaluation
from whisper_train.evaluation.scoring import get_normalizer
from whisper_train.memory import loss_terms
from whisper_train.memory.wrappers import unwrapped
from whisper_train.models import is_multilingual
from whisper_train.runlog import TrainResult, say, step_line
from whisper_train.training import checkpoints, resume, retention
from whisper_train.training.final import FinalChoice, choose_final_step, guard_regression
from whisper_train.training.finish import (
    encoder_cache_counts,
    refuse_nonfinite_final,
    say_what_was_skipped,
    trained_line,
    whole_model,
    write_run_outputs,
)
from whisper_train.training.launch import ddp_settings
from whisper_train.training.setup_phases import (
    open_run_log,
    restore,
    setup_accelerator,
    setup_data,
    setup_encoder_cache,
    setup_loaders,
    setup_memory,
    setup_model_and_labels,
    setup_optimisation,
)
from whisper_train.training.step import (
    OptimizerStep,
    refuse_nonfinite_update,
    step_loss_weights,
    too_many_bad_steps,
)

# Points of guard-set WER a chosen step may lose against the start, when --guard is given and
# --max-regression is not: a default picked by judgement, not measured.
DEFAULT_MAX_REGRESSION = 2.0

log = logging.getLogger(__name__)


class FineTuneRecipe:
    """Full, LoRA or frozen-encoder fine-tuning of one Whisper model on accelerate."""

    def __init__(self, config: RunConfig):
        self.config = config
        t = config.train
        self.output_dir = Path(t.output_dir)
        self.evaluating = not t.only_train
        # Chosen before any process moves a checkpoint (`setup_phases.restore`): every process
        # picks the same.
        self.resume_point = resume.find_resume(t.resume, self.output_dir) if t.resume else None
        self.resume_from = self.resume_point.folder if self.resume_point else None
        # What the evaluations are judged by: fixed by the configuration alone.
        self.primary_set = config.primary_eval_set
        self.guard = t.guard
        self.max_regression = t.max_regression
        if self.guard is not None and self.max_regression is None:
            self.max_regression = DEFAULT_MAX_REGRESSION
        self.decoding = config.decoding_options()
        # The loop's own state (the rest of it, `state`, is what a checkpoint keeps).
        self.stopped_for_regression = False
        self.losses_since_log: list[float] = []  # finite step losses since the last log line
        self.train_seconds = 0.0

    # -- setup ---------------------------------------------------------------------------------

    def setup(self) -> None:
        """Everything before step 1, in `setup_phases`. Each phase takes what it needs and
        returns what it builds, so the order here is the order in which they depend on one
        another."""
        c = self.config
        model, self.processor, self.label_encoder = setup_model_and_labels(c)
        self.multilingual = is_multilingual(model)
        # A multilingual model's sets are normalised by the languages they are decoded in
        # (None: `evaluate.normalizer_for`), which need not be the training language.
        self.normalizer = None if self.multilingual else get_normalizer("english")
        # DDP's settings depend on the model (layerdrop), so the model is read first.
        ddp = ddp_settings(model)
        self.precision, self.accelerator = setup_accelerator(c, ddp)
        accelerator = self.accelerator
        self.datasets = setup_data(c, model, self.label_encoder)
        model, self.offload, self.preserve = setup_memory(
            c,
            model,
            ddp,
            accelerator=accelerator,
            precision=self.precision,
            datasets=self.datasets,
            label_encoder=self.label_encoder,
        )
        # The checkpoints rotation keeps and the final model must fit: said now, not after
        # hours of training; the encoder cache leaves them that room.
        disk_needed = retention.check_room_for_run(
            model,
            c.train,
            evaluating=self.evaluating,
            output_dir=self.output_dir,
            resume_from=self.resume_from,
        )
        self.encoder_cache, self.frozen_encoder = setup_encoder_cache(
            c,
            model,
            processor=self.processor,
            precision=self.precision,
            datasets=self.datasets,
            accelerator=accelerator,
            reserve_bytes=disk_needed,
        )
        # The data workers' default depends on the device (`default_num_workers`); the saved
        # configuration keeps what was asked for.
        workers = default_num_workers(c.train.num_workers, accelerator)
        loader_config = dataclasses.replace(
            c, train=dataclasses.replace(c.train, num_workers=workers)
        )
        self.data, self.eval_loaders, self.eval_languages = setup_loaders(
            loader_config,
            model,
            processor=self.processor,
            label_encoder=self.label_encoder,
            datasets=self.datasets,
            encoder_cache=self.encoder_cache,
            accelerator=accelerator,
        )
        t = c.train
        self.total_steps = t.max_steps or math.ceil((t.epochs or 3.0) * self.steps_per_epoch)
        self.model, self.optimizer, self.scheduler = setup_optimisation(
            c,
            model,
            precision=self.precision,
            accelerator=accelerator,
            total_steps=self.total_steps,
        )
        self.state = restore(
            self.resume_point,
            output_dir=self.output_dir,
            accelerator=accelerator,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            data=self.data,
        )
        self.evaluations: list[dict] = list(self.state.evaluations)
        self.first_step = self.state.step  # 0, or the step a --resume starts from
        self.metrics, self.table, self.progress, self.stop, self.show_bar = open_run_log(
            c,
            output_dir=self.output_dir,
            resumed=self.resume_from is not None,
            step=self.state.step,
            total_steps=self.total_steps,
            primary_set=self.primary_set,
            accelerator=accelerator,
        )

    def _with_encoder_outputs(self, batch: dict) -> dict:
        """`batch` with every clip's encoder outputs: the ones the cache lacked are encoded now
        (and stored, within its limits)."""
        if self.encoder_cache is None or not batch["size"]:
            return batch
        dtype = self.precision.dtype
        return self.encoder_cache.complete(
            batch,
            self.frozen_encoder,
            autocast_dtype=dtype if dtype != torch.float32 else None,
        )

    # -- the loop ------------------------------------------------------------------------------

    def train(self) -> None:
        """Train until `total_steps` optimizer steps, evaluating, logging and saving on the way."""
        t = self.config.train
        # The guard's WER before any training is what every later one is compared with.
        if self.evaluating and (t.eval_at_start or self.guard) and self.resume_from is None:
            self.evaluate(0)
        if self.state.step >= self.total_steps:
            return  # resumed from the last step: nothing left to train
        self.stop.install()
        self.model.train()
        start = time.perf_counter()
        try:
            for micro_batches in self.data.steps(self.state):
                step = self._train_step(micro_batches)
                if step is None:
                    continue  # no process had a usable clip in this step's micro-batches
                self._after_step(step)
                if self.state.step >= self.total_steps or self.stopped_for_regression:
                    return
        except BaseException:
            self.metrics.close()
            raise
        finally:
            self.stop.restore()
            self.progress.close()
            self.train_seconds = time.perf_counter() - start

    def _train_step(self, micro_batches: list[dict]) -> OptimizerStep | None:
        """One optimizer step: forward and backward on each of its micro-batches (gradients
        all-reduced on the last only), then clip, step and zero the gradients.

        The loss is the token mean over every micro-batch of the step on every process: each
        micro-batch's token-mean loss is weighted by its share of the step's label tokens
        (`step_loss_weights`), so batch 2 x accumulation 2 is batch 4 whatever the label
        lengths. An empty micro-batch (a process's share ran out, or none of its clips could be
        read) runs a stand-in row with zero weight: every process executes the same forwards,
        backwards and collectives whatever its data.
        """
        accelerator, state, t = self.accelerator, self.state, self.config.train
        state.skipped_clips += sum(len(batch["skipped"]) for batch in micro_batches)
        weights, total_tokens = step_loss_weights(micro_batches, accelerator)
        # Cross-entropy x tokens, this process, kept on the device: reading it back would make
        # the host wait for the device after every micro-batch (see `_read_loss_and_norm`).
        loss_sum = torch.zeros(
            (), device=accelerator.device, dtype=_LOSS_SUM_DTYPE[accelerator.device.type]
        )
        for position, (batch, weight) in enumerate(zip(micro_batches, weights, strict=True)):
            if batch["size"]:
                # Moved now, not with the step's others: one micro-batch's inputs on the device
                # at a time, however large the accumulation. Non-blocking from pinned memory
                # (`data.loaders.pins_memory`): the copy overlaps the kernels still queued.
                batch = send_to_device(batch, accelerator.device, non_blocking=True)
                batch = self._with_encoder_outputs(batch)
            else:
                batch = stand_in_batch(
                    memory.whisper_of(unwrapped(self.model)).config,
                    accelerator.device,
                    encoder_outputs=self.encoder_cache is not None,
                    per_clip=self.config.packing_per_clip,
                )
            last = position == len(micro_batches) - 1
            sync = contextlib.nullcontext() if last else accelerator.no_sync(self.model)
            with sync, memory.activation_offload(self.offload, accelerator.device):
                terms = loss_terms(self.model, batch, preserve=self.preserve)
                # DDP averages the N processes' gradients: x N makes that average a sum.
                accelerator.backward(terms.loss * (weight * accelerator.num_processes))
            loss_sum += terms.cross_entropy.detach().to(loss_sum) * (weight * total_tokens)
        if accelerator.num_processes > 1:
            loss_sum = accelerator.reduce(loss_sum.reshape(1), reduction="sum").reshape(())
        if not total_tokens:  # nothing to learn anywhere: not a step (as before the stand-ins)
            self.optimizer.zero_grad(set_to_none=True)
            return None
        max_norm = t.max_grad_norm if t.max_grad_norm > 0 else math.inf
        norm = accelerator.clip_grad_norm_(self.model.parameters(), max_norm)
        loss_sum, grad_norm = _read_loss_and_norm(loss_sum, norm)
        step_loss = loss_sum / total_tokens
        skipped = not (math.isfinite(step_loss) and math.isfinite(grad_norm))
        if accelerator.scaler is not None:
            self.optimizer.step()  # the fp16 scaler skips non-finite gradients itself
            skipped = skipped or self.optimizer.step_was_skipped
        elif not skipped:
            self.optimizer.step()
        if not skipped:
            self.scheduler.step()
        # Free the gradients as soon as they are used: no need for that memory any more.
        self.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        return OptimizerStep(step_loss, grad_norm, skipped)

    def _after_step(self, step: OptimizerStep) -> None:
        """After an optimizer step, in order: log it, stop after too many bad steps, stop if
        asked (SIGINT/SIGTERM), evaluate, save a checkpoint."""
        c, t, state = self.config, self.config.train, self.state
        self._log_step(step)
        # An update can make weights NaN or infinite with a finite loss and gradient: stop at
        # once (`refuse_nonfinite_update`; see `nonfinite_tensors` for its measured cost).
        if not step.skipped:
            refuse_nonfinite_update(self.model, self.accelerator, state.step, c, self.output_dir)
        if state.bad_steps_in_a_row >= t.max_bad_steps:
            # The weights are finite (checked after every update above): the last good step's.
            # Not rotated: the older checkpoints the advice may name must stay (one over
            # --save-total-limit at most, and the run ends here).
            folder = self.save_checkpoint("too many bad steps", rotate=False)
            raise too_many_bad_steps(
                state.step,
                state.bad_steps_in_a_row,
                folder,
                precision=self.precision.name,
                config=c,
                output_dir=self.output_dir,
            )
        # A stop request first: an evaluation due now would outlast the grace period a
        # scheduler or torchrun gives after SIGTERM (torchrun kills workers after 30 s).
        if self.stop.requested():  # a signal, or a run log that could not be written
            folder = self.save_checkpoint(self.stop.reason)
            self.stop.stop(folder, self.output_dir / runfolder.CONFIG_FILE)
        last = state.step >= self.total_steps  # finish() evaluates and saves the last step
        new_best = False
        if self.evaluating and t.eval_steps and state.step % t.eval_steps == 0 and not last:
            self.evaluate(state.step)
            # final/ may be this step: keep its weights in a checkpoint until a better one.
            new_best = self._final_choice().step == state.step
        if self.stopped_for_regression:
            self.save_checkpoint("stopped: the guard set regressed (--stop-on-regression)")
        elif t.save_steps and state.step % t.save_steps == 0 and not last:
            self.save_checkpoint("checkpoint")
        elif new_best:
            self.save_checkpoint(f"best {self.primary_set} WER so far")

    def _log_step(self, step: OptimizerStep) -> None:
        """A metrics.jsonl row for every step; a log line (or the bar's loss) every
        --logging-steps steps with the mean loss since the last one."""
        state = self.state
        row = {
            "step": state.step,
            "loss": None if step.skipped else round(step.loss, 6),
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": round(step.grad_norm, 6) if math.isfinite(step.grad_norm) else None,
            "epoch": round(state.epoch + self._epoch_fraction(), 4),
        }
        if step.skipped:
            state.skipped_steps += 1
            state.bad_steps_in_a_row += 1
            row["skipped"] = "non-finite loss or gradient"
        else:
            state.bad_steps_in_a_row = 0
            self.table.last_train_loss = step.loss
            self.losses_since_log.append(step.loss)
        self.metrics.write(row)
        self.progress.update(1)
        if state.step % self.config.train.logging_steps and state.step < self.total_steps:
            return
        window = self.losses_since_log
        mean_loss = sum(window) / len(window) if window else math.nan
        window.clear()
        if self.show_bar:
            self.progress.set_postfix(loss=f"{mean_loss:.4f}")
        elif self.accelerator.is_main_process:
            tqdm.write(step_line(state.step, self.total_steps, mean_loss, row["lr"]))

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps an epoch, from the data source's micro-batches an epoch (a stream's
        is known once counted, or after its first pass)."""
        accumulation = self.config.train.gradient_accumulation
        return max(1, math.ceil(self.data.batches_per_epoch / accumulation))

    def _epoch_fraction(self) -> float:
        done_before = self.state.epoch * self.steps_per_epoch
        return min(1.0, (self.state.step - done_before) / self.steps_per_epoch)

    # -- evaluation and checkpoints ------------------------------------------------------------

    def evaluate(self, step: int) -> list[dict]:
        """Every evaluation set: validation loss, generate-based WER, loop and insertion rates
        (a metrics line each, one table row), then the guard's verdict."""
        rows = []
        # --fsdp: each process decodes its own clips, a different number of forwards each, so
        # the weights are gathered whole for the evaluation (no collective inside a forward).
        with memory.gathered(self.model):
            for name, loader in self.eval_loaders.items():
                rows.append(self._evaluate_set(name, loader, step))
        self.evaluations.extend(rows)
        self.table.row(rows)
        self.model.train()
        self._check_guard(step)
        return rows

    def _evaluate_set(self, name: str, loader, step: int) -> dict:
        """One evaluation set's metrics row at `step`, written to metrics.jsonl."""
        languages = self.eval_languages[name] if self.multilingual else None
        if self.config.eval_set_long_form(name):  # whole recordings, decoded in 30 s windows
            row = run_long_form_evaluation(
                self.model,
                loader,
                self.processor,
                self.accelerator,
                self.normalizer,
                step,
                decoding=self.decoding,
                condition_on_previous_text=self.config.train.condition_on_previous_text,
                languages=languages,
            )
        else:
            device = self.accelerator.device
            batches = (send_to_device(batch, device) for batch in loader)
            if self.encoder_cache is not None:  # batches complete with their encoder outputs
                batches = map(self._with_encoder_outputs, batches)
            row = run_evaluation(
                self.model,
                batches,
                self.processor,
                self.accelerator,
                self.normalizer,
                self.config.train.generation_max_length,
                step,
                self.decoding,
                languages=languages,
            )
        row = {"step": step, "set": name, **row}
        self.metrics.write(row)
        return row

    def _check_guard(self, step: int) -> None:
        """Say so when the guard set's WER rose past --max-regression points over the start;
        with --stop-on-regression, ask the loop to stop."""
        regression = guard_regression(self.evaluations, self.guard, step)
        if regression is None or regression <= self.max_regression:
            return
        say(
            self.accelerator,
            f"guard {self.guard}: WER {regression:+.1f} points over the start at step {step}, "
            f"past --max-regression {self.max_regression:g}: this step will not go to final/"
            + ("; stopping (--stop-on-regression)" if self.config.train.stop_on_regression else ""),
        )
        self.stopped_for_regression = self.config.train.stop_on_regression

    def _final_choice(self) -> FinalChoice:
        return choose_final_step(
            self.evaluations,
            primary_set=self.primary_set,
            guard=self.guard,
            max_regression=self.max_regression,
        )

    def save_checkpoint(self, reason: str, *, rotate: bool = True) -> Path:
        """OUTPUT/checkpoint-<step>/ (atomically), then keep the newest and the best (unless
        `rotate` is False)."""
        self.state.evaluations = self.evaluations
        folder = checkpoints.save_checkpoint(
            self.output_dir / f"{checkpoints.PREFIX}{self.state.step}",
            accelerator=self.accelerator,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            state=self.state,
            config_yaml=self.config.to_saved_yaml(),
            stream_position=self.data.saved_position(),
        )
        if rotate and self.accelerator.is_main_process:
            retention.rotate_checkpoints(
                self.output_dir,
                keep_last=self.config.train.save_total_limit,
                keep_step=self._final_choice().step,
                saved_step=self.state.step,
            )
        if reason:  # none when the caller's own line names the checkpoint
            say(self.accelerator, f"{reason}: saved {folder}")
        return folder

    # -- the end -------------------------------------------------------------------------------

    def finish(self) -> TrainResult:
        """The last checkpoint and evaluation, then OUTPUT/final/, result.json, curves.png and,
        with --compare-baseline, the before/after report (`finish`'s helpers)."""
        c, state, accelerator = self.config, self.state, self.accelerator
        if self.evaluating and not any(row["step"] == state.step for row in self.evaluations):
            self.evaluate(state.step)
        if c.train.save_steps and not self.stopped_for_regression:
            self.save_checkpoint("end of training")  # a later --resume can go further
        choice = self._final_choice()
        best_folder = self.output_dir / f"{checkpoints.PREFIX}{choice.step}"
        if choice.step not in (None, state.step) and not best_folder.is_dir():
            choice = FinalChoice(state.step, f"the last step ({best_folder} is missing)")
        self.data.report_skips(f"step {state.step}")
        say_what_was_skipped(accelerator, state)
        say(accelerator, trained_line(self.first_step, state.step, self.train_seconds))
        if self.encoder_cache is not None:
            say(accelerator, encoder_cache_counts(self.encoder_cache, accelerator))
        result = TrainResult(
            self.output_dir,
            None,
            state.step,
            getattr(self.data, "stream_samples", None) or len(self.datasets.train),
            sum(len(examples) for examples in self.datasets.eval.values()),
            state.skipped_clips,
            self.evaluations,
            state.skipped_steps,
            final_step=choice.step if choice.step is not None else state.step,
            final_reason=choice.reason,
            primary_set=self.primary_set,
        )
        accelerator.wait_for_everyone()
        if choice.step not in (None, state.step):  # an earlier step was better
            resume.load_weights(best_folder, accelerator=accelerator, model=self.model)
        refuse_nonfinite_final(self.model, accelerator, result.final_step, c, self.output_dir)
        say(accelerator, f"final/: step {result.final_step}: {choice.reason}")
        final_model = whole_model(self.model, c, accelerator)
        # The last collective is done: every process leaves the group together now (a process
        # that tore its group down while the main one still worked left the main one's gloo
        # teardown waiting for ever: ~ProcessGroupGloo in a thread join, once in four runs of
        # test_two_processes_share_one_pass). What follows is the main process's alone and
        # may take long (final/ of a large model, the baseline comparison): the others must
        # not wait for it at a barrier, which NCCL gives up on after 10 minutes.
        accelerator.wait_for_everyone()
        accelerator.end_training()
        if accelerator.is_main_process:
            write_run_outputs(
                final_model,
                result,
                config=c,
                processor=self.processor,
                precision=self.precision.name,
                datasets=self.datasets,
                primary_set=self.primary_set,
                decoding=self.decoding,
                accelerator=accelerator,
            )
        self.metrics.close()
        return result


# The step's loss is summed in float64, as the host did before it stayed on the device; Apple's
# MPS has no float64.
_LOSS_SUM_DTYPE = collections.defaultdict(lambda: torch.float64, mps=torch.float32)


def _read_loss_and_norm(loss_sum: torch.Tensor, norm) -> tuple[float, float]:
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
