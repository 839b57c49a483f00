"""The fine-tuning recipe's setup, everything before step 1, in phases that `FineTuneRecipe.setup`
calls in order: each takes what it needs and returns what it builds, so the order of the calls
is the order in which they depend on one another."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import WhisperProcessor, get_scheduler

from whisper_train import doctor, memory, runfolder
from whisper_train.config import RunConfig
from whisper_train.data.augment import spec_augment_overrides
from whisper_train.data.collate import SpeechCollator
from whisper_train.data.features import LogMel, SpeechDataset
from whisper_train.data.labels import LabelEncoder, configure_generation
from whisper_train.data.prompts import longest_prompted_label
from whisper_train.data.source import TrainingData, build_training_data, evaluation_loader
from whisper_train.errors import UserError
from whisper_train.evaluation.evaluate import row_languages
from whisper_train.evaluation.longform import RECORDINGS_PER_BATCH, collate_recordings
from whisper_train.memory import clip_attention
from whisper_train.memory.plan import encoder_cache_line
from whisper_train.models import is_multilingual, load_model
from whisper_train.runlog import MetricsLog, ProgressTable, StopRequest, progress_bars_wanted, say
from whisper_train.trackers import Trackers, accelerate_trackers
from whisper_train.training import checkpoints, resume
from whisper_train.training.datasets import Datasets, prepare_datasets
from whisper_train.training.encoder_cache import CachedClip, EncoderCache, EncoderCacheCollator
from whisper_train.training.encoder_cache import cache_dir as encoder_cache_dir
from whisper_train.training.launch import inside_launcher
from whisper_train.units import parse_bytes


def setup_accelerator(
    config: RunConfig, ddp_kwargs: DistributedDataParallelKwargs
) -> tuple[memory.Precision, Accelerator]:
    """The precision and the Accelerator of this process (the process group joined)."""
    t = config.train
    precision = memory.resolve_precision(config.memory.precision, _default_device())
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


def setup_model_and_labels(
    config: RunConfig,
) -> tuple[torch.nn.Module, WhisperProcessor, LabelEncoder]:
    """The model to train and its processor, with its generation settings (language, task)
    and SpecAugment; the encoder of the labels it learns."""
    c = config
    model, processor = load_model(c.model.model, attn_implementation=c.model.attn_implementation)
    c.model_width = model.config.d_model  # full fine-tuning's default rate depends on it
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


def setup_data(config: RunConfig, model, label_encoder: LabelEncoder) -> Datasets:
    """The evaluation sets, and the training set when it is read whole (a stream is opened
    by the training data source, `setup_loaders`)."""
    return prepare_datasets(
        config, label_encoder, max_label_tokens=model.config.max_target_positions
    )


def _encoder_rows(config: RunConfig) -> int:
    """Sequences the encoder runs per micro-batch for backward, at most: --batch-size (packed,
    a micro-batch holds fewer windows than clips), or twice as many where --packing
    per-clip's context puts a silence window beside each in the windows' batch
    (`clip_attention.encoder_rows_per_window`)."""
    windows = config.train.batch_size
    if not config.packing_per_clip:
        return windows
    context = clip_attention.encoder_context()
    return windows * clip_attention.encoder_rows_per_window(context)


def setup_memory(
    config: RunConfig,
    model,
    ddp: DistributedDataParallelKwargs,
    *,
    accelerator: Accelerator,
    precision: memory.Precision,
    datasets: Datasets,
    label_encoder: LabelEncoder,
) -> tuple[torch.nn.Module, bool, memory.BasePreservation | None]:
    """Freezing, LoRA and checkpointing in the one order that works (`memory`), then the
    checks that refuse, before step 1, what would fail later. Returns the prepared model,
    whether activations are offloaded, and the frozen copy --preserve-base compares with."""
    c = config
    checkpointing = memory.resolve_checkpointing(
        c.memory.gradient_checkpointing, accelerator.device
    )
    lora = c.lora_settings()  # on the decoder only with the encoder cache
    offload = c.memory.offload_activations
    if checkpointing == "auto":
        plan_lines = _encoder_cache_plan_line(config, model, datasets)
        model, plan = memory.prepare_model_within_budget(
            model,
            mode=c.model.mode,
            lora=lora,
            batch_size=c.train.batch_size,
            max_memory_bytes=parse_bytes(c.memory.max_memory, flag="--max-memory"),
            # A stream's labels are unknown before step 1: the longest the workers let through.
            label_tokens=longest_prompted_label(
                max(
                    datasets.label_lengths(label_encoder),
                    default=model.config.max_target_positions + 1,
                ),
                c.data.prompt_probability,  # a prompted label is longer: count its prompt
                model.config.max_target_positions,
            ),
            precision=precision.name,
            optimizer=c.memory.optim,
            encoder_rows=_encoder_rows(config),
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
        preserve = memory.BasePreservation.from_model(
            model,
            c.train.preserve_base,
            autocast_dtype=precision.dtype if precision.mixed_precision != "no" else None,
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
        f"precision {precision.name}; {memory.trainable_parameter_summary(model)}",
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
    return model, offload, preserve


def setup_encoder_cache(
    config: RunConfig,
    model,
    *,
    processor: WhisperProcessor,
    precision: memory.Precision,
    datasets: Datasets,
    accelerator: Accelerator,
    reserve_bytes: int,
) -> tuple[EncoderCache | None, torch.nn.Module | None]:
    """With --cache-encoder (a frozen encoder maps a clip to the same output every epoch
    and every evaluation): the encoder's outputs on disk (`encoder_cache`), shared with
    other runs and evaluations, and the frozen encoder that fills it. Clips are encoded as
    batches first need them, within the size limit and the free space (`reserve_bytes`: the
    checkpoints and the final model keep their room). (None, None) without it."""
    c = config
    if not c.cache_encoder:
        return None, None
    whisper = memory.whisper_of(model)
    encoder = whisper.model.encoder
    cache = EncoderCache.open(
        encoder_cache_dir(c.memory.encoder_cache_dir),
        encoder,
        processor.feature_extractor,
        compute=precision.name,
        model_name=c.model.model,
        shape=(whisper.config.max_source_positions, whisper.config.d_model),
        limit_bytes=parse_bytes(c.memory.encoder_cache_max_size, flag="--encoder-cache-max-size"),
        reserve_bytes=reserve_bytes,
        processes=accelerator.num_processes,
    )
    n_clips = len(datasets.train) + sum(len(e) for e in datasets.eval.values())
    cache.expected_clips = math.ceil(n_clips / accelerator.num_processes)
    say(accelerator, cache.summary(n_clips))
    return cache, encoder


def _encoder_cache_plan_line(config: RunConfig, model, datasets: Datasets) -> str:
    """The memory plan's line for the encoder cache (disk): its size at most and folder."""
    c = config
    if not c.cache_encoder:
        return ""
    return "\n" + encoder_cache_line(
        memory.whisper_of(model).config,
        n_clips=len(datasets.train) + sum(len(e) for e in datasets.eval.values()),
        folder=str(encoder_cache_dir(c.memory.encoder_cache_dir)),
        limit_bytes=parse_bytes(c.memory.encoder_cache_max_size),
    )


def setup_loaders(
    config: RunConfig,
    model,
    *,
    processor: WhisperProcessor,
    label_encoder: LabelEncoder,
    datasets: Datasets,
    encoder_cache: EncoderCache | None,
    accelerator: Accelerator,
) -> tuple[TrainingData, dict[str, DataLoader], dict[str, list | str | None]]:
    """The training data source and this process's share of each evaluation set (both
    split over the processes by `data.source`), and the language each set is decoded in."""
    c, t = config, config.train
    log_mel = LogMel(processor.feature_extractor)
    pad_id = processor.tokenizer.pad_token_id

    def collator(examples):
        if encoder_cache is None:
            return SpeechCollator(pad_id, log_mel=log_mel)
        return EncoderCacheCollator(pad_id, log_mel, encoder_cache, examples)

    # A clip whose encoder output is cached is not decoded at all (`CachedClip`).
    cached = CachedClip(encoder_cache) if encoder_cache is not None else None
    eval_loaders, eval_languages = {}, {}
    # Each set is decoded in its rows' languages, else its own (`eval_set_language`), else
    # each clip's detected one: never the training language by default (issue 24).
    for name, examples in datasets.eval.items():
        eval_languages[name] = row_languages(examples, c.eval_set_language(name))
        if c.eval_set_long_form(name):
            # Whole recordings, read as each is decoded (no features, labels or encoder cache).
            eval_loaders[name] = evaluation_loader(
                list(enumerate(examples)),
                collate_recordings,
                batch_size=RECORDINGS_PER_BATCH,
                rank=accelerator.process_index,
                world=accelerator.num_processes,
                num_workers=0,
            )
            continue
        eval_set = SpeechDataset(examples, label_encoder, seed=t.seed, cached=cached)
        eval_loaders[name] = evaluation_loader(
            eval_set,
            collator(eval_set.examples),
            batch_size=t.batch_size,
            rank=accelerator.process_index,
            world=accelerator.num_processes,
            num_workers=t.num_workers,
        )
    data = build_training_data(
        c,
        datasets,
        label_encoder,
        collator,
        accelerator=accelerator,
        max_label_tokens=model.config.max_target_positions,
        cached=cached,
    )
    sets = ", ".join(f"{len(ex)} in {name}" for name, ex in datasets.eval.items())
    say(accelerator, f"data: {data.describe()}; evaluation: {sets or 'none'}")
    return data, eval_loaders, eval_languages


def setup_optimisation(
    config: RunConfig,
    model,
    *,
    precision: memory.Precision,
    accelerator: Accelerator,
    total_steps: int,
):
    """The model (sharded with --fsdp, wrapped for DDP and mixed precision, compiled with
    --compile), its optimizer and learning-rate schedule over `total_steps`, prepared by
    accelerate. The data is not prepared: `data.source` gives each process its share."""
    c, t = config, config.train
    if t.fsdp:
        if precision.name == "fp16":  # --precision auto on a GPU without bf16
            raise UserError(
                "--fsdp with fp16 (this GPU has no bf16): its loss scaler does not unscale "
                "sharded gradients; add --precision fp32"
            )
        # Sharded before the optimizer is built: sharding replaces the parameters.
        model = memory.shard_model(model, accelerator.device)
    optimizer = memory.build_optimizer(
        model,
        name=c.memory.optim,
        lr=c.learning_rate,
        weight_decay=t.weight_decay,
        encoder_lr_scale=c.encoder_lr_scale,
    )
    if t.fsdp:
        # Mixed precision only: `prepare` would wrap the sharded model in DDP (accelerate
        # knows FSDP only through its plugin, which runs on GPUs only: see memory.sharding).
        model = accelerator.prepare_model(model, evaluation_mode=True)
        optimizer = accelerator.prepare_optimizer(optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    if compiles(c, accelerator.device, total_steps):
        # After the DDP wrapper (as accelerate does): its hooks stay outside the compiled
        # graph. Accelerator(dynamo_backend=) is not used: that setting is process-wide and
        # kept from the first Accelerator, so a second run in one process would not compile.
        model = torch.compile(model)
    scheduler = accelerator.prepare(
        get_scheduler(
            t.lr_scheduler,
            optimizer,
            num_warmup_steps=t.warmup_steps,
            num_training_steps=total_steps,
        )
    )
    return model, optimizer, scheduler


# Measured on an H200 (BENCHMARKS.md "Compiled, and data workers"): whisper-small at batch 16
# with 4 data workers spent ~33 s compiling (its first 10 steps: 37.8 s against 4.9 s eager;
# less when Inductor's cache on the machine already holds the kernels), then 93 ms a step
# against 121 eager: paid back after ~1,200 steps. From 2,000 on, it is the default.
COMPILE_BY_DEFAULT_FROM_STEPS = 2000


def compiles(config: RunConfig, device: torch.device, total_steps: int) -> bool:
    """Whether the model is torch.compile'd: --compile / --no-compile, or by default on a CUDA
    GPU for runs of COMPILE_BY_DEFAULT_FROM_STEPS steps or more, where the compiling pays back,
    except with what --compile is refused with or has not been run with on a GPU (--fsdp,
    --packing per-clip, --offload-activations): never on a CPU, where Inductor's C++ code takes
    minutes to build and the step is bound by arithmetic, not by launching kernels."""
    if config.memory.compile is not None:
        return config.memory.compile
    untried = config.train.fsdp or config.packing_per_clip or config.memory.offload_activations
    return device.type == "cuda" and total_steps >= COMPILE_BY_DEFAULT_FROM_STEPS and not untried


def restore(
    resume_point: resume.ResumePoint | None,
    *,
    output_dir: Path,
    accelerator: Accelerator,
    model,
    optimizer,
    scheduler,
    data: TrainingData,
) -> checkpoints.TrainerState:
    """The trainer's state: a new one, or on --resume the checkpoint's, with the weights,
    optimiser, scheduler, random state and position in the data restored from it."""
    if resume_point is None:
        return checkpoints.TrainerState(world_size=accelerator.num_processes)
    resume_from = resume_point.folder
    state = resume.load_checkpoint(
        resume_from,
        accelerator=accelerator,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
    )
    # A resume after a bad-step stop is its remedy (another precision, a lower rate): the
    # new run gets --max-bad-steps chances of its own, not the stopped run's last one.
    state.bad_steps_in_a_row = 0
    where = data.restore(resume_from, state, resume.read_stream_position)
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
    config: RunConfig,
    *,
    output_dir: Path,
    resumed: bool,
    step: int,
    total_steps: int,
    primary_set: str,
    accelerator: Accelerator,
) -> tuple[MetricsLog, ProgressTable, tqdm, StopRequest, bool]:
    """OUTPUT/whisper-train.yaml and metrics.jsonl (cut back to `step` when `resumed`), the
    progress table, the progress bar (only on a terminal), the stop request, and whether the
    bar is shown."""
    main = accelerator.is_main_process
    output_dir.mkdir(parents=True, exist_ok=True)
    if main:
        (output_dir / runfolder.CONFIG_FILE).write_text(config.to_saved_yaml(), encoding="utf-8")
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
            config.train.report_to,
            config.to_saved_yaml(),
            resumed_from=step if resumed else None,
        ),
    )
    # A bar only on a terminal: in a log file its \r redraws pile up into one unreadable
    # line. Elsewhere every --logging-steps steps get one plain line instead.
    show_bar = main and progress_bars_wanted()
    progress = tqdm(
        total=total_steps,
        initial=step,
        desc="training",
        unit="step",
        disable=not show_bar,
        dynamic_ncols=True,
        leave=False,
    )
    table = ProgressTable(main, primary_set=primary_set)
    return metrics, table, progress, StopRequest(accelerator, metrics), show_bar


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
