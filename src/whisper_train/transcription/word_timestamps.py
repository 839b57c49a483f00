"""Word-level timestamps from Whisper's cross-attention, and the alignment heads they rest on.

Whisper has no word-time output. openai-whisper, faster-whisper and transformers all time words
the same way: a few decoder cross-attention heads (the *alignment heads*) look at the audio of
the token they are about to predict; their attention, normalised and median-filtered, is
aligned to the audio frames by dynamic time warping (DTW); a token starts where the path
enters its row. Which heads do this is a property of the weights: OpenAI listed them for each
of its models, and fine-tuning can move them. This module:

  * turns transformers' token times (`generate(..., return_token_timestamps=True)`, its own DTW)
    into words: sub-word tokens merged at spaces and punctuation attached to its word, by
    transformers' own grouping (`_combine_tokens_into_words`, openai-whisper's rules);
  * finds the heads that follow known word times (`find_alignment_heads`), through the same DTW
    transcription uses, and saves them in a model folder's generation config, which every
    export carries on (`save_alignment_heads`).

One convention, measured on tiny.en against openai-whisper and faster-whisper on the same
weights (identical word times there): transformers' timestamp at a token's position is where
the DTW path leaves that token's row, i.e. the token's *end*; a token starts where the one
before it ends.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers.generation.utils import GenerateEncoderDecoderOutput
from transformers.models.whisper.tokenization_whisper import _combine_tokens_into_words

from whisper_train.audio import HOP_LENGTH, N_SAMPLES, SAMPLE_RATE
from whisper_train.data.labels import LabelEncoder
from whisper_train.errors import UserError
from whisper_train.files import write_atomically

log = logging.getLogger(__name__)

# openai-whisper's rule for words after a pause (timing.py `add_word_timestamps`): the DTW path
# starts at frame 0 and crosses silences inside some word's row, so a word much longer than
# the segment's typical word is cut to twice the median word length (the median capped at
# 0.7 s).
MEDIAN_WORD_CAP_S = 0.7
# The marks transformers' word grouping attaches to a neighbouring word (its defaults,
# openai-whisper's prepend and append punctuations).
PUNCTUATION = "\"'“¡¿([{-" + "\"'.。,，!！?？:：”)]}、"
# At most this many of the best single heads are tried together by find_alignment_heads.
MAX_HEADS_TRIED = 16
# Clips of `export --find-alignment-heads DATA` the head search uses: tiny.en's 24 heads take
# about a CPU second a clip, and 24 clips of the demo's sentences gave 244 words to hold heads
# against.
ALIGNMENT_CLIPS = 24


@dataclass(frozen=True)
class Word:
    word: str  # as the model spelled it, with its leading space (as openai-whisper writes it)
    start: float  # seconds from the start of the recording
    end: float
    probability: float | None = None  # the runtime's token probability, where it reports one


@dataclass(frozen=True)
class AlignmentExample:
    """A clip and the times of its words: what find_alignment_heads holds heads against."""

    audio: np.ndarray  # (n_samples,) float32 at 16 kHz, at most 30 s
    words: Sequence[Word]  # in spoken order, times in seconds from the clip's start


@dataclass(frozen=True)
class HeadSearch:
    heads: list[list[int]]  # [[decoder layer, head], ...]: generation_config.alignment_heads
    error_s: float  # median |word start error| of `heads` together, seconds
    head_errors: dict[tuple[int, int], float] = field(default_factory=dict)  # each head alone
    words: int = 0  # reference words compared


# -- heads ------------------------------------------------------------------------------------


def default_alignment_heads(model) -> list[list[int]]:
    """Every head of the upper half of the decoder layers: what CTranslate2's converter and
    openai-whisper use when a model names none, so all runtimes time a model alike."""
    layers, heads = model.config.decoder_layers, model.config.decoder_attention_heads
    return [[layer, head] for layer in range(layers // 2, layers) for head in range(heads)]


def alignment_heads_of(model) -> list[list[int]]:
    """The model's own heads (generation_config.alignment_heads), else the default."""
    heads = getattr(model.generation_config, "alignment_heads", None)
    if heads:
        return [list(head) for head in heads]
    log.info(
        "the model names no alignment heads: timing words with the upper half of the decoder "
        "layers' heads, as CTranslate2 and openai-whisper do (find_alignment_heads can find "
        "better ones)"
    )
    return default_alignment_heads(model)


def check_alignment_heads(heads, *, layers: int, heads_per_layer: int, source: str) -> None:
    """UserError naming `source` unless `heads` are [layer, head] pairs inside the decoder."""
    bad = [
        head
        for head in heads
        if len(head) != 2
        or not (0 <= int(head[0]) < layers and 0 <= int(head[1]) < heads_per_layer)
    ]
    if not heads or bad:
        raise UserError(
            f"{source}: alignment heads {bad[:1] or heads} are not [layer, head] pairs of this "
            f"model's decoder ({layers} layers x {heads_per_layer} heads)"
        )


def save_alignment_heads(model_dir: str | Path, heads: Sequence[Sequence[int]]) -> Path:
    """Write `heads` into `model_dir/generation_config.json` (an HF model folder or a run's
    final/), from where transformers reads them and `whisper-train export` carries them into
    CTranslate2's config.json and openai-whisper's model.pt."""
    config_file = Path(model_dir) / "generation_config.json"
    if not config_file.is_file():
        raise UserError(
            f"{model_dir}: no generation_config.json to hold the alignment heads; pass a model "
            "folder that `whisper-train train` or `export --format hf` wrote"
        )
    model_config = Path(model_dir) / "config.json"
    if model_config.is_file():
        dims = json.loads(model_config.read_text(encoding="utf-8"))
        check_alignment_heads(
            heads,
            layers=dims["decoder_layers"],
            heads_per_layer=dims["decoder_attention_heads"],
            source=str(model_dir),
        )
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["alignment_heads"] = [[int(layer), int(head)] for layer, head in heads]
    # A kill or a full disk mid-write leaves the model's generation config as it was, never half
    # a file.
    write_atomically(config_file, json.dumps(config, indent=2) + "\n")
    return config_file


# -- token times -> words ---------------------------------------------------------------------


def words_from_token_times(
    tokenizer,
    token_ids: Sequence[int],
    token_ends: Sequence[float],
    *,
    start: float,
    end: float,
    language: str | None = None,
) -> list[Word]:
    """One segment's words. `token_ids` may hold time and special tokens (skipped);
    `token_ends[k]` is where token k ends (transformers' token timestamps, absolute seconds);
    the segment's first text token starts at `start`. Words are kept inside [start, end]."""
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text, spans = [], []
    for k, token in enumerate(token_ids):
        if token < eot:  # the text tokens precede every special and time token
            token_start = start if not spans else float(token_ends[k - 1])
            text.append(int(token))
            spans.append((token_start, float(token_ends[k])))
    if not text:
        return []
    words, _, token_indices = _combine_tokens_into_words(tokenizer, text, language)
    found = []
    for word, indices in zip(words, token_indices, strict=True):
        # Punctuation joins its word's text but not its time (openai-whisper's
        # merge_punctuations): a full stop's row often absorbs the pause after the sentence.
        timed = [i for i in indices if tokenizer.decode([text[i]]).strip(PUNCTUATION)] or indices
        if word.strip():
            found.append(Word(word, spans[timed[0]][0], spans[timed[-1]][1]))
    return fit_into_segment(found, start, end)


def fit_into_segment(words: list[Word], start: float, end: float) -> list[Word]:
    """Words ordered, inside [start, end], the first and last no longer than twice the
    segment's median word (openai-whisper's rule for the silence the DTW path crosses).

    Times are rounded to the millisecond before they are compared, as transcripts.Segment
    rounds the segment's own: a word never starts before its segment by a float's rounding."""
    if not words:
        return []
    durations = [w.end - w.start for w in words if w.end > w.start]
    longest = 2 * min(MEDIAN_WORD_CAP_S, float(np.median(durations))) if durations else 0.0
    start = round(float(start), 3)
    end = max(round(float(end), 3), start)
    fitted, previous_end = [], start
    for i, word in enumerate(words):
        # A time that is no number (transformers' DTW over one token divides by a std of
        # nothing) is no time: the word is timed with its neighbours below.
        raw_start = float(word.start) if math.isfinite(word.start) else previous_end
        raw_end = float(word.end) if math.isfinite(word.end) else raw_start
        word_start = min(max(round(raw_start, 3), previous_end), end)
        word_end = min(max(round(raw_end, 3), word_start), end)
        if longest and word_end - word_start > longest:
            # Still inside [word_start, word_end] once rounded: both ends are whole milliseconds.
            if i == 0:
                word_start = round(word_end - longest, 3)
            elif i == len(words) - 1:
                word_end = round(word_start + longest, 3)
        fitted.append(Word(word.word, word_start, word_end, word.probability))
        previous_end = word_end
    return _spread_collapsed(fitted, start, end)


def _spread_collapsed(words: list[Word], start: float, end: float) -> list[Word]:
    """Words the alignment gave no duration (after silence the DTW path puts every word at the
    segment's end) share the time around them evenly, a millisecond each at least: a subtitle
    cue of no length shows nothing, and no word is put past its segment. The span shared grows
    over the neighbours until it holds enough milliseconds; a segment shorter than a
    millisecond a word keeps its text untimed (no words)."""
    n = len(words)
    times = [[w.start, w.end] for w in words]
    i = 0
    while i < n:
        if times[i][1] > times[i][0]:
            i += 1
            continue
        a = b = i
        while b + 1 < n and times[b + 1][1] <= times[b + 1][0]:
            b += 1
        while True:  # first the silence around the run, then its neighbours' time too
            lo = start if a == 0 else times[a - 1][1]
            hi = end if b == n - 1 else times[b + 1][0]
            if round((hi - lo) * 1000) >= b - a + 1:
                break
            if a == 0 and b == n - 1:
                return []
            a, b = max(a - 1, 0), min(b + 1, n - 1)
        step = (hi - lo) / (b - a + 1)
        for k in range(a, b + 1):
            offset = k - a
            times[k] = [round(lo + offset * step, 3), round(lo + (offset + 1) * step, 3)]
        times[b][1] = round(hi, 3)
        i = b + 1
    return [Word(w.word, t[0], t[1], w.probability) for w, t in zip(words, times, strict=True)]


# -- teacher-forced timing and the head search ------------------------------------------------


def _cross_attentions(model, features: torch.Tensor, decoder_ids: list[int]):
    """The decoder's cross-attention weights for `decoder_ids`, one (1, heads, tokens, frames)
    tensor per layer. Eager attention for this call: SDPA returns no weights."""
    saved = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            output = model(
                input_features=features,
                decoder_input_ids=torch.tensor([decoder_ids], device=features.device),
                output_attentions=True,
            )
    finally:
        model.config._attn_implementation = saved
    return tuple(layer.float() for layer in output.cross_attentions)


def token_boundaries(model, attentions, heads, *, n_prompt: int, n_text: int, n_frames: int):
    """(n_text + 1,) seconds: token k of the text spans [b[k], b[k + 1]], by transformers' DTW
    (`_extract_token_timestamps`) over `heads` of teacher-forced `attentions`."""
    outputs = GenerateEncoderDecoderOutput(
        sequences=torch.zeros(1, n_prompt + n_text + 1, dtype=torch.long),
        cross_attentions=(attentions,),  # one "step" that saw every position at once
    )
    # Skip the prompt's rows but its last: that row predicts the first text token, so the DTW
    # path's entry into it is where the text starts (openai-whisper keeps it too).
    times = model._extract_token_timestamps(
        outputs, heads, num_frames=n_frames, num_input_ids=n_prompt - 1
    )[0]
    return times[n_prompt - 1 : n_prompt + n_text].cpu().numpy()


@dataclass
class _Prepared:
    attentions: tuple
    n_prompt: int
    n_text: int
    n_frames: int
    first_tokens: list[int]  # index of each reference word's first token in the text
    reference_starts: np.ndarray


def _prepare(model, processor, example: AlignmentExample, prompt: list[int]) -> _Prepared:
    tokenizer = processor.tokenizer
    text, first_tokens = [], []
    for word in example.words:
        first_tokens.append(len(text))
        text += tokenizer.encode(" " + word.word.strip(), add_special_tokens=False)
    weight = next(p for p in model.parameters() if p.is_floating_point())
    features = processor.feature_extractor(
        example.audio, sampling_rate=SAMPLE_RATE, return_tensors="pt"
    ).input_features.to(weight.device, weight.dtype)
    return _Prepared(
        attentions=_cross_attentions(model, features, prompt + text),
        n_prompt=len(prompt),
        n_text=len(text),
        n_frames=math.ceil(len(example.audio) / HOP_LENGTH),
        first_tokens=first_tokens,
        reference_starts=np.array([w.start for w in example.words]),
    )


def _start_errors(model, prepared: list[_Prepared], heads) -> np.ndarray:
    """|word start - reference start| of every reference word, timed with `heads` together."""
    errors = []
    for item in prepared:
        bounds = token_boundaries(
            model,
            item.attentions,
            heads,
            n_prompt=item.n_prompt,
            n_text=item.n_text,
            n_frames=item.n_frames,
        )
        errors.append(np.abs(bounds[item.first_tokens] - item.reference_starts))
    return np.concatenate(errors)


def find_alignment_heads(
    model, processor, examples: Sequence[AlignmentExample], *, language: str | None = None
) -> HeadSearch:
    """The decoder heads whose cross-attention, through transformers' DTW, best follows the
    word times of `examples` (e.g. the base model's word times on the training audio).

    Each head is scored alone (median |start error| over all words); then the best 1, 2, ...
    heads together (as transcription averages them), and the set with the smallest median
    error wins (the smaller set on a tie). Cost: one forward per clip, and one DTW per clip
    for each head and each tried set (tiny.en: 24 heads, about a second a clip on a CPU).
    """
    if not examples or not any(example.words for example in examples):
        raise UserError("find_alignment_heads: no reference words to align against")
    for example in examples:
        if len(example.audio) > N_SAMPLES:
            raise UserError(
                f"find_alignment_heads: a clip of {len(example.audio) / SAMPLE_RATE:.1f} s; "
                "use clips of at most 30 s (one window)"
            )
    encoder = LabelEncoder(
        processor.tokenizer,
        language=language or getattr(model.generation_config, "language", None),
        multilingual=bool(getattr(model.generation_config, "is_multilingual", False)),
    )
    prompt = encoder.prefix_ids()
    model = model.eval()
    prepared = [_prepare(model, processor, e, prompt) for e in examples if e.words]
    config = model.config
    singles = {
        (layer, head): float(np.median(_start_errors(model, prepared, [[layer, head]])))
        for layer in range(config.decoder_layers)
        for head in range(config.decoder_attention_heads)
    }
    ranked = sorted(singles, key=singles.get)
    best_heads, best_error = None, math.inf
    for count in range(1, min(MAX_HEADS_TRIED, len(ranked)) + 1):
        heads = [list(head) for head in ranked[:count]]
        error = float(np.median(_start_errors(model, prepared, heads)))
        if error < best_error - 1e-9:
            best_heads, best_error = heads, error
    n_words = sum(len(item.first_tokens) for item in prepared)
    return HeadSearch(sorted(best_heads), best_error, singles, n_words)


# -- subtitles --------------------------------------------------------------------------------


def highlighted_cues(segments) -> list[tuple[float, float, str]]:
    """(start, end, text) subtitle cues in which each word is underlined while it is spoken,
    the segment's plain text between words: openai-whisper's `--highlight_words True` (the
    subtitles its users get with `--word_timestamps True`). `segments` have start, text and
    words; one without words stays one cue."""
    cues = []
    for segment in segments:
        words = segment.words or ()
        if not words:
            cues.append((segment.start, segment.end, segment.text))
            continue
        spoken = [word.word for word in words]
        last = segment.start
        for i, word in enumerate(words):
            if word.start > last:
                cues.append((last, word.start, "".join(spoken).strip()))
            marked = [
                f"{w[: len(w) - len(w.lstrip())]}<u>{w.lstrip()}</u>" if j == i else w
                for j, w in enumerate(spoken)
            ]
            if word.end > word.start:  # a cue of no length shows nothing
                cues.append((word.start, word.end, "".join(marked).strip()))
            last = max(last, word.end)
    return cues


# -- reference word times ---------------------------------------------------------------------


def model_word_times(model, processor, audio: np.ndarray) -> list[Word]:
    """A model's own words on one clip of at most 30 s, timed with its alignment heads (or the
    default): greedy, with timestamps, as `transcribe --word-timestamps` decodes a window."""
    if len(audio) > N_SAMPLES:
        raise UserError(f"a clip of {len(audio) / SAMPLE_RATE:.1f} s: at most 30 s here")
    model.generation_config.alignment_heads = alignment_heads_of(model)
    weight = next(p for p in model.parameters() if p.is_floating_point())
    inputs = processor.feature_extractor(
        audio, sampling_rate=SAMPLE_RATE, return_tensors="pt", return_attention_mask=True
    )
    with torch.inference_mode():
        output = model.generate(
            input_features=inputs.input_features.to(weight.device, weight.dtype),
            attention_mask=inputs.attention_mask.to(weight.device),
            return_timestamps=True,
            return_segments=True,
            return_token_timestamps=True,
        )
    duration = len(audio) / SAMPLE_RATE
    words = []
    for raw in output["segments"][0]:
        start, end = min(float(raw["start"]), duration), min(float(raw["end"]), duration)
        ends = raw["token_timestamps"].tolist()
        tokens = raw["tokens"].tolist()
        words += words_from_token_times(processor.tokenizer, tokens, ends, start=start, end=end)
    return words


def find_alignment_heads_against(
    model, processor, reference, clips: Sequence[np.ndarray], *, language: str | None = None
) -> HeadSearch:
    """find_alignment_heads with `reference` ((model, processor), e.g. the base the model was
    fine-tuned from) timing the words of each clip: what a user has when nobody timed words."""
    reference_model, reference_processor = reference
    examples = [
        AlignmentExample(audio, model_word_times(reference_model, reference_processor, audio))
        for audio in clips
    ]
    return find_alignment_heads(model, processor, examples, language=language)
