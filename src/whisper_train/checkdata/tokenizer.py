"""The tokenizer check-data counts labels with: the `LabelEncoder` `train --model` builds, from
a `--model` spec (reading only the small files where they tell) or a bare Whisper tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import WhisperTokenizerFast

from whisper_train.config import DataConfig
from whisper_train.data.labels import LabelEncoder
from whisper_train.formats import ct2
from whisper_train.models import folder_is_multilingual, is_multilingual, load_model, model_folder

# check-data has no --language, --task or --timestamps: with a model, labels are counted as
# `train` counts them under its defaults for those options (a row's own language still wins);
# `check_data` takes them as arguments.
TRAIN_DEFAULTS = DataConfig()


def label_encoder_for(
    model: Any,
    *,
    language: str | None = TRAIN_DEFAULTS.language,
    task: str = TRAIN_DEFAULTS.task,
    timestamps: bool = TRAIN_DEFAULTS.timestamps,
) -> LabelEncoder:
    """The `LabelEncoder` that `train --model` builds, for counting labels as its screening does.

    `model`: a `--model` spec (its tokenizer and whether it is multilingual, as `load_model`
    and `is_multilingual` would say), or a bare Whisper tokenizer (multilingual when its
    vocabulary's size says so: there is no model to ask).
    """
    if isinstance(model, (str, Path)):
        tokenizer, multilingual = load_tokenizer(str(model))
    else:
        tokenizer, multilingual = model, ct2.is_multilingual_vocab(len(model))
    return LabelEncoder(
        tokenizer, language=language, task=task, timestamps=timestamps, multilingual=multilingual
    )


def load_tokenizer(spec: str) -> tuple[Any, bool]:
    """`--model`'s tokenizer and whether its model is multilingual, as `train` loads them, from
    the small files where they tell (no weights read), else from the loaded model (a hub id)."""
    folder = model_folder(spec)  # a whisper-train run folder: its final/ model
    multilingual = folder_is_multilingual(folder)
    tokenizer = None
    if ct2.is_ct2_model_dir(folder):
        vocab_size = ct2.vocabulary_size(folder)
        if vocab_size is not None:
            tokenizer = ct2.load_tokenizer(folder, vocab_size)  # as load_ct2_whisper reads it
    elif (folder / "tokenizer_config.json").is_file():
        tokenizer = WhisperTokenizerFast.from_pretrained(str(folder))
    elif (folder / "tokenizer.json").is_file():  # tokenizer.json alone
        tokenizer = WhisperTokenizerFast(
            tokenizer_file=str(folder / "tokenizer.json"), pad_token="<|endoftext|>"
        )
    if tokenizer is not None and multilingual is None and not (folder / "config.json").is_file():
        multilingual = ct2.is_multilingual_vocab(len(tokenizer))  # tokenizer files, no model to ask
    if tokenizer is None or multilingual is None:
        model, processor = load_model(spec)  # a hub id, or files that do not tell
        return processor.tokenizer, is_multilingual(model)
    return tokenizer, multilingual
