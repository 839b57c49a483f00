"""Decode with each runtime people deploy Whisper with, all the same way, for the export check.

    hf      transformers' `generate`                       (whisper-train itself)
    ct2     faster-whisper on CTranslate2                  (dependency)
    ggml    whisper.cpp through pywhispercpp               (extra: whisper-train[whispercpp])
    openai  openai-whisper's `decode`                      (extra: whisper-train[openai])

The export check compares the source model and its export utterance by utterance, so both
must decode the same way, whatever each runtime's defaults: greedy (temperature 0, one
candidate, no fallback), no timestamps, no previous text, one 30 s window, the same language
token forced (none for English-only models), the non-speech tokens suppressed and a blank or
<|endoftext|> suppressed as the first token (what the source's generation config says for
OpenAI's checkpoints, and each runtime's `suppress_blank` / `suppress_tokens=-1`). Any word that
still differs is then the export's doing (precision, a broken conversion), not the decoder's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from whisper_train.audio import N_SAMPLES, SAMPLE_RATE
from whisper_train.errors import UserError

# The pip extra that installs each runtime's client.
EXTRAS = {"ggml": "whispercpp", "openai": "openai"}
RUNTIME_NAMES = {
    "hf": "transformers",
    "ct2": "faster-whisper",
    "ggml": "whisper.cpp (pywhispercpp)",
    "openai": "openai-whisper",
}


class MissingRuntimeError(UserError):
    """A runtime's Python client is not installed."""


def require_client(format: str) -> None:
    """One line naming the extra that installs `format`'s runtime client when it is missing."""
    module = {"ggml": "pywhispercpp", "openai": "whisper", "ct2": "faster_whisper"}.get(format)
    if module is None:
        return
    try:
        __import__(module)
    except ImportError:
        extra = EXTRAS.get(format)
        how = f"pip install 'whisper-train[{extra}]'" if extra else "pip install faster-whisper"
        raise MissingRuntimeError(
            f"--format {format}: checking the export needs {RUNTIME_NAMES[format]}, which is not "
            f"installed: {how} (or pass --no-check to only write the export)"
        ) from None


def _window(audio: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(audio[:N_SAMPLES], dtype=np.float32)


@torch.inference_mode()
def transformers_greedy(model, processor, clips: Sequence[np.ndarray], language: str | None):
    """transformers' greedy transcripts of each clip's first 30 s (the source's side)."""
    from whisper_train.models import is_multilingual

    weight = next(p for p in model.parameters() if p.is_floating_point())
    options: dict = {"return_timestamps": False, "num_beams": 1, "do_sample": False}
    if is_multilingual(model):
        options.update(language=language, task="transcribe")
    texts = []
    for audio in clips:
        features = processor.feature_extractor(
            _window(audio), sampling_rate=SAMPLE_RATE, return_tensors="pt"
        ).input_features.to(weight.device, weight.dtype)
        ids = model.generate(input_features=features, **options)
        texts.append(processor.tokenizer.decode(ids[0], skip_special_tokens=True).strip())
    return texts


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def faster_whisper_greedy(model_dir: Path, clips, language: str | None) -> list[str]:
    import ctranslate2
    from faster_whisper import WhisperModel

    logging.getLogger("faster_whisper").setLevel(logging.WARNING)  # a line per clip otherwise
    device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
    model = WhisperModel(str(model_dir), device=device, cpu_threads=_threads())
    texts = []
    for audio in clips:
        segments, _ = model.transcribe(
            _window(audio),
            language=language if model.model.is_multilingual else None,
            task="transcribe",
            beam_size=1,
            best_of=1,
            temperature=[0.0],
            compression_ratio_threshold=None,
            log_prob_threshold=None,
            no_speech_threshold=None,
            condition_on_previous_text=False,
            without_timestamps=True,
            suppress_blank=True,
            suppress_tokens=[-1],
            vad_filter=False,
        )
        texts.append(" ".join(s.text.strip() for s in segments).strip())
    return texts


def whisper_cpp_greedy(model_file: Path, clips, language: str | None) -> list[str]:
    from pywhispercpp.model import Model

    logging.getLogger("pywhispercpp").setLevel(logging.WARNING)  # a line per clip otherwise

    model = Model(
        str(model_file),
        n_threads=_threads(),
        redirect_whispercpp_logs_to=None,
        print_progress=False,
        print_realtime=False,
    )
    texts = []
    for audio in clips:
        segments = model.transcribe(
            _window(audio),
            language=language or "en",
            no_timestamps=True,
            single_segment=True,
            no_context=True,
            temperature=0.0,
            temperature_inc=0.0,  # no fallback
            suppress_blank=True,
            suppress_nst=True,  # openai-whisper's suppress_tokens="-1"; whisper.cpp's is off
        )
        texts.append(" ".join(s.text.strip() for s in segments).strip())
    del model  # free the context now, not at interpreter exit (pywhispercpp's __del__ then fails)
    return texts


def openai_whisper_greedy(model_file: Path, clips, language: str | None) -> list[str]:
    import whisper

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = whisper.load_model(str(model_file), device=device)
    options = whisper.DecodingOptions(
        task="transcribe",
        language=language if model.is_multilingual else "en",
        temperature=0.0,
        without_timestamps=True,
        fp16=device == "cuda",
    )
    texts = []
    for audio in clips:
        mel = whisper.log_mel_spectrogram(
            whisper.pad_or_trim(torch.from_numpy(_window(audio))), n_mels=model.dims.n_mels
        ).to(device)
        texts.append(whisper.decode(model, mel, options).text.strip())
    return texts


def runtime_greedy(format: str, output: Path, clips, language: str | None) -> list[str]:
    """The export at `output` decoded by its own runtime, the parity-check way."""
    require_client(format)
    if format == "ct2":
        return faster_whisper_greedy(output, clips, language)
    if format == "ggml":
        from whisper_train.ggml import MODEL_FILE

        return whisper_cpp_greedy(output / MODEL_FILE, clips, language)
    if format == "openai":
        from whisper_train.openai_whisper import MODEL_FILE

        return openai_whisper_greedy(output / MODEL_FILE, clips, language)
    from whisper_train.models import load_model

    model, processor = load_model(str(output))
    if torch.cuda.is_available():
        model = model.to("cuda")
    return transformers_greedy(model, processor, clips, language)


def detect_language(model, processor, audio: np.ndarray) -> str:
    """The source model's language for one clip (a code such as `en`)."""
    weight = next(p for p in model.parameters() if p.is_floating_point())
    features = processor.feature_extractor(
        _window(audio), sampling_rate=SAMPLE_RATE, return_tensors="pt"
    ).input_features.to(weight.device, weight.dtype)
    with torch.inference_mode():
        token_id = int(model.detect_language(input_features=features)[0])
    token = processor.tokenizer.convert_ids_to_tokens(token_id)
    return token.strip("<|>")
