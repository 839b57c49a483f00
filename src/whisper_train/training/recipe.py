"""The fine-tuning recipe: one run, in named phases.

    recipe = FineTuneRecipe(config)
    recipe.setup()    # model and labels, data and its plan, the run's record of every decision
                      #   (`config.resolve.resolve_run`), then from the record: accelerator,
                      #   memory, loaders, optimisation, restore
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

import contextlib
import logging
import math
import time
from pathlib import Path

import torch
from accelerate.utils import send_to_device
from tqdm.auto import tqdm

from whisper_train import memory, runfolder
from whisper_train.config.record import ResumeChanges, resume_changes
from whisper_train.config.resolve import resolve_run
from whisper_train.config.run import RunConfig
from whisper_train.data.source import stand_in_batch
from whisper_train.evaluation.scoring import get_normalizer
from whisper_train.memory import loss_terms
from whisper_train.memory.wrappers import ddp_settings, unwrapped
from whisper_train.runlog import TrainResult, say, step_line
from whisper_train.training import checkpoints, resume, retention
from whisper_train.training.averaging import average_at_end
from whisper_train.training.checkpoints import save as checkpoint_save
from whisper_train.training.checkpoints.load import load_weights, saved_record
from whisper_train.training.final import FinalChoice
from whisper_train.training.finish import (
    encoder_cache_counts,
    refuse_nonfinite_final,
    say_what_was_skipped,
    trained_line,
    whole_model,
    write_run_outputs,
)
from whisper_train.training.judge import RunEvaluations
from whisper_train.training.setup_phases import (
    check_processes,
    gather_facts,
    join_processes,
    open_run_log,
    restore,
    setup_accelerator,
    setup_encoder_cache,
    setup_loaders,
    setup_memory,
    setup_optimisation,
)
from whisper_train.training.step import (
    LOSS_SUM_DTYPE,
    OptimizerStep,
    read_loss_and_norm,
    refuse_nonfinite_update,
    step_loss_weights,
    too_many_bad_steps,
)

log = logging.getLogger(__name__)


class FineTuneRecipe:
    """Full, LoRA or frozen-encoder fine-tuning of one Whisper model on accelerate."""

    def __init__(self, config: RunConfig):
        # What was asked: read by `setup`'s first phases and `resolve_run` only; every later
        # decision is read from the record they make (`self.record`).
        self.asked = config
        self.output_dir = Path(config.train.output_dir)
        # Chosen before any process moves a checkpoint (`setup_phases.restore`): every process
        # picks the same.
        resume_from = config.train.resume
        self.resume_point = (
            checkpoints.find_resume(resume_from, self.output_dir) if resume_from else None
        )
        self.resume_from = self.resume_point.folder if self.resume_point else None
        # The loop's own state (the rest of it, `state`, is what a checkpoint keeps).
        self.stopped_for_regression = False
        self.losses_since_log: list[float] = []  # finite step losses since the last log line
        self.train_seconds = 0.0
        self.new_sets: list[str] = []  # evaluation sets a --resume added: measured there first

    # -- setup ---------------------------------------------------------------------------------

    def setup(self) -> None:
        """Everything before step 1, in `setup_phases`. Each phase takes what it needs and
        returns what it builds, so the order here is the order in which they depend on one
        another: first the facts (model, data, its plan), then the record of every decision
        (`resolve_run`), then what the record sets up."""
        asked = self.asked
        process = join_processes()
        check_processes(asked.train.nproc, process.num_processes)
        saved, saved_options = saved_record(self.resume_from) if self.resume_from else (None, {})
        if self.resume_from is not None and saved is None:
            resume.check_recordless_options(self.resume_from, saved_options, asked)
        facts = gather_facts(
            asked,
            process=process,
            saved=resume.saved_choices(saved, saved_options) if self.resume_from else None,
        )
        model = facts.model
        self.processor, self.label_encoder = facts.processor, facts.label_encoder
        self.datasets, self.plan = facts.datasets, facts.plan
        self.multilingual = facts.multilingual
        # A multilingual model's sets are normalised by the languages they are decoded in
        # (None: `evaluate.normalizer_for`), which need not be the training language.
        self.normalizer = None if self.multilingual else get_normalizer("english")
        record = resolve_run(
            asked,
            width=model.config.d_model,
            multilingual=self.multilingual,
            device=process.device,
            processes=process.num_processes,
            data=facts.data,
        )
        changes = ResumeChanges()
        if saved is not None:
            step = checkpoints.TrainerState.read(self.resume_from).step
            changes = resume_changes(saved, record, folder=self.resume_from, step=step)
        self.new_sets = changes.new_sets
        # DDP's settings depend on the model (layerdrop), so the model is read first.
        ddp = ddp_settings(model)
        self.precision, self.accelerator = setup_accelerator(record, ddp)
        accelerator = self.accelerator
        for line in [*record.notes, *changes.lines]:
            say(accelerator, line)
        model, self.preserve, record = setup_memory(
            record,
            model,
            ddp,
            accelerator=accelerator,
            precision=self.precision,
            datasets=self.datasets,
            teacher=facts.teacher,
        )
        # Every decision is made: from here on the record is read, never what was asked.
        self.record = record
        # The checkpoints rotation keeps and the final model must fit: said now, not after
        # hours of training; the encoder cache leaves them that room.
        disk_needed = retention.check_room_for_run(
            model, record, output_dir=self.output_dir, resume_from=self.resume_from
        )
        # `complete`: a batch with its clips' cached encoder outputs (None: no cache).
        self.encoder_cache, self.complete = setup_encoder_cache(
            record,
            model,
            processor=self.processor,
            precision=self.precision,
            datasets=self.datasets,
            accelerator=accelerator,
            reserve_bytes=disk_needed,
        )
        self.data, eval_loaders, eval_languages = setup_loaders(
            record,
            self.plan,
            model,
            processor=self.processor,
            label_encoder=self.label_encoder,
            datasets=self.datasets,
            encoder_cache=self.encoder_cache,
            accelerator=accelerator,
        )
        self.model, self.optimizer, self.scheduler = setup_optimisation(
            record, model, precision=self.precision, accelerator=accelerator
        )
        self.state = restore(
            self.resume_point,
            saved=saved,
            replan=changes.replan,
            output_dir=self.output_dir,
            accelerator=accelerator,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            data=self.data,
        )
        self.first_step = self.state.step  # 0, or the step a --resume starts from
        self.metrics, self.table, self.progress, self.stop, self.show_bar = open_run_log(
            record,
            output_dir=self.output_dir,
            resumed=self.resume_from is not None,
            step=self.state.step,
            accelerator=accelerator,
        )
        self.judge = RunEvaluations(
            record.evaluation,
            loaders=eval_loaders,
            # A multilingual model's sets are decoded in their languages; English-only: in English.
            languages=eval_languages if self.multilingual else dict.fromkeys(eval_languages),
            processor=self.processor,
            normalizer=self.normalizer,
            accelerator=accelerator,
            metrics=self.metrics,
            table=self.table,
            complete=self.complete,
            rows=self.state.evaluations,
            guard_start=self.state.guard_start,
        )

    @property
    def total_steps(self) -> int:
        return self.record.training.total_steps

    # -- the loop ------------------------------------------------------------------------------

    def train(self) -> None:
        """Train until `total_steps` optimizer steps, evaluating, logging and saving on the way."""
        if self.record.evaluation.evaluating:
            self.stopped_for_regression = self.judge.measure_starts(
                self.model,
                step=self.state.step,
                resumed=self.resume_from is not None,
                new_sets=self.new_sets,
            )
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
        accelerator, state = self.accelerator, self.state
        weights, total_tokens = step_loss_weights(micro_batches, accelerator)
        # Cross-entropy x tokens, this process, kept on the device: reading it back would make
        # the host wait for the device after every micro-batch (see `step.read_loss_and_norm`).
        loss_sum = torch.zeros(
            (), device=accelerator.device, dtype=LOSS_SUM_DTYPE[accelerator.device.type]
        )
        for position, (batch, weight) in enumerate(zip(micro_batches, weights, strict=True)):
            if batch["size"]:
                # Moved now, not with the step's others: one micro-batch's inputs on the device
                # at a time, however large the accumulation. Non-blocking from pinned memory
                # (`data.loaders.pins_memory`): the copy overlaps the kernels still queued.
                batch = send_to_device(batch, accelerator.device, non_blocking=True)
                batch = self.complete(batch) if self.complete is not None else batch
            else:
                batch = stand_in_batch(
                    memory.whisper_of(unwrapped(self.model)).config,
                    accelerator.device,
                    encoder_outputs=self.encoder_cache is not None,
                    per_clip=self.record.data.per_clip,
                )
            last = position == len(micro_batches) - 1
            sync = contextlib.nullcontext() if last else accelerator.no_sync(self.model)
            with (
                sync,
                memory.activation_offload(
                    self.record.memory.offload_activations, accelerator.device
                ),
            ):
                terms = loss_terms(self.model, batch, preserve=self.preserve)
                # DDP averages the N processes' gradients: x N makes that average a sum.
                accelerator.backward(terms.loss * (weight * accelerator.num_processes))
            loss_sum += terms.cross_entropy.detach().to(loss_sum) * (weight * total_tokens)
        if accelerator.num_processes > 1:
            loss_sum = accelerator.reduce(loss_sum.reshape(1), reduction="sum").reshape(())
        if not total_tokens:  # nothing to learn anywhere: not a step (as before the stand-ins)
            self.optimizer.zero_grad(set_to_none=True)
            return None
        max_grad_norm = self.record.training.max_grad_norm
        max_norm = max_grad_norm if max_grad_norm > 0 else math.inf
        norm = accelerator.clip_grad_norm_(self.model.parameters(), max_norm)
        loss_sum, grad_norm = read_loss_and_norm(loss_sum, norm)
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
        record, state = self.record, self.state
        self._log_step(step)
        # An update can make weights NaN or infinite with a finite loss and gradient: stop at
        # once (`refuse_nonfinite_update`; see `nonfinite_tensors` for its measured cost).
        if not step.skipped:
            refuse_nonfinite_update(
                self.model, self.accelerator, state.step, record, self.output_dir
            )
        if state.bad_steps_in_a_row >= record.training.max_bad_steps:
            # The weights are finite (checked after every update above): the last good step's.
            # Not rotated: the older checkpoints the advice may name must stay (one over
            # --save-total-limit at most, and the run ends here).
            folder = self.save_checkpoint("too many bad steps", rotate=False)
            raise too_many_bad_steps(
                state.step,
                state.bad_steps_in_a_row,
                folder,
                precision=self.precision.name,
                record=record,
                output_dir=self.output_dir,
            )
        # A stop request first: an evaluation due now would outlast the grace period a
        # scheduler or torchrun gives after SIGTERM (torchrun kills workers after 30 s).
        if self.stop.requested():  # a signal, or a run log that could not be written
            folder = self.save_checkpoint(self.stop.reason)
            self.stop.stop(folder, self.output_dir / runfolder.CONFIG_FILE)
        last = state.step >= self.total_steps  # finish() evaluates and saves the last step
        new_best = False
        evaluation, save_steps = record.evaluation, record.output.save_steps
        every = evaluation.eval_steps
        if evaluation.evaluating and every and state.step % every == 0 and not last:
            self.stopped_for_regression = self.judge.evaluate(self.model, state.step)
            # final/ may be this step: keep its weights in a checkpoint until a better one.
            new_best = self.judge.final_choice().step == state.step
        if self.stopped_for_regression:
            self.save_checkpoint("stopped: the guard set regressed (--stop-on-regression)")
        elif save_steps and state.step % save_steps == 0 and not last:
            self.save_checkpoint("checkpoint")
        elif new_best:
            self.save_checkpoint(f"best {evaluation.primary} WER so far")

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
        if state.step % self.record.output.logging_steps and state.step < self.total_steps:
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
        """Optimizer steps an epoch (a stream's is known once counted, or after its first
        pass; until then the run's length stands in)."""
        return self.data.steps_per_epoch or self.total_steps

    def _epoch_fraction(self) -> float:
        done_before = self.state.epoch * self.steps_per_epoch
        return min(1.0, (self.state.step - done_before) / self.steps_per_epoch)

    # -- evaluation and checkpoints ------------------------------------------------------------

    def save_checkpoint(self, reason: str, *, rotate: bool = True) -> Path:
        """OUTPUT/checkpoint-<step>/ (atomically), then keep the newest and the best (unless
        `rotate` is False)."""
        self.state.evaluations, self.state.guard_start = self.judge.rows, self.judge.guard_start
        folder = checkpoint_save.save_checkpoint(
            self.output_dir / f"{checkpoints.PREFIX}{self.state.step}",
            accelerator=self.accelerator,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            state=self.state,
            config_yaml=self.record.to_yaml(),
            stream_position=self.data.saved_position(),
        )
        if rotate and self.accelerator.is_main_process:
            retention.rotate_checkpoints(
                self.output_dir,
                keep_last=self.record.output.save_total_limit,
                keep_steps=self.judge.steps_to_keep(retention.best_kept(self.record)),
                saved_step=self.state.step,
            )
        if reason:  # none when the caller's own line names the checkpoint
            say(self.accelerator, f"{reason}: saved {folder}")
        return folder

    # -- the end -------------------------------------------------------------------------------

    def finish(self) -> TrainResult:
        """The last checkpoint and evaluation, then OUTPUT/final/, result.json, curves.png and,
        with --compare-baseline, the before/after report (`finish`'s helpers). The run log and
        its trackers are closed however that ends: a failure there (a full disk at final/)
        leaves no MLflow or W&B run open."""
        try:
            return self._finish()
        finally:
            self.metrics.close()

    def _finish(self) -> TrainResult:
        record, state, accelerator = self.record, self.state, self.accelerator
        if record.evaluation.evaluating and not self.judge.measured(state.step):
            self.judge.evaluate(self.model, state.step)
        if record.output.save_steps and not self.stopped_for_regression:
            self.save_checkpoint("end of training")  # a later --resume can go further
        choice = self.judge.final_choice()
        best_folder = self.output_dir / f"{checkpoints.PREFIX}{choice.step}"
        if choice.step not in (None, state.step) and not best_folder.is_dir():
            choice = FinalChoice(state.step, f"the last step ({best_folder} is missing)")
        choice = average_at_end(
            record=record,
            output_dir=self.output_dir,
            last_step=state.step,
            chosen=choice,
            model=self.model,
            judge=self.judge,
            accelerator=accelerator,
        )
        self.data.report_skips(f"step {state.step}", state)
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
            [*self.judge.rows, *self.judge.averaged_rows],
            state.skipped_steps,
            final_step=choice.step if choice.step is not None else state.step,
            final_reason=choice.reason,
            final_averaged=list(choice.averaged) if choice.averaged else None,
            primary_set=record.evaluation.primary,
            guard_start=self.judge.guard_start,
            record=record.to_dict(),
        )
        accelerator.wait_for_everyone()
        if choice.step not in (None, state.step) and choice.averaged is None:  # an earlier step
            load_weights(best_folder, accelerator=accelerator, model=self.model)
        refuse_nonfinite_final(self.model, accelerator, result.final_step, record, self.output_dir)
        say(accelerator, f"final/: step {result.final_step}: {choice.reason}")
        # No step follows: what final/ loads (a quantized base's full-precision weights) and
        # copies must not stack on the optimizer's state and the steps' freed memory.
        memory.release_training_state(self.optimizer)
        final_model = whole_model(self.model, record.model, accelerator)
        # The last collective is done: every process passes this barrier together, so none
        # leaves while another still waits in a collective. What follows is the main process's
        # alone and may take long (final/ of a large model, the baseline comparison): the
        # others must not wait for it at a barrier, which NCCL gives up on after 10 minutes.
        # The process group is not destroyed here: each process keeps it until it exits
        # (`train.exit_keeping_process_group` says why).
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_run_outputs(
                final_model,
                result,
                record=record,
                processor=self.processor,
                datasets=self.datasets,
                accelerator=accelerator,
            )
        return result
