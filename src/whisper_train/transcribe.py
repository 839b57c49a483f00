"""Transcribe recordings of any length to text, SRT, WebVTT or JSON.

Four backends, picked from `--model`, each the runtime the model's format is deployed with:
  * faster-whisper (`faster_whisper.WhisperModel`, on CTranslate2), for a CTranslate2 folder:
    the fast path on a CPU, and the client users deploy with. Its `transcribe` walks long
    recordings 30 s window by window (seeking to the last closed timestamp, as OpenAI's
    `transcribe` does) and has the temperature fallback built in.
  * whisper.cpp (pywhispercpp, extra `whisper-train[whispercpp]`), for a `ggml-model.bin` or its
    folder: its own long-form loop and temperature fallback (`temperature_inc`; its
    `entropy_thold` plays the compression-ratio test's part);
  * openai-whisper (extra `whisper-train[openai]`), for a `model.pt` or its folder: its
    `transcribe()` with its fallback;
  * transformers, for everything else: `generate` runs Whisper's own sequential long-form
    decoding on the un-truncated features (with their attention mask).

Both decode loop-proof (whisper_train.decoding): greedy (or beam search), and again at
temperatures 0.2 ... 1.0 for a window whose text repeats itself (compression ratio over 2.4)
or whose tokens are unlikely (mean log-prob under -1.0); `--temperatures 0` turns that off.
Neither conditions a window on the previous window's text (faster-whisper's default does):
that is how one window's loop spreads to the next, and on our long-form check (40 s and 2 min of
espeak-ng speech, tiny.en) it cost words (WER 0.121 vs 0.101 at 40 s).

A file that cannot be read is reported and skipped; the others still get transcribed.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from whisper_train.audio import AUDIO_SUFFIXES, N_SAMPLES, SAMPLE_RATE, load_audio
from whisper_train.decoding import DecodingOptions, generate_decoded
from whisper_train.errors import UserError
from whisper_train.evaluation.longform import decoded_segments, generate_long_form

# The transcript files moved to transcripts.py; their names are still imported from here.
from whisper_train.transcripts import (  # noqa: F401
    FORMATS,
    Segment,
    Transcript,
    format_timestamp,
    render,
    to_json,
    to_srt,
    to_vtt,
)
from whisper_train.word_timestamps import Word, alignment_heads_of, words_from_token_times

log = logging.getLogger(__name__)

AUDIO_EXTENSIONS = set(AUDIO_SUFFIXES)
MANIFEST_EXTENSIONS = {".jsonl", ".json", ".csv", ".tsv"}


# -- backends -------------------------------------------------------------------------------


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class TransformersBackend:
    """`WhisperForConditionalGeneration.generate`, long-form on un-truncated features."""

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
    ):
        from whisper_train.evaluation.generation import set_language

        self.model = model.eval()
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
            )
            text = decoded[0].text
            return text, [Segment(0.0, len(audio) / SAMPLE_RATE, text)] if text else []
        # The long-form decoding `evaluate` scores (evaluation.longform): one implementation.
        output = generate_long_form(
            self.model,
            self.processor,
            audio,
            beam_size=self.beam_size,
            decoding=self.decoding,
            word_timestamps=self.word_timestamps,
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
    ):
        import ctranslate2
        from faster_whisper import WhisperModel

        model_dir = Path(model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            # faster-whisper would fetch openai/whisper-tiny's tokenizer from the hub instead.
            raise UserError(
                f"--model {model_dir}: a CTranslate2 folder needs its tokenizer.json beside "
                "model.bin (`whisper-train export --format ct2` writes one)"
            )
        device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
        self.model = WhisperModel(str(model_dir), device=device)
        if not (model_dir / "preprocessor_config.json").exists():
            # Without it faster-whisper assumes 80 mel bins; large-v3 has 128.
            from faster_whisper.feature_extractor import FeatureExtractor

            self.model.feature_extractor = FeatureExtractor(feature_size=self.model.model.n_mels)
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
        import ctranslate2

        duration = len(audio) / SAMPLE_RATE
        options = self.decoding
        ctranslate2.set_random_seed(options.seed)  # the fallback samples: repeatable runs
        found, _ = self.model.transcribe(
            np.ascontiguousarray(audio if timestamps else audio[:N_SAMPLES], dtype=np.float32),
            language=self.language,
            task=self.task,
            beam_size=self.beam_size,
            best_of=1,  # one sample per fallback temperature, as generate_decoded draws
            temperature=list(
                options.temperatures if options.fallback else options.temperatures[:1]
            ),
            compression_ratio_threshold=options.compression_ratio_threshold,
            log_prob_threshold=options.logprob_threshold,
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
    """whisper.cpp through pywhispercpp on a ggml-model.bin: its loop and temperature fallback."""

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
        from whisper_train.deploy.runtimes import require_client

        if word_timestamps:
            # whisper.cpp's DTW takes its heads at load as a preset for OpenAI's models (or a
            # custom list pywhispercpp 1.5.1 cannot pass); a ggml file has no field to carry
            # a fine-tuned model's heads.
            raise UserError(
                f"--word-timestamps: not available for whisper.cpp models ({model_file}); "
                "export the model with --format ct2 (faster-whisper), openai or hf instead"
            )

        require_client("ggml")
        from pywhispercpp.model import Model

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
        temperatures = options.temperatures if options.fallback else options.temperatures[:1]
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
        from whisper_train.deploy.runtimes import require_client

        require_client("openai")
        import whisper

        saved_language, saved_task = _saved_language_and_task(model_file.parent)
        self.device = _device()
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
        import whisper

        options = self.decoding
        torch.manual_seed(options.seed)  # the fallback samples: repeatable runs
        result = whisper.transcribe(
            self.model,
            np.ascontiguousarray(audio, dtype=np.float32),
            language=self.language,
            task=self.task,
            temperature=tuple(
                options.temperatures if options.fallback else options.temperatures[:1]
            ),
            compression_ratio_threshold=options.compression_ratio_threshold,
            logprob_threshold=options.logprob_threshold,
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
        from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

        language = language.strip("<|>").lower()
        language = TO_LANGUAGE_CODE.get(language, language)
    return language or None, config.get("task")


def _runtime_file(path: Path) -> Path | None:
    """The ggml-model.bin or model.pt that `path` is or holds, else None."""
    from whisper_train.formats import ggml
    from whisper_train.formats import openai as openai_whisper

    if path.is_file() and path.suffix in (".bin", ".pt"):
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        for name in (ggml.MODEL_FILE, openai_whisper.MODEL_FILE):
            if (path / name).is_file():
                return path / name
    return None


def is_ct2_dir(path: Path) -> bool:
    return (path / "model.bin").is_file() and (path / "config.json").is_file()


def load_backend(
    model, *, language=None, task=None, beam_size=1, decoding=None, word_timestamps=False
):
    """`model`: a spec string (folder, hub id, tiny.en) or a (model, processor) pair.

    `decoding`: the temperature fallback (whisper_train.decoding; None: on, openai-whisper's
    defaults); `word_timestamps`: segments carry their words' times (not for whisper.cpp)."""
    options = {"language": language, "task": task, "beam_size": beam_size, "decoding": decoding}
    options["word_timestamps"] = word_timestamps
    if isinstance(model, tuple):
        return TransformersBackend(*model, **options)
    from whisper_train.models import load_model, model_folder

    path = model_folder(str(model))
    runtime_file = _runtime_file(path)
    if runtime_file is not None:
        backend = WhisperCppBackend if runtime_file.suffix == ".bin" else OpenAIWhisperBackend
        return backend(runtime_file, **options)
    if is_ct2_dir(path):
        try:
            import faster_whisper  # noqa: F401
        except ImportError:
            log.info("faster-whisper is not installed: reading %s into transformers", path)
        else:
            return CTranslate2Backend(path, **options)
    hf_model, processor = load_model(str(model))
    return TransformersBackend(hf_model.to(_device()), processor, **options)


# -- inputs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Input:
    path: str
    name: str
    start: float | None = None
    end: float | None = None
    problem: str | None = None  # set when the input itself is unusable


def collect_inputs(inputs: Sequence[str | Path]) -> list[_Input]:
    """Files, folders (searched for audio files) and manifests → recordings to transcribe."""
    from whisper_train.data.layouts import load_examples

    found: list[_Input] = []
    for item in map(Path, inputs):
        if item.is_dir():
            files = sorted(p for p in item.rglob("*") if p.suffix.lower() in AUDIO_EXTENSIONS)
            if not files:
                found.append(_Input(str(item), item.name, problem="no audio files in this folder"))
            found += [_Input(str(p), p.stem) for p in files]
        elif item.suffix.lower() in MANIFEST_EXTENSIONS and item.is_file():
            for example in load_examples(item):
                name = Path(example.audio).stem
                if example.start is not None or example.end is not None:
                    name += f"_{example.start or 0:.2f}-{example.end or 0:.2f}"
                found.append(_Input(example.audio, name, example.start, example.end))
        elif not item.exists():
            found.append(_Input(str(item), item.stem, problem="no such file or folder"))
        else:
            found.append(_Input(str(item), item.stem))
    # Two recordings with the same file name must not overwrite each other's transcript.
    seen: dict[str, int] = {}
    unique = []
    for entry in found:
        count = seen.get(entry.name, 0)
        seen[entry.name] = count + 1
        unique.append(
            entry if count == 0 else _Input(**{**asdict(entry), "name": f"{entry.name}-{count}"})
        )
    return unique


# -- the library entry point ----------------------------------------------------------------


def transcribe_paths(
    model,
    inputs: Sequence[str | Path],
    *,
    format: str = "txt",
    language: str | None = None,
    task: str | None = None,
    beam_size: int = 1,
    output_dir: str | Path | None = None,
    progress: bool = True,
    decoding: DecodingOptions | None = None,
    word_timestamps: bool = False,
) -> list[Transcript]:
    """Transcribe every recording in `inputs`; write `<output_dir>/<name>.<format>` per file.

    `model` is a spec (`--model`) or a (model, processor) pair. Recordings that fail carry an
    `error` and are skipped; the rest are still transcribed. `decoding`: the temperature
    fallback (None: on, with openai-whisper's defaults; `NO_FALLBACK`: greedy only).
    `word_timestamps`: each segment gets its words' times (json: `words`; srt/vtt: each word
    underlined while spoken), from the model's alignment heads.
    """
    from tqdm.auto import tqdm

    if format not in FORMATS:
        raise UserError(f"--format {format}: expected one of {', '.join(FORMATS)}")
    if beam_size < 1:
        raise UserError(f"--beam-size {beam_size}: must be at least 1")
    recordings = collect_inputs(inputs)
    if not recordings:
        raise UserError("no inputs given; pass audio files, folders or a manifest")
    backend = load_backend(
        model,
        language=language,
        task=task,
        beam_size=beam_size,
        decoding=decoding,
        word_timestamps=word_timestamps,
    )
    if output_dir is not None:
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
    results = []
    from whisper_train.runlog import progress_bars_wanted

    show_bar = progress and progress_bars_wanted()
    bar = tqdm(recordings, desc="transcribe", unit="file", disable=not show_bar)
    for entry in bar:
        transcript = Transcript(source=entry.path, name=entry.name)
        if entry.problem:
            transcript.error = entry.problem
        else:
            try:
                audio = load_audio(entry.path, start=entry.start, end=entry.end)
                transcript.text, transcript.segments = backend.transcribe(audio)
            except UserError as exc:  # AudioError included
                transcript.error = str(exc)
        if transcript.error:
            bar.write(f"skipped {entry.path}: {transcript.error}", file=sys.stderr)
        elif output_dir is not None:
            target = output_dir / f"{entry.name}.{format}"
            target.write_text(render(transcript, format), encoding="utf-8")
        results.append(transcript)
    return results
