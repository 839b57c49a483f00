"""The options of a training run: four groups, each a dataclass whose fields carry their help
text (`DataConfig`, `ModelConfig`, `MemoryConfig`, `TrainConfig`), and the choices some of them
take. The CLI turns every field into a flag (`--lora-r` for `lora_r`); `RunConfig` gathers
them and validates them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from whisper_train.choices import (  # noqa: F401
    AVERAGE_BY,
    LORA_VARIANTS,
    MODES,
    NONSPEECH_AUTO,
    OPTIMIZERS,
    PACKING_AUTO,
    PACKINGS,
    QUANTIZE_BASE,
    TASKS,
)

# Each mode's learning rate when --learning-rate is not given, from sweeps on tiny.en scored on
# held-out voices and on real speech no run trained on (BENCHMARKS.md "Learning rates"). Full:
# 2e-5 for the decoder and 5e-5 for the encoder (`ENCODER_LR_SCALES`), not the HF blog's 1e-5
# for all (one epoch at 3e-5 for all made a third fewer held-out errors than 1e-5), nor 1e-4
# (better still on held-out synthetic voices, but 30 steps on AN4 took real English from 7.3%
# to 28-75% WER). Adapters and a decoder alone take larger steps: LoRA 1.5e-4 on every linear
# layer (`LORA_TARGETS`), which kept real English where tiny.en had it (7.3%) where 3e-4 on
# q/v cost 0.6 points and on every linear 1.6.
DEFAULT_LEARNING_RATES = {"full": 2e-5, "lora": 1.5e-4, "freeze-encoder": 3e-5}
# Full fine-tuning's default per model width (d_model), for the sizes not measured here: the
# rates Whisper was pretrained at (its paper's last page: tiny 1.5e-3, base 1e-3, small 5e-4,
# medium 2.5e-4, large 1.75e-4) over 40 (one rate for the whole model: tiny's measured 3e-5,
# small the HF blog's ~1e-5), split as tiny's is: the decoder at 2/3 of it (these), the
# encoder at 2.5x the decoder's. A width between two sizes takes the larger size's rate.
FULL_LEARNING_RATES_BY_WIDTH = {384: 2e-5, 512: 1.7e-5, 768: 8.5e-6, 1024: 4.2e-6, 1280: 2.9e-6}
# The encoder's learning rate over --learning-rate, per mode when --encoder-lr-scale is not
# given. Full fine-tuning on tiny.en: the held-out voices are learnt by the encoder's steps and
# real English is lost by the decoder's (encoder 5e-5 with decoder 3e-5 made 16% fewer held-out
# errors than 3e-5 for all and cost LJ Speech 0.5 points; decoder 5e-5 gained nothing and cost
# 0.35), so encoder 5e-5 with decoder 2e-5: 19% fewer on four seeds, LJ Speech kept, and after
# 30 steps on AN4 too (BENCHMARKS.md "Encoder and decoder at their own rates"). LoRA's adapters
# were measured at one rate; freeze-encoder trains no encoder.
ENCODER_LR_SCALES = {"full": 2.5, "lora": 1.0, "freeze-encoder": 1.0}

# LoRA's default adapters: every linear layer of Whisper's attention and feed-forward blocks
# (not the output head, tied to the token embedding). On tiny.en they made a third fewer
# held-out errors than the HF blog's q_proj/v_proj in the same steps (BENCHMARKS.md "LoRA on
# every linear layer").
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
SCHEDULERS = ("linear", "constant_with_warmup")
# Points of guard-set WER a chosen step may lose against the start, when --guard is given and
# --max-regression is not: a default picked by judgement, not measured.
DEFAULT_MAX_REGRESSION = 2.0
# Words per minute a chosen step may invent on a non-speech set over its start: one word a
# minute, a default picked by judgement (the built-in set is 68 s: one word is 0.88 a minute).
DEFAULT_MAX_NONSPEECH_RISE = 1.0
# --nonspeech's share of an epoch's clips: 2 of a batch of 8 (riding in the speech's windows under
# per-clip packing; 25% more steps an epoch under another). 0.1
# left one "You" on hum or a tone on one seed of two; 0.2 wrote nothing on both, at the same
# WER (BENCHMARKS.md, "Text where nobody speaks": "How much noise").
DEFAULT_NONSPEECH_SHARE = 0.2
# Distillation's loss: DISTILL_CE_WEIGHT x cross-entropy + DISTILL_KL_WEIGHT x T^2 x KL(teacher
# || student) at temperature DISTILL_TEMPERATURE: distil-whisper's training code
# (run_distillation.py; its paper, arXiv 2311.00430, states the two weights the other way round).
DISTILL_TEMPERATURE = 2.0
DISTILL_KL_WEIGHT = 1.0
DISTILL_CE_WEIGHT = 0.8
# --report-to: where the metrics rows go besides metrics.jsonl (whisper_train.trackers).
TRACKERS = ("tensorboard", "mlflow", "wandb", "none")


def default_learning_rate(mode: str, model_width: int | None = None) -> float:
    """`mode`'s learning rate when none is given; for full fine-tuning it falls with the
    model's width (`FULL_LEARNING_RATES_BY_WIDTH`) once that is known."""
    if mode != "full" or model_width is None:
        return DEFAULT_LEARNING_RATES[mode]
    widths = sorted(FULL_LEARNING_RATES_BY_WIDTH)
    at_least = [width for width in widths if width >= model_width]
    return FULL_LEARNING_RATES_BY_WIDTH[at_least[0] if at_least else widths[-1]]


def _help(
    text: str, *, choices: tuple[str, ...] | None = None, first_run: bool = False, **kwargs: Any
) -> Any:
    """A dataclass field whose metadata carries its CLI help: one or two sentences (the whole
    story is in docs/options.md), the words it takes, which every command's usage line shows
    (`--mode {full,lora,freeze-encoder}`), and whether a first run needs it (`first_run`:
    `train --help` lists those, `train --help-all` every option)."""
    metadata: dict[str, Any] = {"help": text}
    if choices is not None:
        metadata["choices"] = choices
    if first_run:
        metadata["first_run"] = True
    return field(metadata=metadata, **kwargs)


@dataclass
class DataConfig:
    data: str | None = _help(
        "Training data: an audiofolder (metadata.csv), a JSONL/CSV/TSV manifest, or another layout "
        "that `check-data` recognises.",
        default=None,
        first_run=True,
    )
    eval_data: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Held-out data as NAME=PATH, scored at every evaluation; repeat the flag "
            "for several sets (NAME:LANG=, NAME:long= and NAME:nonspeech= in "
            "docs/evaluation.md). Default: a seeded split of --data, named 'eval'.",
            "repeatable": True,
            "first_run": True,
        },
    )
    data_format: str | None = _help(
        "Force --data's layout instead of detecting it (evaluation sets are detected).",
        default=None,
    )
    streaming: bool = _help(
        "Stream --data instead of reading it whole (WebDataset .tar and Parquet shards always "
        "stream).",
        default=False,
    )
    shuffle_buffer: int = _help(
        "Rows in a streamed --data's seeded shuffle buffer: larger shuffles better and holds more "
        "audio in memory.",
        default=1000,
    )
    eval_split: float = _help(
        "Fraction of --data held out for evaluation when --eval-data is not given.", default=0.1
    )
    train_subset: int | None = _help("Use only the first N training utterances.", default=None)
    eval_subset: int | None = _help("Use only the first N evaluation utterances.", default=None)
    language: str | None = _help(
        "Language of the speech (e.g. en, de); a row's `language` column wins. English-only "
        "checkpoints (*.en) accept only English.",
        default=None,
        first_run=True,
    )
    pin_language: bool = _help(
        "Save --language as the fine-tuned model's language, so that every runtime decodes in it "
        "(off: the model detects each clip's language, as the base did).",
        default=False,
    )
    task: str = _help("transcribe or translate (to English).", choices=TASKS, default="transcribe")
    timestamps: bool = _help(
        "Train with timestamp tokens where segment times are known.", default=False
    )
    prompt_probability: float = _help(
        "Chance that a training clip whose previous text is known gets it as a prompt, so that "
        "prompts keep working after fine-tuning; 0 is off.",
        default=0.0,
    )
    nonspeech: str | None = _help(
        "Clips where nobody speaks, trained with empty targets so that silence stays silent: a "
        "folder of audio, `builtin` or none (auto: builtin unless --data is streamed).",
        default=NONSPEECH_AUTO,
    )
    nonspeech_share: float | None = _help(
        "Share of each epoch's clips that --nonspeech clips make up (default 0.2; a --resume keeps "
        "its checkpoint's).",
        default=None,
    )
    strict: bool = _help(
        "Stop on the first unusable clip instead of skipping and counting it.", default=False
    )
    spec_augment: bool = _help(
        "SpecAugment: mask bands of time and frequency in the training features.",
        default=False,
    )
    audio_augment: bool = _help(
        "Waveform augmentation of training clips (noise, speed, gain), seeded by --seed.",
        default=False,
    )
    packing: str = _help(
        "per-clip: short clips share a 30 s window, each decoded on its own; on: a window's clips "
        "share one joined label; off: one clip a window; auto: per-clip wherever it can run, else "
        "off.",
        choices=(PACKING_AUTO, *PACKINGS),
        default="auto",
    )
    packing_timestamps: str = _help(
        "on (with --packing on): label every packed window of 2+ clips with timestamps; off: "
        "packed windows follow --timestamps.",
        choices=("on", "off"),
        default="off",
    )


@dataclass
class ModelConfig:
    model: str = _help(
        "A Hugging Face model folder or hub id, a CTranslate2/faster-whisper folder, a "
        "whisper-train output folder, or the alias tiny.en.",
        default="tiny.en",
        first_run=True,
    )
    mode: str = _help(
        "full: train every weight; lora: low-rank adapters (peft); freeze-encoder: train the "
        "decoder only.",
        choices=MODES,
        default="full",
        first_run=True,
    )
    lora_r: int = _help("LoRA rank.", default=32)
    lora_alpha: int = _help("LoRA scaling numerator (scale = alpha / r).", default=64)
    lora_dropout: float = _help("Dropout on the LoRA path.", default=0.05)
    lora_targets: list[str] = _help(
        "Comma-separated module names that get adapters, in the encoder and the decoder (the "
        "decoder only with --cache-encoder).",
        default_factory=lambda: list(LORA_TARGETS),
    )
    lora_variant: str = _help(
        "How the adapters update a weight: lora (scale alpha / r), dora (a trained magnitude per "
        "output) or rslora (scale alpha / sqrt(r)).",
        choices=LORA_VARIANTS,
        default="lora",
    )
    quantize_base: str = _help(
        "Hold LoRA's frozen base weights in 8 bits (int8) or 4 bits (nf4) to save memory.",
        choices=QUANTIZE_BASE,
        default="none",
    )
    attn_implementation: str = _help(
        "sdpa or eager attention.", choices=("sdpa", "eager"), default="sdpa"
    )
    new_language: str | None = _help(
        "Teach a multilingual model a language Whisper lacks, as the new token <|CODE|> (e.g. eo); "
        "needs --new-language-init (docs/languages.md).",
        default=None,
    )
    new_language_init: str | None = _help(
        "The language whose token --new-language's starts from (a neighbour, e.g. es for "
        "Esperanto); required with it.",
        default=None,
    )
    teacher: str | None = _help(
        "Distil this model into the trained one (`whisper-train distill`): the loss adds the KL "
        "divergence from the teacher's next-token distribution (docs/training.md).",
        default=None,
    )
    decoder_layers: int | None = _help(
        "With --teacher: train a student made of the teacher's encoder and N of its decoder "
        "layers, spread from the first to the last, instead of --model.",
        default=None,
    )


@dataclass
class MemoryConfig:
    gradient_checkpointing: str | None = _help(
        "off | on | full | encoder | every-N | auto (default: full on a GPU, off on a CPU). Always "
        "non-reentrant.",
        default=None,
        first_run=True,
    )
    max_memory: str | None = _help(
        "Device memory budget for --gradient-checkpointing auto, e.g. 4GB.",
        default=None,
        first_run=True,
    )
    offload_activations: bool = _help(
        "Keep checkpoint boundaries in host memory (CUDA; needs checkpointing).", default=False
    )
    precision: str = _help(
        "auto (bf16 where supported, fp16 + loss scaling on older GPUs, fp32 on CPU), fp32, bf16 "
        "or fp16.",
        choices=PRECISIONS,
        default="auto",
        first_run=True,
    )
    optim: str = _help(
        "adamw (torch's fused kernel where the weights allow it), adamw-fused (that kernel or "
        "an error) or adamw8bit (bitsandbytes).",
        choices=OPTIMIZERS,
        default="adamw",
    )
    cache_encoder: bool | None = _help(
        "Compute encoder outputs once and reuse them every epoch (default: on when the encoder "
        "is frozen and audio is not augmented).",
        default=None,
    )
    encoder_cache_dir: str | None = _help(
        "Folder of the cached encoder outputs, shared by runs and evaluations (default: encoder/ "
        "under $WHISPER_TRAIN_CACHE, else ~/.cache/whisper-train).",
        default=None,
    )
    encoder_cache_max_size: str = _help(
        "Most disk the encoder cache may fill, all models together (0 writes nothing); clips past "
        "it are encoded again every epoch.",
        # ~8,700 clips of tiny, ~4,300 of small, ~2,600 of large-v3 (1500 x d_model x 2 bytes).
        default="10GB",
    )
    compile: bool | None = _help(
        "torch.compile the model (default: on a CUDA GPU for runs of 2,000 optimizer steps or "
        "more; the start line says when it stays off).",
        default=None,
    )


@dataclass
class TrainConfig:
    output_dir: str = _help(
        "Where metrics, checkpoints and final/ go.", default="whisper-train-output", first_run=True
    )
    epochs: float | None = _help(
        "Passes over the training data (default 3).", default=None, first_run=True
    )
    max_steps: int | None = _help(
        "Optimizer steps; overrides --epochs.", default=None, first_run=True
    )
    batch_size: int = _help(
        "Clips per micro-batch per process: a step trains --batch-size x --gradient-accumulation x "
        "processes clips.",
        default=8,
        first_run=True,
    )
    gradient_accumulation: int = _help(
        "Micro-batches per optimizer step (packed: as many as the step's windows need).",
        default=1,
        first_run=True,
    )
    learning_rate: float | None = _help(
        "Peak learning rate (default: per mode and model width, e.g. 2e-5 for full on tiny, 1.5e-4 "
        "for lora, 3e-5 for freeze-encoder).",
        default=None,
        first_run=True,
    )
    encoder_lr_scale: float | None = _help(
        "The encoder's learning rate as a multiple of --learning-rate, which the decoder takes "
        "(default: 2.5 for full, else 1).",
        default=None,
    )
    lr_scheduler: str = _help(
        "linear or constant_with_warmup.",
        choices=SCHEDULERS,
        default="linear",
    )
    warmup_steps: int = _help(
        "Linear warm-up steps (default 0).",
        default=0,
    )
    weight_decay: float = _help("AdamW weight decay.", default=0.0)
    max_grad_norm: float = _help("Clip gradients to this global norm (0 disables).", default=1.0)
    seed: int = _help("Seed for initialisation, data order, splits and augmentation.", default=42)
    eval_steps: int | None = _help(
        "Evaluate every N optimizer steps (default: only at the end).", default=None, first_run=True
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
        "An --eval-data set (by NAME) of what the model must not forget: a step whose WER there "
        "rose more than --max-regression points over the start is never chosen for final/.",
        default=None,
        first_run=True,
    )
    max_regression: float | None = _help(
        "Points of guard WER a step may lose against the start (default 2.0 with --guard).",
        default=None,
    )
    stop_on_regression: bool = _help(
        "Stop training (with a checkpoint) at the first evaluation past --max-regression.",
        default=False,
    )
    max_nonspeech_rise: float = _help(
        "Words per minute a step may invent on a NAME:nonspeech=PATH evaluation set over that "
        "set's start; a step past it is never chosen for final/.",
        default=DEFAULT_MAX_NONSPEECH_RISE,
    )
    preserve_base: float = _help(
        "Weight of a KL term that keeps the model's predictions close to the starting model's (0 "
        "is off); full and freeze-encoder keep a frozen copy of the weights for it.",
        default=0.0,
    )
    distill_temperature: float = _help(
        "With --teacher: the temperature both distributions are softened by for the KL term "
        "(scaled by its square, as distil-whisper does).",
        default=DISTILL_TEMPERATURE,
    )
    distill_kl_weight: float = _help(
        "With --teacher: the weight of the KL term against the teacher.", default=DISTILL_KL_WEIGHT
    )
    distill_ce_weight: float = _help(
        "With --teacher: the weight of the cross-entropy against the labels.",
        default=DISTILL_CE_WEIGHT,
    )
    compare_baseline: bool = _help(
        "At the end, evaluate the starting model and the fine-tuned one and write OUTPUT/report.md "
        "and report.png.",
        default=False,
    )
    logging_steps: int = _help(
        "Report the training loss averaged over N optimizer steps, every N steps (metrics.jsonl "
        "always gets every step).",
        default=1,
    )
    report_to: list[str] = _help(
        "Comma-separated experiment trackers that get every metrics row and the resolved "
        "configuration, or none (metrics.jsonl is always written).",
        default_factory=lambda: ["tensorboard"],
    )
    generation_max_length: int = _help(
        "Longest transcript generated during evaluation.", default=225
    )
    # Evaluation's decoding, as `evaluate` and `transcribe` decode (whisper_train.decoding).
    temperatures: str = _help(
        "Evaluation decodes a transcript that loops or is unlikely again at these temperatures; a "
        "single 0 turns the fallback off.",
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
    no_speech_threshold: str = _help(
        "A clip whose <|nospeech|> probability is above this and whose mean token log-probability "
        "is under --logprob-threshold is silence; none to disable.",
        default="0.6",
    )
    condition_on_previous_text: bool = _help(
        "Long-form evaluation sets decode each 30 s window with the previous windows' text as its "
        "prompt (off: each window alone, as `transcribe` decodes).",
        default=False,
    )
    num_workers: int | None = _help(
        "Data-loading worker processes (default: 4 per process on a CUDA GPU, fewer on fewer CPUs; "
        "0 elsewhere).",
        default=None,
    )
    group_by_length: bool = _help(
        "Batch utterances of similar label length together (less padding), in a seeded order.",
        default=False,
    )
    save_steps: int | None = _help(
        "Write OUTPUT/checkpoint-<step>/ every N optimizer steps (default: only when the run is "
        "interrupted or stopped).",
        default=None,
        first_run=True,
    )
    save_total_limit: int = _help(
        "Keep the newest N checkpoints, plus the one with the best WER.", default=2
    )
    average_checkpoints: int | None = _help(
        "At the end, average the weights of N checkpoints and keep the average as final/ where it "
        "beats the chosen step; needs --save-steps.",
        default=None,
    )
    average_by: str = _help(
        "Which checkpoints --average-checkpoints N averages: the last N saved, or the N best "
        "evaluated.",
        choices=AVERAGE_BY,
        default="last",
    )
    resume: str | None = field(
        default=None,
        metadata={
            "help": "Continue a run: 'latest' (the newest checkpoint in --output-dir; a bare "
            "--resume means this) or a checkpoint folder.",
            "const": "latest",  # the value of the bare flag
            "first_run": True,
        },
    )
    overwrite: bool = _help(
        "Start afresh in an --output-dir that holds an earlier run, its files moved aside into "
        "OUTPUT.old-<date>-<time> (off: such a folder is refused).",
        default=False,
        first_run=True,
    )
    max_bad_steps: int = _help(
        "Stop (with a checkpoint) after N optimizer steps in a row whose loss or gradient is NaN "
        "or infinite; each such step is skipped.",
        default=10,
    )
    nproc: int = _help(
        "Data-parallel processes on this machine (one per GPU, or CPU processes); --batch-size is "
        "per process.",
        default=1,
    )
    fsdp: bool = _help(
        "Shard weights, gradients and optimiser state over the --nproc processes (FSDP2), for a "
        "model whose training does not fit one GPU.",
        default=False,
    )


GROUPS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "memory": MemoryConfig,
    "train": TrainConfig,
}


def field_owners() -> dict[str, str]:
    """{field_name: group_name} for every option; names are unique across groups."""
    owners: dict[str, str] = {}
    for group_name, group_cls in GROUPS.items():
        for f in fields(group_cls):
            assert f.name not in owners, f"option {f.name} defined twice"
            owners[f.name] = group_name
    return owners


def first_run_options() -> tuple[str, ...]:
    """The options a first run needs (fields marked `first_run`), in declaration order: what
    `train --help` lists; `train --help-all` lists every option."""
    return tuple(
        f.name
        for group_cls in GROUPS.values()
        for f in fields(group_cls)
        if f.metadata.get("first_run")
    )
