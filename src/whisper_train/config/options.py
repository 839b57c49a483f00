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
# --nonspeech's share of an epoch's clips: 2 of a batch of 8, 25% more steps an epoch. 0.1
# left one "You" on hum or a tone on one seed of two; 0.2 wrote nothing on both, at the same
# WER (BENCHMARKS.md, "Text where nobody speaks": "How much noise").
DEFAULT_NONSPEECH_SHARE = 0.2
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


def _help(text: str, *, choices: tuple[str, ...] | None = None, **kwargs: Any) -> Any:
    """A dataclass field whose metadata carries its CLI help (and the words it takes, which
    every command's usage line shows: `--mode {full,lora,freeze-encoder}`)."""
    metadata = {"help": text} if choices is None else {"help": text, "choices": choices}
    return field(metadata=metadata, **kwargs)


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
            "detected in each clip, never in --language. NAME:long=PATH (or NAME:LANG:long=PATH) "
            "is a set of long recordings (audio + .srt/.vtt/.txt of the same name, or manifest "
            "rows of any length), each decoded whole in 30 s windows and scored over its whole "
            "transcript; it can be the --guard. NAME:nonspeech=PATH (a folder of audio, or "
            "`builtin`) is clips where nobody speaks, scored by the words the model invents a "
            "minute and held to its start (--max-nonspeech-rise). "
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
    task: str = _help("transcribe or translate (to English).", choices=TASKS, default="transcribe")
    timestamps: bool = _help(
        "Train with timestamp tokens where segment times are known.", default=False
    )
    prompt_probability: float = _help(
        "Chance that a training clip whose previous text is known (the window before it in a "
        "subtitled recording, or a manifest's previous_text/prompt column) gets that text as "
        "a prompt (<|startofprev|> text, as transformers' generate(prompt_ids=...) and "
        "long-form decoding give it), the loss masked there: keeps prompts and previous-text "
        "conditioning working after fine-tuning. 0 is off (the default: BENCHMARKS.md "
        "'Prompts in training').",
        default=0.0,
    )
    nonspeech: str | None = _help(
        "Clips where nobody speaks, mixed into training with empty targets (and <|nospeech|> "
        "after <|startoftranscript|>) so that the model keeps writing nothing on silence, noise "
        "and tones: a folder of audio (files over 30 s are cut), `builtin` (synthesised "
        "noise, hum, tones and chords, other samples than the built-in evaluation set's), or "
        "none. Default auto: builtin for --data read whole, none for a stream; a --resume "
        "continues as its checkpoint trained (BENCHMARKS.md 'Text where nobody speaks').",
        default=NONSPEECH_AUTO,
    )
    nonspeech_share: float | None = _help(
        "Share of each epoch's clips that --nonspeech clips make up (their clips repeat to "
        "fill it). Default 0.2: about 2 clips of a batch of 8 (measured against 0.1 in "
        "BENCHMARKS.md 'Text where nobody speaks'); a --resume continues with its "
        "checkpoint's.",
        default=None,
    )
    strict: bool = _help(
        "Stop on the first unusable clip instead of skipping and counting it.", default=False
    )
    spec_augment: bool = _help(
        "SpecAugment (time and frequency masking); off by default: on the demo's sets it cost "
        "2.6 points of held-out WER (BENCHMARKS.md 'Augmentation, dropout').",
        default=False,
    )
    audio_augment: bool = _help(
        "Waveform augmentation (noise, speed, gain), seeded by --seed; off by default: on the "
        "demo's sets no better than the seeds' spread, at 1.3x the training time.",
        default=False,
    )
    packing: str = _help(
        "auto (the default): per-clip wherever it can run, else off (streamed data, "
        "--preserve-base, --compile, --group-by-length and the frozen encoder's cache take "
        "off); per-clip: pack short training clips into windows of at most 30 s of audio, "
        "each clip decoded on its own (its own label, cross-attending to its own part of the "
        "window), as unpacked training decodes it, each clip followed in its window by its "
        "own padding, one frame for every 8 of the padding it has alone (so about 4 clips of "
        "3 s a window): within a point of unpacked training per clip seen, 4.9x its clips a "
        "second (BENCHMARKS.md 'Packing per clip by default'); on: the same windows "
        "of at most 448 label tokens, each labelled with its clips' transcripts joined; off: "
        "one clip a window (the encoder always runs on 30 s: packed, it runs on speech, not "
        "padding). Evaluation is never packed.",
        choices=(PACKING_AUTO, *PACKINGS),
        default="auto",
    )
    packing_timestamps: str = _help(
        "on (with --packing on): label every packed window of 2+ clips in Whisper's timestamp "
        "form, each clip a segment at its place in the window, with or without --timestamps; "
        "off: packed windows follow --timestamps as single clips do (the default: "
        "always-timestamped windows measured no better, BENCHMARKS.md).",
        choices=("on", "off"),
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
        choices=MODES,
        default="full",
    )
    lora_r: int = _help("LoRA rank.", default=32)
    lora_alpha: int = _help("LoRA scaling numerator (scale = alpha / r).", default=64)
    lora_dropout: float = _help("Dropout on the LoRA path.", default=0.05)
    lora_targets: list[str] = _help(
        "Comma-separated module names that get adapters, in the encoder and the decoder (in the "
        "decoder only with --cache-encoder: the cached encoder stays as it is). Default: every "
        "linear layer (q_proj,k_proj,v_proj,out_proj,fc1,fc2): a third fewer held-out errors "
        "than the HF blog's q_proj,v_proj; BENCHMARKS.md 'LoRA on every linear layer'.",
        default_factory=lambda: list(LORA_TARGETS),
    )
    lora_variant: str = _help(
        "How the adapters update a weight: lora (scale alpha / r), dora (DoRA: the update's "
        "direction with a trained magnitude per output, peft's use_dora) or rslora (scale "
        "alpha / sqrt(r)). Each is merged into full weights in final/ and the exports; "
        "BENCHMARKS.md 'DoRA and rsLoRA'.",
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
        "Teach the model a language Whisper lacks: add the token <|CODE|> (e.g. eo) to its "
        "tokenizer and embedding, trained with the rest (under LoRA too), so that --language "
        "CODE, language detection, evaluate, transcribe and the exports that can hold it "
        "know it. Multilingual models only; needs --new-language-init.",
        default=None,
    )
    new_language_init: str | None = _help(
        "The language whose token --new-language's starts from (a neighbour, e.g. es for "
        "Esperanto); required with it: the neighbour is a linguistic choice the tool cannot "
        "make.",
        default=None,
    )


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
        choices=PRECISIONS,
        default="auto",
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
    compile: bool | None = _help(
        "torch.compile the model (default: on a CUDA GPU for runs of 2,000 optimizer steps or "
        "more, where its ~35 s of compiling pays back, BENCHMARKS.md 'Compiled, and data "
        "workers'; not with per-clip packing, the default, nor --fsdp or activation offload, "
        "which it has not been run with: the start line says when it stays off).",
        default=None,
    )


@dataclass
class TrainConfig:
    output_dir: str = _help(
        "Where metrics, checkpoints and final/ go.", default="whisper-train-output"
    )
    epochs: float | None = _help("Passes over the training data (default 3).", default=None)
    max_steps: int | None = _help("Optimizer steps; overrides --epochs.", default=None)
    batch_size: int = _help(
        "Clips per micro-batch (per process): an optimizer step trains --batch-size x "
        "--gradient-accumulation x processes clips, packed or not. Packed, a micro-batch is "
        "the whole windows that hold about this many clips (at least one), and no window holds "
        "more clips than a step; the start line says how a step is split.",
        default=8,
    )
    gradient_accumulation: int = _help(
        "Micro-batches per optimizer step (packed: the step's clips are as asked, its "
        "micro-batches as many as its windows need).",
        default=1,
    )
    learning_rate: float | None = _help(
        "Peak learning rate: default 1.5e-4 for lora (on every linear layer it kept real speech "
        "no run trained on at tiny.en's WER, 3e-4 cost 1.6 points), 3e-5 for freeze-encoder; "
        "for full the decoder's, 2e-5 on tiny with the encoder at 2.5x (--encoder-lr-scale; "
        "1e-4 for all broke real speech), lower for wider models (small 8.5e-6, large "
        "2.9e-6); BENCHMARKS.md 'Learning rates'.",
        default=None,
    )
    encoder_lr_scale: float | None = _help(
        "The encoder's learning rate as a multiple of --learning-rate (which the decoder "
        "takes): default 2.5 for full (encoder 5e-5, decoder 2e-5 on tiny: 19% fewer held-out "
        "errors than 3e-5 for all, real speech no run trained on kept), 1 for lora; 1 trains "
        "every weight at one rate; BENCHMARKS.md 'Encoder and decoder at their own rates'.",
        default=None,
    )
    lr_scheduler: str = _help(
        "linear or constant_with_warmup (linear by default: a constant rate cost real speech "
        "0.5-1.4 points of WER; BENCHMARKS.md 'Warm-up and schedule').",
        choices=SCHEDULERS,
        default="linear",
    )
    warmup_steps: int = _help(
        "Linear warm-up steps (default 0: a 10% warm-up changed nothing at full's default rate "
        "and did not make 1e-4 safe for real speech; BENCHMARKS.md 'Warm-up and schedule').",
        default=0,
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
    max_nonspeech_rise: float = _help(
        "Words per minute a step may invent on an --eval-data NAME:nonspeech=PATH set over that "
        "set's start (measured before step 1); a step past it is never chosen for final/. "
        "Default 1.0: at most one more invented word per minute of non-speech audio (a default "
        "chosen, not measured).",
        default=DEFAULT_MAX_NONSPEECH_RISE,
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
    report_to: list[str] = _help(
        "Comma-separated experiment trackers that get every metrics.jsonl row (per-set WER, "
        "losses, learning rate, gradient norm) and the resolved configuration: tensorboard "
        "(OUTPUT/tensorboard/), mlflow (MLFLOW_TRACKING_URI; pip install "
        "'whisper-train[mlflow]'), wandb (W&B's login, or WANDB_MODE=offline; pip install "
        "'whisper-train[wandb]'), or none. metrics.jsonl is always written.",
        default_factory=lambda: ["tensorboard"],
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
    no_speech_threshold: str = _help(
        "A clip whose <|nospeech|> probability is above this and whose mean token "
        "log-probability is under --logprob-threshold is silence: no text, as faster-whisper "
        "and openai-whisper decide; none to disable.",
        default="0.6",
    )
    condition_on_previous_text: bool = _help(
        "Long-form evaluation sets (--eval-data NAME:long=PATH) decode each 30 s window with "
        "the previous windows' text as its prompt, as openai-whisper's and faster-whisper's "
        "transcribe do by default (off: each window alone, as `whisper-train transcribe` "
        "decodes).",
        default=False,
    )
    num_workers: int | None = _help(
        "Data-loading worker processes (default: 4 per process on a CUDA GPU, fewer where the "
        "machine has fewer CPUs; 0 elsewhere, where they would take the CPUs that train).",
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
    )
    save_total_limit: int = _help(
        "Keep the newest N checkpoints, plus the one with the best WER.", default=2
    )
    average_checkpoints: int | None = _help(
        "At the end, average the weights (LoRA: the adapters) of N checkpoints on disk "
        "(--average-by: the last N, the end's own included, or the best N), evaluate the "
        "average like a step, and keep it as final/ only where it beats the chosen step by the "
        "run's own rule (lowest --metric-for-best WER, --guard kept). Needs --save-steps.",
        default=None,
    )
    average_by: str = _help(
        "Which checkpoints --average-checkpoints N averages: the last N saved (needs "
        "--save-total-limit N or more), or the N best evaluated by the run's own rule (needs "
        "--eval-steps; rotation keeps them).",
        choices=AVERAGE_BY,
        default="last",
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


def field_owners() -> dict[str, str]:
    """{field_name: group_name} for every option; names are unique across groups."""
    owners: dict[str, str] = {}
    for group_name, group_cls in GROUPS.items():
        for f in fields(group_cls):
            assert f.name not in owners, f"option {f.name} defined twice"
            owners[f.name] = group_name
    return owners
