"""Export a fine-tuned model for the runtime it will run in, and prove the export transcribes
as its source does, in that runtime.

    whisper-train export --model OUTPUT --format ct2 --quantization int8 --output model-ct2

1. Load: any `--model` spec; a whisper-train run folder (OUTPUT or OUTPUT/final) holding a
   LoRA adapter (`adapter_config.json`) is loaded onto its base model in float32 and merged
   with peft's `merge_and_unload`. Merging happens in float weights only: merging into int8 /
   4-bit weights rounds the adapter away (a frequent complaint with other tools).
2. Save, by `--format`, with the format's own writer (its row of `formats.registry`):
     hf      safetensors + tokenizer + preprocessor + generation config (transformers);
     ct2     CTranslate2 (faster-whisper), with tokenizer.json and preprocessor_config.json;
     ggml    whisper.cpp's ggml-model.bin, written by whisper-train itself (formats.ggml);
     openai  openai-whisper's model.pt (formats.openai).
3. Check (parity.py), like with like: the source (transformers) transcribes the check clips
   greedily, and the export's own runtime scores exactly those tokens, teacher forced, from its
   own log-mel of the same audio. The export fails (`ExportParityError`, after it is written)
   when the mean |Δ log p| per token exceeds what the runtime's arithmetic explains, when its
   vocabulary spells a transcript differently, or when the runtime cannot run it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from peft import PeftModel
from transformers import GenerationConfig, WhisperProcessor

from whisper_train.audio import N_SAMPLES, load_audio
from whisper_train.config import require_positive
from whisper_train.data.layouts import load_examples
from whisper_train.deploy.parity import (
    CHECK_CLIPS,
    ParityCheck,
    check_clips,
    check_export,
    check_language,
    parity_failure,
    score_source,
)
from whisper_train.errors import UserError
from whisper_train.files import check_output_path, write_atomically
from whisper_train.formats.registry import (
    DEFAULT_FORMAT,
    DEVICES,
    EXPORT_FORMATS,
    EXPORT_QUANTIZATIONS,
    ExportFormat,
    export_format,
)
from whisper_train.models import (
    HUB_ID,
    folder_added_languages,
    load_model,
    model_folder,
    require_model,
    resolve_alias,
)
from whisper_train.runfolder import CONFIG_FILE, aside_path
from whisper_train.training.model_card import CARD_FILE, export_card
from whisper_train.transcription.word_timestamps import (
    ALIGNMENT_CLIPS,
    HeadSearch,
    find_alignment_heads_against,
)

log = logging.getLogger(__name__)


@dataclass
class ExportResult:
    output: Path
    format: str
    quantization: str
    merged_lora: bool
    parity: ParityCheck | None
    moved_aside: Path | None = None  # where --overwrite put the earlier export
    alignment: HeadSearch | None = None  # the heads --find-alignment-heads found


def default_device() -> str:
    """Where the export will run when --device is not given: this machine."""
    return "cuda" if torch.cuda.is_available() else "cpu"


# -- loading and merging --------------------------------------------------------------------


def _base_model_spec(adapter_dir: Path) -> str:
    """The base model of a LoRA adapter: adapter_config.json, else the run's whisper-train.yaml."""
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    candidates = [adapter_config.get("base_model_name_or_path")]
    for config_file in (adapter_dir / CONFIG_FILE, adapter_dir.parent / CONFIG_FILE):
        if config_file.is_file():
            run = yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}
            candidates.append((run.get("model") or {}).get("model"))

    for spec in filter(None, candidates):
        if Path(resolve_alias(spec)).expanduser().exists() or HUB_ID.match(resolve_alias(spec)):
            return spec
    raise UserError(
        f"{adapter_dir}: cannot find the LoRA adapter's base model (adapter_config.json names "
        f"{adapter_config.get('base_model_name_or_path')!r}); set base_model_name_or_path there"
    )


def merge_lora(adapter_dir: str | Path):
    """A LoRA adapter folder → (merged WhisperForConditionalGeneration in float32, processor)."""
    adapter_dir = Path(adapter_dir)
    base, processor = load_model(_base_model_spec(adapter_dir))
    quantised = [name for name, p in base.named_parameters() if not p.is_floating_point()]
    if quantised:
        raise UserError(
            f"{adapter_dir}: the base model holds quantised weights ({quantised[0]}); merging a "
            "LoRA adapter into them loses it: load the base model in float16/32"
        )
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    # The run folder's processor and generation config carry the training language/task.
    if any(
        (adapter_dir / name).exists()
        for name in ("preprocessor_config.json", "processor_config.json")
    ):
        processor = WhisperProcessor.from_pretrained(str(adapter_dir))
    if (adapter_dir / "generation_config.json").exists():
        merged.generation_config = GenerationConfig.from_pretrained(str(adapter_dir))
    return merged, processor


def load_for_export(model_spec: str):
    """(model in float32, processor, whether a LoRA adapter was merged) for any spec."""

    path = model_folder(model_spec)
    if (path / "adapter_config.json").is_file():
        model, processor = merge_lora(path)
        return model, processor, True
    model, processor = load_model(model_spec)
    return model, processor, False


# -- the library entry point ----------------------------------------------------------------


def export_model(
    model_spec: str,
    *,
    format: str = DEFAULT_FORMAT,
    output: str | Path,
    quantization: str | None = None,
    check_data: str | None = None,
    check: bool = True,
    n_check_clips: int = CHECK_CLIPS,
    device: str | None = None,
    overwrite: bool = False,
    alignment_data: str | None = None,
    alignment_reference: str | None = None,
) -> ExportResult:
    """Merge (LoRA), save as `format` into `output`, then check it in its own runtime.

    `quantization` None picks one from `format` and `device` (where the export will run; None
    means this machine): its format's `default_quantization`. An `output` that is not empty is
    refused unless `overwrite`, which moves it aside to `<output>.old-<date>-<time>` (an earlier
    export only). Raises ExportParityError (after writing the export) when the check fails, and
    formats.runtimes.MissingRuntimeError before writing anything when the runtime client that checks
    (or, for CTranslate2, writes) the export is not installed. `alignment_data` (clips): find the model's alignment heads there against
    `alignment_reference`'s word times (default: the run's base model) and export them.
    """
    exported = export_format(format)
    require_model(model_spec)  # a mistyped --model is the first thing said, and the only one
    device = device or default_device()
    if device not in DEVICES:
        raise UserError(f"--device {device}: expected one of {', '.join(DEVICES)}")
    default, why = exported.default_quantization(device)
    if quantization is None:
        quantization = default
        log.info("quantization %s: %s (pass --quantization to choose)", quantization, why)
    if quantization not in EXPORT_QUANTIZATIONS:
        raise UserError(
            f"--quantization {quantization}: expected one of {', '.join(EXPORT_QUANTIZATIONS)}"
        )
    if quantization not in exported.quantizations:
        holders = [fmt.name for fmt in EXPORT_FORMATS if quantization in fmt.quantizations]
        raise UserError(
            f"--quantization {quantization} needs --format {_either(holders)}; --format "
            f"{format} takes {_either(exported.quantizations)}"
        )
    exported.require_client(check=check)  # before the work: one line naming the extra
    if check:
        require_positive("--check-clips", n_check_clips, alternative="use --no-check")
        if quantization in exported.unchecked:
            raise UserError(
                f"--format {format} --quantization {quantization}: "
                f"{exported.unchecked[quantization]}, so this export cannot be checked; add "
                "--no-check to write it anyway (it reads back into whisper-train exactly), or "
                f"keep the {default} default"
            )
    if alignment_data is not None and not exported.carries_alignment_heads:
        carriers = [fmt.name for fmt in EXPORT_FORMATS if fmt.carries_alignment_heads]
        raise UserError(
            f"--find-alignment-heads with --format {format}: a {format} file has no place for "
            f"alignment heads ({exported.runtime} takes them at load); export as "
            f"{_either(carriers)}"
        )
    output = Path(output)
    if overwrite:  # moving --output aside must not take the model to export with it
        source = Path(resolve_alias(model_spec)).expanduser().resolve()
        if source == output.resolve() or output.resolve() in source.parents:
            raise UserError(
                f"--model {model_spec} is inside --output {output}, which --overwrite would "
                "move aside; export to a new folder"
            )
    refuse_new_languages(exported, model_spec)
    check_output_path(output, "--output", folder=True)  # before the model is read
    moved_aside = _clear_output(output, overwrite=overwrite)

    model, processor, merged = load_for_export(model_spec)
    alignment = None
    if alignment_data is not None:
        alignment = find_export_heads(
            model, processor, model_spec, alignment_data, alignment_reference
        )
        model.generation_config.alignment_heads = alignment.heads
    if torch.cuda.is_available():
        model = model.to("cuda")  # only speeds up the source's transcripts; saving is the same
    if check:
        # Score the clips before saving: saving in float16 converts `model` in place.
        clips = check_clips(check_data, n_check_clips)
        source = score_source(model, processor, clips, check_language(model, processor, clips))
    card = None  # README.md: the source run's model card, or the base's
    if exported.model_card:
        card = export_card(model_spec, output=output, quantization=quantization, merged_lora=merged)
    save_export(model, processor, output, format=format, quantization=quantization, card=card)
    log.info("saved %s export to %s", format, output)
    parity = None
    if check:
        parity = check_export(source, format, output, quantization)
        if not parity.passed:
            raise parity_failure(parity, format)
    return ExportResult(output, format, quantization, merged, parity, moved_aside, alignment)


def refuse_new_languages(exported: ExportFormat, model_spec: str) -> None:
    """One line, before anything is read or written, where the model adds a language (train
    --new-language) and `exported`'s runtime cannot run one (`ExportFormat.no_new_language`)."""
    if exported.no_new_language is None:
        return
    added = folder_added_languages(model_spec)
    if added:
        raise UserError(
            f"--format {exported.name}: --model {model_spec} adds the language "
            f"{', '.join(added)} (train --new-language), and {exported.runtime} cannot run it: "
            f"{exported.no_new_language}; export as --format hf (transformers)"
        )


def find_export_heads(model, processor, model_spec: str, data: str, reference: str | None):
    """The model's alignment heads on the clips of `data` (up to ALIGNMENT_CLIPS of at most
    30 s), against `reference`'s word times; `reference` None: the run's base model."""
    reference = reference or _run_base_model(model_spec)
    clips = []
    for example in load_examples(data):
        audio = load_audio(example.audio, start=example.start, end=example.end)
        if len(audio) <= N_SAMPLES:
            clips.append(audio)
        if len(clips) == ALIGNMENT_CLIPS:
            break
    if not clips:
        raise UserError(f"--find-alignment-heads {data}: no clip of at most 30 s in it")
    search = find_alignment_heads_against(model, processor, load_model(reference), clips)
    log.info(
        "alignment heads %s: word starts %.3f s (median) from %s's on %d words of %d clips",
        search.heads,
        search.error_s,
        reference,
        search.words,
        len(clips),
    )
    return search


def _run_base_model(model_spec: str) -> str:
    """The model a whisper-train run fine-tuned (whisper-train.yaml in the run or its final/)."""
    path = model_folder(model_spec)
    for config_file in (path / CONFIG_FILE, path.parent / CONFIG_FILE):
        if config_file.is_file():
            run = yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}
            base = (run.get("model") or {}).get("model")
            if base:
                return str(base)
    raise UserError(
        f"--find-alignment-heads: {model_spec} is not a whisper-train run, so its base model is "
        "unknown; add --alignment-reference MODEL (whose word times the heads should follow)"
    )


# -- saving ---------------------------------------------------------------------------------


def save_export(
    model, processor, output: Path, *, format: str, quantization: str, card: str | None = None
) -> None:
    """Write `model` into `output` as `format` in `quantization` (no check), with its format's
    own writer; `card`: the folder's model card (README.md)."""
    export_format(format).write(model, processor, output, quantization=quantization)
    if card is not None:
        write_atomically(output / CARD_FILE, card)


def _either(names) -> str:
    """`a`, `a or b`, `a, b or c`."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _clear_output(output: Path, *, overwrite: bool) -> Path | None:
    """Refuse a non-empty --output; with `overwrite`, move an earlier export aside (never a
    folder of other files: --output /home/me must not take the user's files with it)."""
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output} is a file: choose a folder path for the export")
    if not output.exists() or not any(output.iterdir()):
        return None
    if not overwrite:
        raise UserError(
            f"--output {output} is not empty: add --overwrite to move it aside to "
            f"{output.name}.old-<date>-<time>, or choose a new folder"
        )
    if not any(fmt.holds(output) for fmt in EXPORT_FORMATS):
        markers = ", ".join(" + ".join(fmt.markers) for fmt in EXPORT_FORMATS)
        raise UserError(
            f"--output {output}: --overwrite replaces only an earlier export ({markers}), and "
            "this folder holds other files; choose a new folder"
        )

    aside = aside_path(output)
    try:
        output.rename(aside)
    except OSError as exc:
        raise UserError(
            f"--overwrite: could not move {output} aside to {aside} ({exc.strerror or exc}); "
            "move or delete it yourself, or choose a new --output"
        ) from None
    log.info("--overwrite: moved the earlier export %s to %s", output, aside)
    return aside
