"""Typed configuration for a training run, validated in one place.

Four groups, each a dataclass whose fields carry their help text: `DataConfig`, `ModelConfig`,
`MemoryConfig`, `TrainConfig`, gathered in `RunConfig`. The CLI turns every field into a flag
(`--lora-r` for `lora_r`), a YAML file (`--config`) fills the same fields, flags override it, and
`RunConfig.validate()` is the only place that rejects illegal combinations. The resolved
configuration is written next to every saved model as `whisper-train.yaml`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from whisper_train.errors import UserError
from whisper_train.units import parse_bytes

MODES = ("full", "lora", "freeze-encoder")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
SCHEDULERS = ("linear", "constant_with_warmup")
OPTIMIZERS = ("adamw", "adamw-fused", "adamw8bit")
TASKS = ("transcribe", "translate")


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: only true and false (True, TRUE, ...).

    YAML 1.1, PyYAML's default, also reads yes/no/on/off as booleans, which turns `language: no`
    (Norwegian) into False and `packing: on` into True; options whose values are such words
    (on/off, language codes) then cannot be written plainly. A boolean option still takes
    yes/no/on/off, as text (`_coerce`). Everything else (numbers, null) reads as before.
    Written files (`to_yaml`, PyYAML's dumper) quote every YAML 1.1 boolean word, so a 1.1
    reader reads them the same."""


_BOOL_TAG = "tag:yaml.org,2002:bool"
_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def read_yaml(text: str) -> Any:
    """A configuration file's values, read with YAML 1.2's booleans (`_Yaml12Loader`)."""
    return yaml.load(text, Loader=_Yaml12Loader)  # a SafeLoader: builds only plain values


def named_sets(entries: list[str], flag: str) -> dict[str, tuple[str, str | None]]:
    """["target:es=t/", "general=g/"] → {"target": ("t/", "es"), "general": ("g/", None)}, in
    order: NAME=PATH, or NAME:LANG=PATH to state the set's language (a code or name Whisper
    knows); a bare PATH is named "eval". The one reading of NAME[:LANG]=PATH for `train
    --eval-data` and `evaluate --data`. The language sits on the name's side of `=`, so paths
    (and hub ids such as `name:config:split`) are never split."""
    sets: dict[str, tuple[str, str | None]] = {}
    for entry in entries:
        label, sep, path = entry.partition("=")
        name, _, language = label.partition(":")
        if not sep:  # a bare PATH
            name, language, path = "eval", "", entry
        elif not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) or not path:
            raise UserError(
                f"{flag} {entry}: expected NAME=PATH (or NAME:LANG=PATH) with NAME of letters, "
                "digits, '-', '_' or '.', or a bare PATH"
            )
        if name in sets:
            raise UserError(f"{flag} {entry}: the name {name} is used twice")
        if language:
            from whisper_train.data.labels import language_code

            try:
                language = language_code(language)
            except UserError as exc:
                raise UserError(f"{flag} {entry}: {exc}") from None
        sets[name] = (path, language or None)
    return sets


def named_paths(entries: list[str], flag: str) -> dict[str, str]:
    """{name: path} of `named_sets`."""
    return {name: path for name, (path, _) in named_sets(entries, flag).items()}


def _is_checkpoint_policy(policy: str) -> bool:
    """off | on | full | encoder | auto | every-N, N >= 1 (`on` is `full`; `auto` picks from
    --max-memory)."""
    # Imported here, not at the top: the every-N parser lives with checkpointing, which needs
    # torch, and `import whisper_train.config` (so the CLI's --help) stays torch-free.
    from whisper_train.memory.checkpointing import parse_every_n

    return policy in ("off", "on", "full", "encoder", "auto") or parse_every_n(policy) is not None


def _help(text: str, **kwargs: Any) -> Any:
    """A dataclass field whose metadata carries its CLI help."""
    return field(metadata={"help": text}, **kwargs)


@dataclass
class DataConfig:
    data: str | None = _help(
        "Training data: an audiofolder (metadata.csv), a JSONL/CSV/TSV manifest, or another "
        "layout that `check-data` recognises.",
        default=None,
    )
    eval_data: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Held-out data in any accepted layout, as NAME=PATH (repeat the flag for "
            "several sets, each scored at every evaluation; a bare PATH is named 'eval'). "
            "NAME:LANG=PATH states the set's language (e.g. general:en=general-english/); a "
            "row's `language` column wins, and a set with neither is decoded in the language "
            "detected in each clip, never in --language. "
            "Default: a seeded split of --data, named 'eval' (decoded in --language).",
            "repeatable": True,
        },
    )
    data_format: str | None = _help(
        "Force --data's layout instead of detecting it (evaluation sets are detected).",
        default=None,
    )
    streaming: bool = _help(
        "Stream --data instead of reading it whole: a hub id is then streamed, not downloaded "
        "(WebDataset .tar and Parquet shards always stream).",
        default=False,
    )
    shuffle_buffer: int = _help(
        "Rows held in a streamed --data's seeded shuffle buffer: larger shuffles better and holds "
        "more encoded audio in memory.",
        default=1000,
    )
    eval_split: float = _help(
        "Fraction of --data held out for evaluation when --eval-data is not given.", default=0.1
    )
    train_subset: int | None = _help("Use only the first N training utterances.", default=None)
    eval_subset: int | None = _help("Use only the first N evaluation utterances.", default=None)
    language: str | None = _help(
        "Language of the speech (e.g. en, de); a per-row `language` column wins. "
        "English-only checkpoints (*.en) accept only English.",
        default=None,
    )
    pin_language: bool = _help(
        "Save --language as the fine-tuned model's language, so that transformers' pipeline, "
        "`transcribe` and the exports decode every clip in it. Off by default: the saved model "
        "detects each clip's language, as the base did.",
        default=False,
    )
    task: str = _help("transcribe or translate (to English).", default="transcribe")
    timestamps: bool = _help(
        "Train with timestamp tokens where segment times are known.", default=False
    )
    strict: bool = _help(
        "Stop on the first unusable clip instead of skipping and counting it.", default=False
    )
    spec_augment: bool = _help(
        "SpecAugment (time and frequency masking); off by default, a choice not measured here.",
        default=False,
    )
    audio_augment: bool = _help(
        "Waveform augmentation (noise, speed, gain), seeded by --seed.", default=False
    )
    packing: str = _help(
        "on: pack short training clips into windows of at most 30 s of audio and 448 label "
        "tokens (the encoder always runs on 30 s: packed, it runs on speech, not padding); "
        "off: one clip a window. Evaluation is never packed.",
        default="off",
    )
    packing_timestamps: str = _help(
        "on (with --packing on): label every packed window of 2+ clips in Whisper's timestamp "
        "form, each clip a segment at its place in the window, with or without --timestamps; "
        "off: packed windows follow --timestamps as single clips do (the default: "
        "always-timestamped windows measured no better, BENCHMARKS.md).",
        default="off",
    )


@dataclass
class ModelConfig:
    model: str = _help(
        "A Hugging Face model folder or hub id, a CTranslate2/faster-whisper folder, a "
        "whisper-train output folder, or the alias tiny.en.",
        default="tiny.en",
    )
    mode: str = _help(
        "full: train every weight; lora: low-rank adapters (peft); freeze-encoder: train the "
        "decoder only.",
        default="full",
    )
    lora_r: int = _help("LoRA rank.", default=32)
    lora_alpha: int = _help("LoRA scaling numerator (scale = alpha / r).", default=64)
    lora_dropout: float = _help("Dropout on the LoRA path.", default=0.05)
    lora_targets: list[str] = _help(
        "Comma-separated module names that get adapters, in the encoder and the decoder (in the "
        "decoder only with --cache-encoder: the cached encoder stays as it is).",
        default_factory=lambda: ["q_proj", "v_proj"],
    )
    attn_implementation: str = _help("sdpa or eager attention.", default="sdpa")


@dataclass
class MemoryConfig:
    gradient_checkpointing: str | None = _help(
        "off | on | full | encoder | every-N | auto (default: full on a GPU, off on a CPU). "
        "Always non-reentrant.",
        default=None,
    )
    max_memory: str | None = _help(
        "Device memory budget for --gradient-checkpointing auto, e.g. 4GB.", default=None
    )
    offload_activations: bool = _help(
        "Keep checkpoint boundaries in host memory (CUDA; needs checkpointing).", default=False
    )
    precision: str = _help(
        "auto (bf16 where supported, fp16 + loss scaling on older GPUs, fp32 on CPU), fp32, "
        "bf16 or fp16.",
        default="auto",
    )
    optim: str = _help(
        "adamw (torch's fused kernel where the weights allow it), adamw-fused (that kernel or "
        "an error) or adamw8bit (bitsandbytes).",
        default="adamw",
    )
    cache_encoder: bool | None = _help(
        "Compute encoder outputs once and reuse them every epoch (default: on when the encoder "
        "is frozen and audio is not augmented).",
        default=None,
    )
    encoder_cache_dir: str | None = _help(
        "Folder of the cached encoder outputs, shared by runs and evaluations (one subfolder per "
        "encoder and precision; `whisper-train cache ls|clear`). Default: "
        "$WHISPER_TRAIN_CACHE/encoder, else $XDG_CACHE_HOME/whisper-train/encoder, else "
        "~/.cache/whisper-train/encoder.",
        default=None,
    )
    encoder_cache_max_size: str = _help(
        "Most disk the encoder cache folder may fill, all models together (e.g. 50GB; 0 writes "
        "nothing). Clips past it, or past the disk's free space, are encoded again every epoch.",
        # ~8,700 clips of tiny, ~4,300 of small, ~2,600 of large-v3 (1500 x d_model x 2 bytes).
        default="10GB",
    )
    compile: bool = _help("torch.compile the model.", default=False)


@dataclass
class TrainConfig:
    output_dir: str = _help(
        "Where metrics, checkpoints and final/ go.", default="whisper-train-output"
    )
    epochs: float | None = _help("Passes over the training data (default 3).", default=None)
    max_steps: int | None = _help("Optimizer steps; overrides --epochs.", default=None)
    batch_size: int = _help("Utterances per micro-batch (per process).", default=8)
    gradient_accumulation: int = _help("Micro-batches per optimizer step.", default=1)
    learning_rate: float | None = _help(
        "Peak learning rate: default 3e-4 for lora (1e-3 cost tiny.en 4 points of WER on real "
        "speech it was not trained on), 1e-5 for full, 3e-5 for freeze-encoder (within 1.2 "
        "points there); one measurement, BENCHMARKS.md 'Quality'.",
        default=None,
    )
    lr_scheduler: str = _help("linear or constant_with_warmup.", default="linear")
    warmup_steps: int = _help(
        "Linear warm-up steps (default 0, a choice not measured here).", default=0
    )
    weight_decay: float = _help("AdamW weight decay.", default=0.0)
    max_grad_norm: float = _help("Clip gradients to this global norm (0 disables).", default=1.0)
    seed: int = _help("Seed for initialisation, data order, splits and augmentation.", default=42)
    eval_steps: int | None = _help(
        "Evaluate every N optimizer steps (default: only at the end).", default=None
    )
    only_train: bool = _help("Skip evaluation entirely.", default=False)
    eval_at_start: bool = _help(
        "Evaluate once before the first step too: the starting point in the table and curves.",
        default=False,
    )
    metric_for_best: str | None = _help(
        "The evaluation set whose WER picks the best evaluated step, which final/ holds "
        "(default: the first --eval-data set that is not the --guard).",
        default=None,
    )
    guard: str | None = _help(
        "An --eval-data set (by NAME) of what the model must not forget: scored before step 1 "
        "and at every evaluation; a step whose guard WER rose more than --max-regression points "
        "over the start is never chosen for final/.",
        default=None,
    )
    max_regression: float | None = _help(
        "Points of guard WER a step may lose against the start (default 2.0 with --guard; a "
        "default chosen, not measured).",
        default=None,
    )
    stop_on_regression: bool = _help(
        "Stop training (with a checkpoint) at the first evaluation past --max-regression.",
        default=False,
    )
    preserve_base: float = _help(
        "Weight of a KL term that keeps the model's next-token distribution at label positions "
        "close to the starting model's (distil-whisper's teacher term): 0 is off. Costs a frozen "
        "copy of the weights for full and freeze-encoder (none for LoRA) and one no-grad "
        "forward a step. Off by default: measured once, weight 1 held tiny.en's WER on real "
        "speech it never trained on at 6.4 (7.3 before) where LoRA at 1e-3 without it reached "
        "11.5 (BENCHMARKS.md 'Quality').",
        default=0.0,
    )
    compare_baseline: bool = _help(
        "At the end, evaluate the starting model and the fine-tuned one on the evaluation data "
        "and write OUTPUT/report.md and report.png (utterances that got better and worse).",
        default=False,
    )
    logging_steps: int = _help(
        "Report the training loss averaged over the last N optimizer steps, every N steps: in "
        "the progress bar on a terminal, else (a log file, CI) as one plain line with step/total, "
        "loss and learning rate. metrics.jsonl always gets every step.",
        default=1,
    )
    generation_max_length: int = _help(
        "Longest transcript generated during evaluation.", default=225
    )
    # Evaluation's decoding, as `evaluate` and `transcribe` decode (whisper_train.decoding).
    temperatures: str = _help(
        "Evaluation decodes greedily, then again at these temperatures (sampling) for each "
        "utterance whose output loops (--compression-ratio-threshold) or is unlikely "
        "(--logprob-threshold); a single 0 turns the fallback off. openai-whisper's defaults, "
        "not tuned here.",
        default="0,0.2,0.4,0.6,0.8,1.0",
    )
    compression_ratio_threshold: str = _help(
        "Decode again when a transcript's zlib compression ratio is above this; none to disable.",
        default="2.4",
    )
    logprob_threshold: str = _help(
        "Decode again when a transcript's mean token log-probability is below this; none to "
        "disable.",
        default="-1.0",
    )
    num_workers: int = _help("Data-loading worker processes.", default=0)
    group_by_length: bool = _help(
        "Batch utterances of similar label length together (less padding), in a seeded order.",
        default=False,
    )
    save_steps: int | None = _help(
        "Write OUTPUT/checkpoint-<step>/ every N optimizer steps (default: only when the run is "
        "interrupted or stopped).",
        default=None,
    )
    save_total_limit: int = _help(
        "Keep the newest N checkpoints, plus the one with the best WER.", default=2
    )
    resume: str | None = field(
        default=None,
        metadata={
            "help": "Continue a run: 'latest' (the newest checkpoint in --output-dir; a bare "
            "--resume means this) or a checkpoint folder.",
            "const": "latest",  # the value of the bare flag
        },
    )
    overwrite: bool = _help(
        "Start afresh in an --output-dir that holds an earlier run: its whisper-train files "
        "(final/, checkpoints, metrics, reports) are moved, not deleted, into a new folder "
        "OUTPUT.old-<date>-<time> beside it; other files stay where they are. Off by default: "
        "such a folder is refused.",
        default=False,
    )
    max_bad_steps: int = _help(
        "Stop (with a checkpoint) after N optimizer steps in a row whose loss or gradient is NaN "
        "or infinite; each such step is skipped.",
        default=10,
    )
    nproc: int = _help(
        "Data-parallel processes on this machine (one per GPU, or CPU processes with gloo). "
        "--batch-size is per process: global batch = nproc x batch x accumulation.",
        default=1,
    )
    fsdp: bool = _help(
        "Shard weights, gradients and optimiser state over the --nproc processes (FSDP2): each "
        "holds 1/N of them, for a model whose training does not fit one GPU. Costs gathers "
        "each step and the whole weights on every process while evaluating.",
        default=False,
    )


GROUPS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "memory": MemoryConfig,
    "train": TrainConfig,
}


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    # -- building -------------------------------------------------------------------------
    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> RunConfig:
        """Build from a flat {field_name: value} mapping (CLI flags); unknown keys are an error."""
        config = cls()
        config.update(values)
        return config

    def update(self, values: dict[str, Any], *, source: str = "flag") -> None:
        """Set fields by flat name (`lora_r`) or nested group mapping (`{"model": {...}}`)."""
        owners = field_owners()
        for key, value in values.items():
            key = key.replace("-", "_")
            if key in GROUPS and isinstance(value, dict):
                group = getattr(self, key)
                for sub, sub_value in value.items():
                    sub = sub.replace("-", "_")
                    if sub not in {f.name for f in fields(group)}:
                        raise UserError(
                            f"{source}: unknown option '{key}.{sub}'; see `whisper-train train --help`"
                        )
                    setattr(group, sub, _coerce(group, sub, sub_value, source))
            elif key in owners:
                group = getattr(self, owners[key])
                setattr(group, key, _coerce(group, key, value, source))
            else:
                raise UserError(
                    f"{source}: unknown option '{key}'; see `whisper-train train --help`"
                )

    @classmethod
    def from_yaml(cls, path: str | Path) -> RunConfig:
        path = Path(path)
        if not path.is_file():
            raise UserError(
                f"--config {path}: no such file; pass a YAML file such as configs/lora.yaml"
            )
        try:
            values = read_yaml(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            raise UserError(
                f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})"
            ) from None
        if not isinstance(values, dict):
            raise UserError(
                f"--config {path}: expected a mapping of options, got {type(values).__name__}"
            )
        config = cls()
        config.update(values, source=str(path))
        return config

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in GROUPS}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def to_saved_yaml(self) -> str:
        """The run's record (OUTPUT/whisper-train.yaml, each checkpoint's copy): `to_yaml` less
        the one-shot actions --resume and --overwrite, which describe how this invocation
        began, not the run. The resume command the tool prints (`--config` that file plus
        `--resume`) then works whatever flags the first invocation had."""
        values = self.to_dict()
        values["train"].update(resume=None, overwrite=False)
        return yaml.safe_dump(values, sort_keys=False)

    # -- the one place that validates -----------------------------------------------------
    def validate(self) -> RunConfig:
        """Reject illegal values and combinations with a message that names the flags."""
        d, m, mem, t = self.data, self.model, self.memory, self.train
        _one_of("--mode", m.mode, MODES)
        _one_of("--task", d.task, TASKS)
        _one_of("--precision", mem.precision, PRECISIONS)
        _one_of("--optim", mem.optim, OPTIMIZERS)
        _one_of("--lr-scheduler", t.lr_scheduler, SCHEDULERS)
        _one_of("--attn-implementation", m.attn_implementation, ("sdpa", "eager"))
        if d.pin_language and d.language is None:
            raise UserError("--pin-language saves --language in the model: add --language")
        policy = mem.gradient_checkpointing
        if policy is not None and not _is_checkpoint_policy(policy):
            raise UserError(
                f"--gradient-checkpointing {policy}: expected off, on, full, encoder, every-N "
                "(e.g. every-2) or auto"
            )
        if policy == "auto" and not mem.max_memory:
            raise UserError(
                "--gradient-checkpointing auto needs --max-memory (e.g. --max-memory 4GB)"
            )
        if mem.max_memory is not None:
            parse_bytes(mem.max_memory, flag="--max-memory")
        parse_bytes(mem.encoder_cache_max_size, flag="--encoder-cache-max-size")
        if mem.offload_activations and policy in (None, "off"):
            raise UserError(
                "--offload-activations needs gradient checkpointing: add --gradient-checkpointing full"
            )
        if mem.cache_encoder and m.mode == "full":
            raise UserError(
                "--cache-encoder needs a frozen encoder: use --mode freeze-encoder, or drop --cache-encoder"
            )
        if t.only_train and (t.eval_at_start or t.compare_baseline or t.eval_steps):
            raise UserError(
                "--only-train skips evaluation: drop it, or drop --eval-steps/--eval-at-start/"
                "--compare-baseline"
            )
        if mem.cache_encoder and (d.audio_augment or d.spec_augment):
            raise UserError(
                "--cache-encoder cannot be combined with --audio-augment/--spec-augment: augmented "
                "audio changes the encoder output every epoch"
            )
        for flag, value in (
            ("--batch-size", t.batch_size),
            ("--gradient-accumulation", t.gradient_accumulation),
            ("--lora-r", m.lora_r),
            ("--lora-alpha", m.lora_alpha),  # 0 scales every adapter's update to nothing
            ("--logging-steps", t.logging_steps),
            ("--generation-max-length", t.generation_max_length),
            ("--save-total-limit", t.save_total_limit),
            ("--max-bad-steps", t.max_bad_steps),
            ("--nproc", t.nproc),
            ("--shuffle-buffer", d.shuffle_buffer),
        ):
            require_positive(flag, value)
        d.packing = _on_off("--packing", d.packing)
        d.packing_timestamps = _on_off("--packing-timestamps", d.packing_timestamps)
        if d.packing_timestamps == "on" and d.packing != "on":
            raise UserError(
                "--packing-timestamps on labels packed windows: add --packing on, or drop "
                "--packing-timestamps"
            )
        if d.packing == "on" and t.group_by_length:
            raise UserError(
                "--group-by-length with --packing on: packed windows are batched as they are "
                "planned; drop one of them"
            )
        self._validate_stream()
        if self.packing_on and self.cache_encoder:
            raise UserError(
                "--packing on with the frozen encoder's cache: the cache keeps each clip's "
                "encoder output, and packed windows are drawn anew every epoch, so none would "
                "be reused; drop --packing (cached epochs already skip the encoder) or add "
                "--no-cache-encoder"
            )
        for flag, value in (  # these may also be left unset (None)
            ("--max-steps", t.max_steps),
            ("--eval-steps", t.eval_steps),
            ("--save-steps", t.save_steps),
            ("--train-subset", d.train_subset),
            ("--eval-subset", d.eval_subset),
        ):
            if value is not None:
                require_positive(flag, value)
        self._validate_numbers()
        if t.resume is not None and not t.resume.strip():
            raise UserError("--resume: pass 'latest' or a checkpoint folder")
        if t.resume is not None and t.overwrite:
            raise UserError(
                "--resume continues the run in --output-dir and --overwrite moves it aside: "
                "drop one of them"
            )
        self._validate_fsdp()
        if not m.lora_targets:
            raise UserError("--lora-targets: name at least one module, e.g. q_proj,v_proj")
        self._validate_eval_sets()
        self.decoding_options()  # malformed --temperatures or thresholds: one line, now
        return self

    def _validate_numbers(self) -> None:
        """Each number option within its range, NaN and infinity refused: one line naming the
        flag and what it accepts, before anything loads (torch's AdamW raised a traceback on a
        NaN learning rate; --weight-decay inf and --max-grad-norm nan trained without a word)."""
        d, m, t = self.data, self.model, self.train
        above_0, at_least_0, below_1 = (lambda v: v > 0), (lambda v: v >= 0), (lambda v: 0 <= v < 1)
        for flag, value, in_range, accepted in (
            ("--learning-rate", t.learning_rate, above_0, "a finite number above 0 (e.g. 1e-5)"),
            ("--weight-decay", t.weight_decay, at_least_0, "a finite number of 0 or more"),
            (
                "--max-grad-norm",
                t.max_grad_norm,
                at_least_0,
                "a finite norm of 0 or more (0: no clipping)",
            ),
            ("--epochs", t.epochs, above_0, "a finite number of passes above 0"),
            ("--eval-split", d.eval_split, below_1, "a fraction in [0, 1)"),
            # 1 would zero the adapter path in every training step: nothing would train.
            ("--lora-dropout", m.lora_dropout, below_1, "a probability in [0, 1)"),
            ("--preserve-base", t.preserve_base, at_least_0, "a finite weight of 0 (off) or more"),
            (
                "--max-regression",
                t.max_regression,
                at_least_0,
                "a finite number of points, 0 or more",
            ),
        ):
            if value is not None and not (math.isfinite(value) and in_range(value)):
                raise UserError(f"{flag} {value:g}: expected {accepted}")
        for flag, value in (("--warmup-steps", t.warmup_steps), ("--num-workers", t.num_workers)):
            if value < 0:
                raise UserError(f"{flag} {value}: expected 0 or more")
        # numpy's seed (set with torch's and Python's) takes 32 bits, unsigned.
        if not 0 <= t.seed < 2**32:
            raise UserError(f"--seed {t.seed}: expected a whole number from 0 to {2**32 - 1}")

    def _validate_fsdp(self) -> None:
        """What --fsdp (sharded weights) cannot be combined with, each refused in one line."""
        mem, t = self.memory, self.train
        if not t.fsdp:
            return
        # Under accelerate launch / torchrun, --nproc stays 1 and the launcher sets WORLD_SIZE.
        if t.nproc < 2 and int(os.environ.get("WORLD_SIZE", "1")) < 2:
            raise UserError("--fsdp shards the model over processes: add --nproc 2 (or more)")
        refused = [
            (
                mem.precision == "fp16",
                "--precision fp16 (its loss scaler does not unscale sharded gradients): "
                "use --precision bf16 or fp32",
            ),
            (mem.compile, "--compile (not tested sharded): drop one of them"),
            (
                mem.optim == "adamw8bit",
                "--optim adamw8bit (bitsandbytes does not step sharded weights): use adamw",
            ),
            (
                mem.gradient_checkpointing == "auto",
                "--gradient-checkpointing auto (its plan counts the whole model on one "
                "process): choose a policy, e.g. full",
            ),
            (
                self.cache_encoder,
                "the frozen encoder's cache (each process would run the sharded encoder for "
                "its own uncached clips alone): add --no-cache-encoder",
            ),
        ]
        for refuse, why in refused:
            if refuse:
                raise UserError(f"--fsdp with {why}")

    def _validate_stream(self) -> None:
        """What a streamed --data (shards, or --streaming) cannot do: it has no length before
        it is read, no rows to sort or split, and its clips have no fixed index to cache by."""
        if self.stream_source() is None:
            return
        d, t = self.data, self.train
        refused = [
            ("--group-by-length", t.group_by_length, "drop it"),
            ("--train-subset", d.train_subset, "use --max-steps"),
            ("--cache-encoder", self.memory.cache_encoder, "drop it"),
        ]
        for flag, value, remedy in refused:
            if value:
                raise UserError(
                    f"{flag} needs --data read whole, and {d.data} is streamed: {remedy}"
                )
        if not (t.only_train or self.eval_sets() or d.eval_split == 0):
            raise UserError(
                f"--data {d.data} is streamed and cannot be split for evaluation: pass "
                "--eval-data NAME=PATH (a small set in any layout), or --only-train"
            )

    def stream_source(self):
        """The `streaming.StreamSource` --data names when it is read as a stream, else None."""
        # Imported here: streaming needs torch and soundfile; `import whisper_train.config` stays
        # light for the CLI's --help.
        from whisper_train.data.streaming import stream_source

        d = self.data
        return stream_source(d.data, data_format=d.data_format, streaming=d.streaming)

    def decoding_options(self):
        """The `decoding.DecodingOptions` of evaluation during training."""
        # Imported here: decoding needs torch, and `import whisper_train.config` stays light.
        from whisper_train.decoding import (
            DecodingOptions,
            parse_temperatures,
            parse_threshold,
        )

        t = self.train
        return DecodingOptions(
            temperatures=parse_temperatures(t.temperatures),
            compression_ratio_threshold=parse_threshold(
                t.compression_ratio_threshold, "--compression-ratio-threshold"
            ),
            logprob_threshold=parse_threshold(t.logprob_threshold, "--logprob-threshold"),
        )

    def _validate_eval_sets(self) -> None:
        t = self.train
        names = list(self.eval_sets()) or ["eval"]  # a split of --data is named "eval"
        for flag, name in (("--metric-for-best", t.metric_for_best), ("--guard", t.guard)):
            if name is not None and name not in names:
                raise UserError(
                    f"{flag} {name}: no evaluation set of that name; the sets are "
                    f"{', '.join(names)} (name them with --eval-data NAME=PATH)"
                )
        if t.guard is not None and t.only_train:
            raise UserError("--guard needs evaluation: drop --only-train")
        if t.guard is not None and len(names) < 2:
            raise UserError(
                f"--guard {t.guard}: it needs another set to pick the best step by; add "
                "--eval-data NAME=PATH for the data you fine-tune for"
            )
        if t.guard is not None and t.metric_for_best == t.guard:
            raise UserError("--metric-for-best and --guard name the same set: name another")
        if (t.max_regression is not None or t.stop_on_regression) and t.guard is None:
            raise UserError("--max-regression and --stop-on-regression need --guard NAME")

    def eval_sets(self) -> dict[str, str]:
        """{name: path} of --eval-data, in the order given (empty: split --data instead)."""
        return named_paths(self.data.eval_data or [], "--eval-data")

    def eval_set_language(self, name: str) -> str | None:
        """The language evaluation set `name` is decoded in where its rows state none: its
        NAME:LANG, else --language for the split of --data (the training speech), else None
        (detected per clip)."""
        sets = named_sets(self.data.eval_data or [], "--eval-data")
        if name in sets:
            return sets[name][1]
        return self.data.language

    @property
    def primary_eval_set(self) -> str:
        """The set whose WER picks the best step (and is the run's reported WER)."""
        if self.train.metric_for_best:
            return self.train.metric_for_best
        names = [n for n in self.eval_sets() if n != self.train.guard]
        return names[0] if names else "eval"

    # -- resolved defaults ---------------------------------------------------------------
    @property
    def learning_rate(self) -> float:
        if self.train.learning_rate is not None:
            return self.train.learning_rate
        return {"full": 1e-5, "lora": 3e-4, "freeze-encoder": 3e-5}[self.model.mode]

    def lora_settings(self):
        """The adapters of --mode lora (`memory.LoraSettings`), None for the other modes. With
        the encoder's outputs cached they go on the decoder only: the cache computes each clip's
        encoder output once, without gradient, so adapters inside the encoder would never train
        (trainable parameters that never get a gradient: under --nproc, DDP stopped at step 2)."""
        # Imported here: checkpointing needs torch, and `import whisper_train.config` stays light.
        from whisper_train.memory.checkpointing import LoraSettings

        m = self.model
        if m.mode != "lora":
            return None
        return LoraSettings(
            r=m.lora_r,
            alpha=m.lora_alpha,
            dropout=m.lora_dropout,
            targets=tuple(m.lora_targets),
            decoder_only=self.cache_encoder,
        )

    @property
    def packing_on(self) -> bool:
        """Whether training clips are packed into 30 s windows (`packing`)."""
        return self.data.packing == "on"

    @property
    def packing_timestamps_on(self) -> bool:
        """Whether packed windows of 2+ clips always carry timestamps (`packing_timestamps`)."""
        return self.packing_on and self.data.packing_timestamps == "on"

    @property
    def cache_encoder(self) -> bool:
        if self.memory.cache_encoder is not None:
            return self.memory.cache_encoder
        # A stream's clips have no fixed index to cache by: its encoder runs every step.
        return (
            self.model.mode == "freeze-encoder"
            and not (self.data.audio_augment or self.data.spec_augment)
            and self.stream_source() is None
        )


def field_owners() -> dict[str, str]:
    """{field_name: group_name} for every option; names are unique across groups."""
    owners: dict[str, str] = {}
    for group_name, group_cls in GROUPS.items():
        for f in fields(group_cls):
            assert f.name not in owners, f"option {f.name} defined twice"
            owners[f.name] = group_name
    return owners


def require_positive(flag: str, value: int, *, alternative: str | None = None) -> None:
    """Reject a count below 1 with a one-line error that names the flag and the remedy.

    `--batch-size 0: must be at least 1`; an `alternative` such as "use --no-check" adds
    `(or use --no-check)`.
    """
    if value < 1:
        remedy = f" (or {alternative})" if alternative else ""
        raise UserError(f"{flag} {value}: must be at least 1{remedy}")


def _one_of(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"{flag} {value}: expected one of {', '.join(allowed)}")


def _on_off(flag: str, value: Any) -> str:
    """'on' / 'off' from a flag's text; true/yes/1 and false/no/0 too (the YAML file's
    `true` reaches here as the text "true", `_coerce`)."""
    text = str(value).strip().lower()
    if text in ("on", "true", "yes", "1"):
        return "on"
    if text in ("off", "false", "no", "0"):
        return "off"
    raise UserError(f"{flag} {value}: expected on or off")


_TRUE_WORDS = ("true", "yes", "y", "on", "1")
_FALSE_WORDS = ("false", "no", "n", "off", "0")


def _coerce(group: Any, name: str, value: Any, source: str) -> Any:
    """YAML and flags give strings, numbers, lists; make them the field's declared type."""
    if value is None:
        return None
    annotation = str({f.name: f.type for f in fields(group)}[name])
    try:
        if annotation.startswith("list"):
            if isinstance(value, dict):  # YAML `eval_data: {name: path}`
                return [f"{k}={v}" for k, v in value.items()]
            if isinstance(value, str):
                return [part.strip() for part in value.split(",") if part.strip()]
            return [str(v) for v in value]
        if annotation.startswith("bool"):
            # YAML's true/false, or a yes/no word as text (YAML 1.2 keeps yes/no/on/off text).
            if isinstance(value, bool):
                return value
            word = str(value).strip().lower()
            if word in _TRUE_WORDS or word in _FALSE_WORDS:
                return word in _TRUE_WORDS
            flag = "--" + name.replace("_", "-")
            raise UserError(f"{source}: {flag} {value}: expected true or false (or yes/no, on/off)")
        if annotation.startswith("int"):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if annotation.startswith("float"):
            return float(value)
        if isinstance(value, (list, tuple)):  # YAML `temperatures: [0, 0.2]`
            return ",".join(str(v) for v in value)
        if isinstance(value, bool):  # YAML's true/false where text is expected: as written
            return str(value).lower()
        return str(value)
    except (TypeError, ValueError):
        flag = "--" + name.replace("_", "-")
        raise UserError(f"{source}: {flag} {value!r} is not a valid {annotation}") from None
