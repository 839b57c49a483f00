"""Each runtime people deploy Whisper with, decoding a model all the same way, for the export check.

    transformers     `generate`                                  (whisper-train itself)
    faster-whisper   on CTranslate2                              (extra: whisper-train[faster-whisper])
    whisper.cpp      through pywhispercpp                        (extra: whisper-train[whispercpp])
    openai-whisper   `decode`                                    (extra: whisper-train[openai])

`formats.registry` names each format's pair: its runtime's greedy transcripts
(`*_greedy`) and teacher-forced scores (`*_scores`) of what it loads (the export folder, or the
one file whisper.cpp and openai-whisper load); the source's side is transformers'.

The export check compares the source model and its export utterance by utterance, so both
must decode the same way, whatever each runtime's defaults: greedy (temperature 0, one
candidate, no fallback), no timestamps, no previous text, one 30 s window, the same language
token forced (none for English-only models), the non-speech tokens suppressed and a blank or
<|endoftext|> suppressed as the first token (what the source's generation config says for
OpenAI's checkpoints, and each runtime's `suppress_blank` / `suppress_tokens=-1`). Words still
differ now and then where two tokens are nearly tied, so the check's verdict rests on the
teacher-forced scores below (`*_scores`); the greedy transcripts are reported beside them.
The three optional clients are imported where they run, so that this module loads without them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from whisper_train.audio import N_SAMPLES, SAMPLE_RATE
from whisper_train.data.labels import model_generate_language
from whisper_train.errors import UserError
from whisper_train.formats import ct2
from whisper_train.formats.hf import load_hf, refuse_nonfinite_weights
from whisper_train.transcription.backends import ct2_device, faster_whisper_runtime


class MissingRuntimeError(UserError):
    """A runtime's Python client is not installed."""


def _window(audio: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(audio[:N_SAMPLES], dtype=np.float32)


@torch.inference_mode()
def transformers_greedy(model, processor, clips: Sequence[np.ndarray], language: str | None):
    """transformers' greedy transcripts of each clip's first 30 s (the source's side).
    `language`: the one forced (None: an English-only model, which takes no language token)."""
    weight = next(p for p in model.parameters() if p.is_floating_point())
    options: dict = {"return_timestamps": False, "num_beams": 1, "do_sample": False}
    if language is not None:
        language = model_generate_language(language, model.generation_config)
        options.update(language=language, task="transcribe")
    texts = []
    for audio in clips:
        features = processor.feature_extractor(
            _window(audio), sampling_rate=SAMPLE_RATE, return_tensors="pt"
        ).input_features.to(weight.device, weight.dtype)
        ids = model.generate(input_features=features, **options)
        texts.append(processor.tokenizer.decode(ids[0], skip_special_tokens=True).strip())
    return texts


def transformers_greedy_tokens(model, processor, clips, language: str | None):
    """(texts, text token ids per clip) of `transformers_greedy`: the tokens the export check
    has each runtime score. `language` as `transformers_greedy` takes it."""
    weight = next(p for p in model.parameters() if p.is_floating_point())
    eot = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    options: dict = {"return_timestamps": False, "num_beams": 1, "do_sample": False}
    if language is not None:
        language = model_generate_language(language, model.generation_config)
        options.update(language=language, task="transcribe")
    texts, tokens = [], []
    with torch.inference_mode():
        for audio in clips:
            features = processor.feature_extractor(
                _window(audio), sampling_rate=SAMPLE_RATE, return_tensors="pt"
            ).input_features.to(weight.device, weight.dtype)
            ids = model.generate(input_features=features, **options)[0].tolist()
            texts.append(processor.tokenizer.decode(ids, skip_special_tokens=True).strip())
            # Text tokens are the ids below <|endoftext|>; the prompt and <|eot|> are above.
            tokens.append([token for token in ids if token < eot])
    return texts, tokens


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def ct2_compute_type(model_dir: str | Path, device: str | None = None) -> str:
    """The compute type to run `model_dir` in on `device` (this machine's by default): its
    weights' stored type (int8 matrices with float16 others: int8_float16) where the device
    computes it, else the type CTranslate2 falls back to (a CPU computes float16 in float32).
    Chosen here, not by CTranslate2, which warns on every load of a float16 model on a CPU."""
    stored = ct2.weight_dtypes(model_dir)
    floats = [name for dtype, name in _FLOAT_NAMES if dtype in stored] or ["float32"]
    chosen = f"int8_{floats[0]}" if torch.int8 in stored else floats[0]
    ctranslate2, _ = faster_whisper_runtime()
    if chosen not in ctranslate2.get_supported_compute_types(device or ct2_device()):
        chosen = "int8_float32" if torch.int8 in stored else "float32"
    return chosen


# The float types a model.bin stores, named as CTranslate2 names compute types; the narrowest
# that holds any weight is the model's.
_FLOAT_NAMES = (
    (torch.float16, "float16"),
    (torch.bfloat16, "bfloat16"),
    (torch.float32, "float32"),
)


def _faster_whisper(model_dir: Path):
    _, faster_whisper = faster_whisper_runtime()
    return faster_whisper.WhisperModel(
        str(model_dir),
        device=ct2_device(),
        compute_type=ct2_compute_type(model_dir),
        cpu_threads=_threads(),
    )


def faster_whisper_greedy(model_dir: Path, clips, language: str | None) -> list[str]:
    logging.getLogger("faster_whisper").setLevel(logging.WARNING)  # a line per clip otherwise
    model = _faster_whisper(model_dir)
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
    from pywhispercpp.model import Model  # the whispercpp extra

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
    import whisper  # the openai extra

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


def _load_hf_export(folder: Path):
    """An hf export, read as `whisper-train --model` reads it, where the check runs it."""
    model, processor = load_hf(folder)
    refuse_nonfinite_weights(model, str(folder))
    return (model.to("cuda") if torch.cuda.is_available() else model), processor


def transformers_export_greedy(folder: Path, clips, language: str | None) -> list[str]:
    """The hf export at `folder`, greedy in transformers, as the source is."""
    model, processor = _load_hf_export(folder)
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


# -- teacher-forced scoring: the export check's verdict ------------------------------------
#
# Each runtime scores the source's own transcript tokens (teacher forcing: the same tokens fed
# in, whatever the runtime would have chosen), from its own log-mel of the same 30 s window.
# Two runtimes then disagree only by their arithmetic and the export's precision, never by a
# near-tied word tipping a greedy decoder onto another path; a broken file (a wrong or
# transposed tensor, wrong mel filters, wrong dims) moves every log-probability.


@dataclass
class TokenScores:
    """One clip as a runtime sees the source's tokens."""

    logprobs: np.ndarray  # log p(token | audio, previous tokens), per text token
    text: str  # the tokens turned into text by the runtime's own vocabulary


def prompt_ids(tokenizer, multilingual: bool, language: str | None) -> list[int]:
    """The decoder prompt of a greedy transcript without timestamps:
    <|sot|> [<|lang|> <|transcribe|>] <|notimestamps|>."""
    ids = tokenizer.convert_tokens_to_ids
    prompt = [ids("<|startoftranscript|>")]
    if multilingual:
        prompt += [ids(f"<|{language or 'en'}|>"), ids("<|transcribe|>")]
    return [*prompt, ids("<|notimestamps|>")]


def _padded(audio: np.ndarray) -> np.ndarray:
    """The first 30 s, zero-padded to 30 s: each runtime computes its log-mel of the same samples."""
    window = _window(audio)
    return np.pad(window, (0, N_SAMPLES - len(window)))


def _log_softmax_at(logits: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """log_softmax(logits[i])[targets[i]] for each row, in float64."""
    logits = np.asarray(logits, dtype=np.float64)
    top = logits.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(logits - top).sum(axis=-1)) + top[:, 0]
    return logits[np.arange(len(targets)), list(targets)] - log_norm


@torch.inference_mode()
def transformers_scores(model, processor, clips, prompt: list[int], tokens: list[list[int]]):
    """Teacher-forced scores of `tokens` (per clip, text tokens only) in transformers."""
    weight = next(p for p in model.parameters() if p.is_floating_point())
    eot = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    scores = []
    for audio, text_tokens in zip(clips, tokens, strict=True):
        features = processor.feature_extractor(
            _padded(audio), sampling_rate=SAMPLE_RATE, return_tensors="pt"
        ).input_features.to(weight.device, weight.dtype)
        decoder_ids = torch.tensor([prompt + text_tokens], device=weight.device)
        logits = model(input_features=features, decoder_input_ids=decoder_ids).logits[0]
        rows = logits[len(prompt) - 1 : -1, :eot].float().cpu().numpy()
        scores.append(
            TokenScores(
                _log_softmax_at(rows, text_tokens),
                processor.tokenizer.decode(text_tokens, skip_special_tokens=True).strip(),
            )
        )
    return scores


def faster_whisper_scores(model_dir: Path, clips, prompt, tokens) -> list[TokenScores]:
    """CTranslate2's `Whisper.align` scores the text tokens (and <|eot|>) after `prompt`, on
    faster-whisper's log-mel computed with the folder's preprocessor_config.json."""
    model = _faster_whisper(model_dir)
    frames = N_SAMPLES // model.feature_extractor.hop_length
    scores = []
    for audio, text_tokens in zip(clips, tokens, strict=True):
        features = model.feature_extractor(_padded(audio))[:, :frames]
        encoded = model.encode(features)
        # align appends <|notimestamps|> to the start sequence itself (openai-whisper's
        # timing.find_alignment) and normalises over the text tokens only.
        (result,) = model.model.align(encoded, prompt[:-1], [text_tokens], frames)
        probs = np.asarray(result.text_token_probs, dtype=np.float64)
        scores.append(
            TokenScores(
                np.log(np.maximum(probs, 1e-30)), model.hf_tokenizer.decode(text_tokens).strip()
            )
        )
    return scores


def openai_whisper_scores(model_file: Path, clips, prompt, tokens) -> list[TokenScores]:
    """openai-whisper's own model forward on its own log-mel, its own tokenizer's text."""
    import whisper  # the openai extra
    from whisper.tokenizer import get_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = whisper.load_model(str(model_file), device=device)
    tokenizer = get_tokenizer(model.is_multilingual, num_languages=model.num_languages)
    eot = tokenizer.eot
    scores = []
    with torch.inference_mode():
        for audio, text_tokens in zip(clips, tokens, strict=True):
            mel = whisper.log_mel_spectrogram(
                torch.from_numpy(_padded(audio)), n_mels=model.dims.n_mels
            ).to(device)
            decoder_ids = torch.tensor([prompt + text_tokens], device=device)
            logits = model(mel[None], decoder_ids)[0]
            rows = logits[len(prompt) - 1 : -1, :eot].float().cpu().numpy()
            scores.append(
                TokenScores(
                    _log_softmax_at(rows, text_tokens), tokenizer.decode(text_tokens).strip()
                )
            )
    return scores


def _libwhisper():
    """whisper.cpp's own library as pywhispercpp ships it, through ctypes: pywhispercpp's
    bindings hand back one float of the logits, so teacher forcing calls the C API directly."""
    import _pywhispercpp  # the whispercpp extra; loads the library (and ggml's) into this process

    folder = Path(_pywhispercpp.__file__).parent
    candidates = sorted(folder.glob("pywhispercpp.libs/libwhisper*")) + sorted(
        folder.glob("pywhispercpp/.dylibs/libwhisper*")
    )
    path = str(candidates[0]) if candidates else ctypes.util.find_library("whisper")
    if path is None:
        raise MissingRuntimeError(
            "checking a ggml export needs whisper.cpp's library (libwhisper), which this "
            "pywhispercpp install does not ship: pip install 'whisper-train[whispercpp]' "
            "(pywhispercpp 1.5.1), or pass --no-check"
        )
    lib = ctypes.CDLL(path)
    c_int, c_void_p, c_float_p = ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float)
    signatures = {
        "whisper_init_from_file": ([ctypes.c_char_p], c_void_p),
        "whisper_free": ([c_void_p], None),
        "whisper_pcm_to_mel": ([c_void_p, c_float_p, c_int, c_int], c_int),
        "whisper_encode": ([c_void_p, c_int, c_int], c_int),
        "whisper_decode": ([c_void_p, ctypes.POINTER(ctypes.c_int32), c_int, c_int, c_int], c_int),
        "whisper_get_logits": ([c_void_p], c_float_p),
        "whisper_n_vocab": ([c_void_p], c_int),
        "whisper_token_to_str": ([c_void_p, c_int], ctypes.c_char_p),
        "whisper_token_eot": ([c_void_p], c_int),
    }
    for name, (arguments, result) in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = arguments, result
    return lib


def whisper_cpp_scores(model_file: Path, clips, prompt, tokens) -> list[TokenScores]:
    """whisper.cpp loads the file, computes its log-mel with the file's filters, encodes, then
    decodes the prompt and each token in turn (its KV cache), and turns the tokens into text
    with the file's vocabulary."""
    lib = _libwhisper()
    context = lib.whisper_init_from_file(str(model_file).encode())
    if not context:
        raise UserError(f"{model_file}: whisper.cpp could not load this file (see its log above)")
    threads = _threads()
    try:
        n_vocab = lib.whisper_n_vocab(context)
        eot = lib.whisper_token_eot(context)
        scores = []
        for audio, text_tokens in zip(clips, tokens, strict=True):
            samples = _padded(audio)
            pointer = samples.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            if lib.whisper_pcm_to_mel(context, pointer, len(samples), threads) != 0:
                raise UserError(f"{model_file}: whisper.cpp failed computing the log-mel")
            if lib.whisper_encode(context, 0, threads) != 0:
                raise UserError(f"{model_file}: whisper.cpp failed encoding")
            rows = []
            fed = [prompt, *[[token] for token in text_tokens[:-1]]]
            n_past = 0
            for chunk in fed:
                ids = (ctypes.c_int32 * len(chunk))(*chunk)
                if lib.whisper_decode(context, ids, len(chunk), n_past, threads) != 0:
                    raise UserError(f"{model_file}: whisper.cpp failed decoding")
                n_past += len(chunk)
                # The logits of the last token fed are the last row.
                logits = np.ctypeslib.as_array(
                    lib.whisper_get_logits(context), (len(chunk) * n_vocab,)
                )
                rows.append(
                    logits[(len(chunk) - 1) * n_vocab : (len(chunk) - 1) * n_vocab + eot].copy()
                )
            text = b"".join(lib.whisper_token_to_str(context, token) for token in text_tokens)
            scores.append(
                TokenScores(
                    _log_softmax_at(np.stack(rows), text_tokens),
                    text.decode("utf-8", errors="replace").strip(),
                )
            )
    finally:
        lib.whisper_free(context)
    return scores


def transformers_export_scores(folder: Path, clips, prompt, tokens) -> list[TokenScores]:
    """The hf export at `folder` scoring the source's tokens in transformers (teacher forced)."""
    model, processor = _load_hf_export(folder)
    return transformers_scores(model, processor, clips, prompt, tokens)
