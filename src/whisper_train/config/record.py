"""The run's record: every decision a training run acts on, made once and frozen.

    record = resolve_run(asked, model=..., device=..., data=...)   # RunRecord, frozen
    record.notes                     # where the run does other than asked, one line each
    changes = resume_changes(saved, record, step=...)   # a --resume: refused, or said

What was asked (flags and YAML, `config.RunConfig`) is read by the set-up phases that gather
the facts a decision rests on (the model, the device, the data plan) and by `resolve_run`, never
after: each later phase takes the slice of the record it needs (`model`, `data`, `memory`,
`training`, `evaluation`, `output`). whisper-train.yaml, result.json and the model card are
written from it, and every checkpoint keeps it, so a --resume compares records field by field
under one rule, each field's resume class (`MUST_EQUAL`, `MAY_CHANGE`, `REPLANS`,
`FOLLOWS`): a field an exact resume depends on must equal the checkpoint's (refused in one
line naming both values), one that may change takes effect from the resume point (said in one
line), one that re-plans the rest of the epoch does so (said), and a field that follows from
others is not compared on its own. Every option lands in some field (`options`), so a new
option cannot forget its class (tests/test_record.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from whisper_train.config.run import RECORD_KEY
from whisper_train.config.values import read_yaml
from whisper_train.errors import RunRefused
from whisper_train.memory import LoraSettings
from whisper_train.transcription.decoding import DecodingOptions

# -- resume classes ------------------------------------------------------------------------------
MUST_EQUAL = "must equal"  # an exact resume depends on it: refused when it differs
MAY_CHANGE = "may change"  # takes effect from the resume point, said in one line
REPLANS = "re-plans"  # the rest of the epoch is planned anew with it, said in one line
FOLLOWS = "follows"  # made from other fields (or facts of them): compared through those
RESUME_CLASSES = (MUST_EQUAL, MAY_CHANGE, REPLANS, FOLLOWS)


def decided(
    resume: str,
    *options: str,
    label: str = "",
    remedy: str = "",
    unrecorded_before: bool = False,
    default: Any = dataclasses.MISSING,
):
    """A record field: its resume class, the options (config fields) it is made from, how a
    line names it (`label`, default the first option's flag), for a field no option makes, how
    to resume when it differs (`remedy`), and whether records written before it was kept read
    as None, which a resume does not compare (`unrecorded_before`: the phase that decides it
    says so in one line)."""
    metadata = {
        "resume": resume,
        "options": options,
        "label": label,
        "remedy": remedy,
        "unrecorded_before": unrecorded_before,
    }
    return field(default=default, metadata=metadata)


def flag_of(option: str) -> str:
    return "--" + option.replace("_", "-")


# -- the slices ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelRecord:
    model: str = decided(MUST_EQUAL, "model")
    mode: str = decided(MUST_EQUAL, "mode")
    width: int = decided(FOLLOWS, label="the model's width (d_model)")  # of `model`
    multilingual: bool = decided(FOLLOWS, label="language tokens")  # of `model`
    lora_r: int | None = decided(MUST_EQUAL, "lora_r")  # None: no LoRA
    lora_alpha: int | None = decided(MUST_EQUAL, "lora_alpha")
    lora_targets: tuple[str, ...] = decided(MUST_EQUAL, "lora_targets")
    # The encoder's outputs cached: LoRA's adapters go on the decoder alone.
    lora_decoder_only: bool = decided(
        MUST_EQUAL, "cache_encoder", label="LoRA's adapters on the decoder only (--cache-encoder)"
    )
    lora_dropout: float = decided(MAY_CHANGE, "lora_dropout")
    # lora, dora or rslora (None: no LoRA): the adapters' weights differ in kind or in scale.
    lora_variant: str | None = decided(MUST_EQUAL, "lora_variant")
    attn_implementation: str = decided(MAY_CHANGE, "attn_implementation")
    spec_augment: bool = decided(MAY_CHANGE, "spec_augment")
    # A language token added (None: none) and the language its row starts from: the model's
    # shape and its labels' prefix depend on both.
    new_language: str | None = decided(MUST_EQUAL, "new_language", default=None)
    new_language_init: str | None = decided(MUST_EQUAL, "new_language_init", default=None)
    # How LoRA's frozen base is held: none (as loaded), int8 or nf4 (bitsandbytes). The adapters
    # trained against the quantized weights; a record from before the option held none.
    quantize_base: str = decided(MUST_EQUAL, "quantize_base", default="none")
    # Distillation (None: none): the teacher the loss learns from, and the depth of a student
    # made from it (None: the student is `model` itself). The student's shape depends on both.
    teacher: str | None = decided(MUST_EQUAL, "teacher", default=None)
    decoder_layers: int | None = decided(MUST_EQUAL, "decoder_layers", default=None)

    @property
    def lora(self):
        """`memory.LoraSettings` for --mode lora, else None."""
        if self.lora_r is None:
            return None
        return LoraSettings(
            r=self.lora_r,
            alpha=self.lora_alpha,
            dropout=self.lora_dropout,
            targets=self.lora_targets,
            decoder_only=self.lora_decoder_only,
            variant=self.lora_variant,
            new_languages=() if self.new_language is None else (self.new_language,),
            quantize_base=self.quantize_base,
        )


@dataclass(frozen=True)
class DataRecord:
    data: str | None = decided(MUST_EQUAL, "data")
    data_format: str | None = decided(MUST_EQUAL, "data_format")
    streamed: bool = decided(MUST_EQUAL, "streaming", label="--data streamed")
    # A stream's order depends on its buffer and its workers' split (None: read whole).
    shuffle_buffer: int | None = decided(MUST_EQUAL, "shuffle_buffer")
    stream_workers: int | None = decided(MUST_EQUAL, "num_workers")
    eval_split: float = decided(MUST_EQUAL, "eval_split")
    train_subset: int | None = decided(MUST_EQUAL, "train_subset")
    eval_subset: int | None = decided(MUST_EQUAL, "eval_subset")
    language: str | None = decided(MUST_EQUAL, "language")
    task: str = decided(MUST_EQUAL, "task")
    timestamps: bool = decided(MUST_EQUAL, "timestamps")
    prompt_probability: float = decided(MUST_EQUAL, "prompt_probability")
    # Clips where nobody speaks mixed in (None: none) and their share of an epoch's clips.
    nonspeech: str | None = decided(MUST_EQUAL, "nonspeech")
    nonspeech_share: float = decided(MUST_EQUAL, "nonspeech_share")
    audio_augment: bool = decided(MUST_EQUAL, "audio_augment")
    packing: str = decided(MUST_EQUAL, "packing")  # off | on | per-clip (auto resolved)
    packing_timestamps: bool = decided(MUST_EQUAL, "packing_timestamps")
    group_by_length: bool = decided(REPLANS, "group_by_length")
    # What a step trains: --batch-size x --gradient-accumulation x processes clips.
    clips_per_step: int = decided(
        REPLANS, "batch_size", "gradient_accumulation", label="clips a step"
    )
    clips_per_micro_batch: int = decided(MAY_CHANGE, "batch_size")
    # Read whole: clips, or packed windows of about --batch-size clips (at least one).
    items_per_micro_batch: int | None = decided(FOLLOWS, label="items a micro-batch")
    # The processes a step's clips are dealt to (--nproc, or a launcher's). A step is planned
    # whole, then dealt (`data.step_plan`), so another count at the same clips a step trains
    # the same steps; a stream finishes its interrupted pass with the rows left, dealt to the
    # new count (`data.streaming`); refused for --fsdp's shards (`_check_processes`).
    processes: int = decided(MAY_CHANGE, "nproc", label="processes")
    num_workers: int = decided(MAY_CHANGE, "num_workers")
    strict: bool = decided(MAY_CHANGE, "strict")
    pin_language: bool = decided(MAY_CHANGE, "pin_language")
    # How --nonspeech's clips are labelled (`labels.NONSPEECH_FORMS`; None: no clips, or a record
    # written before it was kept, which a resume continues with its own label, said in one
    # line by `config.resolve.choose_nonspeech`).
    nonspeech_label: str | None = decided(
        MUST_EQUAL,
        label="the non-speech clips' label ($WHISPER_TRAIN_NONSPEECH_LABEL)",
        remedy="resume with $WHISPER_TRAIN_NONSPEECH_LABEL unset (the checkpoint's is taken)",
        unrecorded_before=True,
        default=None,
    )
    # Where --nonspeech's clips go (`choices.NONSPEECH_ALONGSIDE`, `NONSPEECH_SPREAD`,
    # `NONSPEECH_AS_CLIPS`; None: no clips, or a record written before it was kept: placed as
    # clips, as they were then).
    nonspeech_placement: str | None = decided(
        MUST_EQUAL,
        label="the non-speech clips' placement",
        remedy="resume as the checkpoint trained (--packing and --nonspeech as it had them)",
        unrecorded_before=True,
        default=None,
    )

    @property
    def packing_on(self) -> bool:
        return self.packing != "off"

    @property
    def accumulation(self) -> int:
        """--gradient-accumulation: a step's clips over a micro-batch's on every process."""
        return self.clips_per_step // (self.clips_per_micro_batch * self.processes)

    @property
    def per_clip(self) -> bool:
        return self.packing == "per-clip"


@dataclass(frozen=True)
class MemoryRecord:
    precision: str = decided(MAY_CHANGE, "precision")  # fp32 | bf16 | fp16 (auto resolved)
    checkpointing: str = decided(MAY_CHANGE, "gradient_checkpointing")
    max_memory: str | None = decided(MAY_CHANGE, "max_memory")  # --gradient-checkpointing auto's
    offload_activations: bool = decided(MAY_CHANGE, "offload_activations")
    compile: bool = decided(MAY_CHANGE, "compile")
    optim: str = decided(MAY_CHANGE, "optim")
    # adamw and adamw-fused keep the same state; 8-bit AdamW another.
    optimizer_state: str = decided(MUST_EQUAL, "optim", label="the optimizer's state (--optim)")
    fsdp: bool = decided(MUST_EQUAL, "fsdp")
    cache_encoder: bool = decided(MAY_CHANGE, "cache_encoder")
    encoder_cache_dir: str | None = decided(MAY_CHANGE, "encoder_cache_dir")
    encoder_cache_max_size: str = decided(MAY_CHANGE, "encoder_cache_max_size")


@dataclass(frozen=True)
class TrainingRecord:
    seed: int = decided(MUST_EQUAL, "seed")
    learning_rate: float = decided(MAY_CHANGE, "learning_rate")  # the decoder's (all with one)
    encoder_learning_rate: float = decided(MAY_CHANGE, "encoder_lr_scale")
    weight_decay: float = decided(MAY_CHANGE, "weight_decay")
    max_grad_norm: float = decided(MAY_CHANGE, "max_grad_norm")
    lr_scheduler: str = decided(MAY_CHANGE, "lr_scheduler")
    warmup_steps: int = decided(MAY_CHANGE, "warmup_steps")
    total_steps: int = decided(MAY_CHANGE, "epochs", "max_steps", label="the run's length")
    preserve_base: float = decided(MAY_CHANGE, "preserve_base")
    max_bad_steps: int = decided(MAY_CHANGE, "max_bad_steps")
    # With a teacher (None without): the KL term's temperature and the two terms' weights.
    distill_temperature: float | None = decided(MAY_CHANGE, "distill_temperature", default=None)
    distill_kl_weight: float | None = decided(MAY_CHANGE, "distill_kl_weight", default=None)
    distill_ce_weight: float | None = decided(MAY_CHANGE, "distill_ce_weight", default=None)

    @property
    def encoder_lr_scale(self) -> float:
        return self.encoder_learning_rate / self.learning_rate


@dataclass(frozen=True)
class EvalSet:
    name: str
    path: str
    language: str | None  # decoded in it where its rows state none (None: detected per clip)
    long_form: bool  # whole recordings, decoded in 30 s windows
    split: bool = False  # a seeded split of --data (the training speakers and conditions)
    nonspeech: bool = False  # clips where nobody speaks: scored by the words a model invents


@dataclass(frozen=True)
class EvaluationRecord:
    evaluating: bool = decided(MAY_CHANGE, "only_train", label="evaluation (--only-train)")
    # --eval-data, else a split of --data named "eval" (`EvalSet`s; empty without evaluation)
    sets: tuple[EvalSet, ...] = decided(MAY_CHANGE, "eval_data", label="--eval-data")
    primary: str = decided(MAY_CHANGE, "metric_for_best")
    guard: str | None = decided(MAY_CHANGE, "guard")
    max_regression: float | None = decided(MAY_CHANGE, "max_regression")
    stop_on_regression: bool = decided(MAY_CHANGE, "stop_on_regression")
    # Words per minute a step may invent on each non-speech set over that set's start.
    max_nonspeech_rise: float = decided(MAY_CHANGE, "max_nonspeech_rise")
    eval_steps: int | None = decided(MAY_CHANGE, "eval_steps")
    eval_at_start: bool = decided(MAY_CHANGE, "eval_at_start")
    compare_baseline: bool = decided(MAY_CHANGE, "compare_baseline")
    max_length: int = decided(MAY_CHANGE, "generation_max_length")
    temperatures: tuple[float, ...] = decided(MAY_CHANGE, "temperatures")
    compression_ratio_threshold: float | None = decided(MAY_CHANGE, "compression_ratio_threshold")
    logprob_threshold: float | None = decided(MAY_CHANGE, "logprob_threshold")
    no_speech_threshold: float | None = decided(MAY_CHANGE, "no_speech_threshold")
    condition_on_previous_text: bool = decided(MAY_CHANGE, "condition_on_previous_text")

    def set_named(self, name: str) -> EvalSet | None:
        return next((s for s in self.sets if s.name == name), None)

    @property
    def nonspeech_sets(self) -> tuple[str, ...]:
        """The names of the non-speech sets: each measured at its start and held to it."""
        return tuple(s.name for s in self.sets if s.nonspeech)

    @property
    def decoding(self):
        """`decoding.DecodingOptions` of evaluation during training."""
        return DecodingOptions(
            temperatures=self.temperatures,
            compression_ratio_threshold=self.compression_ratio_threshold,
            logprob_threshold=self.logprob_threshold,
            no_speech_threshold=self.no_speech_threshold,
        )


@dataclass(frozen=True)
class OutputRecord:
    output_dir: str = decided(FOLLOWS, "output_dir")  # a resume continues in its own folder
    save_steps: int | None = decided(MAY_CHANGE, "save_steps")
    save_total_limit: int = decided(MAY_CHANGE, "save_total_limit")
    # The last N checkpoints averaged at the end, kept where the average wins (None: not).
    average_checkpoints: int | None = decided(MAY_CHANGE, "average_checkpoints")
    logging_steps: int = decided(MAY_CHANGE, "logging_steps")
    report_to: tuple[str, ...] = decided(MAY_CHANGE, "report_to")
    # Which checkpoints: the last N or the best N evaluated (`choices.AVERAGE_BY`); a record
    # written before the option reads as the last N, all it did then.
    average_by: str = decided(MAY_CHANGE, "average_by", default="last")


SLICES = {
    "model": ModelRecord,
    "data": DataRecord,
    "memory": MemoryRecord,
    "training": TrainingRecord,
    "evaluation": EvaluationRecord,
    "output": OutputRecord,
}
# How this invocation began, not what the run does: in no record.
NOT_RECORDED = ("resume", "overwrite")


@dataclass(frozen=True)
class RunRecord:
    model: ModelRecord
    data: DataRecord
    memory: MemoryRecord
    training: TrainingRecord
    evaluation: EvaluationRecord
    output: OutputRecord
    notes: tuple[str, ...] = ()  # where the run does other than asked, and why
    # The options as asked (`RunConfig.run_options`): whisper-train.yaml's top, so that the file
    # works as --config. Not compared on resume: the decisions above are.
    asked: dict = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict:
        values = {name: _plain(dataclasses.asdict(getattr(self, name))) for name in SLICES}
        values["notes"] = list(self.notes)
        return values

    def to_yaml(self) -> str:
        """whisper-train.yaml (and each checkpoint's copy): the options as asked, then the
        record under `record:`."""
        return yaml.safe_dump({**self.asked, RECORD_KEY: self.to_dict()}, sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> RunRecord | None:
        """The record in a whisper-train.yaml (None: one written before records were kept).
        Raises ValueError when the file is not one."""
        values = read_yaml(text)
        if not isinstance(values, dict):
            raise ValueError("not a mapping of options")
        if not isinstance(values.get(RECORD_KEY), dict):
            return None
        asked = {k: v for k, v in values.items() if k != RECORD_KEY}
        return dataclasses.replace(cls.from_dict(values[RECORD_KEY]), asked=asked)

    @classmethod
    def from_dict(cls, values: dict) -> RunRecord:
        """A record saved by `to_dict` (a checkpoint's, whisper-train.yaml's)."""
        slices = {}
        for name, kind in SLICES.items():
            saved = dict(values.get(name) or {})
            known = {f.name: f for f in fields(kind)}
            kept = {k: _typed(known[k], v) for k, v in saved.items() if k in known}
            missing = [k for k, f in known.items() if k not in kept and _required(f)]
            if missing:
                raise ValueError(f"record.{name} lacks {', '.join(missing)}")
            slices[name] = kind(**kept)
        return cls(**slices, notes=tuple(values.get("notes") or ()))

    def replace(self, slice_name: str, **changes) -> RunRecord:
        """A copy with fields of one slice replaced (a decision a later phase makes: the
        checkpointing policy --gradient-checkpointing auto plans)."""
        updated = dataclasses.replace(getattr(self, slice_name), **changes)
        return dataclasses.replace(self, **{slice_name: updated})

    def with_note(self, note: str) -> RunRecord:
        return dataclasses.replace(self, notes=(*self.notes, note))


def _required(f) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _plain(value):
    """YAML-safe values: tuples as lists, dataclasses as mappings."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _typed(f, value):
    """A saved value as the field holds it (tuples, evaluation sets)."""
    if f.name == "sets":
        return tuple(EvalSet(**entry) for entry in value or ())
    if isinstance(value, list):
        return tuple(value)
    return value


def options_recorded() -> dict[str, list[str]]:
    """{option: the record fields made from it}; every option but NOT_RECORDED has one."""
    found: dict[str, list[str]] = {}
    for slice_name, kind in SLICES.items():
        for f in fields(kind):
            for option in f.metadata["options"]:
                found.setdefault(option, []).append(f"{slice_name}.{f.name}")
    return found


# -- a resume: the saved record against this one ---------------------------------------------


@dataclass
class ResumeChanges:
    """What a --resume changes (refused ones raise): a line for each, and whether the rest of
    the epoch is re-planned (`replan`), from the checkpoint's clips a step."""

    lines: list[str] = dataclasses.field(default_factory=list)
    replan: bool = False
    new_sets: list[str] = dataclasses.field(default_factory=list)  # measured at the resume step


def _label(f) -> str:
    return f.metadata["label"] or flag_of(f.metadata["options"][0])


def _remedy(f, old) -> str:
    """How to resume despite a refusal: the flag and the checkpoint's value where the field is
    one option's, else the checkpoint's own options."""
    if f.metadata["remedy"]:
        return f.metadata["remedy"]
    if not f.metadata["label"] and len(f.metadata["options"]) == 1:
        if old is None:  # not given (or none): leaving the flag out gives the checkpoint's
            return f"resume without {_label(f)}"
        return f"resume with {_label(f)} {_shown(old)}"
    return "resume with the options the checkpoint was saved with (its whisper-train.yaml)"


def _shown(value) -> str:
    if value is None:  # an option not in use (--nonspeech none, no --new-language, ...)
        return "none"
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def same_path(a, b) -> bool:
    """Whether two --data (or set) values name one file or folder, however spelled."""
    if not (isinstance(a, str) and isinstance(b, str)):
        return a == b
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def resume_changes(saved: RunRecord, now: RunRecord, *, folder: Path, step: int) -> ResumeChanges:
    """The one rule of a --resume from checkpoint `folder` (at `step`), field by field:
    UserError (one line, both values) for a MUST_EQUAL field that differs, a line for each
    MAY_CHANGE one, a line and `replan` for a REPLANS one (refused for a stream, which has no
    plan to redo)."""
    changes = ResumeChanges()
    _check_processes(saved, now, folder)
    for slice_name, kind in SLICES.items():
        before, after = getattr(saved, slice_name), getattr(now, slice_name)
        for f in fields(kind):
            old, new = getattr(before, f.name), getattr(after, f.name)
            resume = f.metadata["resume"]
            if resume == FOLLOWS or old == new or (f.name == "data" and same_path(old, new)):
                continue
            if old is None and f.metadata["unrecorded_before"]:
                continue  # a record from before the field was kept: its phase said so
            if f.name == "sets":
                _changed_sets(old, new, folder, changes)
                continue
            label = _label(f)
            if resume == MUST_EQUAL or (resume == REPLANS and now.data.streamed):
                why = "an exact resume depends on it"
                if resume == REPLANS:
                    why = "a stream's place cannot be re-planned"
                    if f.name == "clips_per_step":
                        why += _same_clips_advice(saved.data, now.data)
                # The line that says why this run decided otherwise (`--packing auto`'s).
                how = [note for note in now.notes if note.startswith(f"{f.name} auto ->")]
                raise RunRefused(
                    f"--resume {folder}: {label} {_shown(new)} differs from the checkpoint's "
                    f"{_shown(old)}" + (f" ({how[0]})" if how else "") + f", and {why}; "
                    f"{_remedy(f, old)}, or start a new run (a new --output-dir) to change it"
                )
            if resume == REPLANS:
                changes.replan = True
                advice = (
                    _same_clips_advice(saved.data, now.data) if f.name == "clips_per_step" else ""
                )
                changes.lines.append(
                    f"--resume: {label} {_shown(old)} -> {_shown(new)}: the rest of the epoch "
                    f"is planned anew from the clips it has not trained yet{advice}"
                )
            else:
                changes.lines.append(
                    f"--resume: {label} {_shown(old)} -> {_shown(new)} from step {step + 1} on"
                )
    _check_rate_groups(saved.training, now.training, folder)
    if now.evaluation.guard is not None and (
        saved.evaluation.guard != now.evaluation.guard or now.evaluation.guard in changes.new_sets
    ):
        changes.lines.append(
            f"--resume: guard set {now.evaluation.guard!r} is new: its start is measured now, "
            f"at step {step}, and later steps are held against that"
        )
    return changes


def _check_processes(saved: RunRecord, now: RunRecord, folder: Path) -> None:
    """Another number of processes continues a run whose processes hold one state: replicas
    with one copy of the weights and optimizer state, and steps planned whole, then dealt to
    them (each process restores process 0's random state: `checkpoints.load_checkpoint`).
    A streamed --data, whose processes each saved a place in their share of the pass, finishes
    that pass with the rows they had not read, dealt to the new count (at the same workers and
    clips a step, which must equal), then splits the next passes by it (`data.streaming`);
    one saved while finishing such a pass is refused there. Refused, in one line, where each
    process saved a state that another count has no process for: --fsdp's shards of the
    weights and optimizer state."""
    old, new = saved.data.processes, now.data.processes
    if old == new or not saved.memory.fsdp:
        return
    own = "--fsdp saved the weights and optimizer state as each process's shard of them"
    raise RunRefused(
        f"--resume {folder}: {new} process(es), the checkpoint's {old}, and {own}; resume with "
        f"--nproc {old} (or {old} processes in all under a launcher), or start a new run (a new "
        "--output-dir)"
    )


def _same_clips_advice(saved: DataRecord, now: DataRecord) -> str:
    """On another number of processes, the --batch-size that keeps the checkpoint's clips a
    step (the run then continues exactly as planned), where one does."""
    if saved.processes == now.processes:
        return ""
    share = now.accumulation * now.processes
    if saved.clips_per_step % share:
        return f" ({saved.processes} processes -> {now.processes})"
    return (
        f" ({saved.processes} processes -> {now.processes}; --batch-size "
        f"{saved.clips_per_step // share} keeps {saved.clips_per_step} and continues exactly)"
    )


def _changed_sets(old: tuple, new: tuple, folder: Path, changes: ResumeChanges) -> None:
    """A set added on resume is measured at the resume step; one dropped is no longer
    evaluated; one whose path, language or kind changed under its name is refused (its earlier
    WERs, which choose final/, were of other clips)."""
    before = {s.name: s for s in old}
    for entry in new:
        earlier = before.get(entry.name)
        if earlier is None:
            changes.new_sets.append(entry.name)
        elif earlier != entry and not (
            same_path(earlier.path, entry.path)
            and (earlier.language, earlier.long_form) == (entry.language, entry.long_form)
        ):
            raise RunRefused(
                f"--resume {folder}: evaluation set {entry.name!r} is now {entry.path} "
                f"(language {entry.language}, long {entry.long_form}), the checkpoint's was "
                f"{earlier.path} (language {earlier.language}, long {earlier.long_form}): its "
                "earlier WERs would be of other clips; give the new set another NAME"
            )
    if changes.new_sets:
        changes.lines.append(
            f"--resume: evaluation set(s) {', '.join(changes.new_sets)} new: measured at the "
            "resume step first"
        )
    dropped = [name for name in before if name not in {s.name for s in new}]
    if dropped:
        changes.lines.append(f"--resume: evaluation set(s) {', '.join(dropped)} no longer scored")


def _check_rate_groups(saved: TrainingRecord, now: TrainingRecord, folder: Path) -> None:
    """The checkpoint's optimizer holds its own parameter groups: the encoder has groups of its
    own where its rate differs from the rest (full fine-tuning's default); one rate shares
    them. A resume keeps the grouping: a new rate applies to each group from the resume point."""
    split_before = not math.isclose(saved.encoder_learning_rate, saved.learning_rate)
    split_now = not math.isclose(now.encoder_learning_rate, now.learning_rate)
    if split_before == split_now:
        return
    raise RunRefused(
        f"--resume {folder}: the checkpoint's optimizer gave the encoder "
        f"{'a rate of its own' if split_before else 'one rate with the rest'} and this run "
        f"{'one rate with the rest' if split_before else 'a rate of its own'}; resume with "
        f"--encoder-lr-scale {saved.encoder_lr_scale:g} (the scale it trained with)"
    )
