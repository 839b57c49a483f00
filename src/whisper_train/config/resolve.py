"""From what was asked to what the run does: `resolve_run` makes every decision once.

Its inputs are the asked options (`RunConfig`, validated) and the facts decisions rest on: the
model's width and language tokens, the device and the processes, and the data plan
(`DataFacts`: the packing variant the data phase chose with `choose_packing`, the steps of an
epoch). Its output is the frozen `RunRecord` every later phase reads. Each default is applied
here and nowhere else: the learning rate by mode and width, the encoder's rate, the precision
and checkpointing by device, the loader workers, compile, the frozen encoder's cache, the
evaluation sets and their roles.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from whisper_train.choices import (
    BUILTIN_SET,
    NONSPEECH_ALONGSIDE,
    NONSPEECH_AS_CLIPS,
    NONSPEECH_AUTO,
    NONSPEECH_SPREAD,
    PER_CLIP,
)
from whisper_train.config.options import (
    DEFAULT_MAX_REGRESSION,
    DEFAULT_NONSPEECH_SHARE,
    ENCODER_LR_SCALES,
    PACKING_AUTO,
    default_learning_rate,
)
from whisper_train.config.record import (
    DataRecord,
    EvalSet,
    EvaluationRecord,
    MemoryRecord,
    ModelRecord,
    OutputRecord,
    RunRecord,
    TrainingRecord,
)
from whisper_train.config.run import RunConfig
from whisper_train.config.values import long_form_sets, named_sets, nonspeech_sets
from whisper_train.data.labels import DEFAULT_NONSPEECH_FORM, NONSPEECH_FORMS, NONSPEECH_LABEL
from whisper_train.errors import UserError
from whisper_train.memory import resolve_checkpointing, resolve_precision
from whisper_train.runfolder import encoder_cache_dir
from whisper_train.transcription.decoding import parse_temperatures, parse_threshold
from whisper_train.units import format_share

# Measured on an H200 (BENCHMARKS.md "Compiled, and data workers"): whisper-small at batch 16
# with 4 data workers spent ~33 s compiling (its first 10 steps: 37.8 s against 4.9 s eager;
# less when Inductor's cache on the machine already holds the kernels), then 93 ms a step
# against 121 eager: paid back after ~1,200 steps. From 2,000 on, it is the default.
COMPILE_BY_DEFAULT_FROM_STEPS = 2000
# Measured on an H200 with 16 CPUs (BENCHMARKS.md "Compiled, and data workers"): whisper-small
# compiled at batch 16 waited ~22 ms a step for clips read and turned into log-mel features in
# the training process (133 ms a step); 4 workers did that while the device trained (110 ms).
CUDA_DATA_WORKERS = 4
# The name of the evaluation set split off --data when no --eval-data is given.
SPLIT_SET = "eval"


@dataclass(frozen=True)
class DataFacts:
    """What the data phase planned: the packing it chose (and why, when --packing auto chose),
    whether --data streams, and the steps of an epoch (None: a stream not counted)."""

    packing: str
    packing_note: str | None
    streamed: bool
    items_per_micro_batch: int | None  # read whole: clips, or packed windows
    steps_per_epoch: int | None
    batch_note: str | None = None  # a packed step's micro-batches, where not as asked
    nonspeech: str | None = None  # --nonspeech's source as chosen (`choose_nonspeech`)
    nonspeech_share: float = 0.0  # its share of each epoch's clips (0: none)
    nonspeech_label: str | None = None  # how its clips are labelled (`labels.NONSPEECH_FORMS`)
    nonspeech_note: str | None = None  # why, when --nonspeech auto or a resume chose
    nonspeech_placement: str | None = None  # choices.NONSPEECH_ALONGSIDE, _SPREAD or _AS_CLIPS


@dataclass(frozen=True)
class SavedChoices:
    """What a --resume's checkpoint chose where `auto` may have been asked, so that auto
    continues as it trained: its packing (None: a record-less checkpoint that says none) and
    its --nonspeech source (None: none), share and label (None: none, or a record written
    before labels were recorded)."""

    packing: str | None
    nonspeech: str | None = None
    nonspeech_share: float | None = None
    nonspeech_label: str | None = None
    nonspeech_placement: str | None = None  # None: a record written before it was kept

    @classmethod
    def of(cls, record: RunRecord) -> SavedChoices:
        """What the run of `record` chose."""
        d = record.data
        return cls(
            d.packing, d.nonspeech, d.nonspeech_share, d.nonspeech_label, d.nonspeech_placement
        )


@dataclass(frozen=True)
class NonspeechChoice:
    """What `choose_nonspeech` decided: the clips where nobody speaks mixed in (`source`, None
    for none), their share of each epoch's clips, how they are labelled, and the line that
    says why where auto or a resume chose."""

    source: str | None
    share: float = 0.0
    label: str | None = None
    note: str | None = None
    placement: str | None = None  # choices.NONSPEECH_ALONGSIDE, _SPREAD, _AS_CLIPS (None: none)


# -- decisions the data phase needs before the record ----------------------------------------


def choose_packing(config: RunConfig, saved: str | None = None) -> tuple[str, str | None]:
    """(the packing the run trains with: off, on or per-clip; the line that says why, when
    --packing auto chose). Auto packs per clip wherever that can run, else trains unpacked; on
    a --resume (`saved`: the checkpoint's packing) it continues as the checkpoint trained."""
    asked = config.data.packing
    if asked != PACKING_AUTO:
        return asked, None
    refusal = config.packing_refusal(saved) if saved is not None else None
    if saved is not None and refusal is None:
        return saved, f"packing auto -> {saved}: as the checkpoint trained"
    why = config.packing_refusal(PER_CLIP)
    if saved is not None:  # the record then differs from the checkpoint's: refused, saying why
        fresh = PER_CLIP if why is None else "off"
        return fresh, (
            f"packing auto -> {fresh}: the checkpoint trained with --packing {saved}, which is "
            f"not supported with {refusal}"
        )
    if why is None:
        return PER_CLIP, "packing auto -> per-clip: each clip under 30 s packed, decoded alone"
    return "off", f"packing auto -> off: per-clip packing is not supported with {why}"


def choose_nonspeech(
    config: RunConfig, saved: SavedChoices | None = None, packing: str | None = None
) -> NonspeechChoice:
    """--nonspeech's source, share, label and placement (alongside the speech with `packing`
    per-clip, else as clips dealt evenly through the steps). Auto mixes the built-in clips into
    data read whole (the default fine-tune otherwise learns to hear speech in hum and noise:
    BENCHMARKS.md "Text where nobody speaks"); a stream, whose clips cannot be mixed with
    others, trains on its own. A --resume continues as its checkpoint trained where nothing
    else is asked (auto, the share when not given, the label), so that its plan and record
    stay the same."""
    asked, asked_share = config.data.nonspeech, config.data.nonspeech_share
    if asked != NONSPEECH_AUTO:
        source, note = asked, None
    elif saved is not None:
        source = saved.nonspeech
        note = f"nonspeech auto -> {source or 'none'}: as the checkpoint trained"
    elif config.stream_source() is not None:
        return NonspeechChoice(
            None, note="nonspeech auto -> none: --data is streamed, and no clips can be mixed in"
        )
    else:
        source, note = BUILTIN_SET, None
    if source is None:
        return NonspeechChoice(None, note=note)
    notes = [note]
    if asked_share is not None:
        share = asked_share
    elif saved is not None and saved.nonspeech_share and saved.nonspeech == source:
        share = saved.nonspeech_share
        if share != DEFAULT_NONSPEECH_SHARE:
            notes.append(
                f"nonspeech share {share:g}: as the checkpoint trained (a new run's default "
                f"is {DEFAULT_NONSPEECH_SHARE:g})"
            )
    else:
        share = DEFAULT_NONSPEECH_SHARE
    label, label_note = _nonspeech_label(saved if saved and saved.nonspeech else None)
    notes.append(label_note)
    if saved is not None and saved.nonspeech:  # as its checkpoint placed them: the same plan
        placement = saved.nonspeech_placement or NONSPEECH_AS_CLIPS  # unrecorded: as clips
    else:
        placement = NONSPEECH_ALONGSIDE if packing == PER_CLIP else NONSPEECH_SPREAD
    if not any(notes) and asked == NONSPEECH_AUTO:
        notes[0] = (
            f"nonspeech auto -> {BUILTIN_SET}: noise, hum and tones with empty targets, "
            f"{format_share(share)} of each epoch (--nonspeech none: without)"
        )
    note = "; ".join(n for n in notes if n) or None
    return NonspeechChoice(source, share, label, note, placement)


def _nonspeech_label(saved: SavedChoices | None) -> tuple[str, str | None]:
    """(how the clips where nobody speaks are labelled, the line that says so where a resume
    cannot continue as its checkpoint trained). $WHISPER_TRAIN_NONSPEECH_LABEL names a form
    (the measurement's switch: bench/nonspeech.py), else a resume takes its checkpoint's (one
    that differs from it is refused by the records) and a new run the default. A checkpoint
    whose record does not say (written before labels were recorded) is continued with this
    run's, said in one line: its clips may have been taught <|nospeech|> alone."""
    asked = os.environ.get(NONSPEECH_LABEL) or None  # set but empty: unset
    if asked is not None and asked not in NONSPEECH_FORMS:
        raise UserError(
            f"${NONSPEECH_LABEL} {asked}: expected one of {', '.join(NONSPEECH_FORMS)} (or leave "
            f"it unset: {DEFAULT_NONSPEECH_FORM})"
        )
    if saved is not None and saved.nonspeech_label is not None:
        return asked or saved.nonspeech_label, None
    label = asked or DEFAULT_NONSPEECH_FORM
    if saved is None:
        return label, None
    return label, (
        f"nonspeech label {label}: the checkpoint does not record how its clips where nobody "
        "speaks were labelled (versions before this one may have taught <|nospeech|> alone); "
        "they are labelled so from here on"
    )


def evaluation_sets(config: RunConfig) -> tuple[EvalSet, ...]:
    """The sets each evaluation scores: --eval-data's, else a seeded split of --data named
    "eval" (decoded in --language), none with --only-train or --eval-split 0."""
    d, t = config.data, config.train
    if t.only_train:
        return ()
    if d.eval_data:
        added = config.added_languages()
        sets = named_sets(d.eval_data, "--eval-data", added)
        long_form = long_form_sets(d.eval_data, "--eval-data", added)
        nonspeech = nonspeech_sets(d.eval_data, "--eval-data", added)
        return tuple(
            EvalSet(name, path, language, name in long_form, nonspeech=name in nonspeech)
            for name, (path, language) in sets.items()
        )
    if d.eval_split == 0:
        return ()
    return (EvalSet(SPLIT_SET, str(d.data), d.language, False, split=True),)


def default_num_workers(requested: int | None, device: torch.device, processes: int) -> int:
    """--num-workers, or its default: CUDA_DATA_WORKERS per process on a CUDA GPU, fewer where
    the machine has fewer CPUs (one left to each training process), and none elsewhere: on a
    CPU the workers would take the cores that the training step itself runs on."""
    if requested is not None:
        return requested
    if device.type != "cuda":
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    on_this_machine = int(os.environ.get("LOCAL_WORLD_SIZE", processes))
    return max(0, min(CUDA_DATA_WORKERS, (cpus or 1) // max(1, on_this_machine) - 1))


# -- the record -------------------------------------------------------------------------------


def resolve_run(
    config: RunConfig,
    *,
    width: int,
    multilingual: bool,
    device: torch.device,
    processes: int,
    data: DataFacts,
) -> RunRecord:
    """Every decision of the run, from what was asked (`config`, validated) and the facts."""
    t = config.train
    total_steps = t.max_steps or math.ceil((t.epochs or 3.0) * max(1, data.steps_per_epoch or 1))
    compile, compile_note = decide_compile(config, device, data.packing, total_steps)
    notes = [data.packing_note, data.nonspeech_note, data.batch_note, compile_note]
    notes = [note for note in notes if note]
    return RunRecord(
        _model(config, width=width, multilingual=multilingual),
        _data(config, data, device=device, processes=processes),
        _memory(config, device=device, compile=compile),
        _training(config, width=width, total_steps=total_steps),
        _evaluation(config),
        OutputRecord(
            output_dir=t.output_dir,
            save_steps=t.save_steps,
            save_total_limit=t.save_total_limit,
            average_checkpoints=t.average_checkpoints,
            average_by=t.average_by,
            logging_steps=t.logging_steps,
            report_to=tuple(t.report_to or ()),
        ),
        notes=tuple(notes),
        asked=config.run_options(),
    )


def _model(config: RunConfig, *, width: int, multilingual: bool) -> ModelRecord:
    m = config.model
    lora = m.mode == "lora"
    return ModelRecord(
        # A student made from the teacher (--decoder-layers) starts from the teacher's weights.
        model=m.teacher if m.teacher and m.decoder_layers else m.model,
        mode=m.mode,
        width=width,
        multilingual=multilingual,
        lora_r=m.lora_r if lora else None,
        lora_alpha=m.lora_alpha if lora else None,
        lora_targets=tuple(m.lora_targets) if lora else (),
        # The encoder's outputs cached: an adapter inside it would never train.
        lora_decoder_only=lora and config.cache_encoder,
        lora_dropout=m.lora_dropout if lora else 0.0,
        lora_variant=m.lora_variant if lora else None,
        attn_implementation=m.attn_implementation,
        spec_augment=config.data.spec_augment,
        new_language=next(iter(config.added_languages()), None),
        new_language_init=m.new_language_init if m.new_language else None,
        quantize_base=m.quantize_base if lora else "none",
        teacher=m.teacher,
        decoder_layers=m.decoder_layers if m.teacher else None,
    )


def _data(config: RunConfig, data: DataFacts, *, device, processes: int) -> DataRecord:
    d, t = config.data, config.train
    workers = default_num_workers(t.num_workers, device, processes)
    return DataRecord(
        data=d.data,
        data_format=d.data_format,
        streamed=data.streamed,
        shuffle_buffer=d.shuffle_buffer if data.streamed else None,
        stream_workers=workers if data.streamed else None,
        eval_split=d.eval_split,
        train_subset=d.train_subset,
        eval_subset=d.eval_subset,
        language=d.language,
        task=d.task,
        timestamps=d.timestamps,
        prompt_probability=d.prompt_probability,
        nonspeech=data.nonspeech,
        nonspeech_share=data.nonspeech_share,
        nonspeech_label=data.nonspeech_label,
        nonspeech_placement=data.nonspeech_placement,
        audio_augment=d.audio_augment,
        packing=data.packing,
        packing_timestamps=data.packing == "on" and d.packing_timestamps == "on",
        group_by_length=t.group_by_length,
        clips_per_step=t.batch_size * t.gradient_accumulation * processes,
        clips_per_micro_batch=t.batch_size,
        items_per_micro_batch=data.items_per_micro_batch,
        processes=processes,
        num_workers=workers,
        strict=d.strict,
        pin_language=d.pin_language,
    )


def _memory(config: RunConfig, *, device, compile: bool) -> MemoryRecord:
    mem, cached = config.memory, config.cache_encoder
    return MemoryRecord(
        precision=resolve_precision(mem.precision, device).name,
        # auto stays auto here: the plan chooses once the model is prepared
        # (`training.setup_phases.setup_memory`, which records its choice).
        checkpointing=resolve_checkpointing(mem.gradient_checkpointing, device),
        max_memory=mem.max_memory,
        offload_activations=mem.offload_activations,
        compile=compile,
        optim=mem.optim,
        optimizer_state="adamw8bit" if mem.optim == "adamw8bit" else "adamw",
        fsdp=config.train.fsdp,
        cache_encoder=cached,
        encoder_cache_dir=str(encoder_cache_dir(mem.encoder_cache_dir)) if cached else None,
        encoder_cache_max_size=mem.encoder_cache_max_size,
    )


def _training(config: RunConfig, *, width: int, total_steps: int) -> TrainingRecord:
    m, t = config.model, config.train
    rate = t.learning_rate if t.learning_rate is not None else default_learning_rate(m.mode, width)
    scale = t.encoder_lr_scale if t.encoder_lr_scale is not None else ENCODER_LR_SCALES[m.mode]
    return TrainingRecord(
        seed=t.seed,
        learning_rate=rate,
        encoder_learning_rate=rate * scale,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        lr_scheduler=t.lr_scheduler,
        warmup_steps=t.warmup_steps,
        total_steps=total_steps,
        preserve_base=t.preserve_base,
        max_bad_steps=t.max_bad_steps,
        distill_temperature=t.distill_temperature if m.teacher else None,
        distill_kl_weight=t.distill_kl_weight if m.teacher else None,
        distill_ce_weight=t.distill_ce_weight if m.teacher else None,
    )


def _evaluation(config: RunConfig) -> EvaluationRecord:
    t = config.train
    sets = evaluation_sets(config)
    guard = t.guard
    # final/ is picked by a WER: never by a non-speech set's (it has none).
    names = [s.name for s in sets if s.name != guard and not s.nonspeech]
    if t.max_regression is None and guard is not None:
        max_regression = DEFAULT_MAX_REGRESSION
    else:
        max_regression = t.max_regression
    return EvaluationRecord(
        evaluating=not t.only_train,
        sets=sets,
        primary=t.metric_for_best or (names[0] if names else SPLIT_SET),
        guard=guard,
        max_regression=max_regression,
        stop_on_regression=t.stop_on_regression,
        max_nonspeech_rise=t.max_nonspeech_rise,
        eval_steps=t.eval_steps,
        eval_at_start=t.eval_at_start,
        compare_baseline=t.compare_baseline,
        max_length=t.generation_max_length,
        temperatures=parse_temperatures(t.temperatures),
        compression_ratio_threshold=parse_threshold(
            t.compression_ratio_threshold, "--compression-ratio-threshold"
        ),
        logprob_threshold=parse_threshold(t.logprob_threshold, "--logprob-threshold"),
        no_speech_threshold=parse_threshold(t.no_speech_threshold, "--no-speech-threshold"),
        condition_on_previous_text=t.condition_on_previous_text,
    )


def decide_compile(
    config: RunConfig, device: torch.device, packing: str, total_steps: int
) -> tuple[bool, str | None]:
    """Whether the model is torch.compile'd, and the line that says why not where the default
    would have compiled: --compile / --no-compile, or by default on a CUDA GPU for runs of
    COMPILE_BY_DEFAULT_FROM_STEPS steps or more, where the compiling pays back, except with
    what --compile is refused with or has not been run with on a GPU (--fsdp, --packing
    per-clip, activation offload, which --gradient-checkpointing auto may choose): never on a
    CPU, where Inductor's C++ code takes minutes to build and the step is bound by arithmetic,
    not by launching kernels."""
    asked = config.memory.compile
    if asked is not None:
        return asked, None
    if device.type != "cuda" or total_steps < COMPILE_BY_DEFAULT_FROM_STEPS:
        return False, None
    offload = config.memory.offload_activations or config.memory.gradient_checkpointing == "auto"
    untried = [
        why
        for on, why in (
            (config.train.fsdp, "--fsdp"),
            (packing == PER_CLIP, "per-clip packing (its clips are routed by hooks)"),
            (offload, "activation offload (--gradient-checkpointing auto may choose it)"),
        )
        if on
    ]
    if untried:
        return False, f"compile off (the default for {total_steps} steps on a GPU): {untried[0]}"
    return True, None
