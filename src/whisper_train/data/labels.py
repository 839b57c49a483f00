"""Turn a transcript into the decoder token sequence Whisper was trained on.

A label is a prefix, the text, and end-of-text:

    <|startoftranscript|> [<|lang|> <|task|>] [<|notimestamps|>]  text tokens  <|endoftext|>

English-only checkpoints (`*.en`) have no language or task token in their prefix. With
timestamps the `<|notimestamps|>` token is dropped and every segment is wrapped in a pair of
time tokens, `<|1.20|> Hello there<|2.48|>`, exactly as in Whisper's own training data. The
prefix is not a prediction target: `encode()` returns its length so the collator can mask it
with -100.

Every special token is looked up by its string (`convert_tokens_to_ids`), never by a hard-coded
id, so the same code serves tiny.en (sot 50257), multilingual checkpoints (sot 50258) and
large-v3 (one more language, shifted ids).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from whisper_train.audio import CHUNK_LENGTH
from whisper_train.choices import TASKS
from whisper_train.data.examples import is_nonspeech
from whisper_train.errors import UserError

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedTokenizerBase

# Whisper's time tokens step in 20 ms (one encoder position is 2 mel frames of 10 ms) and
# cover one 30 s window (`audio.CHUNK_LENGTH`): <|0.00|> ... <|30.00|>, 1501 tokens.
TIME_PRECISION = 0.02
N_TIME_TOKENS = round(CHUNK_LENGTH / TIME_PRECISION) + 1  # 1501
# How a clip of --nonspeech is labelled (`LabelEncoder.nonspeech_label`). BOTH_FORM, the
# default: the usual prefix, the empty transcript after it, and <|nospeech|> the target after
# <|startoftranscript|> (`collate`'s `nospeech_target`): the decoder is fed what transcribing
# feeds it, and learns both what the runtimes' no-speech test reads (the probability of
# <|nospeech|> there) and what greedy decoding then writes (nothing), which is what counts
# where that test lets a window through. NOSPEECH_FORM, <|startoftranscript|> <|nospeech|>
# <|endoftext|> alone, left the multilingual base's fine-tunes writing digits on noise;
# EMPTY_FORM, the empty transcript alone, left a word on a tone with tiny.en (BENCHMARKS.md
# "Text where nobody speaks"). $WHISPER_TRAIN_NONSPEECH_LABEL picks one for a new run, for the
# measurement (bench/nonspeech.py); the run's record keeps the one it trains
# (`config.resolve.choose_nonspeech`), and a resume continues with it.
NOSPEECH_FORM, EMPTY_FORM, BOTH_FORM = "nospeech", "empty", "both"
NONSPEECH_FORMS = (NOSPEECH_FORM, EMPTY_FORM, BOTH_FORM)
NONSPEECH_TAUGHT = {  # what each form teaches, in the words of the model card
    NOSPEECH_FORM: "<|nospeech|> alone",
    EMPTY_FORM: "the empty transcript",
    BOTH_FORM: "<|nospeech|> and the empty transcript",
}
NONSPEECH_LABEL = "WHISPER_TRAIN_NONSPEECH_LABEL"
DEFAULT_NONSPEECH_FORM = BOTH_FORM
# Whisper's decoder has 448 positions (`max_target_positions` of every OpenAI checkpoint; where
# a model is loaded, its config is the authority). What must not exceed it is a label's
# `decoder_positions` (below).
MAX_DECODER_TOKENS = 448


# -- a label's size --------------------------------------------------------------------------
# A label from `LabelEncoder.encode` is  prefix + body + <|endoftext|>: the prefix (n_prefix
# tokens, <|startoftranscript|> first) and the body (the transcript's tokens, time tokens
# included when timestamped). Its size is counted in decoder positions: the decoder reads every
# token but the last and predicts every token but the first (`collate`), so a label occupies
# one position fewer than it has tokens, <|endoftext|> taking the place <|startoftranscript|>
# leaves: positions = n_prefix + body. That is the labels tensor's length and what every limit
# bounds (MAX_DECODER_TOKENS, screening, check-data, a stream's label check, a packed window's
# budget). The whole label's length in tokens (`LabelEncoder.count_tokens`) is what the
# length-grouped sampler and the memory plan are given. Code converts between the three only
# with these functions, so the derivation above holds in one place.
def decoder_positions(n_tokens: int) -> int:
    """Decoder positions a label of `n_tokens` tokens occupies."""
    return n_tokens - 1


def label_length(positions: int) -> int:
    """Tokens of a label that occupies `positions` decoder positions."""
    return positions + 1


def body_length(n_tokens: int, n_prefix: int) -> int:
    """Tokens between the prefix and the <|endoftext|> of a label of `n_tokens` tokens."""
    return n_tokens - n_prefix - 1


def label_positions(n_prefix: int, body: int) -> int:
    """Decoder positions of a label with a prefix of `n_prefix` tokens and a body of `body`."""
    return decoder_positions(n_prefix + body + 1)


class _HasText(Protocol):
    """What `encode` needs from a `whisper_train.data.examples.Example`."""

    text: str
    language: str | None
    segments: tuple[tuple[float, float, str], ...]
    origin: str


def whisper_language_tables() -> tuple[dict[str, str], dict[str, str]]:
    """transformers' tables of Whisper's own languages: (code -> name, name -> code). Imported here: transformers takes a second or more to import, and `data` and
    `checkdata` read this module's limits without needing it."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

    return LANGUAGES, TO_LANGUAGE_CODE


def language_code(language: str | None, added: Collection[str] = ()) -> str | None:
    """'en', 'english', 'German', '<|de|>' → 'en' / 'de'; None stays None.

    `added`: codes a model adds to Whisper's (a run's --new-language, a model trained with one:
    `added_languages`); they pass too, and only where that model is the one in use.
    Raises UserError for a language Whisper does not know, with the spellings it accepts.
    """
    if language is None:
        return None
    key = language.strip().lower().removeprefix("<|").removesuffix("|>")
    if key in added:
        return key
    names, codes = whisper_language_tables()
    if key in names:
        return key
    if key in codes:
        return codes[key]
    raise UserError(
        f"language {language!r} is not one Whisper knows; use a code such as en, de, fr, zh "
        f"or a name such as english, german (all {len(names)} codes: "
        f"{', '.join(sorted(names))}), or teach the model a new one with train "
        "--new-language CODE"
    )


def added_languages(generation_config) -> tuple[str, ...]:
    """The language codes a model's generation config maps to a token that Whisper's own
    table lacks: those a run added with --new-language (`lang_to_id` is what generate and
    language detection read, so it is the model's list of languages)."""
    names, _ = whisper_language_tables()
    tokens = getattr(generation_config, "lang_to_id", None) or {}
    mapped = (token.removeprefix("<|").removesuffix("|>") for token in tokens)
    return tuple(code for code in mapped if code not in names)


# A code as it goes into a token and a --language flag: lower-case letters, 2 to 8 of them
# (ISO 639-1/-3 codes and Whisper's own, such as haw and yue, all fit).
NEW_LANGUAGE_CODE = re.compile(r"[a-z]{2,8}")


def check_new_language(code: str, init: str | None, *, multilingual: bool | None = None) -> str:
    """The code --new-language adds, checked without a model where a model is not needed:
    its spelling, a language Whisper has already (named), --new-language-init given and a
    language Whisper knows. `multilingual` False: an English-only model, refused."""
    key = code.strip().lower()
    if not NEW_LANGUAGE_CODE.fullmatch(key):
        raise UserError(
            f"--new-language {code}: expected a language code of 2 to 8 letters (e.g. eo)"
        )
    names, codes = whisper_language_tables()
    if key in names or key in codes:
        known = codes.get(key, key)
        raise UserError(
            f"--new-language {code}: Whisper already has {names[known].title()} ({known}); "
            f"train under its own token with --language {known}"
        )
    if init is None:
        raise UserError(
            f"--new-language {key} needs --new-language-init LANG: the language whose token "
            "the new one starts from (a neighbour, e.g. es for Esperanto)"
        )
    language_code(init)  # one line naming the codes Whisper knows
    if multilingual is False:
        raise UserError(
            f"--new-language {key} on an English-only checkpoint (*.en): it has no language "
            "tokens to add to; use a multilingual checkpoint such as base or "
            "openai/whisper-small"
        )
    return key


def generate_language(code: str) -> str:
    """transformers generate's `language` for a code: the code itself for Whisper's own
    languages, the token (<|eo|>) for an added one, which generate finds in `lang_to_id` only
    in that form (it checks every other spelling against its own table)."""
    names, _ = whisper_language_tables()
    return code if code in names else f"<|{code}|>"


def model_generate_language(language: str, generation_config) -> str:
    """`generate_language` of a language as a user spells it (a code or a name), the model's
    added languages accepted."""
    return generate_language(language_code(language, added_languages(generation_config)))


def _check_language_and_task(language: str | None, task: str, *, multilingual: bool) -> None:
    """Refuse what an English-only checkpoint cannot learn; `language` is already a code."""
    if task not in TASKS:
        raise UserError(f"--task {task}: expected one of {', '.join(TASKS)}")
    if multilingual:
        return
    if language not in (None, "en"):
        raise UserError(
            f"language {language!r} on an English-only checkpoint (*.en): it has no language "
            "tokens and only writes English; use a multilingual checkpoint such as "
            "openai/whisper-small instead of whisper-small.en"
        )
    if task == "translate":
        raise UserError(
            "--task translate on an English-only checkpoint (*.en): it cannot translate; use a "
            "multilingual checkpoint such as openai/whisper-small, or --task transcribe"
        )


class LabelEncoder:
    """Encodes examples into Whisper decoder labels for one model's tokenizer.

    Args:
        tokenizer: the model's Whisper tokenizer (slow or fast).
        language: default language for rows without their own (`Example.language` wins).
        task: "transcribe" or "translate".
        timestamps: emit time tokens for examples whose `segments` are known.
        multilingual: whether the checkpoint is multilingual (prefix carries language + task).
        added_languages: codes the model adds to Whisper's (`added_languages`), accepted as
            languages of rows and as the default.
        timestamp_probability: share of timestamped examples that get the timestamp form; the
            rest get the plain form, so the model keeps both skills (Whisper was trained on a
            mix; distil-whisper uses 50%).
        nonspeech_form: how a clip where nobody speaks is labelled (NONSPEECH_FORMS; the run's
            record holds its run's).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        language: str | None = None,
        task: str = "transcribe",
        timestamps: bool = False,
        multilingual: bool,
        added_languages: Collection[str] = (),
        timestamp_probability: float = 0.5,
        nonspeech_form: str = DEFAULT_NONSPEECH_FORM,
    ) -> None:
        if not 0.0 <= timestamp_probability <= 1.0:
            raise UserError(f"timestamp_probability {timestamp_probability}: must be in [0, 1]")
        self.tokenizer = tokenizer
        self.added_languages = tuple(added_languages)
        self.language = language_code(language, self.added_languages)
        self.task = task
        self.timestamps = timestamps
        self.multilingual = multilingual
        self.timestamp_probability = timestamp_probability
        _check_language_and_task(self.language, task, multilingual=multilingual)

        self.sot_id = self._token_id("<|startoftranscript|>")
        self.eot_id = self._token_id("<|endoftext|>")
        self.no_timestamps_id = self._token_id("<|notimestamps|>")
        # <|nospeech|> (<|nocaptions|> in older vocabularies): always the token before it.
        self.no_speech_id = self.no_timestamps_id - 1
        if nonspeech_form not in NONSPEECH_FORMS:
            raise ValueError(f"nonspeech_form {nonspeech_form!r}: one of {NONSPEECH_FORMS}")
        self.nonspeech_form = nonspeech_form
        self.task_id = self._token_id(f"<|{task}|>") if multilingual else None
        # Some tokenizer files (tiny.en's among them) do not list the time tokens; they always
        # follow <|notimestamps|> directly, which is also how transformers' generate finds them.
        self.timestamp_begin_id = self._token_id("<|0.00|>", fallback=self.no_timestamps_id + 1)

    # -- token ids ---------------------------------------------------------------------------
    def _token_id(self, token: str, *, fallback: int | None = None) -> int:
        """The id of a special token, or `fallback`; UserError if the tokenizer lacks it."""
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        # An unknown token maps to the unknown id, which for Whisper is <|endoftext|> itself.
        unknown = token_id is None or (
            token_id == self.tokenizer.unk_token_id and token != self.tokenizer.unk_token
        )
        if not unknown:
            return int(token_id)
        if fallback is not None:
            return fallback
        raise UserError(
            f"the tokenizer has no {token} token: this does not look like a Whisper tokenizer; "
            "load the model's own processor (tokenizer.json and added_tokens.json)"
        )

    def time_token_id(self, seconds: float) -> int:
        """The id of the time token nearest `seconds`, clamped to [0, 30] s."""
        index = round(min(max(seconds, 0.0), CHUNK_LENGTH) / TIME_PRECISION)
        return self.timestamp_begin_id + index

    def prefix_ids(self, language: str | None = None, timestamps: bool = False) -> list[int]:
        """The decoder prompt: [SOT] (+ [<|lang|>, <|task|>] if multilingual) (+ [<|notimestamps|>]).

        `language` (a code or name) defaults to the encoder's language; a multilingual model
        needs one.
        """
        code = language_code(language, self.added_languages) or self.language
        _check_language_and_task(code, self.task, multilingual=self.multilingual)
        ids = [self.sot_id]
        if self.multilingual:
            if code is None:
                raise UserError(
                    "a multilingual checkpoint needs the language of the speech: pass "
                    "--language (e.g. --language de) or add a `language` column to the data "
                    "(for an evaluation set: --eval-data NAME:LANG=PATH)"
                )
            ids += [self._token_id(f"<|{code}|>"), self.task_id]
        if not timestamps:
            ids.append(self.no_timestamps_id)
        return ids

    def text_ids(self, text: str) -> list[int]:
        """Tokens of one transcript, with the leading space the pretrained model writes; none
        for an empty one (a clip of --nonspeech in a packed window adds nothing)."""
        if not text.strip():
            return []
        return self.tokenizer.encode(" " + text.strip(), add_special_tokens=False)

    def nonspeech_label(self, language: str | None = None) -> tuple[list[int], int]:
        """(ids, n_prefix) of a clip where nobody speaks: the empty transcript after the prefix
        (BOTH_FORM, whose <|nospeech|> target the collator adds, and EMPTY_FORM; a
        multilingual model without a language states English, as a language must be stated),
        or <|startoftranscript|> <|nospeech|> <|endoftext|> (NOSPEECH_FORM)."""
        if self.nonspeech_form == NOSPEECH_FORM:
            return [self.sot_id, self.no_speech_id, self.eot_id], 1
        if (
            self.multilingual
            and language_code(language, self.added_languages) is None
            and self.language is None
        ):
            language = "en"
        prefix = self.prefix_ids(language)
        return prefix + [self.eot_id], len(prefix)

    @property
    def nospeech_target(self) -> int | None:
        """The target after SOT of a label with nothing to say (`collate`): <|nospeech|> where
        the form teaches it beside the empty transcript (BOTH_FORM), else None."""
        return self.no_speech_id if self.nonspeech_form == BOTH_FORM else None

    def fingerprint(self) -> str:
        """A digest of everything a label's length depends on: the tokenizer's vocabulary and
        rules, and this encoder's language, task, timestamps and prefix form."""
        digest = hashlib.blake2b(digest_size=16)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:  # a fast tokenizer serialises its whole pipeline
            digest.update(backend.to_str().encode())
        else:
            vocabulary = sorted(self.tokenizer.get_vocab().items())
            digest.update(json.dumps([type(self.tokenizer).__name__, vocabulary]).encode())
        settings = [self.language, self.task, self.timestamps, self.multilingual]
        digest.update(json.dumps(settings).encode())
        return digest.hexdigest()

    # -- labels ------------------------------------------------------------------------------
    def encode(self, example: _HasText, rng: random.Random | None = None) -> tuple[list[int], int]:
        """Label ids for one example, from <|startoftranscript|> to <|endoftext|> inclusive.

        Returns `(ids, n_prefix)`: `ids[:n_prefix]` is the prompt (SOT included) that the loss
        ignores. With timestamps on and segments known, the timestamp form is drawn with
        probability `timestamp_probability` from `rng` (default: a fresh unseeded draw).
        """
        use_timestamps = self.timestamps and bool(example.segments)
        if use_timestamps and self.timestamp_probability < 1.0:
            draw = (rng or random).random()
            use_timestamps = draw < self.timestamp_probability
        return self._encode(example, timestamps=use_timestamps)

    def count_tokens(self, example: _HasText) -> int:
        """Length of the longest label `encode` may produce for `example`."""
        timestamps = self.timestamps and bool(example.segments)
        return len(self._encode(example, timestamps=timestamps)[0])

    def count_tokens_batch(
        self, examples: Sequence[_HasText], *, chunk_size: int = 10_000
    ) -> list[int]:
        """`count_tokens` of every example, the transcripts tokenised `chunk_size` at a time.

        One tokenizer call per chunk instead of one per example: a fast tokenizer encodes a
        list in Rust, and the prefix is built once per (language, timestamps) pair.
        """
        counts: list[int] = []
        prefix_lengths: dict[tuple[str | None, bool], int] = {}
        for begin in range(0, len(examples), chunk_size):
            chunk = examples[begin : begin + chunk_size]
            timestamped = [self.timestamps and bool(example.segments) for example in chunk]
            texts: list[str] = []
            for example, timestamps in zip(chunk, timestamped, strict=True):
                if timestamps:
                    texts += [text for _, _, text in example.segments]
                else:
                    texts.append(example.text)
            lengths = iter(self._text_lengths(texts))
            for example, timestamps in zip(chunk, timestamped, strict=True):
                if is_nonspeech(example):
                    counts.append(len(self.nonspeech_label(example.language)[0]))
                    next(lengths)
                    continue
                key = (example.language, timestamps)
                if key not in prefix_lengths:
                    prefix_lengths[key] = len(self.prefix_ids(*key))
                if timestamps:  # a time token either side of every segment
                    body = sum(2 + next(lengths) for _ in example.segments)
                else:
                    body = next(lengths)
                counts.append(prefix_lengths[key] + body + 1)  # + <|endoftext|>
        return counts

    def decoder_tokens_batch(self, examples: Sequence[_HasText]) -> list[int]:
        """`decoder_tokens` of every example (see `count_tokens_batch`)."""
        return [decoder_positions(n) for n in self.count_tokens_batch(examples)]

    def _text_lengths(self, texts: list[str]) -> list[int]:
        """len(text_ids(text)) of every text, in one tokenizer call."""
        if not texts:
            return []
        empty = [not text.strip() for text in texts]  # no tokens, as `text_ids` gives them
        texts = [" " + text.strip() for text in texts]
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:  # the Rust tokenizer itself: transformers' wrapping costs more
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # no offsets
            lengths = [len(encoding.ids) for encoding in encode(texts, add_special_tokens=False)]
        else:
            encoded = self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)
            lengths = [len(ids) for ids in encoded["input_ids"]]
        return [0 if none else length for none, length in zip(empty, lengths, strict=True)]

    def decoder_tokens(self, example: _HasText) -> int:
        """`decoder_positions` of the longest label `encode` may produce for `example`. This,
        against the model's `max_target_positions`, is what both `train`'s screening and
        `check-data` measure."""
        return decoder_positions(self.count_tokens(example))

    def _encode(self, example: _HasText, *, timestamps: bool) -> tuple[list[int], int]:
        if is_nonspeech(example):
            return self.nonspeech_label(example.language)
        prefix = self.prefix_ids(example.language, timestamps=timestamps)
        body = self._timestamped_body(example) if timestamps else self.text_ids(example.text)
        return prefix + body + [self.eot_id], len(prefix)

    def _timestamped_body(self, example: _HasText) -> list[int]:
        """`<|t0|> text <|t1|>` per segment; times are seconds from the start of the clip.

        Subtitles often overlap by a few milliseconds; Whisper's time tokens never go back, so
        a segment that starts before the previous one ended is moved to start where it ended.
        """
        body: list[int] = []
        previous_end = 0.0
        for start, end, text in sorted(example.segments):
            start = max(start, previous_end)
            end = max(end, start)
            previous_end = end
            body.append(self.time_token_id(start))
            body += self.text_ids(text)
            body.append(self.time_token_id(end))
        return body


def with_language(examples: Sequence[_HasText], language: str | None) -> list:
    """`examples` with `language` (a code) set on those that state none; the same list when
    `language` is None. An evaluation set's stated language (`--eval-data NAME:LANG=PATH`)
    reaches its labels' prefix this way."""
    if language is None:
        return examples
    return [
        example if example.language else replace(example, language=language) for example in examples
    ]


def configure_generation(
    generation_config: GenerationConfig,
    *,
    language: str | None,
    task: str = "transcribe",
    multilingual: bool,
) -> GenerationConfig:
    """Set `generation_config.language` / `.task` so `generate()` skips language detection.

    English-only checkpoints get `None` for both (transformers refuses either on them), after
    checking that the request makes sense there. Returns the same (mutated) config.
    """
    code = language_code(language, added_languages(generation_config))
    _check_language_and_task(code, task, multilingual=multilingual)
    if multilingual:
        generation_config.language = None if code is None else generate_language(code)
        generation_config.task = task
    else:
        generation_config.language = None
        generation_config.task = None
    return generation_config
