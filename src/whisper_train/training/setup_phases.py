"""The fine-tuning recipe's setup, everything before step 1, in phases that `FineTuneRecipe.setup`
calls in order: each takes what it needs and returns what it builds, so the order of the calls
is the order in which they depend on one another.

The first phase gathers, in one pass, the facts the run's decisions rest on, reading what was
asked: the model, the data and its plan (`gather_facts`). Then `config.resolve.resolve_run`
makes every decision into the frozen `RunRecord`, and the later phases read only that: the
accelerator, memory, the encoder cache, the loaders, the optimizer, the restore of a
checkpoint and the run log.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import WhisperProcessor, get_scheduler

from whisper_train import doctor, memory, runfolder
from whisper_train.audio import CHUNK_LENGTH
from whisper_train.choices import NONSPEECH_ALONGSIDE, NONSPEECH_SPREAD
from whisper_train.config.record import RunRecord
from whisper_train.config.resolve import (
    DataFacts,
    SavedChoices,
    choose_nonspeech,
    choose_packing,
    evaluation_sets,
)
from whisper_train.config.run import RunConfig
from whisper_train.data.augment import spec_augment_overrides
from whisper_train.data.labels import (
    DEFAULT_NONSPEECH_FORM,
    LabelEncoder,
    added_languages,
    configure_generation,
)
from whisper_train.data.packing import NONSPEECH_PIECE_SECONDS
from whisper_train.data.source import (
    TrainingData,
    TrainingPlan,
    open_training_data,
    plan_training_data,
)
from whisper_train.errors import UserError
from whisper_train.memory import clip_attention, quantize
from whisper_train.memory.plan import encoder_cache_line
from whisper_train.models import is_multilingual
from whisper_train.runlog import (
    START_LINE_CHARS,
    MetricsLog,
    ProgressTable,
    StopRequest,
    progress_bars_wanted,
    say,
)
from whisper_train.trackers import Trackers, accelerate_trackers
from whisper_train.training import checkpoints, resume
from whisper_train.training.checkpoints.load import read_stream_position
from whisper_train.training.datasets import (
    Datasets,
    batch_collator,
    evaluation_loaders,
    language_targets,
    prepare_datasets,
)
from whisper_train.training.distillation import (
    advise_on_data_size,
    frozen_model_term,
    load_student_and_teacher,
)
from whisper_train.training.encoder_cache import CachedClip, EncoderCache
from whisper_train.training.launch import inside_launcher
from whisper_train.training.new_language import add_language, frozen_encoder_advice
from whisper_train.units import parse_bytes

# -- the facts: model, data, its plan ------------------------------------------------------------


def join_processes() -> PartialState:
    """This process's place in the run (rank, world, device), the process group joined."""
    # Without a GPU, processes started by a launcher talk through gloo on the CPU; accelerate
    # does that only when told the run is on the CPU.
    return PartialState(cpu=inside_launcher() and not torch.cuda.is_available())


@dataclass(frozen=True)
class RunFacts:
    """What the run's decisions rest on, gathered before any is made (`gather_facts`)."""

    model: torch.nn.Module  # with its generation settings (language, task) and SpecAugment
    multilingual: bool  # the model's tokenizer has language tokens
    processor: WhisperProcessor
    label_encoder: LabelEncoder  # the labels the model learns
    datasets: Datasets  # the evaluation sets, and the training set when it is read whole
    plan: TrainingPlan  # what every epoch trains
    data: DataFacts  # the facts of the plan that the record keeps
    teacher: torch.nn.Module | None = None  # --teacher's model, frozen (None: no distillation)


def gather_facts(
    config: RunConfig, *, process: PartialState, saved: SavedChoices | None
) -> RunFacts:
    """The facts, in one pass: the model to train and the encoder of its labels, then the data
    read (a stream is opened by the training data source, `setup_loaders`) and planned
    (`data.source.plan_training_data`). What the data phase reads and how it packs are decided
    first, from what was asked alone (`config.resolve`): --packing auto and --nonspeech auto
    continue as a --resume's checkpoint trained (`saved`) where they can."""
    d, m, t = config.data, config.model, config.train
    sets = evaluation_sets(config)
    packing, packing_note = choose_packing(config, saved.packing if saved else None)
    nonspeech = choose_nonspeech(config, saved, packing)
    alongside = nonspeech.placement == NONSPEECH_ALONGSIDE
    model, processor, teacher = load_student_and_teacher(m)
    multilingual = is_multilingual(model)
    if m.new_language is not None:
        add_language(model, processor.tokenizer, m.new_language, init=m.new_language_init)
        if advice := frozen_encoder_advice(m.new_language, m.mode, config.memory.cache_encoder):
            say(process, advice)
    label_encoder = LabelEncoder(
        processor.tokenizer,
        language=d.language,
        task=d.task,
        timestamps=d.timestamps,
        multilingual=multilingual,
        added_languages=added_languages(model.generation_config),
        nonspeech_form=nonspeech.label or DEFAULT_NONSPEECH_FORM,
    )
    configure_generation(
        model.generation_config, language=d.language, task=d.task, multilingual=multilingual
    )
    if d.spec_augment:
        for key, value in spec_augment_overrides().items():
            setattr(model.config, key, value)
    max_label_tokens = model.config.max_target_positions
    datasets = prepare_datasets(
        config,
        sets,
        label_encoder,
        nonspeech=nonspeech.source,
        nonspeech_share=nonspeech.share,
        nonspeech_seconds=NONSPEECH_PIECE_SECONDS if alongside else CHUNK_LENGTH,
        max_label_tokens=max_label_tokens,
    )
    stream = config.stream_source()
    plan = plan_training_data(
        datasets,
        label_encoder,
        stream=stream,
        packing=packing,
        packing_timestamps=packing == "on" and d.packing_timestamps == "on",
        batch_size=t.batch_size,
        accumulation=t.gradient_accumulation,
        group_by_length=t.group_by_length,
        seed=t.seed,
        audio_augment=d.audio_augment,
        shuffle_buffer=d.shuffle_buffer,
        max_label_tokens=max_label_tokens,
        counted=t.max_steps is None,
        process=process,
        nonspeech_alongside=alongside,
        nonspeech_spread=nonspeech.placement == NONSPEECH_SPREAD,
    )
    data = DataFacts(
        packing=packing,
        packing_note=packing_note,
        streamed=stream is not None,
        items_per_micro_batch=None if stream else plan.shape.items_per_micro_batch,
        steps_per_epoch=plan.steps_per_epoch,
        batch_note=None if stream else plan.batch_note(t.gradient_accumulation),
        nonspeech=nonspeech.source,
        nonspeech_share=nonspeech.share,
        nonspeech_label=nonspeech.label,
        nonspeech_note=nonspeech.note,
        nonspeech_placement=nonspeech.placement,
    )
    if teacher is not None:
        advise_on_data_size(process, m, teacher, datasets.train, streamed=stream is not None)
    return RunFacts(model, multilingual, processor, label_encoder, datasets, plan, data, teacher)


# -- the phases that read the record -------------------------------------------------------------


def setup_accelerator(
    record: RunRecord, ddp_kwargs: DistributedDataParallelKwargs
) -> tuple[memory.Precision, Accelerator]:
    """The precision and the Accelerator of this process."""
    device = PartialState().device
    precision = memory.resolve_precision(record.memory.precision, device)
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
        cpu=inside_launcher() and not torch.cuda.is_available(),
        log_with=accelerate_trackers(list(record.output.report_to)) or None,  # the run log's
    )
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        raise UserError(
            "accelerate's DeepSpeed and FSDP configurations are not supported: shard with "
            "--fsdp (--nproc N, or accelerate launch with a data-parallel configuration)"
        )
    set_seed(record.training.seed)
    return precision, accelerator


def check_processes(asked_nproc: int, processes: int) -> None:
    """--nproc N under a launcher that started another number of processes: one line."""
    if asked_nproc > 1 and processes != asked_nproc:
        raise UserError(
            f"--nproc {asked_nproc}: the launcher started {processes} processes; drop --nproc "
            "when using accelerate launch or torchrun"
        )


def _encoder_rows(record: RunRecord) -> int:
    """Sequences the encoder runs per micro-batch for backward, at most: --batch-size (packed,
    a micro-batch holds fewer windows than clips), or twice as many where --packing
    per-clip's context puts a silence window beside each in the windows' batch
    (`clip_attention.encoder_rows_per_window`)."""
    windows = record.data.clips_per_micro_batch
    if not record.data.per_clip:
        return windows
    context = clip_attention.encoder_context()
    return windows * clip_attention.encoder_rows_per_window(context)


def setup_memory(
    record: RunRecord,
    model,
    ddp: DistributedDataParallelKwargs,
    *,
    accelerator: Accelerator,
    precision: memory.Precision,
    datasets: Datasets,
    teacher: torch.nn.Module | None = None,
) -> tuple[torch.nn.Module, memory.BasePreservation | None, RunRecord]:
    """Freezing, LoRA and checkpointing in the one order that works (`memory`), then the
    checks that refuse, before step 1, what would fail later. Returns the prepared model, the
    frozen model the loss's KL term compares with (--preserve-base, --teacher), and the record
    with the policy
    --gradient-checkpointing auto planned within --max-memory."""
    mem, m = record.memory, record.model
    lora = m.lora  # on the decoder only with the encoder cache
    checkpointing, offload = mem.checkpointing, mem.offload_activations
    quantize.check_device(m.quantize_base, accelerator.device)
    if checkpointing == "auto":
        encoder_rows = _encoder_rows(record)
        plan_lines = _encoder_cache_plan_line(record, model, datasets)
        model, plan = memory.prepare_model_within_budget(
            model,
            mode=m.mode,
            lora=lora,
            batch_size=record.data.clips_per_micro_batch,
            max_memory_bytes=parse_bytes(mem.max_memory, flag="--max-memory"),
            label_tokens=datasets.longest_label_tokens,
            precision=precision.name,
            optimizer=mem.optim,
            encoder_rows=encoder_rows,
        )
        checkpointing, offload = plan.policy, offload or plan.offload
        record = record.replace("memory", checkpointing=checkpointing, offload_activations=offload)
        say(accelerator, plan.table + plan_lines)
    else:
        model = memory.prepare_model(
            model,
            mode=m.mode,
            checkpointing=checkpointing,
            lora=lora,
            compute_dtype=precision.dtype,
        )
    # The starting model kept for --preserve-base before any update (or resume) changes it, or
    # --teacher's frozen model: the loss's KL term (`distillation.frozen_model_term`).
    preserve = frozen_model_term(record, model, teacher, precision, accelerator=accelerator)
    shown = checkpointing + (" + activation offload" if offload else "")
    if offload and accelerator.device.type != "cuda":
        say(
            accelerator,
            "note: on a CPU, activations already live in host memory; offload does nothing",
        )
    say(
        accelerator,
        f"model: {m.model}, mode {m.mode}, checkpointing {shown}, precision {precision.name}",
    )
    say(accelerator, memory.trainable_parameter_summary(model))
    if m.quantize_base != "none":
        say(
            accelerator,
            f"base: linear layers held in {m.quantize_base} (bitsandbytes), adapters in "
            f"{precision.name}; final/ merges them into the full-precision base",
        )
    if lora is not None and lora.decoder_only:
        say(
            accelerator,
            "LoRA adapters on the decoder only (the encoder's outputs are cached); "
            "--no-cache-encoder adapts the encoder too",
            detail=f"adapters on {','.join(lora.targets)}; the cached encoder stays as it is",
        )
    # The doctor's cheap checks: refuse a configuration known to fail (T1-T9).
    doctor.static_checks(
        model,
        ddp={
            "world_size": accelerator.num_processes,
            "find_unused_parameters": ddp.find_unused_parameters,
            "static_graph": ddp.static_graph,
            "gradient_accumulation": record.data.accumulation,
        },
        compile=record.memory.compile,
    )
    return model, preserve, record


def setup_encoder_cache(
    record: RunRecord,
    model,
    *,
    processor: WhisperProcessor,
    precision: memory.Precision,
    datasets: Datasets,
    accelerator: Accelerator,
    reserve_bytes: int,
) -> tuple[EncoderCache | None, Callable[[dict], dict] | None]:
    """With the frozen encoder's cache (a frozen encoder maps a clip to the same output every
    epoch and every evaluation): the encoder's outputs on disk (`encoder_cache`), shared with
    other runs and evaluations, and what completes a batch with them (its frozen encoder
    encodes the clips the cache lacks). Clips are encoded as batches first need them, within
    the size limit and the free space (`reserve_bytes`: the checkpoints and the final model
    keep their room). (None, None) without it."""
    mem = record.memory
    if not mem.cache_encoder:
        return None, None
    whisper = memory.whisper_of(model)
    encoder = whisper.model.encoder
    cache = EncoderCache.open(
        Path(mem.encoder_cache_dir),
        encoder,
        processor.feature_extractor,
        compute=precision.name,
        model_name=record.model.model,
        shape=(whisper.config.max_source_positions, whisper.config.d_model),
        limit_bytes=parse_bytes(mem.encoder_cache_max_size, flag="--encoder-cache-max-size"),
        reserve_bytes=reserve_bytes,
        processes=accelerator.num_processes,
    )
    n_clips = len(datasets.train) + sum(len(e) for e in datasets.eval.values())
    cache.expected_clips = math.ceil(n_clips / accelerator.num_processes)
    say(accelerator, cache.summary(n_clips), detail=cache.details())
    dtype = precision.dtype if precision.dtype != torch.float32 else None

    def complete(batch: dict) -> dict:
        """`batch` with every clip's encoder outputs: the ones the cache lacked are encoded
        now (and stored, within its limits)."""
        if not batch["size"]:
            return batch
        return cache.complete(batch, encoder, autocast_dtype=dtype)

    return cache, complete


def _encoder_cache_plan_line(record: RunRecord, model, datasets: Datasets) -> str:
    """The memory plan's line for the encoder cache (disk): its size at most and folder."""
    mem = record.memory
    if not mem.cache_encoder:
        return ""
    return "\n" + encoder_cache_line(
        memory.whisper_of(model).config,
        n_clips=len(datasets.train) + sum(len(e) for e in datasets.eval.values()),
        folder=mem.encoder_cache_dir,
        limit_bytes=parse_bytes(mem.encoder_cache_max_size),
    )


def setup_loaders(
    record: RunRecord,
    plan: TrainingPlan,
    model,
    *,
    processor: WhisperProcessor,
    label_encoder: LabelEncoder,
    datasets: Datasets,
    encoder_cache: EncoderCache | None,
    accelerator: Accelerator,
) -> tuple[TrainingData, dict[str, DataLoader], dict[str, list | str | None]]:
    """The training data source of `plan` and this process's share of each evaluation set
    (both split over the processes by `data.source`), and the language each set is decoded
    in."""
    d = record.data
    targets = language_targets(record, model)
    collator = batch_collator(processor, encoder_cache, targets, label_encoder.nospeech_target)
    # A clip whose encoder output is cached is not decoded at all (`CachedClip`).
    cached = CachedClip(encoder_cache) if encoder_cache is not None else None
    eval_loaders, eval_languages = evaluation_loaders(
        record,
        processor=processor,
        label_encoder=label_encoder,
        datasets=datasets,
        encoder_cache=encoder_cache,
        accelerator=accelerator,
        targets=targets,
    )
    data = open_training_data(
        plan,
        datasets,
        label_encoder,
        collator,
        accelerator=accelerator,
        num_workers=d.num_workers,
        data_spec=str(d.data),
        strict=d.strict,
        prompt_probability=d.prompt_probability,
        packing_timestamps=d.packing_timestamps,
        max_label_tokens=model.config.max_target_positions,
        cached=cached,
    )
    say(accelerator, f"data: {data.summary()}", detail=data.describe())
    sets = ", ".join(f"{len(ex)} in {name}" for name, ex in datasets.eval.items())
    line, detail = f"evaluation: {sets or 'none'}", None
    if len(line) > START_LINE_CHARS:  # many sets: their count here, each with -v
        clips = sum(len(ex) for ex in datasets.eval.values())
        line, detail = f"evaluation: {clips} clips in {len(datasets.eval)} sets", line
    say(accelerator, line, detail=detail)
    return data, eval_loaders, eval_languages


def setup_optimisation(
    record: RunRecord,
    model,
    *,
    precision: memory.Precision,
    accelerator: Accelerator,
):
    """The model (sharded with --fsdp, wrapped for DDP and mixed precision, compiled as the
    record says), its optimizer and learning-rate schedule over the run's steps, prepared by
    accelerate. The data is not prepared: `data.source` gives each process its share."""
    mem, training = record.memory, record.training
    if mem.fsdp:
        if precision.name == "fp16":  # --precision auto on a GPU without bf16
            raise UserError(
                "--fsdp with fp16 (this GPU has no bf16): its loss scaler does not unscale "
                "sharded gradients; add --precision fp32"
            )
        # Sharded before the optimizer is built: sharding replaces the parameters.
        model = memory.shard_model(model, accelerator.device)
    optimizer = memory.build_optimizer(
        model,
        name=mem.optim,
        lr=training.learning_rate,
        weight_decay=training.weight_decay,
        encoder_lr_scale=training.encoder_lr_scale,
    )
    if mem.fsdp:
        # Mixed precision only: `prepare` would wrap the sharded model in DDP (accelerate
        # knows FSDP only through its plugin, which runs on GPUs only: see memory.sharding).
        model = accelerator.prepare_model(model, evaluation_mode=True)
        optimizer = accelerator.prepare_optimizer(optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    if mem.compile:
        # After the DDP wrapper (as accelerate does): its hooks stay outside the compiled
        # graph. Accelerator(dynamo_backend=) is not used: that setting is process-wide and
        # kept from the first Accelerator, so a second run in one process would not compile.
        model = torch.compile(model)
    scheduler = accelerator.prepare(
        get_scheduler(
            training.lr_scheduler,
            optimizer,
            num_warmup_steps=training.warmup_steps,
            num_training_steps=training.total_steps,
        )
    )
    return model, optimizer, scheduler


def restore(
    resume_point: checkpoints.ResumePoint | None,
    *,
    saved: RunRecord | None,
    replan: bool,
    output_dir: Path,
    accelerator: Accelerator,
    model,
    optimizer,
    scheduler,
    data: TrainingData,
) -> checkpoints.TrainerState:
    """The trainer's state: a new one, or on --resume the checkpoint's, with the weights,
    optimiser, scheduler, random state and position in the data restored from it, and what
    the record lets change (learning rates, weight decay, ...) applied from there on."""
    if resume_point is None:
        return checkpoints.TrainerState(world_size=accelerator.num_processes)
    resume_from = resume_point.folder
    state = resume.restore_from(
        resume_from, accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler
    )
    # A resume after a bad-step stop is its remedy (another precision, a lower rate): the
    # new run gets --max-bad-steps chances of its own, not the stopped run's last one.
    state.bad_steps_in_a_row = 0
    if saved is None:  # a checkpoint saved before runs kept records
        resume.convert_position(state, resume_from)
    where = data.restore(
        state,
        folder=resume_from,
        read_stream_position=read_stream_position,
        saved_clips_per_step=saved.data.clips_per_step if saved else None,
        saved_group_by_length=saved.data.group_by_length if saved else False,
        replan=replan,
    )
    for line in resume_point.skipped:
        say(accelerator, line)
    say(accelerator, f"resuming from {resume_from} at step {state.step} ({where})")
    # Checkpoints after this step (the run this resume abandons, or damaged ones skipped)
    # would count as the newest: for --resume latest and for rotation, which would delete
    # what this run saves. Moved aside, not deleted: the user may want them. Every process
    # has chosen its checkpoint (in FineTuneRecipe.__init__) before the first moves any.
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        aside = resume.set_aside_later_checkpoints(output_dir, state.step)
        if aside is not None:
            moved = checkpoints.checkpoint_folders(aside)
            rows = (
                " and their metrics.jsonl rows"
                if (aside / runfolder.METRICS_FILE).is_file()
                else ""
            )
            say(
                accelerator,
                f"--resume at step {state.step}: moved the later checkpoints "
                f"({', '.join(p.name for p in moved)}){rows} to {aside}/, so that they no "
                "longer count as the newest",
            )
    accelerator.wait_for_everyone()
    return state


def open_run_log(
    record: RunRecord,
    *,
    output_dir: Path,
    resumed: bool,
    step: int,
    accelerator: Accelerator,
) -> tuple[MetricsLog, ProgressTable, tqdm, StopRequest, bool]:
    """OUTPUT/whisper-train.yaml (the record) and metrics.jsonl (cut back to `step` when
    `resumed`), the progress table, the progress bar (only on a terminal), the stop request,
    and whether the bar is shown."""
    main = accelerator.is_main_process
    output_dir.mkdir(parents=True, exist_ok=True)
    if main:
        (output_dir / runfolder.CONFIG_FILE).write_text(record.to_yaml(), encoding="utf-8")
        metrics_file = output_dir / runfolder.METRICS_FILE
        if resumed:
            resume.truncate_metrics(metrics_file, step)
        else:
            metrics_file.unlink(missing_ok=True)
    metrics = MetricsLog(
        output_dir,
        enabled=main,
        purge_step=step + 1 if resumed else None,
        trackers=Trackers(
            accelerator,
            list(record.output.report_to),
            record.to_yaml(),
            resumed_from=step if resumed else None,
        ),
    )
    # A bar only on a terminal: in a log file its \r redraws pile up into one unreadable
    # line. Elsewhere every --logging-steps steps get one plain line instead.
    show_bar = main and progress_bars_wanted()
    progress = tqdm(
        total=record.training.total_steps,
        initial=step,
        desc="training",
        unit="step",
        disable=not show_bar,
        dynamic_ncols=True,
        leave=False,
    )
    table = ProgressTable(main, primary_set=record.evaluation.primary)
    return metrics, table, progress, StopRequest(accelerator, metrics), show_bar
