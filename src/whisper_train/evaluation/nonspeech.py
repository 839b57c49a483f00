"""Text where nobody speaks: a model scored on a non-speech set (`data.nonspeech`).

Every reference is empty, so WER is undefined; what counts is what the model invents: words per
minute of audio (all words over all audio, so one clip's long loop weighs as it reads) and the
share of clips given any text at all. Words are runs of letters or digits, so a lone "." (what
some runtimes write on silence) is text on no clip. Decoded exactly as `evaluate` decodes
(`generation.generate_texts`: the fallback and the no-speech test of the decoding options;
clips over 30 s long-form, `transcription.longform`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from whisper_train.audio import N_SAMPLES, SAMPLE_RATE, load_audio
from whisper_train.config import require_positive
from whisper_train.data.features import LogMel, content_frames
from whisper_train.data.nonspeech import load_nonspeech
from whisper_train.errors import AudioError, UserError
from whisper_train.evaluation.evaluate import report_paths, write_json
from whisper_train.evaluation.generation import generate_texts
from whisper_train.evaluation.scoring import NonSpeechScores, score_nonspeech, words_in
from whisper_train.models import Assistant, load_assistant, load_model
from whisper_train.transcription.decoding import Decoded, DecodingOptions
from whisper_train.transcription.longform import transcribe_long_form


@dataclass
class NonSpeechReport:
    """A model's transcripts of a non-speech set and their scores; `audio[i]` wrote `texts[i]`."""

    model: str
    scores: NonSpeechScores
    audio: list[str]
    texts: list[str]
    seconds: list[float]
    decoded: list[Decoded] = field(default_factory=list)
    decoding: DecodingOptions | None = None
    elapsed: float = 0.0

    def to_dict(self) -> dict:
        s = self.scores
        utterances = [
            {"audio": audio, "seconds": round(sec, 3), "text": text, "words": words_in(text)}
            for audio, sec, text in zip(self.audio, self.seconds, self.texts, strict=True)
        ]
        for utterance, decoded in zip(utterances, self.decoded, strict=False):
            utterance.update(decoded.report())
        return {
            "model": self.model,
            "kind": "nonspeech",
            "clips": s.clips,
            "audio_seconds": round(s.seconds, 3),
            "words": s.words,
            "words_per_minute": round(s.words_per_minute, 4),
            "clips_with_text": s.clips_with_text,
            "share_with_text": round(s.share_with_text, 4),
            "decoding": self.decoding.to_dict() if self.decoding is not None else None,
            "elapsed_seconds": round(self.elapsed, 2),
            "utterances": utterances,
        }


def _read(example) -> torch.Tensor:
    try:
        return load_audio(example.audio, start=example.start, end=example.end)
    except AudioError as exc:
        # Scored on every clip or not at all: a rate over the readable ones would flatter.
        raise UserError(
            f"{example.audio}: cannot be read ({exc.reason}); a non-speech set is scored on "
            "every clip: repair or remove it"
        ) from None


def evaluate_nonspeech_examples(
    model,
    processor,
    examples: Sequence,
    *,
    batch_size: int = 8,
    max_length: int = 225,
    num_beams: int = 1,
    decoding: DecodingOptions | None = None,
    language: str | None = None,
    model_name: str = "",
    assistant: Assistant | None = None,
) -> NonSpeechReport:
    """Decode every clip of a non-speech set (a clip over 30 s long-form) and score the text;
    `assistant`: speculative decoding (`transcription.assistant`), the same text."""
    decoding = DecodingOptions() if decoding is None else decoding
    started = time.perf_counter()
    clips = [(example.audio, _read(example)) for example in examples]
    short = [(audio, samples) for audio, samples in clips if len(samples) <= N_SAMPLES]
    longer = [(audio, samples) for audio, samples in clips if len(samples) > N_SAMPLES]
    log_mel = LogMel(processor.feature_extractor)

    def batches():
        for first in range(0, len(short), batch_size):
            part = [samples for _, samples in short[first : first + batch_size]]
            batch = {
                "input_features": log_mel(part),
                "content_frames": content_frames(part),
                "size": len(part),
            }
            if language is not None:
                batch["languages"] = [language] * len(part)
            yield batch

    decoded: list[Decoded] = []
    texts = generate_texts(
        model,
        processor,
        batches(),
        max_length=max_length,
        num_beams=num_beams,
        decoding=decoding,
        details=decoded,
        assistant=assistant,
    )
    for _, samples in longer:
        texts.append(
            transcribe_long_form(
                model,
                processor,
                samples,
                beam_size=num_beams,
                decoding=decoding,
                language=language,
                assistant=assistant,
            )
        )
    ordered = short + longer
    seconds = [len(samples) / SAMPLE_RATE for _, samples in ordered]
    return NonSpeechReport(
        model=model_name,
        scores=score_nonspeech(texts, seconds),
        audio=[audio for audio, _ in ordered],
        texts=texts,
        seconds=seconds,
        decoded=decoded,
        decoding=decoding,
        elapsed=time.perf_counter() - started,
    )


def write_nonspeech_json(report: NonSpeechReport, path: str | Path) -> Path:
    return write_json(report.to_dict(), path)


def evaluate_nonspeech(
    model: str,
    data: str | Path,
    *,
    data_format: str | None = None,
    output: str | Path | None = None,
    overwrite: bool = False,
    baseline: str | None = None,
    batch_size: int = 8,
    eval_subset: int | None = None,
    language: str | None = None,
    beam_size: int = 1,
    max_length: int = 225,
    decoding: DecodingOptions | None = None,
    on_report: Callable[[str, NonSpeechReport], None] | None = None,
    assistant: str | None = None,
) -> list[Path]:
    """`evaluate` of a non-speech set: the model's report (and the baseline's), written as
    report.json (and report.baseline.json) where `report_paths` says. Returns the files.
    `assistant` drafts for `model` only."""
    require_positive("--batch-size", batch_size)
    require_positive("--beam-size", beam_size)
    require_positive("--max-length", max_length)
    examples = load_nonspeech(data, data_format=data_format)
    if eval_subset is not None:
        require_positive("--eval-subset", eval_subset)
        examples = examples[:eval_subset]
    if not examples:
        raise UserError(f"--data {data}: no clips found")
    paths = report_paths(model, output=output, baseline=baseline)[:2]  # JSON only
    existing = [path for path in paths if path.exists()]
    if existing and not overwrite:
        raise UserError(f"{existing[0]} already exists; add --overwrite, or pass another --output")
    written = []
    for role, spec in (("model", model), ("baseline", baseline)):
        if spec is None:
            continue
        loaded, processor = load_model(spec)
        if torch.cuda.is_available():
            loaded = loaded.to("cuda")
        report = evaluate_nonspeech_examples(
            loaded,
            processor,
            examples,
            batch_size=batch_size,
            max_length=max_length,
            num_beams=beam_size,
            decoding=decoding,
            language=language,
            model_name=spec,
            assistant=load_assistant(assistant, loaded, processor, beam_size)
            if role == "model"
            else None,
        )
        if on_report is not None:
            on_report(role, report)
        if paths:
            written.append(write_nonspeech_json(report, paths[len(written)]))
    return written
