"""Fine-tune Whisper: one explicit training loop on accelerate.

`train(config)` reads top-down: load the model, read and screen the data, prepare the model
(freezing, LoRA, checkpointing: `memory.prepare_model`), build the loaders (and the encoder cache
when the encoder is frozen), then the loop: forward, backward, and every `gradient_accumulation`
micro-batches clip, step, zero the gradients, log, evaluate. At the end `OUTPUT/final/` holds a
model folder that `transformers.pipeline("automatic-speech-recognition", model=...)` loads.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler
from transformers.modeling_outputs import BaseModelOutput

from whisper_train import memory
from whisper_train.collate import SpeechCollator
from whisper_train.config import RunConfig
from whisper_train.data import Example, load_examples, screen_examples, split_examples, summarize_skips
from whisper_train.encoder_cache import EncoderCache
from whisper_train.errors import UserError
from whisper_train.evaluate import generate_texts, get_normalizer, score
from whisper_train.features import LogMel, SpeechDataset
from whisper_train.labels import LabelEncoder, configure_generation
from whisper_train.models import is_multilingual, load_model

log = logging.getLogger(__name__)

CONFIG_FILE = "whisper-train.yaml"


@dataclass
class TrainResult:
    output_dir: Path
    final_dir: Path | None
    steps: int
    train_examples: int
    eval_examples: int
    skipped_clips: int
    evaluations: list[dict] = field(default_factory=list)  # {"step", "eval_loss", "wer"}

    @property
    def final_wer(self) -> float | None:
        return self.evaluations[-1]["wer"] if self.evaluations else None


@dataclass
class Datasets:
    train: list[Example]
    eval: list[Example]


def train(config: RunConfig) -> TrainResult:
    config.validate()
    if not config.data.data:
        raise UserError("--data is required: a folder with metadata.csv, or a JSONL/CSV manifest")
    t = config.train
    output_dir = Path(t.output_dir)
    _check_output_dir(output_dir)

    precision = memory.resolve_precision(config.memory.precision, _default_device())
    accelerator = Accelerator(
        mixed_precision=precision.mixed_precision,
        gradient_accumulation_steps=t.gradient_accumulation,
        # Non-reentrant checkpointing and no layerdrop: every parameter is used in every step,
        # so DDP needs no unused-parameter search (which also breaks reentrant checkpointing).
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=False)],
    )
    set_seed(t.seed)

    # -- model and labels ------------------------------------------------------------------
    model, processor = load_model(config.model.model, attn_implementation=config.model.attn_implementation)
    multilingual = is_multilingual(model)
    label_encoder = LabelEncoder(
        processor.tokenizer,
        language=config.data.language,
        task=config.data.task,
        timestamps=config.data.timestamps,
        multilingual=multilingual,
    )
    configure_generation(
        model.generation_config, language=config.data.language, task=config.data.task, multilingual=multilingual
    )
    if config.data.spec_augment:
        from whisper_train.augment import spec_augment_overrides

        for key, value in spec_augment_overrides().items():
            setattr(model.config, key, value)

    # -- data ------------------------------------------------------------------------------
    datasets = prepare_datasets(config, label_encoder, max_label_tokens=model.config.max_target_positions)
    _say(accelerator, f"data: {len(datasets.train)} training and {len(datasets.eval)} evaluation utterances")

    # -- model preparation: freezing, LoRA and checkpointing, in that one place --------------
    checkpointing = memory.resolve_checkpointing(config.memory.gradient_checkpointing, accelerator.device)
    model = memory.prepare_model(
        model,
        mode=config.model.mode,
        checkpointing=checkpointing,
        lora=memory.LoraSettings(
            r=config.model.lora_r,
            alpha=config.model.lora_alpha,
            dropout=config.model.lora_dropout,
            targets=list(config.model.lora_targets),
        )
        if config.model.mode == "lora"
        else None,
    )
    _say(accelerator, f"model: {config.model.model}, mode {config.model.mode}, checkpointing {checkpointing}, "
         f"precision {precision.mixed_precision}; {memory.trainable_parameter_summary(model)}")

    # -- loaders -----------------------------------------------------------------------------
    log_mel = LogMel(processor.feature_extractor)
    pad_id = processor.tokenizer.pad_token_id
    augmenter = None
    if config.data.audio_augment:
        from whisper_train.augment import WaveformAugmenter

        augmenter = WaveformAugmenter(seed=t.seed)
    train_set = SpeechDataset(datasets.train, label_encoder, augmenter=augmenter, seed=t.seed)
    eval_set = SpeechDataset(datasets.eval, label_encoder, seed=t.seed)

    # A frozen encoder maps a clip to the same output every epoch and every evaluation:
    # compute it once (for the evaluation set too) and train and evaluate the decoder alone.
    train_cache = eval_cache = None
    if config.cache_encoder:
        train_cache = _build_encoder_cache(model, train_set, log_mel, pad_id, config, accelerator, precision,
                                           output_dir / "encoder-cache" / "train")
        if len(eval_set) and not t.only_train:
            eval_cache = _build_encoder_cache(model, eval_set, log_mel, pad_id, config, accelerator, precision,
                                              output_dir / "encoder-cache" / "eval")
    train_loader = _loader(
        train_set, SpeechCollator(pad_id, log_mel=log_mel, encoder_cache=train_cache),
        t.batch_size, t.num_workers, shuffle=True, seed=t.seed,
    )
    eval_loader = _loader(
        eval_set, SpeechCollator(pad_id, log_mel=log_mel, encoder_cache=eval_cache),
        t.batch_size, t.num_workers, shuffle=False,
    )

    optimizer = memory.build_optimizer(
        model, name=config.memory.optim, lr=config.learning_rate, weight_decay=t.weight_decay,
    )
    steps_per_epoch = max(1, math.ceil(len(train_loader) / t.gradient_accumulation))
    total_steps = t.max_steps or math.ceil((t.epochs or 3.0) * steps_per_epoch)
    scheduler = get_scheduler(
        t.lr_scheduler, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=total_steps
    )
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    # -- the loop ----------------------------------------------------------------------------
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / CONFIG_FILE).write_text(config.to_yaml(), encoding="utf-8")
    metrics = MetricsLog(output_dir, enabled=accelerator.is_main_process)
    table = ProgressTable(accelerator.is_main_process)
    result = TrainResult(output_dir, None, 0, len(datasets.train), len(datasets.eval), 0)
    normalizer = get_normalizer("english" if not multilingual or (config.data.language or "en") in ("en", "english") else "basic")
    evaluate = not t.only_train

    progress = tqdm(total=total_steps, desc="training", unit="step", disable=not accelerator.is_main_process,
                    dynamic_ncols=True, leave=False)
    step, epoch, running_loss, running_batches = 0, 0, 0.0, 0
    model.train()
    start = time.perf_counter()
    while step < total_steps:
        train_set.set_epoch(epoch)
        for batch in train_loader:
            result.skipped_clips += len(batch["skipped"])
            if not batch["size"]:
                continue  # every clip in this micro-batch was unusable; already counted
            with accelerator.accumulate(model):
                loss = training_loss(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and t.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), t.max_grad_norm)
                optimizer.step()
                scheduler.step()
                # Free the gradients as soon as they are used: no need for that memory any more.
                optimizer.zero_grad(set_to_none=True)
            running_loss += loss.detach().float().item()
            running_batches += 1
            if not accelerator.sync_gradients:
                continue
            step += 1
            step_loss = running_loss / running_batches
            running_loss, running_batches = 0.0, 0
            metrics.write({"step": step, "loss": round(step_loss, 6), "lr": scheduler.get_last_lr()[0],
                           "epoch": round(epoch + _epoch_fraction(step, steps_per_epoch, epoch), 4)})
            table.last_train_loss = step_loss
            progress.update(1)
            progress.set_postfix(loss=f"{step_loss:.4f}")
            if evaluate and t.eval_steps and step % t.eval_steps == 0 and step < total_steps:
                result.evaluations.append(
                    run_evaluation(model, eval_loader, processor, accelerator, normalizer, t.generation_max_length, step)
                )
                metrics.write(result.evaluations[-1])
                table.row(result.evaluations[-1])
                model.train()
            if step >= total_steps:
                break
        epoch += 1
    progress.close()
    result.steps = step
    elapsed = time.perf_counter() - start

    if evaluate:
        result.evaluations.append(
            run_evaluation(model, eval_loader, processor, accelerator, normalizer, t.generation_max_length, step)
        )
        metrics.write(result.evaluations[-1])
        table.row(result.evaluations[-1])
    if result.skipped_clips:
        _say(accelerator, f"skipped {result.skipped_clips} clips that could not be decoded during training")
    _say(accelerator, f"trained {step} steps in {elapsed:.1f} s")

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        result.final_dir = save_final(accelerator.unwrap_model(model), processor, config, output_dir / "final")
        _say(accelerator, f"fine-tuned model: {result.final_dir}")
    metrics.close()
    accelerator.end_training()
    return result


# ---------------------------------------------------------------------------------------------
# Pieces of the loop


def training_loss(model, batch: dict) -> torch.Tensor:
    """Teacher-forced cross-entropy over unmasked label tokens (mean over tokens)."""
    if "encoder_hidden_states" in batch:
        hidden = batch["encoder_hidden_states"].to(next(model.parameters()).dtype)
        outputs = model(
            encoder_outputs=BaseModelOutput(last_hidden_state=hidden),
            decoder_input_ids=batch["decoder_input_ids"],
            labels=batch["labels"],
        )
    else:
        outputs = model(
            input_features=batch["input_features"],
            decoder_input_ids=batch["decoder_input_ids"],
            labels=batch["labels"],
        )
    return outputs.loss


@torch.no_grad()
def run_evaluation(model, loader, processor, accelerator, normalizer, max_length: int, step: int) -> dict:
    """Validation loss (teacher-forced) and WER of generated transcripts, gathered over ranks."""
    was_training = model.training
    model.eval()
    losses, references, hypotheses = [], [], []
    unwrapped = accelerator.unwrap_model(model)
    for batch in loader:
        if not batch["size"]:
            continue
        loss = training_loss(model, batch)
        losses.append(accelerator.gather_for_metrics(loss.detach().float().reshape(1)))
        texts = generate_texts(unwrapped, processor, [batch], max_length=max_length)
        references.extend(accelerator.gather_for_metrics(batch["texts"], use_gather_object=True))
        hypotheses.extend(accelerator.gather_for_metrics(texts, use_gather_object=True))
    model.train(was_training)
    if not losses:
        return {"step": step, "eval_loss": float("nan"), "wer": float("nan")}
    scores = score(references, hypotheses, normalizer=normalizer)
    return {"step": step, "eval_loss": round(torch.cat(losses).mean().item(), 6), "wer": round(scores.wer, 6)}


def prepare_datasets(config: RunConfig, label_encoder: LabelEncoder, *, max_label_tokens: int) -> Datasets:
    """Read, split, subset and screen the data; report what was skipped and why."""
    d = config.data
    examples = load_examples(d.data, data_format=d.data_format)
    if d.eval_data:
        train_examples, eval_examples = examples, load_examples(d.eval_data, data_format=d.data_format)
    elif config.train.only_train or d.eval_split == 0:
        train_examples, eval_examples = examples, []
    else:
        train_examples, eval_examples = split_examples(examples, d.eval_split, config.train.seed)
    if d.train_subset:
        train_examples = train_examples[: d.train_subset]
    if d.eval_subset:
        eval_examples = eval_examples[: d.eval_subset]

    def count_tokens(example: Example) -> int:
        return label_encoder.count_tokens(example) - 1  # labels exclude the leading SOT

    kept_train, skipped = screen_examples(train_examples, count_tokens=count_tokens,
                                          max_label_tokens=max_label_tokens, strict=d.strict)
    kept_eval, skipped_eval = screen_examples(eval_examples, count_tokens=count_tokens,
                                              max_label_tokens=max_label_tokens, strict=d.strict)
    if skipped or skipped_eval:
        log.warning(summarize_skips(skipped + skipped_eval))
    if not kept_train:
        raise UserError(f"--data {d.data}: no usable training utterances after screening; "
                        "run `whisper-train check-data` on it to see why")
    return Datasets(kept_train, kept_eval)


def save_final(model, processor, config: RunConfig, final_dir: Path) -> Path:
    """A self-describing model folder: full weights (LoRA merged), processor, config used."""
    if hasattr(model, "merge_and_unload"):  # peft: merge the adapters into full 32-bit weights
        model = model.merge_and_unload()
    tmp_dir = final_dir.with_name(final_dir.name + ".tmp")
    _remove(tmp_dir)
    model.config.use_cache = True  # inference default; training turned the cache off
    model.save_pretrained(tmp_dir, safe_serialization=True)
    processor.save_pretrained(tmp_dir)
    (tmp_dir / CONFIG_FILE).write_text(config.to_yaml(), encoding="utf-8")
    # Write to a temporary folder and rename: a crash mid-write never leaves a half model.
    _remove(final_dir)
    tmp_dir.rename(final_dir)
    return final_dir


def _build_encoder_cache(model, dataset, log_mel, pad_id, config, accelerator, precision, spill_dir):
    unwrapped = model.get_base_model() if hasattr(model, "get_base_model") else model
    encoder = unwrapped.model.encoder.to(accelerator.device)
    loader = _loader(dataset, SpeechCollator(pad_id, log_mel=log_mel), config.train.batch_size,
                     config.train.num_workers, shuffle=False)
    start = time.perf_counter()
    with tqdm(total=len(dataset), desc=f"encoding {spill_dir.name} clips (once)", unit="clip", leave=False,
              disable=not accelerator.is_main_process) as bar:
        cache = EncoderCache.build(
            encoder, loader, n_examples=len(dataset), device=accelerator.device,
            dtype=precision.dtype, autocast_dtype=precision.dtype if precision.dtype != torch.float32 else None,
            spill_dir=spill_dir, progress=bar,
        )
    _say(accelerator, f"encoder outputs of {int(cache.filled.sum())} {spill_dir.name} clips cached in "
         f"{time.perf_counter() - start:.1f} s")
    return cache


def _loader(dataset, collator, batch_size: int, num_workers: int, *, shuffle: bool, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle, collate_fn=collator, num_workers=num_workers,
        generator=generator, persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
    )


def _epoch_fraction(step: int, steps_per_epoch: int, epoch: int) -> float:
    return min(1.0, (step - epoch * steps_per_epoch) / steps_per_epoch)


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _check_output_dir(output_dir: Path) -> None:
    probe = output_dir if output_dir.exists() else next((p for p in output_dir.parents if p.exists()), Path("."))
    if probe.exists() and not probe.is_dir():
        raise UserError(f"--output-dir {output_dir}: {probe} is a file; choose a folder path")
    import os

    if not os.access(probe, os.W_OK):
        raise UserError(f"--output-dir {output_dir}: {probe} is not writable; choose another folder")


def _remove(path: Path) -> None:
    import shutil

    if path.exists():
        shutil.rmtree(path)


def _say(accelerator, message: str) -> None:
    if accelerator.is_main_process:
        tqdm.write(message)


class MetricsLog:
    """OUTPUT/metrics.jsonl (one JSON line per optimizer step and per evaluation) + TensorBoard."""

    def __init__(self, output_dir: Path, *, enabled: bool):
        self.enabled = enabled
        self.file = None
        self.writer = None
        if not enabled:
            return
        self.file = (output_dir / "metrics.jsonl").open("a", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"))
        except ImportError:  # tensorboard is a dependency, but never fail a run over logging
            self.writer = None

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(f"{'eval' if key in ('eval_loss', 'wer') else 'train'}/{key}", value, row["step"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.writer:
            self.writer.close()


class ProgressTable:
    """The live `Step | Training Loss | Validation Loss | WER` table, printed above the bar."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.header_printed = False
        self.last_train_loss = float("nan")

    def row(self, evaluation: dict) -> None:
        if not self.enabled:
            return
        if not self.header_printed:
            tqdm.write(f"{'Step':>6} | {'Training Loss':>13} | {'Validation Loss':>15} | {'WER':>7}")
            self.header_printed = True
        tqdm.write(f"{evaluation['step']:>6} | {self.last_train_loss:>13.4f} | "
                   f"{evaluation['eval_loss']:>15.4f} | {100 * evaluation['wer']:>6.2f}%")
