"""Export a fine-tuned model for use elsewhere, and prove the export still transcribes.

    whisper-train export --model OUTPUT --format ct2 --quantization int8 --output model-ct2

1. Load: any `--model` spec; a whisper-train run folder (OUTPUT or OUTPUT/final) holding a
   LoRA adapter (`adapter_config.json`) is loaded onto its base model in float32 and merged
   with peft's `merge_and_unload`. Merging happens in float weights only: merging into int8 /
   4-bit weights rounds the adapter away (a frequent complaint with other tools).
2. Save: `hf` writes safetensors + tokenizer + preprocessor + generation config (language and
   task kept); `ct2` converts that folder with `whisper_train.ct2.save_ct2` (faster-whisper).
3. Check: greedy transcripts of a few clips by the source and by the exported model (each with
   the temperature fallback of whisper_train.decoding, as `transcribe` decodes), scored
   against the clips' references. The export fails if its WER is worse by more than 1 point
   (float formats) or 3 points (int8 formats, which lose some precision by design).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml

from whisper_train.config import require_positive
from whisper_train.errors import UserError
from whisper_train.runfolder import CONFIG_FILE, aside_path

log = logging.getLogger(__name__)

FORMATS = ("hf", "ct2")
EXPORT_QUANTIZATIONS = ("float32", "float16", "int8", "int8_float16")
DEVICES = ("cpu", "cuda")
# Allowed WER loss of the export, in absolute points (fractions), by weight precision.
FLOAT_WER_TOLERANCE = 0.01
INT8_WER_TOLERANCE = 0.03
CHECK_CLIPS = 6
# Spoken by espeak-ng when no --check-data is given; tiny.en gets all but the last word-perfect.
CHECK_SENTENCES = (
    "open the door and turn on the light in the kitchen",
    "my brother plays football every saturday afternoon",
    "there are twelve eggs in the box on the table",
    "turn left at the church and walk for five minutes",
    "i would like a cup of tea with milk and sugar",
    "please call stella and ask her to bring these things with her from the store",
)


class ExportParityError(UserError):
    """The exported model transcribes clearly worse than the model it came from."""


@dataclass
class ParityCheck:
    source_wer: float
    export_wer: float
    tolerance: float  # allowed export_wer - source_wer
    # (reference, source transcript, exported transcript) per clip
    transcripts: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.export_wer - self.source_wer <= self.tolerance


@dataclass
class ExportResult:
    output: Path
    format: str
    quantization: str
    merged_lora: bool
    parity: ParityCheck | None
    moved_aside: Path | None = None  # where --overwrite put the earlier export


def default_device() -> str:
    """Where the export will run when --device is not given: this machine."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_quantization(format: str, device: str) -> tuple[str, str]:
    """(quantization, why) when --quantization is not given.

    hf: float32, the precision transformers loads by default. ct2 on cuda: float16, half the
    size at no measurable WER cost. ct2 on cpu: float32. CTranslate2 has no fast float16 on
    CPUs, so a float16 model is converted to float32 (with a warning) on every load anyway.
    int8 is faster-whisper's usual CPU choice and smaller still, but it changes the weights;
    the default stays exact (the parity check then holds it to 1 point) and int8 is one flag.
    """
    if format == "hf":
        return "float32", "the default for --format hf"
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
    from whisper_train.models import HUB_ID, resolve_alias

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

    from whisper_train.models import load_model

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
    from whisper_train.models import load_model, model_folder

    path = model_folder(model_spec)
    if (path / "adapter_config.json").is_file():
        model, processor = merge_lora(path)
        return model, processor, True
    model, processor = load_model(model_spec)
    return model, processor, False


# -- saving ---------------------------------------------------------------------------------


def save_hf(model, processor, output: Path, *, dtype: torch.dtype = torch.float32) -> Path:
    """safetensors weights + config + generation config + tokenizer + preprocessor."""
    output.mkdir(parents=True, exist_ok=True)
    model = model.to(dtype)
    model.save_pretrained(str(output))
    processor.save_pretrained(str(output))
    # transformers 5 folds the feature extractor into processor_config.json; older versions,
    # faster-whisper and other tools read preprocessor_config.json, so write both.
    processor.feature_extractor.save_pretrained(str(output))
    return output


# -- parity check ---------------------------------------------------------------------------


def check_clips(check_data: str | None, n_clips: int = CHECK_CLIPS) -> list[tuple[np.ndarray, str]]:
    """(audio, reference) pairs: the first `n_clips` of `check_data`, or synthesised speech."""
    from whisper_train.audio import load_audio

    if check_data is not None:
        from whisper_train.data import load_examples

        examples = load_examples(check_data)[:n_clips]
        return [(load_audio(e.audio, start=e.start, end=e.end), e.text) for e in examples]
    from whisper_train.synth import synthesize

    return [(synthesize(text), text) for text in CHECK_SENTENCES[:n_clips]]


def greedy_transcripts(backend, clips) -> list[str]:
    """Greedy transcripts (no timestamps) of each clip's audio by a `transcribe` backend; a clip
    whose output loops or is unlikely is decoded again by the backend's temperature fallback
    (its `decoding`, on by default), so one looping clip does not fail a faithful export."""
    return [backend.transcribe(audio, timestamps=False)[0] for audio, _ in clips]


def check_parity(
    references: list[str],
    source: list[str],
    exported: list[str],
    *,
    quantization: str,
    normalizer: str = "english",
) -> ParityCheck:
    """Score the source's and the export's transcripts of the same clips against `references`.

    Raises ExportParityError when the export's WER exceeds the source's by more than the
    tolerance for `quantization`.
    """
    from whisper_train.evaluate import score

    tolerance = INT8_WER_TOLERANCE if quantization.startswith("int8") else FLOAT_WER_TOLERANCE
    result = ParityCheck(
        source_wer=score(references, source, normalizer=normalizer).wer,
        export_wer=score(references, exported, normalizer=normalizer).wer,
        tolerance=tolerance,
        transcripts=list(zip(references, source, exported, strict=True)),
    )
    if not result.passed:
        raise ExportParityError(
            f"export check failed: WER {100 * result.export_wer:.1f}% exported vs "
            f"{100 * result.source_wer:.1f}% source on {len(references)} clips (allowed "
            f"+{100 * tolerance:.0f} points for {quantization}); the export is broken or "
            "too coarse: try --quantization float16"
        )
    return result


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
) -> ExportResult:
    """Merge (LoRA), save as `format` into `output`, then run the parity check.

    `quantization` None picks one from `format` and `device` (where the export will run; None
    means this machine): see `default_quantization`. `hf` takes only float32 or float16 (int8
    is a CTranslate2 compute type). An `output` that is not empty is refused unless
    `overwrite`, which moves it aside to `<output>.old-<date>-<time>` (an earlier export only).
    """
    from whisper_train.transcribe import TransformersBackend, load_backend

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
    if format == "hf" and quantization.startswith("int8"):
        raise UserError(
            f"--quantization {quantization} needs --format ct2; Hugging Face exports take "
            "float32 or float16"
        )
    if check:
        require_positive("--check-clips", n_check_clips, alternative="use --no-check")
    output = Path(output)
    if overwrite:  # moving --output aside must not take the model to export with it
        from whisper_train.models import resolve_alias

        source = Path(resolve_alias(model_spec)).expanduser().resolve()
        if source == output.resolve() or output.resolve() in source.parents:
            raise UserError(
                f"--model {model_spec} is inside --output {output}, which --overwrite would "
                "move aside; export to a new folder"
            )
    moved_aside = _clear_output(output, overwrite=overwrite)

    model, processor, merged = load_for_export(model_spec)
    if torch.cuda.is_available():
        model = model.to("cuda")  # only speeds up the source's transcripts; saving is the same
    if check:
        # Decode the clips before saving: saving in float16 converts `model` in place.
        clips = check_clips(check_data, n_check_clips)
        source_texts = greedy_transcripts(TransformersBackend(model, processor), clips)
    if format == "hf":
        dtype = torch.float16 if quantization == "float16" else torch.float32
        save_hf(model, processor, output, dtype=dtype)
    else:
        from whisper_train.ct2 import save_ct2

        with tempfile.TemporaryDirectory(prefix="whisper-train-export-") as hf_dir:
            save_hf(model, processor, Path(hf_dir))
            save_ct2(hf_dir, output, quantization=quantization, overwrite=True)
            # Keep the generation config (language/task) beside the CTranslate2 weights.
            shutil.copyfile(
                Path(hf_dir) / "generation_config.json", output / "generation_config.json"
            )
    log.info("saved %s export to %s", format, output)
    parity = None
    if check:
        parity = check_parity(
            [text for _, text in clips],
            source_texts,
            greedy_transcripts(load_backend(str(output)), clips),
            quantization=quantization,
        )
    return ExportResult(output, format, quantization, merged, parity, moved_aside)


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
    if not (output / "config.json").is_file():  # every hf and ct2 export has one
        raise UserError(
            f"--output {output}: --overwrite replaces only an earlier export (config.json), and "
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
