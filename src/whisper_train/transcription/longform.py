"""Long-form decoding: recordings longer than Whisper's 30 s window, decoded as users decode them.

transformers' sequential long-form `generate`, what `whisper-train transcribe` runs on a
transformers model (`backends.TransformersBackend`) and what `evaluate` scores on recordings
over 30 s (`evaluation.longform`): the un-truncated log-mel features with their attention mask,
30 s windows with timestamps, each window starting where the previous one's last closed
timestamp ended, and the temperature fallback window by window with openai-whisper's text
compression ratio. Optionally each window is conditioned on the previous windows' text
(`condition_on_previous_text`, openai-whisper's and faster-whisper's name; off by default, as
`transcribe` decodes).

A recording of any length is decoded in bounded memory by `transcribe_in_pieces`: its audio read
a piece at a time (`audio.audio_pieces`) and handed to a runtime DECODE_SECONDS at a time, each
part starting where the last whole window of the one before closed its last segment.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from whisper_train.audio import CHUNK_LENGTH, N_SAMPLES, SAMPLE_RATE
from whisper_train.data.labels import model_generate_language
from whisper_train.transcription.assistant import Assistant, assisted
from whisper_train.transcription.decoding import DecodingOptions, compression_ratio, seeded
from whisper_train.transcription.transcripts import Segment
from whisper_train.transcription.word_timestamps import Word

# A recording is read PIECE_SECONDS at a time and decoded DECODE_SECONDS (8 windows) at a time:
# what a runtime holds for one call (audio, log-mel, its own copies) is bounded by that, not by
# the recording's length; each part's last 30 s to 60 s are decoded again with what follows.
PIECE_SECONDS = 60.0
DECODE_SECONDS = 240.0


def _fallback_arguments(options: DecodingOptions) -> dict:
    """generate's own window-by-window fallback and no-speech test, set from `options`. When
    every temperature fails, transformers keeps the last try (as openai-whisper does), not the
    most likely one (`decoding.choose`, faster-whisper's rule)."""
    sampling = {"top_k": 0}  # the whole distribution, as openai-whisper samples
    silence = {}
    # transformers' detector (the same probability, at <|startoftranscript|>) always pairs it
    # with the log-prob test: with --logprob-threshold off, long-form windows are not tested.
    if options.no_speech_threshold is not None and options.logprob_threshold is not None:
        silence = {
            "no_speech_threshold": options.no_speech_threshold,
            "logprob_threshold": options.logprob_threshold,
        }
    if not options.fallback:
        first = options.temperatures[0]
        if first > 0:
            return {"temperature": first, **sampling, **silence}
        # transformers' log-prob test rescales by the temperature: it must be given (0: greedy).
        return {"temperature": 0.0, **silence} if silence else {}
    return {
        "temperature": options.temperatures,
        "compression_ratio_threshold": options.compression_ratio_threshold,
        "logprob_threshold": options.logprob_threshold,
        **sampling,
        **silence,
    }


@contextlib.contextmanager
def _text_compression_ratio(model, tokenizer):
    """transformers' long-form fallback computes the compression ratio of the token ids'
    bytes (a scale where 1.35 is its suggested threshold); for the duration of one call, make
    it openai-whisper's ratio of the decoded text, so 2.4 means what it means there."""

    def text_ratio(tokens, vocab_size):
        ids = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        return compression_ratio(tokenizer.decode(ids, skip_special_tokens=True).strip())

    model._retrieve_compression_ratio = text_ratio  # shadows the static method
    try:
        yield
    finally:
        del model._retrieve_compression_ratio


@torch.inference_mode()
def generate_long_form(
    model,
    processor,
    audio: np.ndarray,
    *,
    beam_size: int = 1,
    decoding: DecodingOptions | None = None,
    condition_on_previous_text: bool = False,
    language: str | None = None,
    word_timestamps: bool = False,
    assistant: Assistant | None = None,
) -> dict:
    """(n_samples,) float32 16 kHz audio of any length → `generate`'s output with timestamps
    and `segments` (one list per recording: {"start", "end", "tokens", ...}).

    `language`: a code for a multilingual model (None: its generation config's, else detected);
    ignored by English-only models, which take no language token. `assistant`
    (`transcription.assistant`) drafts every window's tokens: the greedy text is the model's
    own; a window the fallback decodes again is sampled through transformers' speculative
    sampling, which keeps the model's distribution but not the draws made without it."""
    decoding = DecodingOptions() if decoding is None else decoding
    weight = next(p for p in model.parameters() if p.is_floating_point())
    # Un-truncated features + attention mask switch generate into sequential long-form
    # decoding for recordings over 30 s; shorter ones are padded to the 30 s window.
    inputs = processor.feature_extractor(
        audio,
        sampling_rate=SAMPLE_RATE,
        return_tensors="pt",
        truncation=False,
        padding="longest" if len(audio) > N_SAMPLES else "max_length",
        return_attention_mask=True,
    )
    options = _fallback_arguments(decoding)
    if condition_on_previous_text:  # passed only when asked: a 30 s clip warns otherwise
        options["condition_on_prev_tokens"] = True
    if word_timestamps:  # each token's end time, from the alignment heads' cross-attention
        options["return_token_timestamps"] = True
    if language is not None and getattr(model.generation_config, "is_multilingual", False):
        options["language"] = model_generate_language(language, model.generation_config)
    features = inputs.input_features.to(weight.device, weight.dtype)
    options.update(assisted(assistant, model, {"input_features": features}, {}))
    with seeded(decoding.seed, weight.device), _text_compression_ratio(model, processor.tokenizer):
        return model.generate(
            input_features=features,
            attention_mask=inputs.attention_mask.to(weight.device),
            return_timestamps=True,
            return_segments=True,
            num_beams=beam_size,
            **options,
        )


@dataclass(frozen=True)
class DecodedSegment:
    """One non-empty segment of a long-form decoding: its times (s), text and tokens, and with
    word timestamps asked for, each token's end time (s: transformers' DTW over the alignment
    heads; `word_timestamps.words_from_token_times` makes words of them)."""

    start: float
    end: float
    text: str
    tokens: list[int]
    token_ends: list[float] | None = None


def decoded_segments(output: dict, tokenizer) -> list[DecodedSegment]:
    """The non-empty segments of the first recording of `generate_long_form`'s `output`."""
    found = []
    for raw in output["segments"][0]:
        tokens = raw["tokens"].tolist()
        text = tokenizer.decode([t for t in tokens if t < tokenizer.eos_token_id]).strip()
        if text:
            ends = raw["token_timestamps"].tolist() if "token_timestamps" in raw else None
            found.append(DecodedSegment(float(raw["start"]), float(raw["end"]), text, tokens, ends))
    return found


def transcribe_long_form(model, processor, audio: np.ndarray, **options) -> str:
    """The text of a recording decoded long-form (`generate_long_form`'s options)."""
    output = generate_long_form(model, processor, audio, **options)
    return " ".join(segment.text for segment in decoded_segments(output, processor.tokenizer))


def transcribe_in_pieces(
    transcribe: Callable[[np.ndarray], tuple[str, list[Segment]]],
    pieces: Iterable[np.ndarray],
    *,
    decode_seconds: float | None = None,
    progress: Callable[[float], None] | None = None,
) -> tuple[str, list[Segment]]:
    """(text, segments) of a recording given as consecutive pieces of 16 kHz audio, decoded by
    `transcribe` (a backend's: audio of any length → (text, segments timed from its start))
    at most about `decode_seconds` (None: DECODE_SECONDS) + a piece at a time;
    `progress(seconds)` after each part.

    A part that is not the recording's last keeps only the segments that end at least 30 s
    before its end: those came from whole windows, as decoding the recording at once would have
    made them (a window that reaches the part's end was cut short by it). The next part starts
    where the last of them ends, so its window starts where sequential decoding's next window
    would; or, when none ended in the last minute, 60 s before the part's end, which holds the
    window that was cut short. A recording of at most one part is decoded in one call, as it
    always was."""
    limit = round((DECODE_SECONDS if decode_seconds is None else decode_seconds) * SAMPLE_RATE)
    held, offset, segments, texts = np.zeros(0, np.float32), 0, [], []
    pieces = iter(pieces)
    piece = next(pieces, None)
    while piece is not None:
        held = np.concatenate([held, piece])
        piece = next(pieces, None)
        if piece is not None and len(held) < limit:
            continue
        text, found = transcribe(held)
        if piece is None:  # the recording's end: all of it
            keep, cut = found, len(held)
        else:
            whole_windows = len(held) / SAMPLE_RATE - CHUNK_LENGTH
            keep = [segment for segment in found if segment.end <= whole_windows]
            last_end = keep[-1].end if keep else 0.0
            cut = round(max(last_end, whole_windows - CHUNK_LENGTH) * SAMPLE_RATE)
        texts.append(text)
        segments += [_shifted(segment, offset / SAMPLE_RATE) for segment in keep]
        held, offset = held[cut:], offset + cut
        if progress is not None:
            progress(offset / SAMPLE_RATE)
    if len(texts) == 1:  # decoded in one call: the runtime's own text
        return texts[0], segments
    return " ".join(segment.text for segment in segments), segments


def _shifted(segment: Segment, seconds: float) -> Segment:
    """`segment` (and its words) `seconds` later."""
    if not seconds:
        return segment
    words = segment.words
    if words is not None:
        words = tuple(
            Word(w.word, w.start + seconds, w.end + seconds, w.probability) for w in words
        )
    return Segment(segment.start + seconds, segment.end + seconds, segment.text, words)
