"""A transformers (Hugging Face) Whisper folder: `export --format hf`, a run's final/, and the
folder CTranslate2's converter reads.

Reading (`load_hf`) checks what transformers would fail on with a traceback or, worse, load
with random weights: a config.json that is not a Whisper config or lacks a shape key, no
weights file, a safetensors file shorter than its header says, tensors that do not fit the
config, missing processor files. Writing (`save_model_folder`) is the one writer of such a
folder, atomic: written beside it and renamed over it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import shutil
import struct
from pathlib import Path

import torch
from transformers import WhisperForConditionalGeneration, WhisperProcessor

from whisper_train.errors import UserError, unpickling_refusal

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
_RECOPY = "copy the model folder again from where it came from, or save or export it again"


def read_json_object(file: Path, spec: str) -> dict:
    """A JSON file of `--model spec` that must hold an object; one line naming it otherwise."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        value = None
    except json.JSONDecodeError as exc:
        raise UserError(
            f"--model {spec}: {file} is not valid JSON ({exc.msg} at line {exc.lineno} column "
            f"{exc.colno}); {_RECOPY}"
        ) from None
    if not isinstance(value, dict):
        raise UserError(f"--model {spec}: {file} does not hold a JSON object; {_RECOPY}")
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
            f"shapes; {_RECOPY}"
        )
    for key in WHISPER_SHAPE_KEYS:
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UserError(
                f"--model {spec}: {config_file} has {key} {value!r}, not a positive whole "
                f"number; {_RECOPY}"
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
                raise UserError(f"--model {spec}: {path / index} has no weight_map; {_RECOPY}")
            shards = [path / name for name in sorted(set(map(str, weight_map.values())))]
            absent = [shard for shard in shards if not shard.is_file()]
            if absent:
                raise UserError(
                    f"--model {spec}: {absent[0]} is missing ({index} lists {len(shards)} "
                    f"files); {_RECOPY}"
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
                f"bytes); {_RECOPY}"
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
                f"--model {spec}: {file} has a damaged safetensors header; {_RECOPY}"
            ) from None
    needed = 8 + header_bytes + max(ends, default=0)
    if needed > size:
        raise UserError(
            f"--model {spec}: {file} is truncated ({size} bytes, its header describes "
            f"{needed}); {_RECOPY}"
        )


def load_hf(path: str | Path, *, attn_implementation: str = "sdpa"):
    """A transformers model folder → (WhisperForConditionalGeneration in float32, processor),
    its files checked first (`check_hf_folder`)."""
    path = Path(path)
    spec = str(path)
    check_hf_folder(path, spec)
    try:
        model, processor = from_pretrained(spec, spec, attn_implementation)
    except UserError:
        raise
    except _LOAD_ERRORS as exc:  # what the checks cannot foresee (a damaged .bin)
        raise UserError(
            f"--model {spec}: transformers could not load the model in {path} "
            f"({type(exc).__name__}: {unpickling_refusal(exc) or _first_line(exc)[:160]}); "
            "the folder is damaged: copy "
            "or save the model again"
        ) from None
    if any(p.dtype != torch.float32 for p in model.parameters()):
        model = model.float()
    return model, processor


def save_hf(model, processor, output: Path, *, quantization: str = "float32") -> Path:
    """`export --format hf`: the model folder in `quantization` (float32 or float16)."""
    dtype = torch.float16 if quantization == "float16" else torch.float32
    return save_model_folder(model, processor, output, dtype=dtype)


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
    converts `model` in place. A folder already at `folder` is moved aside (`.old`) until the
    new one is in place: a kill between leaves both whole, none lost."""
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
    previous = folder.with_name(folder.name + ".old")
    if folder.exists():
        shutil.rmtree(previous, ignore_errors=True)
        folder.rename(previous)
    staging.rename(folder)
    shutil.rmtree(previous, ignore_errors=True)
    return folder


def nonfinite_names(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the tensors of `named` (name, tensor) that hold a NaN or an infinity: one
    fused norm per tensor, NaN or infinite exactly when the tensor holds one, or is so large
    that no trained weight comes near. Empty tensors hold neither."""
    filled = [(name, tensor) for name, tensor in named if tensor.numel()]
    if not filled:
        return []
    norms = torch._foreach_norm([tensor for _, tensor in filled], 2)
    return [name for (name, _), norm in zip(filled, norms, strict=True) if not norm.isfinite()]


def refuse_nonfinite_weights(model, spec: str) -> None:
    """A weight that is NaN or infinite makes every output NaN: training would only find out at
    its end, and evaluate or export would report or ship garbage. One fused norm per tensor
    (NaN or infinite exactly when the tensor holds one, or is so large that no trained weight
    comes near), before anything uses the model."""
    named = [(name, p.detach()) for name, p in model.named_parameters() if p.numel()]
    blown = nonfinite_names(named)
    if blown:
        raise UserError(
            f"--model {spec}: {len(blown)} of {len(named)} weight tensors hold NaN or infinite "
            f"values ({', '.join(blown[:3])}{', ...' if len(blown) > 3 else ''}); the weights are "
            "damaged: use an undamaged copy of the model, or an earlier checkpoint of its run"
        )


@contextlib.contextmanager
def _quiet_load_report():
    """Drop transformers' table of missing or mismatched tensors (`from_pretrained` says it in
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def from_pretrained(source: str, spec: str, attn_implementation: str):
    """A folder or hub id through transformers' `from_pretrained`, refused in one line when its
    weights do not fit its config.json or its processor files are missing."""
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
                f"{_RECOPY}"
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
