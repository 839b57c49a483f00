"""Writing a CTranslate2 (faster-whisper) folder: `export --format ct2`.

`save_ct2(hf_folder, out)` runs CTranslate2's own converter on a transformers folder and adds
the files faster-whisper reads beside `model.bin` (tokenizer.json, preprocessor_config.json,
config.json's `lang_ids`) and the generation config; `save_ct2_model` does that for a model in
memory, through a temporary transformers folder (`hf.save_model_folder`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from transformers import WhisperFeatureExtractor, WhisperTokenizerFast

from whisper_train.errors import UserError
from whisper_train.formats.ct2 import (
    MODEL_CONFIG,
    MULTILINGUAL_MIN_VOCAB,
    PREPROCESSOR_FILE,
    QUANTIZATIONS,
    TOKENIZER_FILE,
    language_token_ids,
)
from whisper_train.formats.hf import save_model_folder
from whisper_train.transcription.backends import faster_whisper_runtime

GENERATION_CONFIG_FILE = "generation_config.json"


def save_ct2_model(model, processor, output: Path, *, quantization: str = "float16") -> Path:
    """`model` and `processor` as a faster-whisper folder `output` in `quantization`."""
    with tempfile.TemporaryDirectory(prefix="whisper-train-export-") as hf_dir:
        save_model_folder(model, processor, Path(hf_dir))
        return save_ct2(hf_dir, output, quantization=quantization, overwrite=True)


def save_ct2(
    model_dir_hf: str | Path,
    output_dir: str | Path,
    *,
    quantization: str = "float16",
    overwrite: bool = False,
) -> Path:
    """Convert a saved HF Whisper folder into a faster-whisper folder; returns `output_dir`.

    Writes model.bin, config.json and vocabulary.json (CTranslate2's converter, offline for a
    local folder) plus the tokenizer.json and preprocessor_config.json faster-whisper loads,
    and fills config.json's `lang_ids` for multilingual models when the converter could not;
    the generation config (language/task) is kept beside the weights.
    """
    model_dir_hf, output_dir = Path(model_dir_hf), Path(output_dir)
    if quantization not in QUANTIZATIONS:
        raise UserError(
            f"unknown quantization {quantization!r}: use one of {', '.join(QUANTIZATIONS)}"
        )
    hf_config_file = model_dir_hf / MODEL_CONFIG
    if not hf_config_file.is_file():
        raise UserError(f"{model_dir_hf} has no {MODEL_CONFIG}: pass a saved Whisper model folder")
    hf_config = json.loads(hf_config_file.read_text())
    if hf_config.get("model_type") != "whisper":
        raise UserError(f"{hf_config_file} is not a Whisper model's config")
    if output_dir.exists() and any(output_dir.iterdir()) and not overwrite:
        raise UserError(f"{output_dir} is not empty: choose a new folder or delete it")

    ctranslate2, _ = faster_whisper_runtime()
    ctranslate2.converters.TransformersConverter(str(model_dir_hf)).convert(
        str(output_dir), quantization=quantization, force=True
    )

    tokenizer = WhisperTokenizerFast.from_pretrained(str(model_dir_hf))
    if (model_dir_hf / TOKENIZER_FILE).is_file():
        shutil.copyfile(model_dir_hf / TOKENIZER_FILE, output_dir / TOKENIZER_FILE)
    else:
        tokenizer.backend_tokenizer.save(str(output_dir / TOKENIZER_FILE))

    try:
        extractor = WhisperFeatureExtractor.from_pretrained(str(model_dir_hf))
    except OSError:  # saved without a processor: Whisper's defaults for this mel count
        extractor = WhisperFeatureExtractor(feature_size=hf_config["num_mel_bins"])
    extractor.to_json_file(str(output_dir / PREPROCESSOR_FILE))

    # The converter writes null for suppress lists the generation config lacks, and takes
    # lang_ids (which language detection needs) from the generation config or the tokenizer's
    # special-token list, which transformers 5 renamed: fill in what is missing.
    ct2_config_file = output_dir / MODEL_CONFIG
    ct2_config = json.loads(ct2_config_file.read_text())
    for key in ("suppress_ids", "suppress_ids_begin"):
        ct2_config[key] = ct2_config.get(key) or []
    if hf_config["vocab_size"] >= MULTILINGUAL_MIN_VOCAB and not ct2_config.get("lang_ids"):
        ct2_config["lang_ids"] = language_token_ids(tokenizer)
    ct2_config_file.write_text(json.dumps(ct2_config, indent=2))
    if (model_dir_hf / GENERATION_CONFIG_FILE).is_file():
        shutil.copyfile(model_dir_hf / GENERATION_CONFIG_FILE, output_dir / GENERATION_CONFIG_FILE)
    return output_dir
