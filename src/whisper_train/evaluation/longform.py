"""Long-form decoding and evaluation: recordings longer than Whisper's 30 s window, decoded as
users decode them and scored whole.

Decoding is transformers' sequential long-form `generate` (what `whisper-train transcribe`
runs on a transformers model: `transcribe.TransformersBackend` calls `generate_long_form`):
the un-truncated log-mel features with their attention mask, 30 s windows with timestamps,
each window starting where the previous one's last closed timestamp ended, and the temperature
fallback window by window with openai-whisper's text compression ratio. Optionally each window
is conditioned on the previous windows' text (`condition_on_previous_text`, openai-whisper's
and faster-whisper's name; off by default, as `transcribe` decodes).

Scoring: a recording is one utterance whose reference is its whole transcript, so its row's
WER is the WER over the whole recording, and the corpus figures of `scoring.score` add up the
recordings' errors. A dropped window shows as deletions, a repeated one as insertions: both
rates are reported.

Where long-form decoding happens: every clip of a set named NAME:long=PATH
(`config.LONG_FORM`, read whole by `data.recordings`), and in `evaluate` every clip longer than
30 s in any set: a clip is never scored on its first window only. During training a long-form
set is scored by `run_long_form_evaluation` (no validation loss: its labels would not fit the
decoder's 448 positions).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from whisper_train.audio import N_SAMPLES, SAMPLE_RATE, load_audio
from whisper_train.decoding import Decoded, DecodingOptions, compression_ratio, seeded
from whisper_train.errors import AudioError
from whisper_train.evaluation.scoring import Normalizer, get_normalizer, normalizer_for, score

# A long-form set is decoded one recording at a time (a recording is many windows already).
RECORDINGS_PER_BATCH = 1


# -- decoding -------------------------------------------------------------------------------


def _fallback_arguments(options: DecodingOptions) -> dict:
    """generate's own window-by-window fallback, set from `options`. When every temperature
    fails, transformers keeps the last try (as openai-whisper does), not the most likely one
    (`decoding.choose`, faster-whisper's rule)."""
    sampling = {"top_k": 0}  # the whole distribution, as openai-whisper samples
    if not options.fallback:
        first = options.temperatures[0]
        return {"temperature": first, **sampling} if first > 0 else {}
    return {
        "temperature": options.temperatures,
        "compression_ratio_threshold": options.compression_ratio_threshold,
        "logprob_threshold": options.logprob_threshold,
        **sampling,
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
) -> dict:
    """(n_samples,) float32 16 kHz audio of any length → `generate`'s output with timestamps
    and `segments` (one list per recording: {"start", "end", "tokens", ...}).

    `language`: a code for a multilingual model (None: its generation config's, else detected);
    ignored by English-only models, which take no language token."""
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
        options["language"] = language
    with seeded(decoding.seed, weight.device), _text_compression_ratio(model, processor.tokenizer):
        return model.generate(
            input_features=inputs.input_features.to(weight.device, weight.dtype),
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


# -- evaluating recordings ------------------------------------------------------------------


@dataclass
class Recordings:
    """Recordings decoded long-form: `texts[i]` is the transcript of `examples[i]`."""

    examples: list = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    decoded: list[Decoded] = field(default_factory=list)


def decode_recordings(
    model,
    processor,
    examples: Iterable,
    *,
    beam_size: int = 1,
    decoding: DecodingOptions | None = None,
    condition_on_previous_text: bool = False,
    languages: Sequence[str | None] | None = None,
    skipped: list[dict] | None = None,
    progress: bool = False,
) -> Recordings:
    """Decode each example (a recording, or a window of one) long-form. Unreadable audio is
    appended to `skipped` ({"audio", "reason"}) and left out. `languages[i]`: the language of
    example i on a multilingual model (None: the model's, else detected). `progress`: a line on
    stderr per recording (a long recording takes a while)."""
    decoding = DecodingOptions() if decoding is None else decoding
    was_training = model.training
    model.eval()
    found = Recordings()
    started = time.perf_counter()
    examples = list(examples)
    try:
        for index, example in enumerate(examples):
            try:
                audio = load_audio(example.audio, start=example.start, end=example.end)
            except AudioError as exc:
                if skipped is not None:
                    skipped.append({"audio": example.audio, "reason": exc.reason})
                continue
            language = languages[index] if languages is not None else None
            text = transcribe_long_form(
                model,
                processor,
                audio,
                beam_size=beam_size,
                decoding=decoding,
                condition_on_previous_text=condition_on_previous_text,
                language=language,
            )
            found.examples.append(example)
            found.texts.append(text)
            # The fallback ran window by window inside generate, which does not say which
            # windows needed it: the recording is reported at its first temperature.
            found.decoded.append(
                Decoded(
                    text=text,
                    tokens=(),
                    avg_logprob=None,
                    compression_ratio=compression_ratio(text),
                    temperature=decoding.temperatures[0],
                    language=language,
                )
            )
            if progress:
                print(
                    f"evaluate: {index + 1} of {len(examples)} recordings decoded long-form "
                    f"({len(audio) / SAMPLE_RATE:.0f} s) in {time.perf_counter() - started:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        model.train(was_training)
    return found


def collate_recordings(items: list[tuple[int, object]]) -> dict:
    """A batch of a long-form set's loader: (index in the set, example) pairs, unread (each
    recording's audio is read as it is decoded). `size` 0: a share padded to the others'."""
    return {"items": items, "size": len(items)}


@torch.no_grad()
def run_long_form_evaluation(
    model,
    loader,
    processor,
    accelerator,
    normalizer: Normalizer | None,
    step: int,
    *,
    decoding: DecodingOptions | None = None,
    condition_on_previous_text: bool = False,
    languages: Sequence[str | None] | None = None,
) -> dict:
    """A long-form set's metrics row during training: {"step", "eval_loss" (NaN: none is
    computed), "wer", "clips", "long_form": True, "repeated_ngram_rate", "insertion_rate",
    "deletion_rate"}.

    `loader` yields this process's share (`collate_recordings` batches, from
    `data.source.evaluation_loader`: every process the same number of batches, some empty).
    Whatever its share, every process joins the one gather at the end, and only it: decoding
    runs on the unwrapped model, whose forwards hold no collective."""
    from accelerate.utils import gather_object

    unwrapped = accelerator.unwrap_model(model)
    references, hypotheses, decoded = [], [], []
    for batch in loader:
        if not batch["size"]:
            continue
        indices = [index for index, _ in batch["items"]]
        found = decode_recordings(
            unwrapped,
            processor,
            [example for _, example in batch["items"]],
            decoding=decoding,
            condition_on_previous_text=condition_on_previous_text,
            languages=[languages[i] for i in indices] if languages is not None else None,
        )
        references += [example.text for example in found.examples]
        hypotheses += found.texts
        decoded += found.decoded
    if accelerator.num_processes > 1:
        shares = gather_object([(references, hypotheses, decoded)])
        references, hypotheses, decoded = (
            [item for share in shares for item in share[column]] for column in range(3)
        )
    if not references:
        return {"step": step, "eval_loss": math.nan, "wer": math.nan, "long_form": True}
    if normalizer is None:
        normalizer = get_normalizer(normalizer_for(item.language for item in decoded))
    scores = score(references, hypotheses, normalizer=normalizer)
    return {
        "step": step,
        "eval_loss": math.nan,  # teacher forcing needs labels within 448 decoder positions
        "wer": round(scores.wer, 6),
        "clips": len(references),
        "long_form": True,
        "repeated_ngram_rate": round(scores.repeated_ngram_rate, 6),
        "insertion_rate": round(scores.insertion_rate, 6),
        "deletion_rate": round(scores.deletion_rate, 6),
    }


__all__ = [
    "RECORDINGS_PER_BATCH",
    "Recordings",
    "collate_recordings",
    "decode_recordings",
    "generate_long_form",
    "run_long_form_evaluation",
    "decoded_segments",
    "DecodedSegment",
    "transcribe_long_form",
]
