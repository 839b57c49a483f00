"""The end of a run, after its last step (`FineTuneRecipe.finish` calls these in order): the
lines that sum the run up, the trained model made whole for final/ and refused there when a
weight is NaN, then final/, result.json, curves.png and the --compare-baseline report. Which
step final/ holds and how that folder is written are `final`'s."""

from __future__ import annotations

from pathlib import Path

import torch

from whisper_train import memory, runfolder
from whisper_train.config.record import ModelRecord, RunRecord
from whisper_train.errors import UserError
from whisper_train.evaluation.report import write_curves_png
from whisper_train.memory.wrappers import unwrapped
from whisper_train.runlog import TrainResult, say, write_result
from whisper_train.training import model_card
from whisper_train.training.checkpoints import TrainerState
from whisper_train.training.datasets import Datasets
from whisper_train.training.distillation import load_start_model
from whisper_train.training.encoder_cache import EncoderCache
from whisper_train.training.final import compare_with_baseline, save_final
from whisper_train.training.new_language import add_language
from whisper_train.training.step import lower_learning_rate_advice, nonfinite_tensors


def trained_line(first_step: int, last_step: int, seconds: float) -> str:
    """What the run trained and how long that took: after a resume, only the steps this
    process ran are timed, and the line says so."""
    if first_step == 0:
        return f"trained {last_step} steps in {seconds:.1f} s"
    if last_step == first_step:
        return f"trained no further step: resumed at step {last_step}, the last"
    return (
        f"trained steps {first_step + 1}-{last_step} ({last_step - first_step} after resuming "
        f"at step {first_step}; {last_step} in all) in {seconds:.1f} s"
    )


def say_what_was_skipped(accelerator, state: TrainerState) -> None:
    """The clips that could not be read and the optimizer steps skipped, when there were any."""
    if state.skipped_clips:
        say(
            accelerator,
            f"skipped {state.skipped_clips} clips during training (each named above, once "
            "however often it was read)",
        )
    if state.skipped_steps:
        say(
            accelerator,
            f"skipped {state.skipped_steps} optimizer steps with a NaN or infinite loss or "
            "gradient",
        )


def encoder_cache_counts(cache: EncoderCache, accelerator) -> str:
    """What the encoder cache did in this run, summed over the processes (each encodes
    and stores only the clips of its own batches). Every process must call this."""
    counts = torch.tensor([cache.found, cache.encoded, cache.stored], device=accelerator.device)
    if accelerator.num_processes > 1:
        counts = accelerator.reduce(counts, reduction="sum")
    found, encoded, stored = counts.tolist()
    return (
        f"encoder cache: {encoded} clips encoded ({stored} stored), {found} read back, "
        f"over {accelerator.num_processes} process(es)"
    )


def refuse_nonfinite_final(
    model: torch.nn.Module, accelerator, final_step: int, record: RunRecord, output_dir: Path
) -> None:
    """final/ is what `--model OUTPUT`, pipelines and exports take as the result: a model
    with a NaN or infinite weight is not written there, nor called fine-tuned (every
    forward through it is NaN). Its checkpoints stay; nothing in final/ is replaced. Every
    process calls this (`nonfinite_tensors` is collective)."""
    # Only trained tensors can be NaN here: `load_model` refuses a model that holds one. A
    # quantized base's (--quantize-base) integer weights hold no NaN and are not trained.
    parameters = [p for p in model.parameters() if p.is_floating_point()]
    blown = sum(nonfinite_tensors(parameters, accelerator))
    if not blown:
        return
    raise UserError(
        f"the model of step {final_step} has {blown} of {len(parameters)} tensors NaN or "
        f"infinite; {runfolder.FINAL_DIR}/ was not written. "
        f"{lower_learning_rate_advice(record, output_dir, final_step)}"
    )


def whole_model(model: torch.nn.Module, model_record: ModelRecord, accelerator):
    """The trained `model`, unwrapped, for final/: on the main process (None on the others
    under --fsdp, where every process must call this: the weights are gathered)."""
    if not memory.is_sharded(model):
        trained = accelerator.unwrap_model(model, keep_torch_compile=False)
        return full_precision_base(trained, model_record)
    weights = memory.full_state_dict(model)  # whole, on the main process's CPU
    if not accelerator.is_main_process:
        return None
    # A fresh model as setup made it (LoRA included), unsharded, with the trained weights
    # and the trained model's configuration (generation settings, SpecAugment's).
    m = model_record
    fresh, processor = load_start_model(m)
    if m.new_language is not None:  # its shape as setup made it: the added row
        add_language(fresh, processor.tokenizer, m.new_language, init=m.new_language_init)
    fresh = memory.prepare_model(fresh, mode=m.mode, checkpointing="off", lora=m.lora)
    fresh.load_state_dict(weights)
    whole, trained = memory.whisper_of(fresh), memory.whisper_of(unwrapped(model))
    whole.config, whole.generation_config = trained.config, trained.generation_config
    return fresh


def full_precision_base(trained: torch.nn.Module, m: ModelRecord) -> torch.nn.Module:
    """`trained` itself, or where its base was quantized (--quantize-base) its adapters on the
    base loaded again in full precision: final/ merges them into the original weights, never
    into the 8- or 4-bit ones (which would round every merged weight again)."""
    if m.quantize_base == "none":
        return trained
    base, processor = load_start_model(m)
    if m.new_language is not None:  # its shape as setup made it: the added row
        add_language(base, processor.tokenizer, m.new_language, init=m.new_language_init)
    return memory.checkpointing.adapters_on_full_precision(unwrapped(trained), base, m.lora)


def write_run_outputs(
    final_model,
    result: TrainResult,
    *,
    record: RunRecord,
    processor,
    datasets: Datasets,
    accelerator,
) -> None:
    """OUTPUT/final/ (with its model card), result.json, curves.png and, with
    --compare-baseline, the before/after report: the main process's alone. Each says what the
    run's record says."""
    output_dir, evaluation = result.output_dir, record.evaluation
    result.final_dir = save_final(
        final_model,
        processor,
        output_dir / runfolder.FINAL_DIR,
        pin_language=record.data.pin_language,
        config_yaml=record.to_yaml(),
        card=model_card.run_card(record, result, datasets.train),
    )
    write_result(result)
    write_curves_png(output_dir / runfolder.METRICS_FILE, output_dir / runfolder.CURVES_FILE)
    say(accelerator, f"fine-tuned model: {result.final_dir}")
    primary = evaluation.set_named(evaluation.primary)
    primary_examples = datasets.eval.get(evaluation.primary)
    if evaluation.compare_baseline and primary_examples:
        compare_with_baseline(
            record.model.model,
            result.final_dir,
            primary_examples,
            output_dir,
            language=primary.language,
            task=record.data.task,
            batch_size=record.data.clips_per_micro_batch,
            max_length=evaluation.max_length,
            decoding=evaluation.decoding,
            attn_implementation=record.model.attn_implementation,
        )
