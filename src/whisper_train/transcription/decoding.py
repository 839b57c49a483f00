"""Loop-proof decoding: greedy first, temperature fallback for the utterances that fail.

The fallback users know from openai-whisper and faster-whisper: decode at temperature 0
(greedy, or beam search with --beam-size); an utterance whose text compresses too well (a
compression ratio over 2.4: it repeats itself) or whose tokens the model did not believe (a
mean log-probability under -1.0) is decoded again, by sampling at 0.2, 0.4, ... 1.0, and the
first decode that passes both tests is kept. Only the utterances that failed are decoded again,
so a batch stays one generate call when nothing loops. Sampling is seeded (`seed`) in a forked
RNG, so an evaluation repeats exactly and a training run's own random stream is left alone.

The defaults are openai-whisper's (`transcribe()`: temperature (0.0, 0.2, ..., 1.0),
compression_ratio_threshold 2.4, logprob_threshold -1.0, no_speech_threshold 0.6); they were not
tuned here.

Silence, as openai-whisper and faster-whisper judge it: the no-speech probability is the softmax
of the unsuppressed logits at <|nospeech|> (<|nocaptions|> in HF's older vocabularies; always
the token before <|notimestamps|>) at the position of <|startoftranscript|> (openai-whisper's
`probs_at_sot`): one decoder step on [SOT], the step that detects the language. A decode over
`no_speech_threshold` AND under `logprob_threshold` (that test off: the probability alone) is
silence: no text, not decoded again. Without it every clip gets text, even digital silence.
A window judged speech only by its confident text is judged again as the runtimes pad it
(`_runtime_look`): tiny.en writes a confident "you" on digital silence, dither, hum and quiet
noise from training's padding, an unlikely "." from theirs (BENCHMARKS.md, "Text where nobody
speaks"); no speech clip of 80 came near the threshold, so speech pays nothing.

Definitions, as openai-whisper has them (whisper/utils.py, whisper/decoding.py):
  compression ratio  len(text bytes) / len(zlib.compress(text bytes)), on the decoded TEXT
                     (special and timestamp tokens left out, stripped);
  mean log-prob      the sum of the chosen tokens' log-softmax, <|endoftext|> included,
                     divided by (number of tokens before <|endoftext|>) + 1: decoding.py's
                     `avg_logprobs = [lp / (len(t) + 1) ...]`, where `t` excludes the EOT whose
                     log-prob `lp` includes. faster-whisper divides by (seq_len + 1) too.
At temperature T the log-softmax is of the (suppressed, not temperature-scaled) logits, again as
openai-whisper and transformers' own Whisper fallback compute it.

Why not transformers' built-in `generate(temperature=(...), compression_ratio_threshold=...)`:
its compression ratio is of the token ids' BYTES (its docs suggest 1.35, not 2.4), and it tells
the caller neither which utterances fell back nor their log-probs, which the report counts.
Only the transformers long-form path (`longform`) uses the built-in loop (it owns the window
seeking), with its ratio swapped for this one and its own no-speech test.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace

import torch
from transformers.modeling_outputs import BaseModelOutput

from whisper_train.data.features import runtime_padded
from whisper_train.errors import UserError
from whisper_train.transcription.assistant import Assistant, assisted
from whisper_train.transcription.languages import (
    batch_size,
    chosen_languages,
    detect_languages,
    is_multilingual_generation,
    language_argument,
    no_speech_probabilities,
    sot_logits,
)

DEFAULT_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
DEFAULT_COMPRESSION_RATIO_THRESHOLD = 2.4
DEFAULT_LOGPROB_THRESHOLD = -1.0
DEFAULT_NO_SPEECH_THRESHOLD = 0.6
DEFAULT_SEED = 0
OFF = ("none", "off")

# One help text per option, shared by the commands (and the training configuration).
TEMPERATURES_HELP = (
    "Decode at the first temperature (0 = greedy, or beam search with --beam-size), then again "
    "at the next ones (sampling) for each utterance whose output fails "
    "--compression-ratio-threshold or --logprob-threshold; a single 0 turns the fallback off. "
    "openai-whisper's defaults, not tuned here"
)
COMPRESSION_RATIO_HELP = (
    "Decode again when the text's zlib compression ratio is above this (it repeats itself); "
    "none or off to disable. openai-whisper's default, not tuned here"
)
LOGPROB_HELP = (
    "Decode again when the mean log-probability of the output tokens is below this; none or "
    "off to disable. openai-whisper's default, not tuned here"
)
NO_SPEECH_HELP = (
    "A window whose <|nospeech|> probability is above this and whose mean log-probability is "
    "under --logprob-threshold is silence and gets no text; none or off to disable. "
    "openai-whisper's and faster-whisper's default, not tuned here"
)


def compression_ratio(text: str) -> float:
    """len(UTF-8 bytes) / len(zlib-compressed bytes), openai-whisper's loop detector.

    Ordinary sentences score about 1 to 1.5 (short ones under 1: zlib's header costs bytes);
    a phrase repeated over and over scores well above openai-whisper's 2.4.
    """
    data = text.encode("utf-8")
    if not data:
        return 0.0
    return len(data) / len(zlib.compress(data))


def parse_temperatures(value: str | Sequence[float]) -> tuple[float, ...]:
    """'0,0.2,0.4' (or a sequence of numbers) → (0.0, 0.2, 0.4); UserError if malformed."""
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        temperatures = tuple(float(item) for item in items)
    except (TypeError, ValueError):
        raise UserError(
            f"--temperatures {value}: expected comma-separated numbers like 0,0.2,0.4"
        ) from None
    _check_temperatures(temperatures, value)
    return temperatures


def parse_threshold(value: str | float | None, flag: str) -> float | None:
    """'2.4' → 2.4; 'none' / 'off' / None → None (that test is off)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in OFF):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise UserError(f"{flag} {value}: expected a number, or none/off to disable") from None
    if not math.isfinite(number):
        raise UserError(f"{flag} {value}: expected a finite number, or none/off to disable")
    return number


def _check_temperatures(temperatures: Sequence[float], shown) -> None:
    if not temperatures:
        raise UserError("--temperatures: give at least one temperature, e.g. 0")
    if any(not math.isfinite(t) or t < 0 for t in temperatures):
        raise UserError(f"--temperatures {shown}: temperatures must be 0 or positive")
    if any(t == 0 for t in temperatures[1:]):
        raise UserError(f"--temperatures {shown}: only the first may be 0; the rest sample")


@dataclass(frozen=True)
class DecodingOptions:
    """How generate decodes: the temperature schedule, the two tests that trigger it, and the
    no-speech test. `temperatures[0]` is the first decode (0: greedy / beam search), the rest
    the fallback, which runs with at least two temperatures and one threshold. A threshold of
    None turns that test off."""

    temperatures: tuple[float, ...] = DEFAULT_TEMPERATURES
    compression_ratio_threshold: float | None = DEFAULT_COMPRESSION_RATIO_THRESHOLD
    logprob_threshold: float | None = DEFAULT_LOGPROB_THRESHOLD
    no_speech_threshold: float | None = DEFAULT_NO_SPEECH_THRESHOLD
    seed: int = DEFAULT_SEED  # sampling seed: the same inputs give the same fallback outputs

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperatures", tuple(float(t) for t in self.temperatures))
        _check_temperatures(self.temperatures, ",".join(map(str, self.temperatures)))

    @property
    def fallback(self) -> bool:
        """Whether a failed decode is ever decoded again."""
        has_test = (
            self.compression_ratio_threshold is not None or self.logprob_threshold is not None
        )
        return len(self.temperatures) > 1 and has_test

    def fails(self, candidate: Decoded) -> bool:
        """Whether `candidate` fails a test (too repetitive, or too unlikely)."""
        too_repetitive = (
            self.compression_ratio_threshold is not None
            and candidate.compression_ratio > self.compression_ratio_threshold
        )
        too_unlikely = (
            self.logprob_threshold is not None
            and candidate.avg_logprob is not None
            and candidate.avg_logprob < self.logprob_threshold
        )
        return too_repetitive or too_unlikely

    def silent(self, candidate: Decoded) -> bool:
        """Whether `candidate` is silence: its no-speech probability over the threshold and its
        mean log-prob under --logprob-threshold (that test off: the probability alone decides,
        as in openai-whisper and faster-whisper)."""
        probability = candidate.no_speech_prob
        if self.no_speech_threshold is None or probability is None:
            return False
        if probability <= self.no_speech_threshold:
            return False
        return self.logprob_threshold is None or (
            candidate.avg_logprob is not None and candidate.avg_logprob < self.logprob_threshold
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "temperatures": list(self.temperatures)}


# Greedy (or beam search) only, no temperature fallback (silence is still found).
NO_FALLBACK = DecodingOptions(temperatures=(0.0,))


@dataclass(frozen=True)
class Decoded:
    """One utterance's kept decode and how it was reached."""

    text: str
    tokens: tuple[int, ...]  # generated tokens, prompt and <|endoftext|> left out
    avg_logprob: float | None  # None when the fallback is off (no scores were asked for)
    compression_ratio: float
    temperature: float  # of the decode that was kept
    fallback: bool = False  # the first decode failed a test, so it was decoded again
    passed: bool = True  # the kept decode passes both tests (False: every temperature failed)
    # Multilingual models only (None on English-only ones): the language the text was decoded
    # in (its <|lang|> prompt token, as a code), and the one the model detects in the clip
    # with its probability, measured whether or not the decode was told a language.
    language: str | None = None
    detected_language: str | None = None
    detected_probability: float | None = None
    # The no-speech probability of the clip's window (None: not measured, the test is off), and
    # whether the decode was judged silence (its text and tokens then emptied).
    no_speech_prob: float | None = None
    no_speech: bool = False

    def report(self) -> dict:
        """The per-utterance figures of a JSON report."""
        logprob = None if self.avg_logprob is None else round(self.avg_logprob, 4)
        figures = {
            "temperature": self.temperature,
            "avg_logprob": logprob,
            "compression_ratio": round(self.compression_ratio, 4),
            "fallback": self.fallback,
        }
        if self.no_speech_prob is not None:
            figures.update(no_speech_prob=round(self.no_speech_prob, 4), no_speech=self.no_speech)
        if self.detected_language is not None:
            figures.update(
                language=self.language,
                detected_language=self.detected_language,
                detected_probability=round(self.detected_probability, 4),
            )
        return figures


# decode(rows, temperature) → one Decoded per row (the indices of the batch to decode).
DecodeFn = Callable[[list[int], float], list[Decoded]]


def choose(candidates: Sequence[Decoded], options: DecodingOptions) -> Decoded:
    """The decode to keep of one utterance's tries, in temperature order.

    The first that passes; when none does, faster-whisper's choice (its
    `generate_with_fallback`): the highest mean log-probability among the tries that are not
    repetitive, else among all. openai-whisper keeps the last try (temperature 1.0, the most
    random); the most likely non-looping try is the better transcript, and it keeps the two
    backends of `transcribe` (ours and faster-whisper) making the same choice.
    """
    for candidate in candidates:
        if not options.fails(candidate):
            return candidate
    limit = options.compression_ratio_threshold
    pool = [c for c in candidates if limit is None or c.compression_ratio <= limit]
    return max(
        pool or candidates, key=lambda c: -math.inf if c.avg_logprob is None else c.avg_logprob
    )


def decode_with_fallback(decode: DecodeFn, n: int, options: DecodingOptions) -> list[Decoded]:
    """Decode `n` utterances at `options.temperatures[0]`, then again at each later temperature
    only those whose latest decode failed and is not silence; returns the kept decode of each,
    in order, a silent one with no text."""

    def again(candidate: Decoded) -> bool:
        return options.fails(candidate) and not options.silent(candidate)

    first = decode(list(range(n)), options.temperatures[0])
    tries: list[list[Decoded]] = [[candidate] for candidate in first]
    pending = [i for i, candidate in enumerate(first) if again(candidate)]
    fell_back = set(pending) if options.fallback else set()
    if options.fallback:
        for temperature in options.temperatures[1:]:
            if not pending:
                break
            for i, candidate in zip(pending, decode(pending, temperature), strict=True):
                tries[i].append(candidate)
            pending = [i for i in pending if again(tries[i][-1])]
    kept = []
    for i, candidates in enumerate(tries):
        best = choose(candidates, options) if i in fell_back else candidates[0]
        if options.silent(best):
            best = _emptied(best)
        silent = best.no_speech
        kept.append(
            replace(best, fallback=i in fell_back, passed=silent or not options.fails(best))
        )
    return kept


@contextlib.contextmanager
def seeded(seed: int, device: torch.device | str | None = None) -> Iterator[None]:
    """torch's RNG seeded with `seed` inside, and given back untouched afterwards."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    cuda = []
    if device.type == "cuda":
        cuda = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        yield


# -- transformers' generate -----------------------------------------------------------------


def _rows_of(inputs: dict, rows: list[int], n: int) -> dict:
    """The generate inputs of some rows of the batch (all of them: `inputs` itself)."""
    if rows == list(range(n)):
        return inputs
    index = torch.tensor(rows)
    picked = {}
    for key, value in inputs.items():
        if key == "encoder_outputs":
            hidden = value.last_hidden_state
            picked[key] = BaseModelOutput(last_hidden_state=hidden[index.to(hidden.device)])
        elif isinstance(value, torch.Tensor):
            picked[key] = value[index.to(value.device)]
        else:
            picked[key] = value
    return picked


# Every generate call here decodes one window per utterance. Without this, transformers' Whisper
# generate treats two consecutive time tokens in a sampled output as a segment boundary and goes
# on to a "next window" of the same clip: from `encoder_outputs` (the fallback's input) it then
# fails in `_maybe_reduce_batch` (TypeError on 5.24: its `input_features` is None), and from
# `input_features` it returns only the last window's rows.
ONE_WINDOW = {"force_unique_generate_call": True}


def decoded_from_output(output, tokenizer, temperature: float) -> list[Decoded]:
    """generate's output (`return_dict_in_generate=True, output_scores=True`) → one Decoded per
    row: its tokens up to <|endoftext|>, text, mean log-prob and compression ratio."""
    eot = tokenizer.eos_token_id
    sequences = output.sequences
    steps = len(output.scores)
    # Every generated token has one score row (beam search's re-indexed to the kept beam by
    # Whisper's generate), so the generated tokens are the last `steps` of each sequence.
    generated = sequences[:, sequences.shape[1] - steps :]
    scale = temperature if temperature > 0 else 1.0
    # Step by step, not stacked: (batch, steps, vocab) floats would double generate's memory.
    chosen = (
        torch.stack(
            [
                torch.log_softmax(score.float() * scale, dim=-1)
                .gather(-1, generated[:, step : step + 1].to(score.device))
                .squeeze(-1)
                .cpu()
                for step, score in enumerate(output.scores)
            ],
            dim=1,
        )
        if steps
        else torch.zeros(sequences.shape[0], 0)
    )
    decoded = []
    for row, row_logprobs in zip(generated.tolist(), chosen, strict=True):
        length = row.index(eot) if eot in row else len(row)
        scored = min(length + 1, len(row))  # <|endoftext|>'s log-prob counts, as in openai-whisper
        avg_logprob = float(row_logprobs[:scored].sum()) / (length + 1)
        text = tokenizer.decode(row[:length], skip_special_tokens=True).strip()
        decoded.append(
            Decoded(
                text=text,
                tokens=tuple(row[:length]),
                avg_logprob=avg_logprob,
                compression_ratio=compression_ratio(text),
                temperature=temperature,
            )
        )
    return decoded


class _Window:
    """One batch of generate inputs (`input_features`, or an encoder cache's `encoder_outputs`)
    and the encoder outputs of its rows, each computed once however often a row is decoded."""

    def __init__(self, model, inputs: dict):
        self.model = model
        self.inputs = inputs
        self.n = batch_size(inputs)
        self.encoded: dict[int, torch.Tensor] = {}

    def rows(self, rows: list[int]) -> dict:
        """The generate inputs of `rows`, as given."""
        return _rows_of(self.inputs, rows, self.n)

    def encoder_outputs(self, rows: list[int]) -> dict:
        """`{"encoder_outputs": ...}` of `rows`, running the encoder only for rows not yet seen."""
        if "input_features" not in self.inputs:
            return self.rows(rows)
        missing = [row for row in rows if row not in self.encoded]
        if missing:
            features = self.rows(missing)["input_features"]
            with torch.no_grad():
                hidden = self.model.get_encoder()(features).last_hidden_state
            self.encoded.update(zip(missing, hidden, strict=True))
        hidden = torch.stack([self.encoded[row] for row in rows])
        return {"encoder_outputs": BaseModelOutput(last_hidden_state=hidden)}


def hf_decoder(
    model,
    inputs: dict,
    tokenizer,
    *,
    max_length: int | None,
    num_beams: int = 1,
    languages: Sequence[str] | None = None,
    window: _Window | None = None,
    no_speech: Sequence[float] | None = None,
    assistant: Assistant | None = None,
) -> DecodeFn:
    """A DecodeFn over one batch of generate inputs (`input_features`, or `encoder_outputs`);
    `max_length` None leaves it to the model's generation config. `languages` (multilingual
    models): the language of each row, as codes; None leaves it to the generation config.
    `no_speech`: each row's no-speech probability, carried by its decodes. `assistant` drafts
    the greedy decodes (the sampled ones are the model's alone: the same draws as without it)."""
    window = window or _Window(model, inputs)

    def decode(rows: list[int], temperature: float) -> list[Decoded]:
        kwargs: dict = {} if max_length is None else {"max_length": max_length}
        if temperature > 0:
            # Sampling from the whole distribution (top_k 0; transformers' default is 50), one
            # sample per temperature, as openai-whisper's transcribe() does without --best_of.
            kwargs.update(temperature=temperature, do_sample=True, top_k=0, num_beams=1)
        else:
            kwargs.update(num_beams=num_beams)
        if languages is not None:
            kwargs["language"] = language_argument([languages[row] for row in rows])
        # Sampled passes reuse the encoder outputs of the first (run once per row); so does a
        # first pass that detection already encoded.
        encoded = temperature > 0 or all(row in window.encoded for row in rows)
        batch = window.encoder_outputs(rows) if encoded else window.rows(rows)
        if temperature == 0 and assistant is not None:
            kwargs.update(assisted(assistant, model, batch, window.rows(rows)))
        output = model.generate(
            **batch, return_dict_in_generate=True, output_scores=True, **ONE_WINDOW, **kwargs
        )
        decoded = decoded_from_output(output, tokenizer, temperature)
        return [
            replace(
                item,
                language=None if languages is None else languages[row],
                no_speech_prob=None if no_speech is None else no_speech[row],
            )
            for row, item in zip(rows, decoded, strict=True)
        ]

    return decode


def generate_decoded(
    model,
    inputs: dict,
    tokenizer,
    *,
    max_length: int | None,
    num_beams: int = 1,
    options: DecodingOptions | None = None,
    languages: Sequence[str | None] | None = None,
    content_frames: Sequence[int] | None = None,
    assistant: Assistant | None = None,
) -> list[Decoded]:
    """Decode one batch of generate inputs with `options` (default: the fallback on);
    `assistant` (`transcription.assistant`, one clip a call) drafts the greedy decodes.

    On a multilingual model every row's language is detected first (one decoder step on its
    encoder output, which the decodes then reuse) and recorded; the row is decoded in
    `languages[row]` when given, else in the detected language, as openai-whisper does with no
    language. `languages` None: the generation config's language for every row when it has
    one, else each row's detected one. English-only models take no language (`languages` must
    be None or all None/"en").

    With `options.no_speech_threshold`, every row's no-speech probability is measured the same
    way, and a row judged silence (`DecodingOptions.silent`) is kept with no text; with
    `content_frames` (each row's frames of audio, `data.features.content_frames`) a row the model
    believes silent gets the runtimes' second look (`_runtime_look`).

    Without a fallback or the no-speech test, one plain generate call, as before either existed
    (no scores asked for: `avg_logprob` None, `tokens` the text tokens).
    """
    options = DecodingOptions() if options is None else options
    window = _Window(model, inputs)
    chosen: list[str] | None = None
    detected: list[tuple[str, float]] = []
    no_speech: list[float] | None = None
    multilingual = is_multilingual_generation(model)
    if multilingual or options.no_speech_threshold is not None:
        # One decoder step on [SOT] for both; the decodes then reuse its encoder outputs.
        every = window.encoder_outputs(list(range(window.n)))
        logits = sot_logits(model, every)
        if multilingual:
            detected = detect_languages(model, every, logits)
            chosen = chosen_languages(model, detected, languages)
        if options.no_speech_threshold is not None:
            no_speech = no_speech_probabilities(model, logits)
    if not options.fallback and options.temperatures[0] == 0 and no_speech is None:
        limit = {} if max_length is None else {"max_length": max_length}
        if chosen is not None:
            limit["language"] = language_argument(chosen)
        batch = window.encoder_outputs(list(range(window.n))) if chosen is not None else inputs
        limit.update(assisted(assistant, model, batch, inputs))
        ids = model.generate(**batch, num_beams=num_beams, **ONE_WINDOW, **limit)
        texts = [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]
        eot = tokenizer.eos_token_id
        plain = [
            Decoded(text, tuple(t for t in row if t < eot), None, compression_ratio(text), 0.0)
            for text, row in zip(texts, ids.tolist(), strict=True)
        ]
        kept = [replace(item, passed=not options.fails(item)) for item in plain]
    else:
        decode = hf_decoder(
            model,
            inputs,
            tokenizer,
            max_length=max_length,
            num_beams=num_beams,
            languages=chosen,
            window=window,
            no_speech=no_speech,
            assistant=assistant,
        )
        device = _first_device(inputs)
        with seeded(options.seed, device):
            kept = decode_with_fallback(decode, window.n, options)
        if "input_features" in inputs:
            kept = _runtime_look(
                model, inputs, tokenizer, kept, content_frames, chosen, options, max_length
            )
    if chosen is None:
        return kept
    return [
        replace(item, language=code, detected_language=found, detected_probability=p)
        for item, code, (found, p) in zip(kept, chosen, detected, strict=True)
    ]


def _runtime_look(
    model,
    inputs: dict,
    tokenizer,
    kept: list[Decoded],
    content_frames: Sequence[int] | None,
    languages: Sequence[str] | None,
    options: DecodingOptions,
    max_length: int | None,
) -> list[Decoded]:
    """`kept`, each row of digital silence emptied, and each the model believes silent (over
    the no-speech threshold) but decoded confidently judged as openai-whisper and faster-whisper
    judge it, from a greedy decode of its window padded their way (`runtime_padded`): silence
    under `logprob_threshold`, else that decode's text if it passes the tests."""
    if options.no_speech_threshold is None:
        return kept
    features = inputs["input_features"]
    kept = list(kept)
    # A window without one non-zero sample (its log-mel one value throughout) holds nothing to
    # hear: no text, whatever the model guesses there (tiny.en and base: a confident "you").
    flat = (features.amax(dim=(1, 2)) == features.amin(dim=(1, 2))).tolist()
    for row in (row for row, is_flat in enumerate(flat) if is_flat and not kept[row].no_speech):
        kept[row] = _emptied(kept[row])
    if options.logprob_threshold is None or content_frames is None:
        return kept  # the probability alone decides (and did), or no clip lengths to pad at
    believed = options.no_speech_threshold
    rows = [r for r, d in enumerate(kept) if not d.no_speech and (d.no_speech_prob or 0) > believed]
    if not rows:
        return kept
    picked = _rows_of(inputs, rows, len(kept))["input_features"]
    padded = {"input_features": runtime_padded(picked, [content_frames[row] for row in rows])}
    decode = hf_decoder(
        model,
        padded,
        tokenizer,
        max_length=max_length,
        languages=None if languages is None else [languages[row] for row in rows],
    )
    for row, look in zip(rows, decode(list(range(len(rows))), 0.0), strict=True):
        if look.avg_logprob is not None and look.avg_logprob < options.logprob_threshold:
            kept[row] = _emptied(kept[row])
        elif not options.fails(look):  # the runtimes' text, often none (<|endoftext|> at once)
            kept[row] = replace(look, no_speech_prob=kept[row].no_speech_prob)
    return kept


def _emptied(item: Decoded) -> Decoded:
    """`item` judged silence: no text, passing (nothing loops in silence)."""
    return replace(item, text="", tokens=(), compression_ratio=0.0, no_speech=True, passed=True)


def _first_device(inputs: dict) -> torch.device:
    if "encoder_outputs" in inputs:
        return inputs["encoder_outputs"].last_hidden_state.device
    return inputs["input_features"].device
