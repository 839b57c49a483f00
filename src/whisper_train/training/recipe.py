"""The fine-tuning recipe: one run, in named phases.

    recipe = FineTuneRecipe(config)
    recipe.setup()    # accelerator, model and labels, data, memory, loaders, optimisation, restore
    recipe.train()    # each step's micro-batches (`data.source`) → `_train_step`; then
                      #   `_after_step`: log, bad-step guard, stop if asked, evaluate, save
    result = recipe.finish()   # last evaluation, OUTPUT/final/, result.json, curves, report

Where things are decided: which utterances train and evaluate in `training.datasets`; their
order, packing and each process's share in `data.source` (read whole or streamed: the recipe
does not know which); memory (freezing, LoRA, checkpointing, precision, optimiser) in
`whisper_train.memory`; what a checkpoint holds in `checkpoints`; what the run prints and logs in
`runlog`; the loss in `memory.training_loss`. At the end `OUTPUT/final/` holds a model folder
that `transformers.pipeline("automatic-speech-recognition", model=...)` loads.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shlex
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import (
    DistributedDataParallelKwargs,
    DistributedType,
    send_to_device,
    set_seed,
)
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import WhisperProcessor, get_scheduler

from whisper_train import doctor, memory, runfolder
from whisper_train.config import RunConfig
from whisper_train.data.augment import spec_augment_overrides
from whisper_train.data.collate import SpeechCollator
from whisper_train.data.features import LogMel, SpeechDataset
from whisper_train.data.labels import LabelEncoder, configure_generation
from whisper_train.data.source import (
    TrainingData,
    build_training_data,
    evaluation_loader,
    stand_in_batch,
)
from whisper_train.errors import UserError
from whisper_train.evaluation.evaluate import row_languages, run_evaluation
from whisper_train.evaluation.report import write_curves_png
from whisper_train.evaluation.scoring import get_normalizer
from whisper_train.memory import loss_terms
from whisper_train.memory.plan import encoder_cache_line
from whisper_train.memory.wrappers import unwrapped
from whisper_train.models import is_multilingual, load_model
from whisper_train.runlog import (
    MetricsLog,
    ProgressTable,
    StopRequest,
    TrainResult,
    progress_bars_wanted,
    resume_command,
    say,
    step_line,
    write_result,
)
from whisper_train.trackers import Trackers, accelerate_trackers
from whisper_train.training import checkpoints, model_card
from whisper_train.training.datasets import Datasets, prepare_datasets
from whisper_train.training.encoder_cache import CachedClip, EncoderCache, EncoderCacheCollator
from whisper_train.training.encoder_cache import cache_dir as encoder_cache_dir
from whisper_train.training.final import (
    FinalChoice,
    choose_final_step,
    compare_with_baseline,
    guard_regression,
    save_final,
)
from whisper_train.training.launch import ddp_settings, inside_launcher
from whisper_train.training.step import (
    OptimizerStep,
    lower_learning_rate,
    nonfinite_tensors,
    step_loss_weights,
)
from whisper_train.units import parse_bytes

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
        # Chosen before any process moves a checkpoint (`_restore`): every process picks the same.
        self.resume_point = checkpoints.find_resume(t.resume, self.output_dir) if t.resume else None
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
        """Everything before step 1. Each phase takes what it needs and returns what it builds,
        so the order here is the order in which they depend on one another."""
        model, self.processor, self.label_encoder = self._setup_model_and_labels()
        self.multilingual = is_multilingual(model)
        # A multilingual model's sets are normalised by the languages they are decoded in
        # (None: `evaluate.normalizer_for`), which need not be the training language.
        self.normalizer = None if self.multilingual else get_normalizer("english")
        # DDP's settings depend on the model (layerdrop), so the model is read first.
        ddp = ddp_settings(model)
        self.precision, self.accelerator = self._setup_accelerator(ddp)
        self.datasets = self._setup_data(model, self.label_encoder)
        model, self.offload, self.preserve = self._setup_memory(model, ddp)
        self.encoder_cache, self.frozen_encoder = self._setup_encoder_cache(model)
        self.data, self.eval_loaders, self.eval_languages = self._setup_loaders(model)
        self.model, self.optimizer, self.scheduler = self._setup_optimisation(model)
        self.state = self._restore()
        self.evaluations: list[dict] = list(self.state.evaluations)
        self.first_step = self.state.step  # 0, or the step a --resume starts from
        self.metrics, self.table, self.progress, self.stop = self._open_run_log()

    def _setup_accelerator(
        self, ddp_kwargs: DistributedDataParallelKwargs
    ) -> tuple[memory.Precision, Accelerator]:
        """The precision and the Accelerator of this process (the process group joined)."""
        t = self.config.train
        precision = memory.resolve_precision(self.config.memory.precision, _default_device())
        # accelerate keeps one AcceleratorState a process and refuses an Accelerator with another
        # mixed precision ("restart your runtime"): a second train() in a notebook starts from a
        # clean one. The process group (PartialState) is kept.
        AcceleratorState._reset_state(reset_partial_state=False)
        accelerator = Accelerator(
            mixed_precision=precision.mixed_precision,
            # Accumulation is the step loop's (`_train_step`: the token mean over the step's
            # micro-batches, gradients all-reduced on the last): accelerate's would divide by N.
            gradient_accumulation_steps=1,
            kwargs_handlers=[ddp_kwargs],
            # The scheduler is stepped by hand once per optimizer step (not once per process,
            # accelerate's default), so N processes follow the single-process LR schedule.
            step_scheduler_with_optimizer=False,
            # Without a GPU, processes started by a launcher talk through gloo on the CPU;
            # accelerate does that only when told the run is on the CPU.
            cpu=inside_launcher() and not torch.cuda.is_available(),
            log_with=accelerate_trackers(t.report_to) or None,  # started by the run log
        )
        if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
            raise UserError(
                "accelerate's DeepSpeed and FSDP configurations are not supported: shard with "
                "--fsdp (--nproc N, or accelerate launch with a data-parallel configuration)"
            )
        if t.nproc > 1 and accelerator.num_processes != t.nproc:
            raise UserError(
                f"--nproc {t.nproc}: the launcher started {accelerator.num_processes} "
                "processes; drop --nproc when using accelerate launch or torchrun"
            )
        set_seed(t.seed)
        return precision, accelerator

    def _setup_model_and_labels(self) -> tuple[torch.nn.Module, WhisperProcessor, LabelEncoder]:
        """The model to train and its processor, with its generation settings (language, task)
        and SpecAugment; the encoder of the labels it learns."""
        c = self.config
        model, processor = load_model(
            c.model.model, attn_implementation=c.model.attn_implementation
        )
        multilingual = is_multilingual(model)
        label_encoder = LabelEncoder(
            processor.tokenizer,
            language=c.data.language,
            task=c.data.task,
            timestamps=c.data.timestamps,
            multilingual=multilingual,
        )
        configure_generation(
            model.generation_config,
            language=c.data.language,
            task=c.data.task,
            multilingual=multilingual,
        )
        if c.data.spec_augment:
            for key, value in spec_augment_overrides().items():
                setattr(model.config, key, value)
        return model, processor, label_encoder

    def _setup_data(self, model, label_encoder: LabelEncoder) -> Datasets:
        """The evaluation sets, and the training set when it is read whole (a stream is opened
        by the training data source, `_setup_loaders`)."""
        return prepare_datasets(
            self.config, label_encoder, max_label_tokens=model.config.max_target_positions
        )

    def _setup_memory(
        self, model, ddp: DistributedDataParallelKwargs
    ) -> tuple[torch.nn.Module, bool, memory.BasePreservation | None]:
        """Freezing, LoRA and checkpointing in the one order that works (`memory`), then the
        checks that refuse, before step 1, what would fail later. Returns the prepared model,
        whether activations are offloaded, and the frozen copy --preserve-base compares with."""
        c, accelerator = self.config, self.accelerator
        checkpointing = memory.resolve_checkpointing(
            c.memory.gradient_checkpointing, accelerator.device
        )
        lora = c.lora_settings()  # on the decoder only with the encoder cache
        offload = c.memory.offload_activations
        if checkpointing == "auto":
            plan_lines = self._encoder_cache_plan_line(model)
            model, plan = memory.prepare_model_within_budget(
                model,
                mode=c.model.mode,
                lora=lora,
                batch_size=c.train.batch_size,
                max_memory_bytes=parse_bytes(c.memory.max_memory, flag="--max-memory"),
                # A stream's labels are unknown before step 1: the longest the workers let through.
                label_tokens=max(
                    self.datasets.label_lengths(self.label_encoder),
                    default=model.config.max_target_positions + 1,
                ),
                precision=self.precision.name,
                optimizer=c.memory.optim,
            )
            checkpointing, offload = plan.policy, offload or plan.offload
            say(accelerator, plan.table + plan_lines)
        else:
            model = memory.prepare_model(
                model, mode=c.model.mode, checkpointing=checkpointing, lora=lora
            )
        # The starting model, kept for --preserve-base before any update (or resume) changes it;
        # autocast wraps only the prepared model, so the frozen copy is told the dtype itself.
        preserve = None
        if c.train.preserve_base:
            p = self.precision
            preserve = memory.BasePreservation.from_model(
                model,
                c.train.preserve_base,
                autocast_dtype=p.dtype if p.mixed_precision != "no" else None,
            )
        if offload:
            checkpointing += " + activation offload"
            if accelerator.device.type != "cuda":
                say(
                    accelerator,
                    "note: on a CPU, activations already live in host memory; offload does nothing",
                )
        say(
            accelerator,
            f"model: {c.model.model}, mode {c.model.mode}, checkpointing {checkpointing}, "
            f"precision {self.precision.name}; {memory.trainable_parameter_summary(model)}",
        )
        if lora is not None and lora.decoder_only:
            say(
                accelerator,
                f"LoRA adapters on the decoder only ({','.join(lora.targets)}): the encoder's "
                "outputs are cached (--cache-encoder), so it stays as it is; --no-cache-encoder "
                "adapts the encoder too",
            )
        # The doctor's cheap checks: refuse a configuration known to fail (T1-T9).
        doctor.static_checks(
            model,
            ddp={
                "world_size": accelerator.num_processes,
                "find_unused_parameters": ddp.find_unused_parameters,
                "static_graph": ddp.static_graph,
                "gradient_accumulation": c.train.gradient_accumulation,
            },
            compile=c.memory.compile,
        )
        # The checkpoints rotation keeps and the final model must fit: say so now, not after
        # hours of training.
        checkpoints.check_free_space(
            self.output_dir,
            self._disk_needed_bytes(model),
            what=self._disk_needed_text(),
        )
        return model, offload, preserve

    def _checkpoints_kept(self) -> int:
        """How many checkpoints rotation keeps: --save-total-limit, plus the best one when
        evaluations during the run can make an older step the best; none when nothing but a
        stop saves one (the run ends there, before final/ is written)."""
        t = self.config.train
        evaluating_during = bool(self.evaluating and t.eval_steps)
        if not (t.save_steps or evaluating_during):
            return 0
        return t.save_total_limit + (1 if evaluating_during else 0)

    def _disk_needed_text(self) -> str:
        """What `_disk_needed_bytes` counts, for the line that refuses too little space."""
        kept, limit = self._checkpoints_kept(), self.config.train.save_total_limit
        if kept == 0:
            return "the final model (or a checkpoint, when the run is stopped)"
        best = " + the best" if kept > limit else ""
        return (
            f"the {kept} checkpoints rotation keeps (--save-total-limit {limit}{best}), with "
            "one more being written or the final model,"
        )

    def _disk_needed_bytes(self, model) -> int:
        """Disk the checkpoints and final/ of `model` take at their peak, beyond the resumed
        run's checkpoints already there (`checkpoints.peak_disk_bytes`)."""
        already = 0
        resumed_here = (
            self.resume_from is not None
            and self.resume_from.parent.resolve() == self.output_dir.resolve()
        )
        if resumed_here:
            step = checkpoints.checkpoint_step(self.resume_from)
            already = sum(
                1
                for p in checkpoints.list_checkpoints(self.output_dir)
                if step is not None and checkpoints.checkpoint_step(p) <= step
            )
        return checkpoints.peak_disk_bytes(
            model,
            checkpoints_kept=self._checkpoints_kept(),
            already_saved=min(already, self._checkpoints_kept()),
            final_bytes=4 * sum(p.numel() for p in model.parameters()),
        )

    def _setup_encoder_cache(self, model) -> tuple[EncoderCache | None, torch.nn.Module | None]:
        """With --cache-encoder (a frozen encoder maps a clip to the same output every epoch
        and every evaluation): the encoder's outputs on disk (`encoder_cache`), shared with
        other runs and evaluations, and the frozen encoder that fills it. Clips are encoded as
        batches first need them, within the size limit and the free space (a checkpoint and
        the final model keep their room). (None, None) without it."""
        c, accelerator = self.config, self.accelerator
        if not c.cache_encoder:
            return None, None
        whisper = memory.whisper_of(model)
        encoder = whisper.model.encoder
        cache = EncoderCache.open(
            encoder_cache_dir(c.memory.encoder_cache_dir),
            encoder,
            self.processor.feature_extractor,
            compute=self.precision.name,
            model_name=c.model.model,
            shape=(whisper.config.max_source_positions, whisper.config.d_model),
            limit_bytes=parse_bytes(
                c.memory.encoder_cache_max_size, flag="--encoder-cache-max-size"
            ),
            reserve_bytes=self._disk_needed_bytes(model),
            processes=accelerator.num_processes,
        )
        n_clips = len(self.datasets.train) + sum(len(e) for e in self.datasets.eval.values())
        cache.expected_clips = math.ceil(n_clips / accelerator.num_processes)
        say(accelerator, cache.summary(n_clips))
        return cache, encoder

    def _setup_loaders(
        self, model
    ) -> tuple[TrainingData, dict[str, DataLoader], dict[str, list | str | None]]:
        """The training data source and this process's share of each evaluation set (both
        split over the processes by `data.source`), and the language each set is decoded in."""
        c, t = self.config, self.config.train
        log_mel = LogMel(self.processor.feature_extractor)
        pad_id = self.processor.tokenizer.pad_token_id

        def collator(examples):
            if self.encoder_cache is None:
                return SpeechCollator(pad_id, log_mel=log_mel)
            return EncoderCacheCollator(pad_id, log_mel, self.encoder_cache, examples)

        # A clip whose encoder output is cached is not decoded at all (`CachedClip`).
        cached = CachedClip(self.encoder_cache) if self.encoder_cache is not None else None
        eval_loaders, eval_languages = {}, {}
        # Each set is decoded in its rows' languages, else its own (`eval_set_language`), else
        # each clip's detected one: never the training language by default (issue 24).
        for name, examples in self.datasets.eval.items():
            eval_set = SpeechDataset(examples, self.label_encoder, seed=t.seed, cached=cached)
            eval_loaders[name] = evaluation_loader(
                eval_set,
                collator(eval_set.examples),
                batch_size=t.batch_size,
                rank=self.accelerator.process_index,
                world=self.accelerator.num_processes,
                num_workers=t.num_workers,
            )
            eval_languages[name] = row_languages(examples, c.eval_set_language(name))
        data = build_training_data(
            c,
            self.datasets,
            self.label_encoder,
            collator,
            accelerator=self.accelerator,
            max_label_tokens=model.config.max_target_positions,
            cached=cached,
        )
        sets = ", ".join(f"{len(ex)} in {name}" for name, ex in self.datasets.eval.items())
        say(self.accelerator, f"data: {data.describe()}; evaluation: {sets or 'none'}")
        return data, eval_loaders, eval_languages

    def _encoder_cache_plan_line(self, model) -> str:
        """The memory plan's line for the encoder cache (disk): its size at most and folder."""
        c = self.config
        if not c.cache_encoder:
            return ""
        return "\n" + encoder_cache_line(
            memory.whisper_of(model).config,
            n_clips=len(self.datasets.train) + sum(len(e) for e in self.datasets.eval.values()),
            folder=str(encoder_cache_dir(c.memory.encoder_cache_dir)),
            limit_bytes=parse_bytes(c.memory.encoder_cache_max_size),
        )

    def _encoder_cache_counts(self) -> str:
        """What the encoder cache did in this run, summed over the processes (each encodes
        and stores only the clips of its own batches). Every process must call this."""
        cache, accelerator = self.encoder_cache, self.accelerator
        counts = torch.tensor([cache.found, cache.encoded, cache.stored], device=accelerator.device)
        if accelerator.num_processes > 1:
            counts = accelerator.reduce(counts, reduction="sum")
        found, encoded, stored = counts.tolist()
        return (
            f"encoder cache: {encoded} clips encoded ({stored} stored), {found} read back, "
            f"over {accelerator.num_processes} process(es)"
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

    def _setup_optimisation(self, model):
        """The model (sharded with --fsdp, wrapped for DDP and mixed precision, compiled with
        --compile), its optimizer and learning-rate schedule, prepared by accelerate. The data
        is not prepared: `data.source` gives each process its share."""
        c, t, accelerator = self.config, self.config.train, self.accelerator
        if t.fsdp:
            if self.precision.name == "fp16":  # --precision auto on a GPU without bf16
                raise UserError(
                    "--fsdp with fp16 (this GPU has no bf16): its loss scaler does not unscale "
                    "sharded gradients; add --precision fp32"
                )
            # Sharded before the optimizer is built: sharding replaces the parameters.
            model = memory.shard_model(model, accelerator.device)
        optimizer = memory.build_optimizer(
            model, name=c.memory.optim, lr=c.learning_rate, weight_decay=t.weight_decay
        )
        if t.fsdp:
            # Mixed precision only: `prepare` would wrap the sharded model in DDP (accelerate
            # knows FSDP only through its plugin, which runs on GPUs only: see memory.sharding).
            model = accelerator.prepare_model(model, evaluation_mode=True)
            optimizer = accelerator.prepare_optimizer(optimizer)
        else:
            model, optimizer = accelerator.prepare(model, optimizer)
        if c.memory.compile:
            # After the DDP wrapper (as accelerate does): its hooks stay outside the compiled
            # graph. Accelerator(dynamo_backend=) is not used: that setting is process-wide and
            # kept from the first Accelerator, so a second run in one process would not compile.
            model = torch.compile(model)
        self.total_steps = t.max_steps or math.ceil((t.epochs or 3.0) * self.steps_per_epoch)
        scheduler = accelerator.prepare(
            get_scheduler(
                t.lr_scheduler,
                optimizer,
                num_warmup_steps=t.warmup_steps,
                num_training_steps=self.total_steps,
            )
        )
        return model, optimizer, scheduler

    def _restore(self) -> checkpoints.TrainerState:
        """The trainer's state: a new one, or on --resume the checkpoint's, with the weights,
        optimiser, scheduler, random state and position in the data restored from it."""
        if self.resume_from is None:
            return checkpoints.TrainerState(world_size=self.accelerator.num_processes)
        state = checkpoints.load_checkpoint(
            self.resume_from,
            accelerator=self.accelerator,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
        )
        # A resume after a bad-step stop is its remedy (another precision, a lower rate): the
        # new run gets --max-bad-steps chances of its own, not the stopped run's last one.
        state.bad_steps_in_a_row = 0
        where = self.data.restore(self.resume_from, state, checkpoints.read_stream_position)
        for line in self.resume_point.skipped:
            say(self.accelerator, line)
        say(self.accelerator, f"resuming from {self.resume_from} at step {state.step} ({where})")
        # Checkpoints after this step (the run this resume abandons, or damaged ones skipped)
        # would count as the newest: for --resume latest and for rotation, which would delete
        # what this run saves. Moved aside, not deleted: the user may want them. Every process
        # has chosen its checkpoint (in __init__) before the first moves any.
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            aside = checkpoints.set_aside_later_checkpoints(self.output_dir, state.step)
            if aside is not None:
                moved = checkpoints.checkpoint_folders(aside)
                rows = (
                    " and their metrics.jsonl rows"
                    if (aside / runfolder.METRICS_FILE).is_file()
                    else ""
                )
                say(
                    self.accelerator,
                    f"--resume at step {state.step}: moved the later checkpoints "
                    f"({', '.join(p.name for p in moved)}){rows} to {aside}/, so that they no "
                    "longer count as the newest",
                )
        self.accelerator.wait_for_everyone()
        return state

    def _open_run_log(self) -> tuple[MetricsLog, ProgressTable, tqdm, StopRequest]:
        """OUTPUT/whisper-train.yaml and metrics.jsonl (cut back to the checkpoint on resume),
        the progress table, the progress bar (only on a terminal) and the stop request."""
        accelerator, main = self.accelerator, self.accelerator.is_main_process
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if main:
            (self.output_dir / runfolder.CONFIG_FILE).write_text(
                self.config.to_saved_yaml(), encoding="utf-8"
            )
            metrics_file = self.output_dir / runfolder.METRICS_FILE
            if self.resume_from is not None:
                checkpoints.truncate_metrics(metrics_file, self.state.step)
            else:
                metrics_file.unlink(missing_ok=True)
        metrics = MetricsLog(
            self.output_dir,
            enabled=main,
            purge_step=None if self.resume_from is None else self.state.step + 1,
            trackers=Trackers(
                accelerator, self.config.train.report_to, self.config.to_saved_yaml()
            ),
        )
        # A bar only on a terminal: in a log file its \r redraws pile up into one unreadable
        # line. Elsewhere every --logging-steps steps get one plain line instead.
        self.show_bar = main and progress_bars_wanted()
        progress = tqdm(
            total=self.total_steps,
            initial=self.state.step,
            desc="training",
            unit="step",
            disable=not self.show_bar,
            dynamic_ncols=True,
            leave=False,
        )
        table = ProgressTable(main, primary_set=self.primary_set)
        return metrics, table, progress, StopRequest(accelerator, metrics)

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
        loss_sum = 0.0  # cross-entropy x tokens, this process
        for position, (batch, weight) in enumerate(zip(micro_batches, weights, strict=True)):
            if batch["size"]:
                # Moved now, not with the step's others: one micro-batch's inputs on the device
                # at a time, however large the accumulation.
                batch = self._with_encoder_outputs(send_to_device(batch, accelerator.device))
            else:
                batch = stand_in_batch(
                    memory.whisper_of(unwrapped(self.model)).config,
                    accelerator.device,
                    encoder_outputs=self.encoder_cache is not None,
                )
            last = position == len(micro_batches) - 1
            sync = contextlib.nullcontext() if last else accelerator.no_sync(self.model)
            with sync, memory.activation_offload(self.offload, accelerator.device):
                terms = loss_terms(self.model, batch, preserve=self.preserve)
                # DDP averages the N processes' gradients: x N makes that average a sum.
                accelerator.backward(terms.loss * (weight * accelerator.num_processes))
            loss_sum += float(terms.cross_entropy.detach().float()) * weight * total_tokens
        if accelerator.num_processes > 1:
            summed = torch.tensor([loss_sum], device=accelerator.device, dtype=torch.float64)
            loss_sum = float(accelerator.reduce(summed, reduction="sum").item())
        if not total_tokens:  # nothing to learn anywhere: not a step (as before the stand-ins)
            self.optimizer.zero_grad(set_to_none=True)
            return None
        step_loss = loss_sum / total_tokens
        max_norm = t.max_grad_norm if t.max_grad_norm > 0 else math.inf
        grad_norm = _as_float(accelerator.clip_grad_norm_(self.model.parameters(), max_norm))
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
        t, state = self.config.train, self.state
        self._log_step(step)
        # An applied update can make weights NaN or infinite with a finite loss and gradient (a
        # learning rate far too high); no later step can undo it, and every later loss is NaN.
        # Stop at once: no checkpoint holds such weights, and the advice names one that is
        # finite. One fused kernel and, with several processes, one small all-reduce: see
        # `nonfinite_tensors` for its measured cost.
        if not step.skipped:
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            if blown := sum(nonfinite_tensors(trainable, self.accelerator)):
                raise UserError(
                    f"stopped at step {state.step}: its update made {blown} of {len(trainable)} "
                    "trained tensors NaN or infinite (its loss and gradient were finite: "
                    f"--learning-rate {self.config.learning_rate:g} is far too high); nothing "
                    f"was saved from it. {self._lower_learning_rate_advice(state.step)}"
                )
        if state.bad_steps_in_a_row >= t.max_bad_steps:
            # The weights are finite (checked after every update above): the weights of the
            # last good step, G. They gave only NaN or infinite steps since, so resuming from
            # them needs another precision (fp16 overflows where bf16 does not); with a lower
            # learning rate, resume from before G's update, which may be what broke them.
            # Not rotated: the older checkpoints the advice may name must stay (one over
            # --save-total-limit at most, and the run ends here).
            folder = self.save_checkpoint("too many bad steps", rotate=False)
            last_good = state.step - state.bad_steps_in_a_row
            fp16 = ""
            if self.precision.name == "fp16":  # only ever on CUDA (`resolve_precision`)
                command = resume_command(self.output_dir / runfolder.CONFIG_FILE, folder)
                wider = "bf16" if torch.cuda.is_bf16_supported() else "fp32"
                fp16 = f"With fp16 this is usually overflow: {command} --precision {wider}. Else "
            raise UserError(
                f"stopped at step {state.step}: {state.bad_steps_in_a_row} optimizer steps in a "
                "row had a NaN or infinite loss or gradient and were skipped; "
                f"{folder} holds the weights from before them (finite, but they gave only "
                f"those steps). {fp16}{self._lower_learning_rate_advice(last_good)}"
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

    def _lower_learning_rate_advice(self, suspect_step: int) -> str:
        """The command that continues with a lower learning rate from the newest checkpoint
        saved before `suspect_step` (whose update may have broken the weights), or that starts
        again when there is none. Every checkpoint holds finite weights (`_after_step`)."""
        lower = lower_learning_rate(self.config.learning_rate, self.config.model.mode)
        config_file = self.output_dir / runfolder.CONFIG_FILE
        earlier = [
            folder
            for folder in checkpoints.list_checkpoints(self.output_dir)
            if checkpoints.TrainerState.read(folder).step < suspect_step
        ]
        if earlier:
            command = resume_command(config_file, earlier[-1])
            return (
                f"Continue from {earlier[-1].name} (finite weights, saved before step "
                f"{suspect_step}) with a lower learning rate: {command} --learning-rate {lower:g}"
            )
        command = f"whisper-train train --config {shlex.quote(str(config_file))}"
        return (
            f"No checkpoint from before step {suspect_step} is kept: train again with a lower "
            f"learning rate: {command} --learning-rate {lower:g} --overwrite"
        )

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
            languages=self.eval_languages[name] if self.multilingual else None,
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
            checkpoints.rotate_checkpoints(
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
        with --compare-baseline, the before/after report."""
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
        if state.skipped_clips:
            say(
                accelerator,
                f"skipped {state.skipped_clips} clips during training (a clip is counted each "
                "time it is read)",
            )
        if state.skipped_steps:
            say(
                accelerator,
                f"skipped {state.skipped_steps} optimizer steps with a NaN or infinite loss or "
                "gradient",
            )
        say(accelerator, trained_line(self.first_step, state.step, self.train_seconds))
        if self.encoder_cache is not None:
            say(accelerator, self._encoder_cache_counts())
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
            checkpoints.load_weights(best_folder, accelerator=accelerator, model=self.model)
        self._refuse_nonfinite_final(result.final_step)
        say(accelerator, f"final/: step {result.final_step}: {choice.reason}")
        final_model = self._whole_model()
        # The last collective is done: every process leaves the group together now (a process
        # that tore its group down while the main one still worked left the main one's gloo
        # teardown waiting for ever: ~ProcessGroupGloo in a thread join, once in four runs of
        # test_two_processes_share_one_pass). What follows is the main process's alone and
        # may take long (final/ of a large model, the baseline comparison): the others must
        # not wait for it at a barrier, which NCCL gives up on after 10 minutes.
        accelerator.wait_for_everyone()
        accelerator.end_training()
        if accelerator.is_main_process:
            result.final_dir = save_final(
                final_model,
                self.processor,
                self.output_dir / runfolder.FINAL_DIR,
                pin_language=c.data.pin_language,
                config_yaml=c.to_saved_yaml(),
                card=model_card.run_card(c, result, self.precision.name, self.datasets.train),
            )
            write_result(result)
            write_curves_png(
                self.output_dir / runfolder.METRICS_FILE,
                self.output_dir / runfolder.CURVES_FILE,
            )
            say(accelerator, f"fine-tuned model: {result.final_dir}")
            primary_examples = self.datasets.eval.get(self.primary_set)
            if c.train.compare_baseline and primary_examples:
                compare_with_baseline(
                    c.model.model,
                    result.final_dir,
                    primary_examples,
                    self.output_dir,
                    language=c.eval_set_language(self.primary_set),
                    task=c.data.task,
                    batch_size=c.train.batch_size,
                    max_length=c.train.generation_max_length,
                    decoding=self.decoding,
                    attn_implementation=c.model.attn_implementation,
                )
        self.metrics.close()
        return result

    def _refuse_nonfinite_final(self, final_step: int) -> None:
        """final/ is what `--model OUTPUT`, pipelines and exports take as the result: a model
        with a NaN or infinite weight is not written there, nor called fine-tuned (every
        forward through it is NaN). Its checkpoints stay; nothing in final/ is replaced. Every
        process calls this (`nonfinite_tensors` is collective)."""
        # Only trained tensors can be NaN here: `load_model` refuses a model that holds one.
        parameters = list(self.model.parameters())
        blown = sum(nonfinite_tensors(parameters, self.accelerator))
        if not blown:
            return
        raise UserError(
            f"the model of step {final_step} has {blown} of {len(parameters)} tensors NaN or "
            f"infinite; {runfolder.FINAL_DIR}/ was not written. "
            f"{self._lower_learning_rate_advice(final_step)}"
        )

    def _whole_model(self):
        """The trained model, unwrapped, for final/: on the main process (None on the others
        under --fsdp, where every process must call this: the weights are gathered)."""
        accelerator = self.accelerator
        if not memory.is_sharded(self.model):
            return accelerator.unwrap_model(self.model, keep_torch_compile=False)
        weights = memory.full_state_dict(self.model)  # whole, on the main process's CPU
        if not accelerator.is_main_process:
            return None
        # A fresh model as setup made it (LoRA included), unsharded, with the trained weights
        # and the trained model's configuration (generation settings, SpecAugment's).
        c = self.config
        model, _ = load_model(c.model.model, attn_implementation=c.model.attn_implementation)
        model = memory.prepare_model(
            model, mode=c.model.mode, checkpointing="off", lora=c.lora_settings()
        )
        model.load_state_dict(weights)
        whole, trained = memory.whisper_of(model), memory.whisper_of(unwrapped(self.model))
        whole.config, whole.generation_config = trained.config, trained.generation_config
        return model


# ---------------------------------------------------------------------------------------------
# The recipe's pieces that need no recipe state


def trained_line(first_step: int, last_step: int, seconds: float) -> str:
    """What the run trained and how long that took: after a resume, only the steps this
    process ran are timed, and the line says so."""
    if first_step == 0:
        return f"trained {last_step} steps in {seconds:.1f} s"
    if last_step == first_step:
        return f"trained no further step: resumed at step {last_step}, the last"
    return (
        f"trained steps {first_step + 1}-{last_step} ({last_step - first_step} after resuming "
        f"at step {first_step}; {last_step} in all) in {seconds:.1f} s"
    )


def _as_float(value) -> float:
    """A scalar tensor as a float; a DTensor (the gradient norm of sharded gradients, --fsdp)
    is made whole first (a collective: every process calls this)."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
