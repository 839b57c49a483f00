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
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from whisper_train import checkpoints, doctor, memory
from whisper_train.collate import IGNORE_INDEX, SpeechCollator
from whisper_train.config import RunConfig, parse_bytes
from whisper_train.data import (
    Example,
    load_examples,
    screen_examples,
    split_examples,
    summarize_skips,
)
from whisper_train.encoder_cache import EncoderCache
from whisper_train.errors import UserError
from whisper_train.evaluate import generate_texts, get_normalizer, progress_bars_wanted, score
from whisper_train.features import LogMel, SpeechDataset
from whisper_train.labels import LabelEncoder, configure_generation, language_code
from whisper_train.memory import training_loss
from whisper_train.models import is_multilingual, load_model, resolve_alias
from whisper_train.report import write_curves_png
from whisper_train.sampling import LengthGroupedBatchSampler

log = logging.getLogger(__name__)

CONFIG_FILE = checkpoints.CONFIG_FILE
METRICS_FILE = checkpoints.METRICS_FILE
RESULT_FILE = checkpoints.RESULT_FILE
# Set by `--nproc N` for its worker processes: the parent already checked (and, with
# --overwrite, cleared) this output folder, so the workers must not refuse their own run.
_CLAIMED_ENV = "WHISPER_TRAIN_CLAIMED_OUTPUT_DIR"


@dataclass
class TrainResult:
    output_dir: Path
    final_dir: Path | None
    steps: int
    train_examples: int
    eval_examples: int
    skipped_clips: int
    evaluations: list[dict] = field(default_factory=list)  # {"step", "eval_loss", "wer"}
    skipped_steps: int = 0  # optimizer steps skipped for a NaN or infinite loss or gradient

    @property
    def final_wer(self) -> float | None:
        return self.evaluations[-1]["wer"] if self.evaluations else None


@dataclass
class Datasets:
    train: list[Example]
    eval: list[Example]


def train(config: RunConfig) -> TrainResult:
    """Fine-tune per `config`; with `--nproc N` (outside a launcher) re-launch as N processes."""
    config.validate()
    if not config.data.data:
        raise UserError("--data is required: a folder with metadata.csv, or a JSONL/CSV manifest")
    t = config.train
    output_dir = Path(t.output_dir)
    _check_output_dir(output_dir)
    if os.environ.get(_CLAIMED_ENV) != str(output_dir.resolve()):
        claim_output_dir(config)
    if t.nproc > 1 and not _inside_launcher():
        return launch_data_parallel(config)
    resume_from = checkpoints.resolve_resume(t.resume, output_dir) if t.resume else None

    precision = memory.resolve_precision(config.memory.precision, _default_device())
    # Non-reentrant checkpointing and no layerdrop: every parameter is used in every step, so DDP
    # needs no unused-parameter search (which also breaks reentrant checkpointing, T3) and the
    # graph is static. The handler is completed once the model's layerdrop is known.
    ddp_kwargs = DistributedDataParallelKwargs(find_unused_parameters=False)
    accelerator = Accelerator(
        mixed_precision=precision.mixed_precision,
        gradient_accumulation_steps=t.gradient_accumulation,
        kwargs_handlers=[ddp_kwargs],
        # The scheduler is stepped by hand once per optimizer step (not once per process, which
        # is accelerate's default), so N processes follow the single-process LR schedule.
        step_scheduler_with_optimizer=False,
        # Without a GPU, processes started by a launcher talk through gloo on the CPU; accelerate
        # does that only when told the run is on the CPU.
        cpu=_inside_launcher() and not torch.cuda.is_available(),
    )
    if t.nproc > 1 and accelerator.num_processes != t.nproc:
        raise UserError(
            f"--nproc {t.nproc}: the launcher started {accelerator.num_processes} processes; "
            "drop --nproc when using accelerate launch or torchrun"
        )
    set_seed(t.seed)

    # -- model and labels ------------------------------------------------------------------
    model, processor = load_model(
        config.model.model, attn_implementation=config.model.attn_implementation
    )
    multilingual = is_multilingual(model)
    label_encoder = LabelEncoder(
        processor.tokenizer,
        language=config.data.language,
        task=config.data.task,
        timestamps=config.data.timestamps,
        multilingual=multilingual,
    )
    configure_generation(
        model.generation_config,
        language=config.data.language,
        task=config.data.task,
        multilingual=multilingual,
    )
    if config.data.spec_augment:
        from whisper_train.augment import spec_augment_overrides

        for key, value in spec_augment_overrides().items():
            setattr(model.config, key, value)
    # Layerdrop skips layers at random, leaving parameters unused in a step (T4).
    layerdrop = bool(model.config.encoder_layerdrop or model.config.decoder_layerdrop)
    ddp_kwargs.find_unused_parameters = layerdrop
    ddp_kwargs.static_graph = not layerdrop

    # -- data ------------------------------------------------------------------------------
    datasets = prepare_datasets(
        config, label_encoder, max_label_tokens=model.config.max_target_positions
    )
    _say(
        accelerator,
        f"data: {len(datasets.train)} training and {len(datasets.eval)} evaluation utterances",
    )

    # -- model preparation: freezing, LoRA and checkpointing, in that one place --------------
    checkpointing = memory.resolve_checkpointing(
        config.memory.gradient_checkpointing, accelerator.device
    )
    lora = (
        memory.LoraSettings(
            r=config.model.lora_r,
            alpha=config.model.lora_alpha,
            dropout=config.model.lora_dropout,
            targets=list(config.model.lora_targets),
        )
        if config.model.mode == "lora"
        else None
    )
    offload = config.memory.offload_activations
    if checkpointing == "auto":
        model, plan = memory.prepare_model_within_budget(
            model,
            mode=config.model.mode,
            lora=lora,
            batch_size=t.batch_size,
            max_memory_bytes=parse_bytes(config.memory.max_memory, flag="--max-memory"),
            label_tokens=max(label_encoder.count_tokens(e) for e in datasets.train),
            precision=_precision_name(precision),
            optimizer=config.memory.optim,
        )
        checkpointing, offload = plan.policy, offload or plan.offload
        _say(accelerator, plan.table)
    else:
        model = memory.prepare_model(
            model, mode=config.model.mode, checkpointing=checkpointing, lora=lora
        )
    if offload:
        checkpointing += " + activation offload"
        if accelerator.device.type != "cuda":
            _say(
                accelerator,
                "note: on a CPU, activations already live in host memory; offload does nothing",
            )
    _say(
        accelerator,
        f"model: {config.model.model}, mode {config.model.mode}, checkpointing {checkpointing}, "
        f"precision {_precision_name(precision)}; {memory.trainable_parameter_summary(model)}",
    )
    # The doctor's cheap checks: refuse, before step 1, a configuration known to fail (T1-T9).
    doctor.static_checks(
        model,
        ddp={
            "world_size": accelerator.num_processes,
            "find_unused_parameters": ddp_kwargs.find_unused_parameters,
            "static_graph": ddp_kwargs.static_graph,
        },
        compile=config.memory.compile,
    )
    # A checkpoint and the final model must fit: say so now, not after hours of training.
    checkpoints.check_free_space(
        output_dir,
        checkpoints.estimate_checkpoint_bytes(model)
        + 4 * sum(p.numel() for p in model.parameters()),
        what="a checkpoint and the final model",
    )

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
        train_cache = _build_encoder_cache(
            model,
            train_set,
            log_mel,
            pad_id,
            config,
            accelerator,
            precision,
            output_dir / checkpoints.ENCODER_CACHE_DIR / "train",
        )
        if len(eval_set) and not t.only_train:
            eval_cache = _build_encoder_cache(
                model,
                eval_set,
                log_mel,
                pad_id,
                config,
                accelerator,
                precision,
                output_dir / checkpoints.ENCODER_CACHE_DIR / "eval",
            )
    # The shuffling generator is re-seeded with (seed + epoch) at every epoch: the order of any
    # epoch is known without replaying the ones before it, which is what resuming needs.
    shuffle_generator = torch.Generator().manual_seed(t.seed)
    train_collator = SpeechCollator(pad_id, log_mel=log_mel, encoder_cache=train_cache)
    length_sampler = None
    if t.group_by_length:
        length_sampler = LengthGroupedBatchSampler(
            [label_encoder.count_tokens(e) for e in datasets.train], t.batch_size, seed=t.seed
        )
        train_loader = DataLoader(
            train_set,
            batch_sampler=length_sampler,
            collate_fn=train_collator,
            num_workers=t.num_workers,
            persistent_workers=t.num_workers > 0,
        )
    else:
        train_loader = _loader(
            train_set,
            train_collator,
            t.batch_size,
            t.num_workers,
            shuffle=True,
            generator=shuffle_generator,
        )
    eval_loader = _loader(
        eval_set,
        SpeechCollator(pad_id, log_mel=log_mel, encoder_cache=eval_cache),
        t.batch_size,
        t.num_workers,
        shuffle=False,
    )

    optimizer = memory.build_optimizer(
        model,
        name=config.memory.optim,
        lr=config.learning_rate,
        weight_decay=t.weight_decay,
    )
    # Prepare first: with N processes each one sees 1/N of the batches, and the number of
    # optimizer steps per epoch must come from that sharded loader.
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    if config.memory.compile:
        # After the DDP wrapper (as accelerate does): its hooks stay outside the compiled graph.
        # Accelerator(dynamo_backend=) is not used: its setting is process-wide and kept from
        # the first Accelerator, so a second run in the same process would silently not compile.
        model = torch.compile(model)
    steps_per_epoch = max(1, math.ceil(len(train_loader) / t.gradient_accumulation))
    total_steps = t.max_steps or math.ceil((t.epochs or 3.0) * steps_per_epoch)
    scheduler = accelerator.prepare(
        get_scheduler(
            t.lr_scheduler,
            optimizer,
            num_warmup_steps=t.warmup_steps,
            num_training_steps=total_steps,
        )
    )

    # -- resume: weights, optimiser, scheduler, random state, position in the data ------------
    state = checkpoints.TrainerState(world_size=accelerator.num_processes)
    if resume_from is not None:
        state = checkpoints.load_checkpoint(
            resume_from,
            accelerator=accelerator,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
        )
        _say(
            accelerator,
            f"resuming from {resume_from} at step {state.step} "
            f"(epoch {state.epoch}, {state.batches_in_epoch} batches into it)",
        )

    # -- the loop ----------------------------------------------------------------------------
    output_dir.mkdir(parents=True, exist_ok=True)
    if accelerator.is_main_process:
        (output_dir / CONFIG_FILE).write_text(config.to_yaml(), encoding="utf-8")
        if resume_from is not None:
            checkpoints.truncate_metrics(output_dir / METRICS_FILE, state.step)
        else:
            (output_dir / METRICS_FILE).unlink(missing_ok=True)
    metrics = MetricsLog(output_dir, enabled=accelerator.is_main_process)
    table = ProgressTable(accelerator.is_main_process)
    result = TrainResult(
        output_dir,
        None,
        state.step,
        len(datasets.train),
        len(datasets.eval),
        0,
        list(state.evaluations),
    )
    normalizer_name = (
        "english"
        if not multilingual or language_code(config.data.language) in (None, "en")
        else "basic"
    )
    normalizer = get_normalizer(normalizer_name)
    evaluate = not t.only_train

    def save(reason: str) -> Path:
        state.evaluations = result.evaluations
        folder = checkpoints.save_checkpoint(
            output_dir / f"{checkpoints.PREFIX}{state.step}",
            accelerator=accelerator,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            state=state,
            config_yaml=config.to_yaml(),
        )
        if accelerator.is_main_process:
            checkpoints.rotate_checkpoints(
                output_dir, keep_last=t.save_total_limit, evaluations=result.evaluations
            )
        _say(accelerator, f"{reason}: saved {folder}")
        return folder

    def evaluate_now(step: int) -> None:
        """Validation loss and WER: a metrics line, a table row; back to training mode after."""
        result.evaluations.append(
            run_evaluation(
                model,
                eval_loader,
                processor,
                accelerator,
                normalizer,
                t.generation_max_length,
                step,
            )
        )
        metrics.write(result.evaluations[-1])
        table.row(result.evaluations[-1])
        model.train()

    if evaluate and t.eval_at_start and resume_from is None:
        evaluate_now(0)

    # A bar only on a terminal: in a log file its \r redraws pile up into one unreadable line.
    # Elsewhere every --logging-steps steps get one plain line instead.
    show_bar = accelerator.is_main_process and progress_bars_wanted()
    progress = tqdm(
        total=total_steps,
        initial=state.step,
        desc="training",
        unit="step",
        disable=not show_bar,
        dynamic_ncols=True,
        leave=False,
    )
    logged_losses: list[float] = []  # finite step losses since the last report
    stop = StopRequest(accelerator)
    stop.install()
    running_loss, running_batches = 0.0, 0
    epoch, skip = state.epoch, state.batches_in_epoch
    model.train()
    start = time.perf_counter()
    try:
        while state.step < total_steps:
            train_set.set_epoch(epoch)
            shuffle_generator.manual_seed(t.seed + epoch)
            if length_sampler is not None:
                length_sampler.set_epoch(epoch)
            # Mid-epoch resume: the same order, minus the micro-batches already trained on.
            batches = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
            state.epoch, state.batches_in_epoch = epoch, skip
            for batch in batches:
                state.batches_in_epoch += 1
                state.skipped_clips += len(batch["skipped"])
                if not batch["size"]:
                    continue  # every clip in this micro-batch was unusable; already counted
                with accelerator.accumulate(model):
                    with memory.activation_offload(offload, accelerator.device):
                        loss, reported_loss = data_parallel_loss(model, batch, accelerator)
                    accelerator.backward(loss)
                    running_loss += reported_loss
                    running_batches += 1
                    if not accelerator.sync_gradients:
                        continue
                    step_loss = running_loss / running_batches
                    running_loss, running_batches = 0.0, 0
                    grad_norm = accelerator.clip_grad_norm_(
                        model.parameters(), t.max_grad_norm if t.max_grad_norm > 0 else math.inf
                    )
                    bad = not (math.isfinite(step_loss) and math.isfinite(float(grad_norm)))
                    if accelerator.scaler is not None:
                        optimizer.step()  # the fp16 scaler skips non-finite gradients and lowers its scale
                        bad = bad or optimizer.step_was_skipped
                    elif not bad:
                        optimizer.step()
                    if not bad:
                        scheduler.step()
                    # Free the gradients as soon as they are used: no need for that memory any more.
                    optimizer.zero_grad(set_to_none=True)
                state.step += 1
                row = {
                    "step": state.step,
                    "loss": round(step_loss, 6) if not bad else None,
                    "lr": scheduler.get_last_lr()[0],
                    "grad_norm": _finite_or_none(grad_norm),
                    "epoch": round(epoch + _epoch_fraction(state.step, steps_per_epoch, epoch), 4),
                }
                if bad:
                    state.skipped_steps += 1
                    state.bad_steps_in_a_row += 1
                    row["skipped"] = "non-finite loss or gradient"
                else:
                    state.bad_steps_in_a_row = 0
                    table.last_train_loss = step_loss
                metrics.write(row)
                progress.update(1)
                if not bad:
                    logged_losses.append(step_loss)
                if state.step % t.logging_steps == 0 or state.step >= total_steps:
                    mean_loss = (
                        sum(logged_losses) / len(logged_losses) if logged_losses else math.nan
                    )
                    logged_losses.clear()
                    if show_bar:
                        progress.set_postfix(loss=f"{mean_loss:.4f}")
                    elif accelerator.is_main_process:
                        tqdm.write(step_line(state.step, total_steps, mean_loss, row["lr"]))
                if state.bad_steps_in_a_row >= t.max_bad_steps:
                    folder = save("too many bad steps")
                    raise UserError(
                        f"stopped at step {state.step}: {state.bad_steps_in_a_row} optimizer steps in a row had a "
                        f"NaN or infinite loss or gradient and were skipped; {folder} holds the weights from "
                        "before them. With fp16 this is usually overflow: try --precision bf16 or a lower "
                        "--learning-rate, then add --resume latest"
                    )
                if (
                    evaluate
                    and t.eval_steps
                    and state.step % t.eval_steps == 0
                    and state.step < total_steps
                ):
                    evaluate_now(state.step)
                if stop.requested():
                    folder = save("interrupted")
                    _say(
                        accelerator,
                        f"to continue: {resume_command(output_dir / CONFIG_FILE, folder)}",
                    )
                    raise TrainingInterrupted(stop.exit_code)
                if t.save_steps and state.step % t.save_steps == 0 and state.step < total_steps:
                    save("checkpoint")
                if state.step >= total_steps:
                    break
            else:
                epoch, skip = epoch + 1, 0
    except BaseException:
        metrics.close()
        raise
    finally:
        stop.restore()
        progress.close()
    if t.save_steps:  # a checkpoint at the end too: a later --resume can train further
        save("end of training")
    result.steps = state.step
    result.skipped_clips = state.skipped_clips
    result.skipped_steps = state.skipped_steps
    elapsed = time.perf_counter() - start

    if evaluate:
        evaluate_now(state.step)
    if result.skipped_clips:
        _say(
            accelerator,
            f"skipped {result.skipped_clips} clips that could not be decoded during training",
        )
    if state.skipped_steps:
        _say(
            accelerator,
            f"skipped {state.skipped_steps} optimizer steps with a NaN or infinite loss or gradient",
        )
    _say(accelerator, f"trained {state.step} steps in {elapsed:.1f} s")

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        result.final_dir = save_final(
            accelerator.unwrap_model(model, keep_torch_compile=False),
            processor,
            config,
            output_dir / checkpoints.FINAL_DIR,
        )
        _write_result(result)
        write_curves_png(output_dir / METRICS_FILE, output_dir / checkpoints.CURVES_FILE)
        _say(accelerator, f"fine-tuned model: {result.final_dir}")
        if t.compare_baseline and datasets.eval:
            compare_with_baseline(
                config, result.final_dir, datasets.eval, output_dir, normalizer_name
            )
    metrics.close()
    accelerator.end_training()
    return result


# ---------------------------------------------------------------------------------------------
# Pieces of the loop


def compare_with_baseline(
    config: RunConfig, final_dir: Path, examples: list[Example], output_dir: Path, normalizer: str
) -> None:
    """The starting model and the fine-tuned one on the same utterances: report.md / report.png."""
    from whisper_train.evaluate import evaluate_examples, write_report_json
    from whisper_train.report import write_comparison

    reports = []
    for spec in (config.model.model, str(final_dir)):
        model, processor = load_model(spec, attn_implementation=config.model.attn_implementation)
        if torch.cuda.is_available():
            model = model.to("cuda")
        configure_generation(
            model.generation_config,
            language=config.data.language,
            task=config.data.task,
            multilingual=is_multilingual(model),
        )
        reports.append(
            evaluate_examples(
                model,
                processor,
                examples,
                batch_size=config.train.batch_size,
                normalizer=normalizer,
                max_length=config.train.generation_max_length,
                model_name=spec,
            )
        )
    before, after = reports
    json_file, baseline_file, markdown, png = (output_dir / n for n in checkpoints.REPORT_FILES)
    write_report_json(after, json_file)
    write_report_json(before, baseline_file)
    write_comparison(before, after, markdown_path=markdown, png_path=png)
    tqdm.write(
        f"baseline WER {100 * before.wer:.2f}% -> fine-tuned {100 * after.wer:.2f}%; see {markdown}"
    )


def data_parallel_loss(model, batch: dict, accelerator) -> tuple[torch.Tensor, float]:
    """(loss to backpropagate, loss to report) for this process's share of the batch.

    One process: the token-mean loss, unchanged. N processes: DDP averages the N gradients, so
    each process's loss is rescaled to (its token-loss sum) x N / (tokens in the whole global
    batch); the gradient is then that of the token-mean over the global batch, exactly what one
    process computes on the same batch, however the tokens are spread over the processes.
    """
    loss = training_loss(model, batch)
    if accelerator.num_processes == 1:
        return loss, loss.detach().float().item()
    n_tokens = (batch["labels"] != IGNORE_INDEX).sum().float()
    local = torch.stack([loss.detach().float() * n_tokens, n_tokens])
    loss_sum, total_tokens = accelerator.reduce(local, reduction="sum").tolist()
    scale = accelerator.num_processes * n_tokens / max(total_tokens, 1.0)
    return loss * scale, loss_sum / max(total_tokens, 1.0)


class TrainingInterrupted(SystemExit):
    """SIGINT or SIGTERM stopped the run after a checkpoint; exits 130 or 143 (128 + signal)."""


class StopRequest:
    """SIGINT / SIGTERM ask the loop to finish the step in progress, save and exit.

    A second signal stops at once (KeyboardInterrupt). With several processes the request is
    shared at every step (a max-reduce of one number), so all of them stop after the same step
    even when the signal reached them at different moments.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.signum = 0
        self.previous: dict = {}

    def install(self) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for signum in self.SIGNALS:
            self.previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def _handle(self, signum, frame) -> None:
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum
        if self.accelerator.is_main_process:
            print(
                f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
                "(send it again to stop at once)",
                file=sys.stderr,
                flush=True,
            )

    def requested(self) -> bool:
        if self.accelerator.num_processes > 1:
            flag = torch.tensor([self.signum], device=self.accelerator.device)
            self.signum = int(self.accelerator.reduce(flag, reduction="max").item())
        return bool(self.signum)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def resume_command(config_file: Path, checkpoint: Path) -> str:
    """The command line that continues from `checkpoint` (the saved config holds every option)."""
    return f"whisper-train train --config {shlex.quote(str(config_file))} --resume {shlex.quote(str(checkpoint))}"


# ---------------------------------------------------------------------------------------------
# Several processes: `--nproc N` re-launches this command through torch.distributed


def _inside_launcher() -> bool:
    """True in a process started by torchrun / accelerate launch (they set LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def launch_data_parallel(config: RunConfig) -> TrainResult:
    """Run `whisper-train train` as `config.train.nproc` data-parallel processes on this machine.

    The processes are started by torch.distributed's launcher (torchrun), which accelerate uses
    underneath: one per GPU (NCCL), or CPU processes (gloo) where there is no GPU. If one process
    dies, the launcher stops the others and this call raises instead of waiting.
    """
    n = config.train.nproc
    if torch.cuda.is_available() and torch.cuda.device_count() < n:
        raise UserError(
            f"--nproc {n}: only {torch.cuda.device_count()} GPU(s) visible; use --nproc "
            f"{torch.cuda.device_count()} or fewer"
        )
    output_dir = Path(config.train.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    launch_config = output_dir / checkpoints.LAUNCH_FILE
    launch_config.write_text(config.to_yaml(), encoding="utf-8")
    (output_dir / RESULT_FILE).unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        "-m",
        "whisper_train",
        "train",
        "--config",
        str(launch_config),
    ]
    env = dict(os.environ)
    env[_CLAIMED_ENV] = str(output_dir.resolve())
    # Two processes on one CPU must not each take every core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    process = subprocess.Popen(command, env=env)
    received = []

    def forward(signum, frame):  # the workers save a checkpoint and exit; wait for them
        received.append(signum)
        process.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in StopRequest.SIGNALS}
    try:
        code = process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        raise TrainingInterrupted(128 + received[0])
    if code != 0:
        raise UserError(
            f"--nproc {n}: a training process failed (exit code {code}); its error is printed above"
        )
    return _read_result(output_dir)


def _write_result(result: TrainResult) -> None:
    values = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(result).items()}
    (result.output_dir / RESULT_FILE).write_text(
        json.dumps(values, indent=1) + "\n", encoding="utf-8"
    )


def _read_result(output_dir: Path) -> TrainResult:
    values = json.loads((output_dir / RESULT_FILE).read_text(encoding="utf-8"))
    values["output_dir"] = Path(values["output_dir"])
    values["final_dir"] = Path(values["final_dir"]) if values["final_dir"] else None
    return TrainResult(**values)


def _finite_or_none(value) -> float | None:
    value = float(value)
    return round(value, 6) if math.isfinite(value) else None


@torch.no_grad()
def run_evaluation(
    model, loader, processor, accelerator, normalizer, max_length: int, step: int
) -> dict:
    """Validation loss (teacher-forced, mean over all label tokens) and WER of generated
    transcripts, gathered over processes (each evaluates its share of the loader)."""
    was_training = model.training
    model.eval()
    loss_and_tokens = torch.zeros(2, device=accelerator.device)  # summed token losses, tokens
    references, hypotheses = [], []
    unwrapped = accelerator.unwrap_model(model)
    for batch in loader:
        if not batch["size"]:
            continue
        n_tokens = (batch["labels"] != IGNORE_INDEX).sum().float()
        loss_and_tokens += torch.stack(
            [training_loss(model, batch).detach().float() * n_tokens, n_tokens]
        )
        texts = generate_texts(unwrapped, processor, [batch], max_length=max_length)
        references.extend(accelerator.gather_for_metrics(batch["texts"], use_gather_object=True))
        hypotheses.extend(accelerator.gather_for_metrics(texts, use_gather_object=True))
    model.train(was_training)
    if accelerator.num_processes > 1:
        loss_and_tokens = accelerator.reduce(loss_and_tokens, reduction="sum")
    loss_sum, n_tokens = loss_and_tokens.tolist()
    if not references:
        return {"step": step, "eval_loss": float("nan"), "wer": float("nan")}
    scores = score(references, hypotheses, normalizer=normalizer)
    return {
        "step": step,
        "eval_loss": round(loss_sum / max(n_tokens, 1.0), 6),
        "wer": round(scores.wer, 6),
    }


def prepare_datasets(
    config: RunConfig, label_encoder: LabelEncoder, *, max_label_tokens: int
) -> Datasets:
    """Read, split, subset and screen the data; report what was skipped and why."""
    d = config.data
    examples = load_examples(d.data, data_format=d.data_format)
    if d.eval_data:
        train_examples, eval_examples = (
            examples,
            load_examples(d.eval_data, data_format=d.data_format),
        )
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

    kept_train, skipped = screen_examples(
        train_examples,
        count_tokens=count_tokens,
        max_label_tokens=max_label_tokens,
        strict=d.strict,
    )
    kept_eval, skipped_eval = screen_examples(
        eval_examples, count_tokens=count_tokens, max_label_tokens=max_label_tokens, strict=d.strict
    )
    if skipped or skipped_eval:
        log.warning(summarize_skips(skipped + skipped_eval))
    if not kept_train:
        raise UserError(
            f"--data {d.data}: no usable training utterances after screening; "
            "run `whisper-train check-data` on it to see why"
        )
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


def _build_encoder_cache(
    model, dataset, log_mel, pad_id, config, accelerator, precision, spill_dir
):
    unwrapped = model.get_base_model() if hasattr(model, "get_base_model") else model
    encoder = unwrapped.model.encoder.to(accelerator.device)
    loader = _loader(
        dataset,
        SpeechCollator(pad_id, log_mel=log_mel),
        config.train.batch_size,
        config.train.num_workers,
        shuffle=False,
    )
    start = time.perf_counter()
    with tqdm(
        total=len(dataset),
        desc=f"encoding {spill_dir.name} clips (once)",
        unit="clip",
        leave=False,
        disable=not (accelerator.is_main_process and progress_bars_wanted()),
    ) as bar:
        cache = EncoderCache.build(
            encoder,
            loader,
            n_examples=len(dataset),
            device=accelerator.device,
            dtype=precision.dtype,
            autocast_dtype=precision.dtype if precision.dtype != torch.float32 else None,
            spill_dir=spill_dir,
            progress=bar,
        )
    _say(
        accelerator,
        f"encoder outputs of {int(cache.filled.sum())} {spill_dir.name} clips cached in "
        f"{time.perf_counter() - start:.1f} s",
    )
    return cache


def _loader(
    dataset,
    collator,
    batch_size: int,
    num_workers: int,
    *,
    shuffle: bool,
    generator: torch.Generator | None = None,
) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        collate_fn=collator,
        num_workers=num_workers,
        generator=generator,
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
    )


def _epoch_fraction(step: int, steps_per_epoch: int, epoch: int) -> float:
    return min(1.0, (step - epoch * steps_per_epoch) / steps_per_epoch)


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _precision_name(precision: memory.Precision) -> str:
    """The --precision name of a resolved precision (accelerate calls fp32 "no")."""
    return {"no": "fp32"}.get(precision.mixed_precision, precision.mixed_precision)


def step_line(step: int, total: int, loss: float, lr: float) -> str:
    """The plain progress line for logs: `step 20/300  loss 1.2345  lr 1.00e-05`."""
    shown = "-" if math.isnan(loss) else f"{loss:.4f}"  # every step of the window was skipped
    return f"step {step}/{total}  loss {shown}  lr {lr:.2e}"


def claim_output_dir(config: RunConfig) -> None:
    """Refuse to train over an earlier run in --output-dir unless told to --resume or
    --overwrite it; with --overwrite, move its whisper-train files aside first.

    Call once per run, before anything is written: before `--nproc` re-launches the command
    (its workers skip this), and, under an outside launcher, in every process before they meet
    (each sees the folder as it was; only the first moves anything).
    """
    t = config.train
    output_dir = Path(t.output_dir)
    entries = checkpoints.run_entries(output_dir)
    if not entries:
        return  # a new, empty, or someone else's folder: their files are left alone
    if t.resume:
        resume_from = checkpoints.resolve_resume(t.resume, output_dir)
        if resume_from.parent.resolve() != output_dir.resolve():
            raise UserError(
                f"--resume {t.resume}: that checkpoint is not in --output-dir {output_dir}, which "
                "holds another run that resuming would replace; choose an empty --output-dir"
            )
        return
    names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in entries[:4])
    names += ", ..." if len(entries) > 4 else ""
    if not t.overwrite:
        continuing = (
            "add --resume latest to continue it"
            if checkpoints.list_checkpoints(output_dir)
            else "it has no checkpoint to --resume from"
        )
        raise UserError(
            f"--output-dir {output_dir} holds an earlier run ({names}); {continuing}, add "
            "--overwrite to move it aside and start afresh, or choose another --output-dir"
        )
    # Fine-tuning the earlier run's own model further: moving it aside first would lose it.
    model_path = Path(resolve_alias(config.model.model)).expanduser().resolve()
    moved = [entry.resolve() for entry in entries]
    if model_path == output_dir.resolve() or any(
        model_path == entry or entry in model_path.parents for entry in moved
    ):
        raise UserError(
            f"--model {config.model.model} is part of the run in --output-dir {output_dir}, "
            "which --overwrite would move aside; train into another --output-dir"
        )
    if int(os.environ.get("RANK", "0")) == 0:
        aside = checkpoints.move_aside(output_dir, entries)
        tqdm.write(f"--overwrite: moved the earlier run's files ({names}) to {aside}")


def _check_output_dir(output_dir: Path) -> None:
    probe = (
        output_dir
        if output_dir.exists()
        else next((p for p in output_dir.parents if p.exists()), Path("."))
    )
    if probe.exists() and not probe.is_dir():
        raise UserError(f"--output-dir {output_dir}: {probe} is a file; choose a folder path")
    if not os.access(probe, os.W_OK):
        raise UserError(
            f"--output-dir {output_dir}: {probe} is not writable; choose another folder"
        )


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
        self.file = (output_dir / METRICS_FILE).open("a", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(output_dir / checkpoints.TENSORBOARD_DIR))
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
                    self.writer.add_scalar(
                        f"{'eval' if key in ('eval_loss', 'wer') else 'train'}/{key}",
                        value,
                        row["step"],
                    )

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
            tqdm.write(
                f"{'Step':>6} | {'Training Loss':>13} | {'Validation Loss':>15} | {'WER':>7}"
            )
            self.header_printed = True
        train_loss = "-" if math.isnan(self.last_train_loss) else f"{self.last_train_loss:.4f}"
        tqdm.write(
            f"{evaluation['step']:>6} | {train_loss:>13} | "
            f"{evaluation['eval_loss']:>15.4f} | {100 * evaluation['wer']:>6.2f}%"
        )
