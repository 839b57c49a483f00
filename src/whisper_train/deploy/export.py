"""Export a fine-tuned model for the runtime it will run in, and prove the export transcribes
as its source does, in that runtime.

    whisper-train export --model OUTPUT --format ct2 --quantization int8 --output model-ct2

1. Load: any `--model` spec; a whisper-train run folder (OUTPUT or OUTPUT/final) holding a
   LoRA adapter (`adapter_config.json`) is loaded onto its base model in float32 and merged
   with peft's `merge_and_unload`. Merging happens in float weights only: merging into int8 /
   4-bit weights rounds the adapter away (a frequent complaint with other tools).
2. Save, by `--format`:
     hf      safetensors + tokenizer + preprocessor + generation config (transformers);
     ct2     CTranslate2 (faster-whisper), with tokenizer.json and preprocessor_config.json;
     ggml    whisper.cpp's ggml-model.bin, written here (ggml.py);
     openai  openai-whisper's model.pt (openai_whisper.py).
3. Check (parity.py), like with like: the source (transformers) transcribes the check clips
   greedily, and the export's own runtime scores exactly those tokens, teacher forced, from its
   own log-mel of the same audio. The export fails (`ExportParityError`, after it is written)
   when the mean |Δ log p| per token exceeds what the runtime's arithmetic explains, when its
   vocabulary spells a transcript differently, or when the runtime cannot run it.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from whisper_train.config import require_positive
from whisper_train.deploy.parity import (
    CHECK_CLIPS,
    CHECK_SENTENCES,
    LOGPROB_TOLERANCE,
    ClipComparison,
    ExportParityError,
    ParityCheck,
    SourceSide,
    check_clips,
    check_export,
    check_language,
    compare,
    language_code,
    logprob_tolerance,
    parity_failure,
    score_source,
    scoring_arithmetic,
)
from whisper_train.errors import UserError
from whisper_train.models import (
    HUB_ID,
    load_model,
    model_folder,
    resolve_alias,
    save_model_folder,
)
from whisper_train.runfolder import CONFIG_FILE, aside_path
from whisper_train.training.model_card import CARD_FILE, export_card
from whisper_train.word_timestamps import HeadSearch

log = logging.getLogger(__name__)

FORMATS = ("hf", "ct2", "ggml", "openai")
EXPORT_QUANTIZATIONS = ("float32", "float16", "int8", "int8_float16")
# Weight precisions each format can hold (int8 is CTranslate2's).
FORMAT_QUANTIZATIONS = {
    "hf": ("float32", "float16"),
    "ct2": EXPORT_QUANTIZATIONS,
    "ggml": ("float32", "float16"),
    "openai": ("float32", "float16"),
}
# The file each runtime format's folder holds (an earlier export, for --overwrite).
EXPORT_MARKERS = ("config.json", "ggml-model.bin", "model.pt")
DEVICES = ("cpu", "cuda")
# Clips of --find-alignment-heads DATA the head search uses: tiny.en's 24 heads take about a
# CPU second a clip, and 24 clips of the demo's sentences gave 244 words to hold heads against.
ALIGNMENT_CLIPS = 24


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


def default_quantization(format: str, device: str) -> tuple[str, str]:
    """(quantization, why) when --quantization is not given.

    ggml and openai: float16, what whisper.cpp and OpenAI ship (float32 on request).
    hf: float32, the precision transformers loads by default. ct2 on cuda: float16, half the
    size at no measurable WER cost. ct2 on cpu: float32. CTranslate2 has no fast float16 on
    CPUs, so a float16 model is converted to float32 (with a warning) on every load anyway.
    int8 is faster-whisper's usual CPU choice and smaller still, but it changes the weights;
    the default stays exact (the parity check then holds it to 1 point) and int8 is one flag.
    """
    if format == "hf":
        return "float32", "the default for --format hf"
    if format in ("ggml", "openai"):
        return "float16", f"the default for --format {format}, as its runtime's own models"
    if device == "cuda":
        return "float16", "the default for --device cuda"
    return "float32", (
        "the default for --device cpu, where CTranslate2 would convert float16 to float32 on "
        "every load; --quantization int8 is smaller and faster on a CPU"
    )


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
    from peft import PeftModel
    from transformers import GenerationConfig, WhisperProcessor

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
    format: str = "hf",
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
    means this machine): see `default_quantization`. An `output` that is not empty is refused
    unless `overwrite`, which moves it aside to `<output>.old-<date>-<time>` (an earlier export
    only). Raises ExportParityError (after writing the export) when the check fails, and
    runtimes.MissingRuntimeError before writing anything when the check's runtime client is
    not installed. `alignment_data` (clips): find the model's alignment heads there against
    `alignment_reference`'s word times (default: the run's base model) and export them.
    """
    from whisper_train.deploy.runtimes import require_client

    if format not in FORMATS:
        raise UserError(f"--format {format}: expected one of {', '.join(FORMATS)}")
    device = device or default_device()
    if device not in DEVICES:
        raise UserError(f"--device {device}: expected one of {', '.join(DEVICES)}")
    if quantization is None:
        quantization, why = default_quantization(format, device)
        log.info("quantization %s: %s (pass --quantization to choose)", quantization, why)
    if quantization not in EXPORT_QUANTIZATIONS:
        raise UserError(
            f"--quantization {quantization}: expected one of {', '.join(EXPORT_QUANTIZATIONS)}"
        )
    if quantization not in FORMAT_QUANTIZATIONS[format]:
        raise UserError(
            f"--quantization {quantization} needs --format ct2; --format {format} takes "
            f"{' or '.join(FORMAT_QUANTIZATIONS[format])}"
        )
    if check:
        require_positive("--check-clips", n_check_clips, alternative="use --no-check")
        require_client(format)  # before the work: one line naming the extra
        if format == "ggml" and quantization == "float32":
            # Measured with pywhispercpp 1.5.1: its CPU convolution asserts float16 kernels
            # (ggml-cpu ops.cpp GGML_ASSERT) and aborts the whole process on a float32 file.
            raise UserError(
                "--format ggml --quantization float32: whisper.cpp's CPU build (pywhispercpp "
                "1.5.1) aborts on float32 convolution kernels, so this export cannot be checked; "
                "add --no-check to write it anyway (it reads back into whisper-train exactly), "
                "or keep the float16 default"
            )
    if alignment_data is not None and format == "ggml":
        raise UserError(
            "--find-alignment-heads with --format ggml: a ggml file has no place for alignment "
            "heads (whisper.cpp takes them at load); export as ct2, openai or hf"
        )
    output = Path(output)
    if overwrite:  # moving --output aside must not take the model to export with it
        source = Path(resolve_alias(model_spec)).expanduser().resolve()
        if source == output.resolve() or output.resolve() in source.parents:
            raise UserError(
                f"--model {model_spec} is inside --output {output}, which --overwrite would "
                "move aside; export to a new folder"
            )
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
    card = None  # an hf folder's README.md: the source run's model card, or the base's
    if format == "hf":
        card = export_card(model_spec, output=output, quantization=quantization, merged_lora=merged)
    save_export(model, processor, output, format=format, quantization=quantization, card=card)
    log.info("saved %s export to %s", format, output)
    parity = None
    if check:
        parity = check_export(source, format, output, quantization)
        if not parity.passed:
            raise parity_failure(parity, format)
    return ExportResult(output, format, quantization, merged, parity, moved_aside, alignment)


def find_export_heads(model, processor, model_spec: str, data: str, reference: str | None):
    """The model's alignment heads on the clips of `data` (up to ALIGNMENT_CLIPS of at most
    30 s), against `reference`'s word times; `reference` None: the run's base model."""
    from whisper_train.audio import N_SAMPLES, load_audio
    from whisper_train.data.layouts import load_examples
    from whisper_train.word_timestamps import find_alignment_heads_against

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
    """Write `model` into `output` as `format` in `quantization` (no check); `card`: an hf
    folder's model card (README.md)."""
    if format == "hf":
        dtype = torch.float16 if quantization == "float16" else torch.float32
        readme = {CARD_FILE: card} if card is not None else None
        save_model_folder(model, processor, output, dtype=dtype, extra_files=readme)
    elif format == "ggml":
        from whisper_train.formats.ggml import save_ggml

        save_ggml(model, processor, output, quantization=quantization)
    elif format == "openai":
        from whisper_train.formats.openai import save_openai

        dtype = torch.float16 if quantization == "float16" else torch.float32
        save_openai(model, processor, output, dtype=dtype)
    else:
        from whisper_train.formats.ct2 import save_ct2

        with tempfile.TemporaryDirectory(prefix="whisper-train-export-") as hf_dir:
            save_model_folder(model, processor, Path(hf_dir))
            save_ct2(hf_dir, output, quantization=quantization, overwrite=True)
            # Keep the generation config (language/task) beside the CTranslate2 weights.
            shutil.copyfile(
                Path(hf_dir) / "generation_config.json", output / "generation_config.json"
            )


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
    if not any((output / marker).is_file() for marker in EXPORT_MARKERS):
        raise UserError(
            f"--output {output}: --overwrite replaces only an earlier export "
            f"({', '.join(EXPORT_MARKERS)}), and "
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


# The check's names import from here too, as they did before parity.py held them.
__all__ = [
    "CHECK_CLIPS",
    "CHECK_SENTENCES",
    "DEVICES",
    "EXPORT_MARKERS",
    "EXPORT_QUANTIZATIONS",
    "FORMATS",
    "FORMAT_QUANTIZATIONS",
    "LOGPROB_TOLERANCE",
    "ClipComparison",
    "ExportParityError",
    "ExportResult",
    "ParityCheck",
    "SourceSide",
    "check_clips",
    "check_export",
    "check_language",
    "compare",
    "default_device",
    "default_quantization",
    "export_model",
    "language_code",
    "load_for_export",
    "logprob_tolerance",
    "merge_lora",
    "parity_failure",
    "save_export",
    "score_source",
    "scoring_arithmetic",
]
