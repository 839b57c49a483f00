"""Transcribe recordings of any length to text, SRT, WebVTT or JSON.

Two backends, picked from `--model`:
  * CTranslate2 (`ctranslate2.models.Whisper`), for a CTranslate2 / faster-whisper folder when
    the ctranslate2 package imports: the fast path on a CPU. CTranslate2 decodes one 30 s
    window at a time, so long recordings are walked here, window by window (below).
  * transformers, for everything else: `generate` runs Whisper's own sequential long-form
    decoding on the un-truncated features (with their attention mask).

Long-form decoding, CTranslate2 backend (as OpenAI's `transcribe` does it): decode a 30 s
window with timestamp tokens, keep the segments it closes (`<|t0|> text <|t1|>`), and start
the next window at the last closing timestamp when the window's final words were cut off by
its end; otherwise move on by the whole window. Times are relative to the window, so the
window's start is added.

A file that cannot be read is reported and skipped; the others still get transcribed.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from whisper_train.audio import CHUNK_LENGTH, N_SAMPLES, SAMPLE_RATE, load_audio
from whisper_train.errors import UserError
from whisper_train.labels import TIME_PRECISION  # seconds per timestamp token

log = logging.getLogger(__name__)

FORMATS = ("txt", "srt", "vtt", "json")
AUDIO_EXTENSIONS = {".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aiff", ".aif"}
MANIFEST_EXTENSIONS = {".jsonl", ".json", ".csv", ".tsv"}
MIN_WINDOW_SECONDS = 0.2  # a shorter tail after the last window holds no words worth decoding


@dataclass(frozen=True)
class Segment:
    start: float  # seconds from the start of the recording
    end: float
    text: str


@dataclass
class Transcript:
    """One recording: its text and timed segments, or the reason it failed (`error`)."""

    source: str
    name: str  # output file stem
    text: str = ""
    segments: list[Segment] = field(default_factory=list)
    error: str | None = None


# -- subtitle writers -----------------------------------------------------------------------


def format_timestamp(seconds: float, *, decimal_marker: str = ".") -> str:
    """3.5 → '00:00:03.500' (SRT uses ',' as the decimal marker, WebVTT '.')."""
    milliseconds = max(0, round(seconds * 1000))
    hours, milliseconds = divmod(milliseconds, 3_600_000)
    minutes, milliseconds = divmod(milliseconds, 60_000)
    secs, milliseconds = divmod(milliseconds, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal_marker}{milliseconds:03d}"


def to_srt(segments: Sequence[Segment]) -> str:
    blocks = [
        f"{i}\n{format_timestamp(s.start, decimal_marker=',')} --> "
        f"{format_timestamp(s.end, decimal_marker=',')}\n{s.text}\n"
        for i, s in enumerate(segments, start=1)
    ]
    return "\n".join(blocks)


def to_vtt(segments: Sequence[Segment]) -> str:
    blocks = [
        f"{format_timestamp(s.start)} --> {format_timestamp(s.end)}\n{s.text}\n" for s in segments
    ]
    return "WEBVTT\n\n" + "\n".join(blocks)


def to_json(transcript: Transcript) -> str:
    payload = {
        "audio": transcript.source,
        "text": transcript.text,
        "segments": [asdict(s) for s in transcript.segments],
    }
    return json.dumps(payload, indent=2, ensure_ascii=False) + "\n"


def render(transcript: Transcript, output_format: str) -> str:
    if output_format == "srt":
        return to_srt(transcript.segments)
    if output_format == "vtt":
        return to_vtt(transcript.segments)
    if output_format == "json":
        return to_json(transcript)
    return transcript.text + "\n"


# -- timestamp tokens → segments ------------------------------------------------------------


@dataclass
class WindowSegments:
    """What one 30 s window's tokens say: closed segments, trailing words, and whether the
    model stopped mid-speech (words or a fresh timestamp left open at the window's end)."""

    closed: list[Segment]
    open_segment: Segment | None
    unfinished: bool


def segments_from_tokens(
    tokens: Sequence[int], tokenizer, *, timestamp_begin: int, offset: float = 0.0
) -> WindowSegments:
    """Generated tokens of one window (prompt excluded) → its segments, times + `offset`.

    `<|t0|> words <|t1|>` closes a segment. Words with no closing timestamp (a model that lost
    its timestamps, or speech running past the window) become the open segment, ending at the
    window's end. Ending on two timestamps in a row (`<|t1|><|t1|>`) means the model opened a
    segment it could not fill: the speech after t1 was cut by the window, as in OpenAI's
    `transcribe`.
    """
    closed: list[Segment] = []
    start = 0.0
    words: list[int] = []
    eot = tokenizer.eos_token_id
    previous_was_timestamp = ended_on_pair = False
    for token in tokens:
        if token >= timestamp_begin:
            time = (token - timestamp_begin) * TIME_PRECISION
            text = tokenizer.decode(words).strip()
            if text:
                closed.append(Segment(offset + start, offset + time, text))
            ended_on_pair = previous_was_timestamp
            words, start, previous_was_timestamp = [], time, True
        elif token == eot:
            break
        elif token < eot:
            words.append(token)
            previous_was_timestamp = ended_on_pair = False
    text = tokenizer.decode(words).strip()
    open_segment = Segment(offset + start, offset + CHUNK_LENGTH, text) if text else None
    return WindowSegments(closed, open_segment, unfinished=bool(text) or ended_on_pair)


# -- backends -------------------------------------------------------------------------------


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class TransformersBackend:
    """`WhisperForConditionalGeneration.generate`, long-form on un-truncated features."""

    def __init__(self, model, processor, *, language=None, task=None, beam_size=1):
        from whisper_train.evaluate import set_language

        self.model = model.eval()
        self.processor = processor
        self.beam_size = beam_size
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
            ids = self.model.generate(
                input_features=features.to(weight.device, weight.dtype), num_beams=self.beam_size
            )
            text = self.processor.batch_decode(ids, skip_special_tokens=True)[0].strip()
            return text, [Segment(0.0, len(audio) / SAMPLE_RATE, text)] if text else []
        # Un-truncated features + attention mask switch generate into sequential long-form
        # decoding for recordings over 30 s; shorter ones are padded to the 30 s window.
        inputs = self.processor.feature_extractor(
            audio,
            sampling_rate=SAMPLE_RATE,
            return_tensors="pt",
            truncation=False,
            padding="longest" if len(audio) > N_SAMPLES else "max_length",
            return_attention_mask=True,
        )
        output = self.model.generate(
            input_features=inputs.input_features.to(weight.device, weight.dtype),
            attention_mask=inputs.attention_mask.to(weight.device),
            return_timestamps=True,
            return_segments=True,
            num_beams=self.beam_size,
        )
        duration = len(audio) / SAMPLE_RATE
        tokenizer = self.processor.tokenizer
        segments = []
        for raw in output["segments"][0]:
            words = [t for t in raw["tokens"].tolist() if t < tokenizer.eos_token_id]
            text = tokenizer.decode(words).strip()
            if text:
                start, end = float(raw["start"]), float(raw["end"])
                segments.append(Segment(min(start, duration), min(end, duration), text))
        return " ".join(s.text for s in segments), segments


class CTranslate2Backend:
    """`ctranslate2.models.Whisper` on a CTranslate2 folder, decoded window by window."""

    def __init__(self, model_dir: str | Path, *, language=None, task=None, beam_size=1):
        import ctranslate2
        from transformers import WhisperFeatureExtractor, WhisperTokenizerFast

        from whisper_train.features import LogMel

        model_dir = Path(model_dir)
        device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
        self.model = ctranslate2.models.Whisper(str(model_dir), device=device)
        self.tokenizer = WhisperTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
        if (model_dir / "preprocessor_config.json").exists():
            extractor = WhisperFeatureExtractor.from_pretrained(str(model_dir))
        else:
            extractor = WhisperFeatureExtractor(feature_size=self.model.n_mels)
        self.log_mel = LogMel(extractor)
        # Like transformers, default to the language/task the model was fine-tuned for.
        saved_language, saved_task = _saved_language_and_task(model_dir)
        self.language = language or saved_language
        self.task = task or saved_task or "transcribe"
        self.beam_size = beam_size
        self._recording_language = self.language
        self.timestamp_begin = self.tokenizer.convert_tokens_to_ids("<|notimestamps|>") + 1

    def _features(self, window: np.ndarray):
        import ctranslate2

        mel = self.log_mel([window]).numpy()  # (1, n_mels, 3000)
        return ctranslate2.StorageView.from_array(np.ascontiguousarray(mel, dtype=np.float32))

    def _prompt(self, features, *, timestamps: bool) -> list[str]:
        prompt = ["<|startoftranscript|>"]
        if self.model.is_multilingual:
            if self._recording_language is None:
                # Detected on the recording's first window, then kept for all its windows.
                token = self.model.detect_language(features)[0][0][0]
                self._recording_language = token.strip("<|>")
            prompt += [f"<|{self._recording_language}|>", f"<|{self.task}|>"]
        if not timestamps:
            prompt.append("<|notimestamps|>")
        return prompt

    def _decode(self, window: np.ndarray, *, timestamps: bool) -> list[int]:
        features = self._features(window)
        result = self.model.generate(
            features, [self._prompt(features, timestamps=timestamps)], beam_size=self.beam_size
        )[0]
        return result.sequences_ids[0]

    def transcribe(
        self, audio: np.ndarray, *, timestamps: bool = True
    ) -> tuple[str, list[Segment]]:
        """(n_samples,) float32 16 kHz audio → (text, segments); any length when `timestamps`."""
        duration = len(audio) / SAMPLE_RATE
        self._recording_language = self.language
        if not timestamps:
            tokens = self._decode(audio[:N_SAMPLES], timestamps=False)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True).strip()
            return text, [Segment(0.0, duration, text)] if text else []
        segments: list[Segment] = []
        seek = 0  # first sample of the current window
        while len(audio) - seek >= MIN_WINDOW_SECONDS * SAMPLE_RATE:
            window = audio[seek : seek + N_SAMPLES]
            tokens = self._decode(window, timestamps=True)
            parsed = segments_from_tokens(
                tokens,
                self.tokenizer,
                timestamp_begin=self.timestamp_begin,
                offset=seek / SAMPLE_RATE,
            )
            if parsed.unfinished and len(window) == N_SAMPLES and parsed.closed:
                # Speech ran into the window's end: decode it again from the last closed segment.
                found = parsed.closed
                advance = round(parsed.closed[-1].end * SAMPLE_RATE) - seek
            else:
                found = parsed.closed + ([parsed.open_segment] if parsed.open_segment else [])
                advance = len(window)
            segments += [
                Segment(min(s.start, duration), min(s.end, duration), s.text) for s in found
            ]
            seek += advance if advance > 0 else len(window)
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


def is_ct2_dir(path: Path) -> bool:
    return (path / "model.bin").is_file() and (path / "config.json").is_file()


def load_backend(model, *, language=None, task=None, beam_size=1):
    """`model`: a spec string (folder, hub id, tiny.en) or a (model, processor) pair."""
    if isinstance(model, tuple):
        return TransformersBackend(*model, language=language, task=task, beam_size=beam_size)
    from whisper_train.models import load_model, model_folder

    path = model_folder(str(model))
    if is_ct2_dir(path):
        try:
            import ctranslate2  # noqa: F401
        except ImportError:
            log.info("ctranslate2 is not installed: reading %s into transformers", path)
        else:
            return CTranslate2Backend(path, language=language, task=task, beam_size=beam_size)
    hf_model, processor = load_model(str(model))
    return TransformersBackend(
        hf_model.to(_device()), processor, language=language, task=task, beam_size=beam_size
    )


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
    from whisper_train.data import load_examples

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
) -> list[Transcript]:
    """Transcribe every recording in `inputs`; write `<output_dir>/<name>.<format>` per file.

    `model` is a spec (`--model`) or a (model, processor) pair. Recordings that fail carry an
    `error` and are skipped; the rest are still transcribed.
    """
    from tqdm.auto import tqdm

    if format not in FORMATS:
        raise UserError(f"--format {format}: expected one of {', '.join(FORMATS)}")
    if beam_size < 1:
        raise UserError(f"--beam-size {beam_size}: must be at least 1")
    recordings = collect_inputs(inputs)
    if not recordings:
        raise UserError("no inputs given; pass audio files, folders or a manifest")
    backend = load_backend(model, language=language, task=task, beam_size=beam_size)
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
