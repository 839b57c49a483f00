"""The runtimes `transcribe` runs a model in, one class each: `transcribe(audio)` → (text,
timed segments), any length.

  * `TransformersBackend`: `WhisperForConditionalGeneration.generate` runs Whisper's own
    sequential long-form decoding on the un-truncated features (`longform`), for every model
    whisper-train reads into transformers;
  * `CTranslate2Backend`: faster-whisper (`faster_whisper.WhisperModel`, on CTranslate2; extra
    `whisper-train[faster-whisper]`), for a CTranslate2 folder: the fast path on a CPU, and the
    client users deploy with. Its
    `transcribe` walks long recordings 30 s window by window (seeking to the last closed
    timestamp, as OpenAI's `transcribe` does) and has the temperature fallback built in;
  * `WhisperCppBackend`: whisper.cpp (pywhispercpp, extra `whisper-train[whispercpp]`), for a
    `ggml-model.bin`: its own long-form loop and temperature fallback (`temperature_inc`; its
    `entropy_thold` plays the compression-ratio test's part);
  * `OpenAIWhisperBackend`: openai-whisper (extra `whisper-train[openai]`), for a `model.pt`:
    its `transcribe()` with its fallback.

Which format each runs is a row of `formats.registry`; the three optional clients are imported
where a backend is made, so that this module loads without them.

Each decodes loop-proof (`decoding`): greedy (or beam search), and again at temperatures
0.2 ... 1.0 for a window whose text repeats itself (compression ratio over 2.4) or whose tokens
are unlikely (mean log-prob under -1.0); `--temperatures 0` turns that off. None conditions a
window on the previous window's text (faster-whisper's default does): that is how one window's
loop spreads to the next, and on our long-form check (40 s and 2 min of espeak-ng speech,
tiny.en) it cost words (WER 0.121 vs 0.101 at 40 s).
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np
import torch
from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

from whisper_train.audio import N_SAMPLES, SAMPLE_RATE
from whisper_train.data.features import content_frames
from whisper_train.data.labels import model_generate_language
from whisper_train.errors import UserError
from whisper_train.transcription.assistant import Assistant
from whisper_train.transcription.decoding import DecodingOptions, generate_decoded
from whisper_train.transcription.longform import decoded_segments, generate_long_form
from whisper_train.transcription.transcripts import Segment
from whisper_train.transcription.word_timestamps import (
    Word,
    alignment_heads_of,
    words_from_token_times,
)

# torch's warning for a std over one value (no degrees of freedom).
STD_WARNING = r"std\(\): degrees of freedom is <= 0"


def torch_device() -> str:
    """Where transformers and openai-whisper run: this machine's GPU, else its CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def set_language(model, language: str | None, task: str | None = None) -> None:
    """Point `generation_config` at `language`/`task` on multilingual models; None keeps the
    checkpoint's own setting (or language detection when it has none).

    English-only checkpoints take no language or task tokens (transformers refuses them).
    """
    config = model.generation_config
    if not getattr(config, "is_multilingual", False):
        return
    if language is not None:
        config.language = model_generate_language(language, config)
    if task is not None:
        config.task = task


class TransformersBackend:
    """`WhisperForConditionalGeneration.generate`, long-form on un-truncated features;
    `assistant` (`transcription.assistant`): speculative decoding, the model's greedy text."""

    def __init__(
        self,
        model,
        processor,
        *,
        language=None,
        task=None,
        beam_size=1,
        decoding: DecodingOptions | None = None,
        word_timestamps: bool = False,
        assistant: Assistant | None = None,
    ):
        self.model = model.eval()
        self.assistant = assistant
        self.processor = processor
        self.beam_size = beam_size
        self.decoding = DecodingOptions() if decoding is None else decoding
        self.word_timestamps = word_timestamps
        if word_timestamps:  # generate's DTW reads them there; the default where none are named
            model.generation_config.alignment_heads = alignment_heads_of(model)
        set_language(model, language, task)

    @torch.inference_mode()
    def transcribe(
        self, audio: np.ndarray, *, timestamps: bool = True
    ) -> tuple[str, list[Segment]]:
        """(n_samples,) float32 16 kHz audio → (text, segments); any length when `timestamps`."""
        if self.decoding.no_speech_threshold is not None and not np.any(audio):
            # Not one non-zero sample: no text, as a flat window gets in `generate_decoded` and
            # in the runtimes; transformers' long-form test keeps tiny.en's confident "you".
            return "", []
        weight = next(p for p in self.model.parameters() if p.is_floating_point())
        if not timestamps:
            features = self.processor.feature_extractor(
                audio[:N_SAMPLES], sampling_rate=SAMPLE_RATE, return_tensors="pt"
            ).input_features
            decoded = generate_decoded(
                self.model,
                {"input_features": features.to(weight.device, weight.dtype)},
                self.processor.tokenizer,
                max_length=None,
                num_beams=self.beam_size,
                options=self.decoding,
                content_frames=content_frames([audio[:N_SAMPLES]]),
                assistant=self.assistant,
            )
            text = decoded[0].text
            return text, [Segment(0.0, len(audio) / SAMPLE_RATE, text)] if text else []
        # The long-form decoding `evaluate` scores (evaluation.longform): one implementation.
        with warnings.catch_warnings():
            # transformers' token times normalise each head's weights by their std over the
            # tokens: a window of one token warns (and gives NaN, which `fit_into_segment`
            # times from its neighbours). A library's warning is no line of a transcript.
            warnings.filterwarnings("ignore", message=STD_WARNING, category=UserWarning)
            output = generate_long_form(
                self.model,
                self.processor,
                audio,
                beam_size=self.beam_size,
                decoding=self.decoding,
                word_timestamps=self.word_timestamps,
                assistant=self.assistant,
            )
        duration = len(audio) / SAMPLE_RATE
        segments = []
        for decoded in decoded_segments(output, self.processor.tokenizer):
            start, end = min(decoded.start, duration), min(decoded.end, duration)
            words = None
            if decoded.token_ends is not None:
                words = tuple(
                    words_from_token_times(
                        self.processor.tokenizer,
                        decoded.tokens,
                        decoded.token_ends,
                        start=start,
                        end=end,
                    )
                )
            segments.append(Segment(start, end, decoded.text, words))
        return " ".join(s.text for s in segments), segments


def faster_whisper_runtime():
    """The faster-whisper extra's modules, `ctranslate2` and `faster_whisper`, imported where a
    CTranslate2 model is written or run: whisper-train trains, evaluates and exports the other
    formats without them (`make setup` leaves out their 228 MiB, onnxruntime's included)."""
    try:
        import ctranslate2  # the faster-whisper extra
        import faster_whisper
    except ImportError:
        raise UserError(
            "faster-whisper (CTranslate2) is not installed: pip install "
            "'whisper-train[faster-whisper]'"
        ) from None
    return ctranslate2, faster_whisper


def ct2_device() -> str:
    ctranslate2, _ = faster_whisper_runtime()
    return "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"


class CTranslate2Backend:
    """faster-whisper's `WhisperModel` on a CTranslate2 folder: its long-form loop and fallback."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        language=None,
        task=None,
        beam_size=1,
        decoding: DecodingOptions | None = None,
        word_timestamps: bool = False,
        compute_type: str = "default",  # the format registry chooses it for the device
    ):
        model_dir = Path(model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            # faster-whisper would fetch openai/whisper-tiny's tokenizer from the hub instead.
            raise UserError(
                f"--model {model_dir}: a CTranslate2 folder needs its tokenizer.json beside "
                "model.bin (`whisper-train export --format ct2` writes one)"
            )
        self._ctranslate2, faster_whisper = faster_whisper_runtime()
        self.model = faster_whisper.WhisperModel(
            str(model_dir), device=ct2_device(), compute_type=compute_type
        )
        if not (model_dir / "preprocessor_config.json").exists():
            # Without it faster-whisper assumes 80 mel bins; large-v3 has 128.
            self.model.feature_extractor = faster_whisper.feature_extractor.FeatureExtractor(
                feature_size=self.model.model.n_mels
            )
        # Like transformers, default to the language/task the model was fine-tuned for.
        saved_language, saved_task = _saved_language_and_task(model_dir)
        self.language = language or saved_language  # None: detected on the first window
        self.task = task or saved_task or "transcribe"
        self.beam_size = beam_size
        self.decoding = DecodingOptions() if decoding is None else decoding
        self.word_timestamps = word_timestamps  # config.json's alignment_heads time them

    def transcribe(
        self, audio: np.ndarray, *, timestamps: bool = True
    ) -> tuple[str, list[Segment]]:
        """(n_samples,) float32 16 kHz audio → (text, segments); any length when `timestamps`."""
        duration = len(audio) / SAMPLE_RATE
        options = self.decoding
        self._ctranslate2.set_random_seed(options.seed)  # the fallback samples: repeatable runs
        found, _ = self.model.transcribe(
            np.ascontiguousarray(audio if timestamps else audio[:N_SAMPLES], dtype=np.float32),
            language=self.language,
            task=self.task,
            beam_size=self.beam_size,
            best_of=1,  # one sample per fallback temperature, as generate_decoded draws
            temperature=list(temperatures_tried(options)),
            compression_ratio_threshold=options.compression_ratio_threshold,
            log_prob_threshold=options.logprob_threshold,
            no_speech_threshold=options.no_speech_threshold,
            condition_on_previous_text=False,  # see the module docstring
            without_timestamps=not timestamps,
            word_timestamps=self.word_timestamps and timestamps,
            vad_filter=False,
        )
        found = list(found)
        if not timestamps:
            text = " ".join(s.text.strip() for s in found if s.text.strip())
            return text, [Segment(0.0, duration, text)] if text else []
        segments = [
            Segment(
                min(s.start, duration), min(s.end, duration), s.text.strip(), _words(s, duration)
            )
            for s in found
            if s.text.strip()
        ]
        return " ".join(s.text for s in segments), segments


def _words(segment, duration: float) -> tuple[Word, ...] | None:
    """A faster-whisper or openai-whisper segment's words (objects or dicts), or None."""
    found = (
        getattr(segment, "words", None) if not isinstance(segment, dict) else segment.get("words")
    )
    if found is None:
        return None
    fields = [w if isinstance(w, dict) else vars(w) for w in found]  # faster-whisper: objects
    return tuple(
        Word(f["word"], min(f["start"], duration), min(f["end"], duration), f.get("probability"))
        for f in fields
    )


class WhisperCppBackend:
    """whisper.cpp through pywhispercpp on a ggml-model.bin: its loop and temperature fallback.

    No word timestamps: whisper.cpp's DTW takes its heads at load, as a preset for OpenAI's
    models (or a custom list pywhispercpp 1.5.1 cannot pass), and a ggml file has no field to
    carry a fine-tuned model's heads (`load_backend` refuses --word-timestamps for it)."""

    def __init__(
        self,
        model_file: Path,
        *,
        language=None,
        task=None,
        beam_size=1,
        decoding=None,
    ):
        from pywhispercpp.model import Model  # the whispercpp extra

        logging.getLogger("pywhispercpp").setLevel(logging.WARNING)
        saved_language, saved_task = _saved_language_and_task(model_file.parent)
        self.language = language or saved_language or "auto"
        self.translate = (task or saved_task) == "translate"
        self.beam_size = beam_size
        self.decoding = DecodingOptions() if decoding is None else decoding
        self.model = Model(
            str(model_file),
            redirect_whispercpp_logs_to=None,
            print_progress=False,
            print_realtime=False,
        )

    def transcribe(self, audio: np.ndarray, *, timestamps: bool = True):
        options = self.decoding
        temperatures = temperatures_tried(options)
        step = temperatures[1] - temperatures[0] if len(temperatures) > 1 else 0.0
        params = {
            "language": self.language,
            "translate": self.translate,
            "no_context": True,  # see the module docstring
            "no_timestamps": not timestamps,
            "temperature": temperatures[0],
            "temperature_inc": step,
            "suppress_nst": True,  # openai-whisper's suppress_tokens="-1"
        }
        if options.compression_ratio_threshold is not None:
            params["entropy_thold"] = options.compression_ratio_threshold
        if options.logprob_threshold is not None:
            params["logprob_thold"] = options.logprob_threshold
        # A probability is never over 1: off. (pywhispercpp 1.5.1 marks it unimplemented.)
        params["no_speech_thold"] = (
            1.0 if options.no_speech_threshold is None else options.no_speech_threshold
        )
        if self.beam_size > 1:
            params["beam_search"] = {"beam_size": self.beam_size, "patience": -1.0}
        found = self.model.transcribe(np.ascontiguousarray(audio, dtype=np.float32), **params)
        duration = len(audio) / SAMPLE_RATE
        segments = [
            Segment(min(s.t0 / 100, duration), min(s.t1 / 100, duration), s.text.strip())
            for s in found
            if s.text.strip()
        ]
        return " ".join(s.text for s in segments), segments


class OpenAIWhisperBackend:
    """openai-whisper's `transcribe()` on a model.pt: its loop and temperature fallback."""

    def __init__(
        self,
        model_file: Path,
        *,
        language=None,
        task=None,
        beam_size=1,
        decoding=None,
        word_timestamps=False,
    ):
        import whisper  # the openai extra

        saved_language, saved_task = _saved_language_and_task(model_file.parent)
        self.device = torch_device()
        self.model = whisper.load_model(str(model_file), device=self.device)
        # load_model sets the heads only for OpenAI's named models; the export stores them.
        heads = torch.load(model_file, map_location="cpu", weights_only=True, mmap=True)
        if heads.get("alignment_heads"):
            self.model.set_alignment_heads(heads["alignment_heads"])
        self.word_timestamps = word_timestamps
        self.language = language or saved_language
        self.task = task or saved_task or "transcribe"
        self.beam_size = beam_size
        self.decoding = DecodingOptions() if decoding is None else decoding

    def transcribe(self, audio: np.ndarray, *, timestamps: bool = True):
        import whisper  # the openai extra

        options = self.decoding
        torch.manual_seed(options.seed)  # the fallback samples: repeatable runs
        result = whisper.transcribe(
            self.model,
            np.ascontiguousarray(audio, dtype=np.float32),
            language=self.language,
            task=self.task,
            temperature=tuple(temperatures_tried(options)),
            compression_ratio_threshold=options.compression_ratio_threshold,
            logprob_threshold=options.logprob_threshold,
            no_speech_threshold=options.no_speech_threshold,
            condition_on_previous_text=False,  # see the module docstring
            without_timestamps=not timestamps,
            word_timestamps=self.word_timestamps and timestamps,
            beam_size=self.beam_size if self.beam_size > 1 else None,
            fp16=self.device == "cuda",
            verbose=None,
        )
        duration = len(audio) / SAMPLE_RATE
        segments = [
            Segment(
                min(s["start"], duration),
                min(s["end"], duration),
                s["text"].strip(),
                _words(s, duration),
            )
            for s in result["segments"]
            if s["text"].strip()
        ]
        return " ".join(s.text for s in segments), segments


def _saved_language_and_task(model_dir: Path) -> tuple[str | None, str | None]:
    """generation_config.json's language (as a code: `en`) and task, when the folder has one."""
    config_file = model_dir / "generation_config.json"
    if not config_file.is_file():
        return None, None
    config = json.loads(config_file.read_text(encoding="utf-8"))
    language = config.get("language")
    if language:
        language = language.strip("<|>").lower()
        language = TO_LANGUAGE_CODE.get(language, language)
    return language or None, config.get("task")


def temperatures_tried(options: DecodingOptions) -> tuple[float, ...]:
    """The temperatures a runtime may decode at: the whole fallback ladder, or its first alone
    when the fallback is off."""
    return tuple(options.temperatures if options.fallback else options.temperatures[:1])
