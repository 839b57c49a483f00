"""The export check: does the export transcribe as its source does, in the export's runtime?

Like with like: the source (transformers) transcribes the check clips greedily (`score_source`:
`--check-data`'s first clips, or synthesised English, `check_clips`), and the export's own
runtime (faster-whisper's CTranslate2, whisper.cpp, openai-whisper, transformers) scores exactly
those tokens, teacher forced, from its own log-mel of the same audio (the format's row of
`formats.registry`: its `scores`, from `formats.runtimes`). The check (`check_export`, a
`ParityCheck` of one `ClipComparison` per clip) fails when the mean |Δ log p| per token exceeds
what the runtime's arithmetic explains at the source's confidence in those tokens
(`logprob_tolerance`), when its vocabulary spells a transcript differently, or when the runtime
cannot run it (`parity_failure` words the `ExportParityError`). Each runtime's own greedy
transcripts are compared too, for the report only: two runtimes' greedy decoders tip near-tied
words apart even on bit-identical weights (base as ct2 float16, bitwise equal to Systran's
conversion, differed in 7 words of 126).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

from whisper_train.audio import load_audio
from whisper_train.data.layouts import load_examples
from whisper_train.data.synth import synthesize
from whisper_train.errors import UserError
from whisper_train.evaluation.scoring import get_normalizer, score, word_counts
from whisper_train.formats.registry import export_format
from whisper_train.formats.runtimes import (
    MissingRuntimeError,
    detect_language,
    prompt_ids,
    transformers_greedy_tokens,
    transformers_scores,
)
from whisper_train.models import is_multilingual

log = logging.getLogger(__name__)

# The largest mean |log p_source - log p_export| per token of the source's transcripts, in nats,
# by the arithmetic the export's runtime scores in (logprob_tolerance says where they come from).
LOGPROB_TOLERANCE = {"float32": 0.005, "float16": 0.05, "int8": 0.1}
# The mean 2 (1 - p) of the tokens those bounds were measured on (tiny.en's greedy transcripts of
# the 12 synthesised clips: 0.31; base's: 0.27): the scale of |Δ log p| at which they hold
# (`logprob_tolerance`).
CALIBRATION_UNCERTAINTY = 0.31
CHECK_CLIPS = 12
# Spoken by espeak-ng when no --check-data is given: everyday sentences, about 110 words, so
# that one near-tied word is under 1% of the check.
CHECK_SENTENCES = (
    "open the door and turn on the light in the kitchen",
    "my brother plays football every saturday afternoon",
    "there are twelve eggs in the box on the table",
    "turn left at the church and walk for five minutes",
    "i would like a cup of tea with milk and sugar",
    "the train to london leaves at half past seven in the morning",
    "please put the books back on the shelf when you are done",
    "we planted tomatoes and beans in the garden last spring",
    "the meeting has been moved to thursday at three o'clock",
    "she bought a new coat because the winter was very cold",
    "can you tell me where the nearest bus stop is",
    "the children were playing in the park until it started to rain",
)


class ExportParityError(UserError):
    """The exported model transcribes clearly worse than the model it came from."""


@dataclass
class ClipComparison:
    """One check clip: the source's transcript scored by both sides, and each side's own
    greedy transcript (informative)."""

    name: str  # the audio file's name, or "synthesised #N"
    reference: str
    source: str  # the source's greedy transcript: the tokens both sides score
    exported: str  # the export's own greedy transcript in its runtime (informative)
    spelled: str  # the source's tokens turned into text by the export's runtime
    deviations: np.ndarray  # |log p_source - log p_export| of each token, in nats
    words: int  # in the source's transcript, normalised
    errors: int  # word edits turning the source's transcript into the export's (informative)
    # 2 (1 - p_source) of each token: how far a logit error reaches its log p (`uncertainty`)
    uncertainties: np.ndarray | None = None

    @property
    def spelled_alike(self) -> bool:
        return self.spelled == self.source


@dataclass
class ParityCheck:
    """The export against its source, like with like: the export's runtime scores the tokens of
    the source's transcripts (teacher forcing) and spells them with its own vocabulary."""

    runtime: str
    language: str | None  # forced in both decoders (None: an English-only model)
    clips: list[ClipComparison]
    tolerance: float  # the largest mean |Δ log p| per token the precision explains, in nats
    quantization: str
    arithmetic: str  # what the runtime computed in (scoring_arithmetic)
    source_wer: float  # against the references: context, not the test
    export_wer: float
    runtime_error: str | None = None  # the runtime could not load or run the export
    left_out: int = 0  # check clips not scored: their transcripts overflow the decoder
    uncertainty: float | None = None  # the scored tokens' mean 2 (1 - p_source), where known

    @property
    def tokens(self) -> int:
        return sum(len(clip.deviations) for clip in self.clips)

    @property
    def deviation(self) -> float:
        """Mean |Δ log p| per token over every clip's tokens (nan: no tokens to score)."""
        if not self.tokens:
            return math.nan
        return float(np.concatenate([clip.deviations for clip in self.clips]).mean())

    @property
    def misspelled(self) -> list[ClipComparison]:
        return [clip for clip in self.clips if not clip.spelled_alike]

    @property
    def passed(self) -> bool:
        return (
            self.runtime_error is None
            and self.tokens > 0
            and self.deviation <= self.tolerance
            and not self.misspelled
        )

    @property
    def words(self) -> int:
        return sum(clip.words for clip in self.clips)

    @property
    def word_errors(self) -> int:
        return sum(clip.errors for clip in self.clips)

    @property
    def differing(self) -> list[ClipComparison]:
        return [clip for clip in self.clips if clip.errors]

    def summary(self) -> str:
        if self.runtime_error is not None:
            return f"{self.runtime} could not run the export: {self.runtime_error}"
        if not self.clips:
            return f"no check clip scored through {self.runtime}{self.left_out_note()}"
        worst = max(self.clips, key=lambda clip: clip.deviations.max(initial=0.0))
        return (
            f"the source's transcripts of {len(self.clips)} clips ({self.tokens} tokens) scored "
            f"through {self.runtime}: mean |Δ log p| {self.deviation:.4f} nats per token "
            f"(allowed {self.tolerance:.3g} for {self.quantization} in {self.arithmetic} "
            f"arithmetic{self.scale_note()}; largest "
            f"{worst.deviations.max(initial=0.0):.3f} in {worst.name}), "
            f"{len(self.clips) - len(self.misspelled)}/{len(self.clips)} spelled alike by its "
            f"vocabulary; greedy transcripts (informative): {self.word_errors} of {self.words} "
            f"words differ, WER against the references {100 * self.export_wer:.1f}% exported vs "
            f"{100 * self.source_wer:.1f}% source{self.left_out_note()}"
        )

    def scale_note(self) -> str:
        if self.uncertainty is None or self.uncertainty <= CALIBRATION_UNCERTAINTY:
            return ""
        return (
            f" at this model's uncertainty, mean 2(1-p) {self.uncertainty:.2f} against "
            f"{CALIBRATION_UNCERTAINTY}"
        )

    def left_out_note(self) -> str:
        if not self.left_out:
            return ""
        return (
            f"; {self.left_out} more clip(s) left out: their transcripts exceed the decoder's "
            "positions"
        )


def scoring_arithmetic(format: str, quantization: str) -> str:
    """The precision the export's runtime computes in when the check scores it: what bounds the
    difference from the source. int8 weights are int8 arithmetic in every runtime that holds
    them; float16 weights alone change nothing measurable (CTranslate2 converts them to float32
    on a CPU; openai-whisper's model holds float32); float16 arithmetic does (whisper.cpp
    always, CTranslate2 on a GPU): each format's row says (`ExportFormat.arithmetic`)."""
    if quantization.startswith("int8"):
        return "int8"
    return export_format(format).arithmetic(quantization)


def logprob_tolerance(arithmetic: str, uncertainty: float | None = None) -> float:
    """The largest mean |Δ log p| per token of the source's transcripts an intact export shows,
    by `scoring_arithmetic`, for tokens of mean 2 (1 - p) `uncertainty` (p the source's
    probability of each token).

    Measured (BENCHMARKS.md, "The export check, like with like") over the 12 synthesised clips
    on tiny.en and base: float32 arithmetic (float32 or float16 weights in CTranslate2 or
    openai-whisper on a CPU) 0.0000 nats; whisper.cpp's float16 arithmetic 0.0074 (tiny.en)
    and 0.0172 (base); int8 0.029 (tiny.en) and 0.021 (base). Each bound is about 3x the
    largest of these. A q/k pair swapped in tiny.en's first decoder layer, the subtlest
    breakage measured, moved float16 weights 0.044 (caught in float32 arithmetic) and int8
    0.062 (within int8's own noise: not caught).

    Those tokens were mostly confident (mean 2 (1 - p) 0.31, `CALIBRATION_UNCERTAINTY`), and
    |Δ log p| follows the uncertainty: log p_i moves by (e_i - p)·Δz for logit errors Δz, at
    most 2 (1 - p_i) max|Δz|, so a token the source is sure of hides the runtime's logit error
    and a token it guesses carries all of it. The bound therefore grows with the tokens' mean
    2 (1 - p) above the calibration's: an untrained 2-layer student of tiny.en, whose greedy
    tokens have p ~ 0.01, showed 0.04-0.07 nats in whisper.cpp, while its logit error per unit
    of 2 (1 - p) (0.020) was the teacher's (0.025); the same model's ggml file was scored
    bit-identically to tiny.en's with the two left-out layers made to add nothing.
    """
    tolerance = LOGPROB_TOLERANCE.get(arithmetic, LOGPROB_TOLERANCE["int8"])
    if uncertainty is None:
        return tolerance
    return tolerance * max(1.0, uncertainty / CALIBRATION_UNCERTAINTY)


def check_clips(
    check_data: str | None, n_clips: int = CHECK_CLIPS
) -> list[tuple[str, np.ndarray, str, str | None]]:
    """(name, audio, reference, language) of the first `n_clips` of `check_data`, or of
    synthesised English speech."""
    if check_data is not None:
        examples = load_examples(check_data)[:n_clips]
        return [
            (
                Path(e.audio).name,
                load_audio(e.audio, start=e.start, end=e.end),
                e.text,
                e.language,
            )
            for e in examples
        ]
    return [
        (f"synthesised #{i + 1}", synthesize(text), text, "en")
        for i, text in enumerate(CHECK_SENTENCES[:n_clips])
    ]


def check_language(model, processor, clips) -> str | None:
    """The one language both sides are forced to: None for English-only models; else the
    language the check data states, or the one the model was fine-tuned for (its generation
    config), or English for the synthesised clips, or the source's detection on the first clip."""
    if not is_multilingual(model):
        return None
    synthesised = clips[0][0].startswith("synthesised")
    stated = [language for _, _, _, language in clips if language]
    if stated and not synthesised:
        if len(set(stated)) > 1:
            log.info("the check data states several languages; forcing %s (the first)", stated[0])
        return language_code(stated[0])
    pinned = getattr(model.generation_config, "language", None)
    if pinned:
        return language_code(pinned)
    if synthesised:
        return "en"
    return detect_language(model, processor, clips[0][1])


def language_code(language: str) -> str:
    """`<|de|>`, `german` or `de` -> `de`."""
    language = language.strip("<|>").lower()
    return TO_LANGUAGE_CODE.get(language, language)


@dataclass
class SourceSide:
    """What the source made of the check clips: its greedy transcripts, their tokens, and its
    own teacher-forced scores of them."""

    clips: list
    language: str | None
    prompt: list[int]
    texts: list[str]
    tokens: list[list[int]]
    scores: list  # formats.runtimes.TokenScores per clip
    left_out: int = 0  # clips whose transcripts no runtime can hold whole (`fits_the_decoder`)


def fits_the_decoder(prompt: list[int], tokens: list[int], positions: int) -> bool:
    """Whether the prompt, the transcript `tokens` and <|endoftext|> fit the decoder's
    `positions` (its max_target_positions, 448): what every runtime holds. A longer greedy
    transcript was cut by the length limit, not ended, and CTranslate2's scoring (which feeds
    <|endoftext|> too) refuses it ("No position encodings are defined for positions >= 448")."""
    return len(prompt) + len(tokens) + 1 <= positions


def score_source(model, processor, clips, language: str | None) -> SourceSide:
    """The source's greedy transcripts of `clips` and its scores of their tokens (before the
    export is written: saving in float16 converts `model` in place). Clips whose transcript
    does not fit the decoder (`fits_the_decoder`) are left out of the check, and one line says
    how many."""
    audio = [clip[1] for clip in clips]
    texts, tokens = transformers_greedy_tokens(model, processor, audio, language)
    prompt = prompt_ids(processor.tokenizer, is_multilingual(model), language)
    positions = model.config.max_target_positions
    kept = [i for i, ids in enumerate(tokens) if fits_the_decoder(prompt, ids, positions)]
    if len(kept) < len(clips):
        names = [clip[0] for i, clip in enumerate(clips) if i not in kept]
        log.info(
            "export check: %d of %d clips left out (%s%s): their transcripts with the %d-token "
            "prompt and <|endoftext|> exceed the %d decoder positions the runtimes hold",
            len(names),
            len(clips),
            ", ".join(names[:3]),
            ", ..." if len(names) > 3 else "",
            len(prompt),
            positions,
        )
    left_out = len(clips) - len(kept)
    clips, audio = [clips[i] for i in kept], [audio[i] for i in kept]
    texts, tokens = [texts[i] for i in kept], [tokens[i] for i in kept]
    scores = transformers_scores(model, processor, audio, prompt, tokens)
    return SourceSide(clips, language, prompt, texts, tokens, scores, left_out)


def check_export(
    source: SourceSide, format: str, output: Path, quantization: str, *, greedy: bool = True
) -> ParityCheck:
    """The export at `output` against `source`, in the export's own runtime.

    The verdict rests on teacher forcing: the runtime scores the source's transcript tokens from
    its own log-mel of the same audio, and the mean |Δ log p| per token must stay within what
    the precision explains; its vocabulary must spell every transcript as the source's does.
    The runtime's own greedy transcripts are compared too (unless not `greedy`), for the report
    only: a near-tied word tipped by another runtime's arithmetic is not a defect of the file.
    """
    exported_format = export_format(format)
    audio = [clip[1] for clip in source.clips]
    runtime = exported_format.runtime
    arithmetic = scoring_arithmetic(format, quantization)
    if not source.clips:  # every clip left out (`score_source`): nothing to score
        return _unscored(source, runtime, quantization, arithmetic, runtime_error=None)
    try:
        # The folder or the file its runtime loads, once our reader accepted what was written.
        model_input = exported_format.accepted_input(output)
        exported_format.require_client()
        scores = exported_format.scores(model_input, audio, source.prompt, source.tokens)
        exported = (
            exported_format.greedy(model_input, audio, source.language) if greedy else source.texts
        )
    except UserError as exc:
        if isinstance(exc, MissingRuntimeError):
            raise
        error = str(exc)
    except Exception as exc:  # the runtime's own refusal of a damaged file, in its words
        error = f"{type(exc).__name__}: {exc}"
    else:
        check = compare(
            source,
            scores,
            exported,
            runtime=runtime,
            quantization=quantization,
            arithmetic=arithmetic,
        )
        check.left_out = source.left_out
        return check
    runtime_error = error.splitlines()[0][:300] if error else "no message"
    return _unscored(source, runtime, quantization, arithmetic, runtime_error=runtime_error)


def _unscored(source, runtime, quantization, arithmetic, *, runtime_error) -> ParityCheck:
    """A check that scored no clip: every clip left out, or the runtime refused the file."""
    return ParityCheck(
        runtime=runtime,
        language=source.language,
        clips=[],
        tolerance=logprob_tolerance(arithmetic),
        quantization=quantization,
        arithmetic=arithmetic,
        source_wer=math.nan,
        export_wer=math.nan,
        runtime_error=runtime_error,
        left_out=source.left_out,
    )


def compare(
    source: SourceSide,
    scores,
    exported: list[str],
    *,
    runtime: str,
    quantization: str,
    arithmetic: str,
) -> ParityCheck:
    """Per clip: the token log-probabilities' differences, the spelling, and (informative) the
    word differences between the greedy transcripts."""
    normalize = get_normalizer(None, source.language)
    rows = []
    for (name, _, reference, _), text, theirs, ours, exp in zip(
        source.clips, source.texts, scores, source.scores, exported, strict=True
    ):
        words, subs, dels, ins = word_counts(normalize(text), normalize(exp))
        deviations = np.abs(np.asarray(ours.logprobs) - np.asarray(theirs.logprobs))
        uncertainties = 2 * (1 - np.exp(np.asarray(ours.logprobs, dtype=np.float64)))
        rows.append(
            ClipComparison(
                name,
                reference,
                text,
                exp,
                theirs.text,
                deviations,
                words,
                subs + dels + ins,
                uncertainties,
            )
        )
    references = [reference for _, _, reference, _ in source.clips]
    scored = [row.uncertainties for row in rows if len(row.uncertainties)]
    uncertainty = float(np.concatenate(scored).mean()) if scored else None
    return ParityCheck(
        runtime=runtime,
        language=source.language,
        clips=rows,
        tolerance=logprob_tolerance(arithmetic, uncertainty),
        quantization=quantization,
        arithmetic=arithmetic,
        source_wer=score(references, source.texts, normalizer=normalize).wer,
        export_wer=score(references, exported, normalizer=normalize).wer,
        uncertainty=uncertainty,
    )


def parity_failure(check: ParityCheck, format: str) -> ExportParityError:
    """The failure message: what differs (scores, spelling, the runtime's refusal), each clip
    concerned, advice that fits the finding."""
    lines = [f"export check failed: {check.summary()}"]
    for clip in check.misspelled:
        lines += [
            f"  {clip.name}: the export's vocabulary spells the source's tokens differently",
            f"    source: {clip.source!r}",
            f"    export: {clip.spelled!r}",
        ]
    if check.runtime_error is None and check.deviation > check.tolerance:
        worst = sorted(
            check.clips,
            key=lambda clip: -float(clip.deviations.mean()) if len(clip.deviations) else 0.0,
        )
        for clip in worst[:3]:
            lines.append(
                f"  {clip.name}: mean |Δ log p| {clip.deviations.mean():.3f} over "
                f"{len(clip.deviations)} tokens of {clip.source!r} (export's own transcript: "
                f"{clip.exported!r})"
            )
    if check.runtime_error is None and not check.tokens and check.left_out:
        advice = (
            f"every check clip's transcript ({check.left_out}) exceeded the decoder's positions, "
            "so there was nothing to score: pass --check-data with shorter transcripts"
        )
    elif check.runtime_error is None and not check.tokens:
        advice = (
            "the source transcribed none of the check clips, so there was nothing to score: "
            "pass --check-data with speech the model transcribes"
        )
    elif check.quantization.startswith("int8") and not check.misspelled and not check.runtime_error:
        advice = (
            "int8 moved the scores more than int8 rounding does elsewhere: try --quantization "
            "float16 (or float32), and please report it"
        )
    else:
        advice = (
            "the precision does not explain this, so the conversion itself is suspect: please "
            "report it with the lines above"
        )
    lines.append(f"  the export was written to its folder anyway; {advice}")
    return ExportParityError("\n".join(lines))
