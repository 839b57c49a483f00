"""`RunConfig`: a training run's options (`options`), read from flags and YAML, validated in
one place (`validate`), and the choices derived from them (learning rate, LoRA, packing, the
encoder cache, decoding)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from whisper_train.choices import NONSPEECH_AUTO, NONSPEECH_OFF, PER_CLIP
from whisper_train.config.distill import validate_distillation
from whisper_train.config.options import (
    AVERAGE_BY,
    ENCODER_LR_SCALES,
    GROUPS,
    LORA_VARIANTS,
    MODES,
    OPTIMIZERS,
    PACKING_AUTO,
    PRECISIONS,
    QUANTIZE_BASE,
    SCHEDULERS,
    TASKS,
    TRACKERS,
    DataConfig,
    MemoryConfig,
    ModelConfig,
    TrainConfig,
    field_owners,
)
from whisper_train.config.values import (
    NONSPEECH,
    coerce,
    named_paths,
    nonspeech_sets,
    on_off,
    one_of,
    read_yaml,
    require_positive,
)
from whisper_train.data.labels import check_new_language
from whisper_train.errors import UserError
from whisper_train.units import parse_bytes

# The section of whisper-train.yaml that holds what the run did (`config.record`), beside the
# options it was asked: read back on --resume, skipped when the file is given as --config.
RECORD_KEY = "record"


def is_checkpoint_policy(policy: str) -> bool:
    """off | on | full | encoder | auto | every-N, N >= 1 (`on` is `full`; `auto` picks from
    --max-memory)."""
    # Imported here, not at the top: the every-N parser lives with checkpointing, which needs
    # torch, and `import whisper_train.config` (so the CLI's --help) stays torch-free.
    from whisper_train.memory.checkpointing import parse_every_n

    return policy in ("off", "on", "full", "encoder", "auto") or parse_every_n(policy) is not None


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
            if key == RECORD_KEY:  # what a run did (whisper-train.yaml): not an option
                continue
            if key in GROUPS and isinstance(value, dict):
                group = getattr(self, key)
                for sub, sub_value in value.items():
                    sub = sub.replace("-", "_")
                    if sub not in {f.name for f in fields(group)}:
                        raise UserError(
                            f"{source}: unknown option '{key}.{sub}'; see `whisper-train train --help-all`"
                        )
                    setattr(group, sub, coerce(group, sub, sub_value, source))
            elif key in owners:
                group = getattr(self, owners[key])
                setattr(group, key, coerce(group, key, value, source))
            else:
                raise UserError(
                    f"{source}: unknown option '{key}'; see `whisper-train train --help-all`"
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

    def run_options(self) -> dict[str, dict[str, Any]]:
        """The options of the run, as asked: `to_dict` less the one-shot actions --resume and
        --overwrite, which describe how this invocation began, not the run. Written at the top
        of whisper-train.yaml (`RunRecord.to_yaml`), so the resume command the tool prints
        (`--config` that file plus `--resume`) works whatever flags the first invocation had."""
        values = self.to_dict()
        values["train"].update(resume=None, overwrite=False)
        return values

    # -- the one place that validates -----------------------------------------------------
    def validate(self) -> RunConfig:
        """Reject illegal values and combinations with a message that names the flags."""
        d, m, mem, t = self.data, self.model, self.memory, self.train
        one_of("--mode", m.mode, MODES)
        one_of("--lora-variant", m.lora_variant, LORA_VARIANTS)
        if m.lora_variant != "lora" and m.mode != "lora":
            raise UserError(
                f"--lora-variant {m.lora_variant} sets how LoRA's adapters scale and --mode "
                f"{m.mode} trains none: add --mode lora, or drop --lora-variant"
            )
        self._validate_quantized_base()
        one_of("--task", d.task, TASKS)
        one_of("--precision", mem.precision, PRECISIONS)
        one_of("--optim", mem.optim, OPTIMIZERS)
        one_of("--lr-scheduler", t.lr_scheduler, SCHEDULERS)
        one_of("--attn-implementation", m.attn_implementation, ("sdpa", "eager"))
        for tracker in t.report_to or []:
            one_of("--report-to", tracker, TRACKERS)
        if "none" in (t.report_to or []) and len(set(t.report_to)) > 1:
            raise UserError("--report-to none turns every tracker off: name no other with it")
        if d.pin_language and d.language is None:
            raise UserError("--pin-language saves --language in the model: add --language")
        self._validate_new_language()
        policy = mem.gradient_checkpointing
        if policy is not None and not is_checkpoint_policy(policy):
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
        if t.encoder_lr_scale not in (None, 1) and m.mode == "freeze-encoder":
            raise UserError(
                "--encoder-lr-scale sets the encoder's learning rate and --mode freeze-encoder "
                "trains no encoder weights: drop --encoder-lr-scale"
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
        self._validate_packing_and_nonspeech()
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
        self._validate_averaging()
        if not m.lora_targets:
            raise UserError("--lora-targets: name at least one module, e.g. q_proj,v_proj")
        self._validate_eval_sets()
        validate_distillation(self)
        _validate_decoding(t)
        return self

    def _validate_packing_and_nonspeech(self) -> None:
        """--packing and --packing-timestamps normalised and met with what cannot pack; the
        clips where nobody speaks (--nonspeech none read as off) and their share."""
        d, t = self.data, self.train
        d.packing = on_off("--packing", d.packing, PER_CLIP, PACKING_AUTO)
        if d.nonspeech is not None and str(d.nonspeech).strip().lower() in NONSPEECH_OFF:
            d.nonspeech = None
        if d.nonspeech is None and d.nonspeech_share is not None:  # else ignored unseen
            raise UserError(
                f"--nonspeech-share {d.nonspeech_share:g} with --nonspeech none: no clips where "
                "nobody speaks are mixed in, so there is no share to give them; drop one of the two"
            )
        d.packing_timestamps = on_off("--packing-timestamps", d.packing_timestamps)
        if d.packing_timestamps == "on" and d.packing != "on":
            raise UserError(
                "--packing-timestamps on labels joined packed windows: add --packing on, or drop "
                "--packing-timestamps"
            )
        if d.packing in ("on", PER_CLIP) and t.group_by_length:
            raise UserError(
                f"--group-by-length with --packing {d.packing}: packed windows are batched as "
                "they are planned; drop one of them"
            )
        self._validate_per_clip()
        self._validate_stream()
        if d.packing in ("on", PER_CLIP) and self.cache_encoder:
            raise UserError(
                f"--packing {d.packing} with the frozen encoder's cache: the cache keeps each clip's "
                "encoder output, and packed windows are drawn anew every epoch, so none would "
                "be reused; drop --packing (cached epochs already skip the encoder) or add "
                "--no-cache-encoder"
            )

    def _validate_numbers(self) -> None:
        """Each number option within its range, NaN and infinity refused: one line naming the
        flag and what it accepts, before anything loads (torch's AdamW raised a traceback on a
        NaN learning rate; --weight-decay inf and --max-grad-norm nan trained without a word)."""
        d, m, t = self.data, self.model, self.train
        above_0, at_least_0, below_1 = (lambda v: v > 0), (lambda v: v >= 0), (lambda v: 0 <= v < 1)
        probability = lambda v: 0 <= v <= 1  # noqa: E731
        share = lambda v: 0 < v < 1  # noqa: E731
        for flag, value, in_range, accepted in (
            ("--learning-rate", t.learning_rate, above_0, "a finite number above 0 (e.g. 1e-5)"),
            (
                "--encoder-lr-scale",
                t.encoder_lr_scale,
                above_0,
                "a finite multiple of --learning-rate above 0 (1: one rate for the whole model)",
            ),
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
            ("--prompt-probability", d.prompt_probability, probability, "a probability in [0, 1]"),
            (
                "--max-regression",
                t.max_regression,
                at_least_0,
                "a finite number of points, 0 or more",
            ),
            ("--nonspeech-share", d.nonspeech_share, share, "a share in (0, 1)"),
            (
                "--max-nonspeech-rise",
                t.max_nonspeech_rise,
                at_least_0,
                "a finite number of words per minute, 0 or more",
            ),
        ):
            if value is not None and not (math.isfinite(value) and in_range(value)):
                raise UserError(f"{flag} {value:g}: expected {accepted}")
        scale = t.encoder_lr_scale if t.encoder_lr_scale is not None else ENCODER_LR_SCALES[m.mode]
        if t.learning_rate is not None and not math.isfinite(t.learning_rate * scale):
            raise UserError(
                f"--learning-rate {t.learning_rate:g} x --encoder-lr-scale "
                f"{scale:g}: the encoder's rate is past float range; lower one"
            )
        for flag, value in (("--warmup-steps", t.warmup_steps), ("--num-workers", t.num_workers)):
            if value is not None and value < 0:
                raise UserError(f"{flag} {value}: expected 0 or more")
        # numpy's seed (set with torch's and Python's) takes 32 bits, unsigned.
        if not 0 <= t.seed < 2**32:
            raise UserError(f"--seed {t.seed}: expected a whole number from 0 to {2**32 - 1}")

    def _validate_quantized_base(self) -> None:
        """--quantize-base int8|nf4 holds LoRA's frozen base in bitsandbytes' layers: what it
        cannot meet, each refused in one line naming the remedy."""
        m, mem = self.model, self.memory
        one_of("--quantize-base", m.quantize_base, QUANTIZE_BASE)
        if m.quantize_base == "none":
            return
        asked = f"--quantize-base {m.quantize_base}"
        refused = [
            (
                m.mode == "full",
                "--mode full: quantized weights cannot train; use --mode lora",
            ),
            (
                m.mode == "freeze-encoder",
                "--mode freeze-encoder: its decoder trains in full precision; use --mode lora",
            ),
            (self.train.fsdp, "--fsdp: bitsandbytes' layers are not sharded; drop --fsdp"),
            (
                self.cache_encoder,
                "the encoder cache (it holds a full-precision encoder's outputs): "
                "add --no-cache-encoder",
            ),
            (mem.compile, "--compile (not tested on bitsandbytes' layers): drop --compile"),
        ]
        for refuse, why in refused:
            if refuse:
                raise UserError(f"{asked} with {why}")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise UserError(
                f"{asked} needs bitsandbytes: pip install 'whisper-train[bnb]', "
                "or drop --quantize-base"
            )

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

    def _validate_averaging(self) -> None:
        """--average-checkpoints N averages the last N checkpoints rotation keeps, and keeps
        the average only where its evaluation wins: what it needs, each refused in one line."""
        d, t = self.data, self.train
        n = t.average_checkpoints
        one_of("--average-by", t.average_by, AVERAGE_BY)
        if n is None:
            return
        best = t.average_by == "best"
        if n < 2:
            raise UserError(f"--average-checkpoints {n}: expected 2 or more checkpoints")
        refused = [
            (t.only_train, "--only-train (the average is kept only where it wins an evaluation)"),
            (
                not (self.eval_sets() or d.eval_split > 0),
                "no evaluation set to judge the average by: add --eval-data NAME=PATH",
            ),
            (not t.save_steps, "no --save-steps (the run saves no checkpoints to average)"),
            (
                best and not t.eval_steps,
                "--average-by best and no --eval-steps (no checkpoint is evaluated to rank it): "
                "add --eval-steps",
            ),
            (
                not best and t.save_total_limit < n,
                f"--save-total-limit {t.save_total_limit} (rotation keeps fewer checkpoints "
                f"than that): raise --save-total-limit to {n}",
            ),
            (t.fsdp, "--fsdp (its checkpoints are sharded): drop one of them"),
        ]
        for refuse, why in refused:
            if refuse:
                raise UserError(f"--average-checkpoints {n} with {why}")

    def _per_clip_refusal(self) -> str | None:
        """Why --packing per-clip cannot run with the other options, or None: it meets what it
        has been proven with (tests/test_clip_attention.py, the combination matrix)."""
        for unsupported, why in (
            (self.stream_source() is not None, "streamed data (packs windows of its own)"),
            (self.train.preserve_base, "--preserve-base (its frozen copy decodes whole windows)"),
            (self.memory.compile, "--compile (the clips' routing runs hooks on tensors)"),
        ):
            if unsupported:
                return why
        return None

    def packing_refusal(self, packing: str) -> str | None:
        """What keeps `packing` from training with the other options (None: nothing). --packing
        auto trains unpacked where per-clip has one; what refuses any packing: --group-by-length
        and the frozen encoder's cache (whose epochs after the first skip the encoder anyway)."""
        if packing == "off":
            return None
        if self.train.group_by_length:
            return "--group-by-length"
        if self.cache_encoder:
            return "the frozen encoder's cache (--no-cache-encoder turns it off)"
        return self._per_clip_refusal() if packing == PER_CLIP else None

    def _validate_per_clip(self) -> None:
        """--packing per-clip with what it cannot run with: refused here, not at step 1."""
        if self.data.packing != PER_CLIP:
            return
        why = self._per_clip_refusal()
        if why is not None:
            raise UserError(
                f"--packing per-clip is not supported with {why}: use --packing on, or "
                "drop the other option"
            )

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
            # A stream's rows come through a shuffle buffer and carry no previous text.
            ("--prompt-probability", d.prompt_probability, "drop it"),
            # Its clips are mixed into the list of clips read whole.
            ("--nonspeech", d.nonspeech not in (None, NONSPEECH_AUTO), "drop it"),
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

    def _validate_new_language(self) -> None:
        m = self.model
        if m.new_language is not None:
            check_new_language(m.new_language, m.new_language_init)
            if self.train.compare_baseline:
                raise UserError(
                    f"--compare-baseline with --new-language {m.new_language}: the base has no "
                    "token to decode that language in; drop --compare-baseline, and score the "
                    f"base with `whisper-train evaluate --language {m.new_language_init}`"
                )
        elif m.new_language_init is not None:
            raise UserError(
                "--new-language-init names the token --new-language starts from: add "
                "--new-language CODE, or drop --new-language-init"
            )

    def _validate_eval_sets(self) -> None:
        d, t = self.data, self.train
        if t.guard is not None and t.only_train:
            raise UserError("--guard needs evaluation: drop --only-train")
        nonspeech = nonspeech_sets(d.eval_data or [], "--eval-data", self.added_languages())
        names = list(self.eval_sets())
        if nonspeech and not set(names) - nonspeech:
            raise UserError(
                f"--eval-data {sorted(nonspeech)[0]}:{NONSPEECH}=...: every evaluation set is "
                "non-speech, and final/ is picked by a WER: add a speech set, NAME=PATH"
            )
        for flag, name in (("--metric-for-best", t.metric_for_best), ("--guard", t.guard)):
            if name in nonspeech:
                raise UserError(
                    f"{flag} {name}: a non-speech set has no WER; it guards the run by itself "
                    "(--max-nonspeech-rise): name a speech set"
                )
        if not names and not t.only_train and d.eval_split > 0:
            names = ["eval"]  # a split of --data is named "eval"
        for flag, name in (
            ("--metric-for-best", t.metric_for_best),
            ("--guard", t.guard),
            ("--compare-baseline", "a set" if t.compare_baseline else None),
        ):
            if name is not None and not names:
                raise UserError(
                    f"{flag} needs an evaluation set, and this run has none: add --eval-data "
                    "NAME=PATH" + (" (or an --eval-split above 0)" if d.eval_split == 0 else "")
                )
            if name is not None and flag != "--compare-baseline" and name not in names:
                raise UserError(
                    f"{flag} {name}: no evaluation set of that name; the sets are "
                    f"{', '.join(names)} (name them with --eval-data NAME=PATH)"
                )
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
        return named_paths(self.data.eval_data or [], "--eval-data", self.added_languages())

    def added_languages(self) -> tuple[str, ...]:
        """The language codes this run adds to Whisper's (--new-language), as tokens spell
        them: languages its data and evaluation sets may state."""
        code = self.model.new_language
        return () if code is None else (code.strip().lower(),)

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


def _validate_decoding(t: TrainConfig) -> None:
    """Malformed --temperatures or thresholds: one line, before anything loads."""
    from whisper_train.transcription.decoding import parse_temperatures, parse_threshold

    parse_temperatures(t.temperatures)
    parse_threshold(t.compression_ratio_threshold, "--compression-ratio-threshold")
    parse_threshold(t.logprob_threshold, "--logprob-threshold")
    parse_threshold(t.no_speech_threshold, "--no-speech-threshold")
