"""Scoring transcripts: normalise them, count word and character errors and loops.

The hypotheses come from `model.generate` (`evaluation.generation`), never from the argmax of
teacher-forced logits, which hides hallucination and looping. Figures are fractions (0.07 is
7 %) everywhere in the library and the JSON report; the CLI prints percentages.

Normalisers (`--normalizer`):
  english  Whisper's EnglishTextNormalizer (spellings, numbers, contractions, punctuation);
  basic    Whisper's BasicTextNormalizer (lower case, no punctuation), for other languages;
  none     only whitespace is collapsed.
The orthographic WER (raw text, case and punctuation count) is reported beside the normalised
one, as distil-whisper does, because fine-tuning often changes style more than words.

Empty references: an utterance whose reference is empty after normalisation has no words to
get wrong, so every word of its hypothesis counts as an insertion (a model that "hears" speech
in silence is penalised) and its own per-utterance WER is undefined (None). The corpus WER
divides all errors by all reference words; if every reference is empty it is undefined and
`score` raises UserError.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import jiwer
from whisper_normalizer.basic import BasicTextNormalizer
from whisper_normalizer.english import EnglishTextNormalizer

from whisper_train.errors import UserError

log = logging.getLogger(__name__)

NORMALIZERS = ("english", "basic", "none")
# Hallucination loops repeat a phrase; three words rarely repeat inside a real sentence.
LOOP_NGRAM = 3

Normalizer = Callable[[str], str]


# -- normalisation --------------------------------------------------------------------------


def _collapse_whitespace(text: str) -> str:
    return " ".join(text.split())


def normalizer_for(languages: Iterable[str | None]) -> str:
    """The default normaliser of texts in `languages` (codes; None: English-only model):
    `english` when they are all English, else `basic` (Whisper's English rules would mangle
    other languages' spellings and numbers)."""
    return "english" if all(code in (None, "en") for code in languages) else "basic"


def get_normalizer(name: str | None = None, language: str | None = None) -> Normalizer:
    """`english` | `basic` | `none` → text → normalised text (whitespace collapsed).

    With no name: `english` for English (or an unknown language), `basic` otherwise.
    """
    if name is None:
        name = "english" if language in (None, "en", "english") else "basic"
    if name == "english":
        english = EnglishTextNormalizer()
        return lambda text: _collapse_whitespace(english(text))
    if name == "basic":
        basic = BasicTextNormalizer()
        return lambda text: _collapse_whitespace(basic(text))
    if name == "none":
        return _collapse_whitespace
    raise UserError(f"--normalizer {name}: expected one of {', '.join(NORMALIZERS)}")


# -- scoring --------------------------------------------------------------------------------


@dataclass
class UtteranceScore:
    """One utterance: raw and normalised texts and its word-error counts (normalised)."""

    reference: str
    hypothesis: str
    normalized_reference: str
    normalized_hypothesis: str
    reference_words: int
    substitutions: int
    deletions: int
    insertions: int
    repeated_ngrams: int
    wer: float | None  # None when the normalised reference is empty

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions


@dataclass
class Scores:
    """Corpus-level figures (fractions) and the per-utterance rows they were summed from."""

    wer: float
    cer: float
    orthographic_wer: float
    substitutions: int
    deletions: int
    insertions: int
    reference_words: int
    insertion_rate: float  # insertions / reference words: hallucinated words
    # deletions / reference words: dropped words (in a long recording, a skipped window)
    deletion_rate: float
    repeated_ngram_rate: float  # repeated word 3-grams / all 3-grams in hypotheses: loops
    empty_output_rate: float  # hypotheses that are empty after normalisation
    n: int
    rows: list[UtteranceScore] = field(default_factory=list)

    def summary(self) -> dict:
        """Every corpus figure, without the rows."""
        return {k: v for k, v in asdict(self).items() if k != "rows"}


def word_counts(reference: str, hypothesis: str) -> tuple[int, int, int, int]:
    """(reference words, substitutions, deletions, insertions) for one utterance."""
    if not reference:
        return 0, 0, 0, len(hypothesis.split())
    if not hypothesis:
        n = len(reference.split())
        return n, 0, n, 0
    out = jiwer.process_words(reference, hypothesis)
    n = out.hits + out.substitutions + out.deletions
    return n, out.substitutions, out.deletions, out.insertions


def _char_counts(reference: str, hypothesis: str) -> tuple[int, int]:
    """(reference characters, character edits) for one utterance."""
    if not reference:
        return 0, len(hypothesis)
    if not hypothesis:
        return len(reference), len(reference)
    out = jiwer.process_characters(reference, hypothesis)
    return (
        out.hits + out.substitutions + out.deletions,
        out.substitutions + out.deletions + out.insertions,
    )


def _repeated_ngrams(words: Sequence[str], n: int = LOOP_NGRAM) -> tuple[int, int]:
    """(n-grams that already occurred earlier in the same text, all n-grams)."""
    seen: set[tuple[str, ...]] = set()
    repeated = 0
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    for gram in grams:
        repeated += gram in seen
        seen.add(gram)
    return repeated, len(grams)


def score(
    references: Sequence[str],
    hypotheses: Sequence[str],
    *,
    normalizer: Normalizer | str = "english",
) -> Scores:
    """WER, CER and hallucination figures of `hypotheses` against `references` (same order)."""
    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    normalize = get_normalizer(normalizer) if isinstance(normalizer, str) else normalizer
    rows: list[UtteranceScore] = []
    ref_chars = char_edits = ortho_words = ortho_errors = 0
    repeated = ngrams = empty_outputs = 0
    for reference, hypothesis in zip(references, hypotheses, strict=True):
        norm_ref, norm_hyp = normalize(reference), normalize(hypothesis)
        n_words, subs, dels, ins = word_counts(norm_ref, norm_hyp)
        n_chars, edits = _char_counts(norm_ref, norm_hyp)
        ref_chars, char_edits = ref_chars + n_chars, char_edits + edits
        o_words, o_subs, o_dels, o_ins = word_counts(
            _collapse_whitespace(reference), _collapse_whitespace(hypothesis)
        )
        ortho_words, ortho_errors = ortho_words + o_words, ortho_errors + o_subs + o_dels + o_ins
        row_repeated, row_ngrams = _repeated_ngrams(norm_hyp.split())
        repeated, ngrams = repeated + row_repeated, ngrams + row_ngrams
        empty_outputs += not norm_hyp
        rows.append(
            UtteranceScore(
                reference=reference,
                hypothesis=hypothesis,
                normalized_reference=norm_ref,
                normalized_hypothesis=norm_hyp,
                reference_words=n_words,
                substitutions=subs,
                deletions=dels,
                insertions=ins,
                repeated_ngrams=row_repeated,
                wer=(subs + dels + ins) / n_words if n_words else None,
            )
        )
    words = sum(row.reference_words for row in rows)
    if words == 0:
        raise UserError(
            f"all {len(rows)} references are empty after normalisation, so WER is undefined; "
            "check the transcripts in your data or pass --normalizer none (a set where nobody "
            "speaks is scored as one: give it as NAME:nonspeech=PATH)"
        )
    subs, dels, ins = (
        sum(getattr(r, k) for r in rows) for k in ("substitutions", "deletions", "insertions")
    )
    return Scores(
        wer=(subs + dels + ins) / words,
        cer=char_edits / ref_chars if ref_chars else 0.0,
        orthographic_wer=ortho_errors / ortho_words if ortho_words else 0.0,
        substitutions=subs,
        deletions=dels,
        insertions=ins,
        reference_words=words,
        insertion_rate=ins / words,
        deletion_rate=dels / words,
        repeated_ngram_rate=repeated / ngrams if ngrams else 0.0,
        empty_output_rate=empty_outputs / len(rows),
        n=len(rows),
        rows=rows,
    )


# -- text where nobody speaks (`evaluation.nonspeech`, and the pauses of long recordings) --

_WORD = re.compile(r"\w+")


def words_in(text: str) -> int:
    """Words of a transcript: runs of letters or digits (punctuation alone is none)."""
    return len(_WORD.findall(text))


@dataclass(frozen=True)
class NonSpeechScores:
    """What a model wrote on `clips` clips of non-speech lasting `seconds` in all."""

    clips: int
    seconds: float
    words: int
    clips_with_text: int

    @property
    def words_per_minute(self) -> float:
        return self.words / (self.seconds / 60) if self.seconds > 0 else 0.0

    @property
    def share_with_text(self) -> float:
        return self.clips_with_text / self.clips if self.clips else 0.0


def score_nonspeech(texts: Sequence[str], seconds: Sequence[float]) -> NonSpeechScores:
    """The scores of `texts[i]`, written on a clip of `seconds[i]` where nobody speaks."""
    counts = [words_in(text) for text in texts]
    return NonSpeechScores(
        clips=len(texts),
        seconds=float(sum(seconds)),
        words=sum(counts),
        clips_with_text=sum(count > 0 for count in counts),
    )
