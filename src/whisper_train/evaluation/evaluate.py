"""Evaluating a model on sets of examples: generation (`evaluation.generation`), scoring
(`evaluation.scoring`), language identification, the JSON report, and `whisper-train evaluate`.

WER here always comes from `model.generate`, never from teacher-forced logits; see
`evaluation.scoring` for the normalisers and how empty references count."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from whisper_train.audio import N_SAMPLES, load_audio
from whisper_train.config import require_positive
from whisper_train.data.collate import IGNORE_INDEX
from whisper_train.data.features import LogMel, content_frames
from whisper_train.data.labels import added_languages, language_code
from whisper_train.data.layouts import load_examples
from whisper_train.data.recordings import load_recordings
from whisper_train.errors import AudioError, UserError
from whisper_train.evaluation.generation import generate_texts
from whisper_train.evaluation.longform import decode_recordings, pause_figures
from whisper_train.evaluation.report import write_comparison
from whisper_train.evaluation.scoring import (
    NonSpeechScores,
    Normalizer,
    Scores,
    get_normalizer,
    normalizer_for,
    score,
)
from whisper_train.files import check_output_path, write_atomically
from whisper_train.memory import training_loss
from whisper_train.models import Assistant, load_assistant, load_model, resolve_alias
from whisper_train.runfolder import EVALUATION_DIR, REPORT_FILES, run_folder_of
from whisper_train.runlog import progress_bars_wanted
from whisper_train.transcription.decoding import Decoded, DecodingOptions

log = logging.getLogger(__name__)


# -- evaluating a list of examples ----------------------------------------------------------


@dataclass
class EvalReport:
    """What `evaluate_examples` measured; `audio[i]` is the clip of `scores.rows[i]`."""

    model: str
    normalizer: str
    language: str | None
    scores: Scores
    audio: list[str]
    skipped: list[dict]  # {"audio", "reason"} for clips that could not be read
    seconds: float
    # How each transcript was decoded (`decoded[i]` is the decode of `scores.rows[i]`) and with
    # which options; empty / None for a report built elsewhere.
    decoded: list[Decoded] = field(default_factory=list)
    decoding: DecodingOptions | None = None
    # The language each clip is in, where the data (a `language` column) or the user
    # (--language) says it; what the model's detected language is scored against.
    expected_languages: list[str | None] = field(default_factory=list)
    # Which rows were decoded long-form (`long_form[i]` for `scores.rows[i]`: a recording over
    # 30 s, or every row of a NAME:long set), and whether windows saw the previous text.
    long_form: list[bool] = field(default_factory=list)
    condition_on_previous_text: bool = False
    # What was written in the pauses of the recordings with cue times (None: no such pause).
    pauses: NonSpeechScores | None = None
    assistant: str | None = None  # the model that drafted for this one (--assistant), or None

    @property
    def long_form_recordings(self) -> int:
        return sum(self.long_form)

    @property
    def detected_languages(self) -> dict[str, int]:
        """{language code: clips detected in it}, most frequent first (`detected_counts`)."""
        return detected_counts(self.decoded)

    @property
    def language_id(self) -> LanguageId | None:
        """Language identification on the clips whose language is known (None: not measured,
        an English-only model or no stated language)."""
        return language_id(self.expected_languages, self.decoded)

    @property
    def fallbacks(self) -> int:
        """Utterances whose first decode failed the fallback's tests (looped, or unlikely) and
        were decoded again: a model that needs the fallback stays visible in the report."""
        return sum(item.fallback for item in self.decoded)

    @property
    def silenced(self) -> int:
        """Utterances judged silence (the no-speech test) and given no text."""
        return sum(item.no_speech for item in self.decoded)

    @property
    def unresolved(self) -> int:
        """Utterances that failed the tests at every temperature (the best try was kept)."""
        return sum(item.fallback and not item.passed for item in self.decoded)

    @property
    def wer(self) -> float:
        return self.scores.wer

    @property
    def cer(self) -> float:
        return self.scores.cer


@dataclass(frozen=True)
class LanguageId:
    """How often the detected language was the stated one, over `n` clips."""

    correct: int
    n: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.n


def language_id(expected: Sequence[str | None], decoded: Sequence[Decoded]) -> LanguageId | None:
    """Detected vs stated language over the clips that have both; None when there are none."""
    pairs = [
        (want, item.detected_language)
        for want, item in zip(expected, decoded, strict=False)
        if want is not None and item.detected_language is not None
    ]
    if not pairs:
        return None
    return LanguageId(sum(want == found for want, found in pairs), len(pairs))


def detected_counts(decoded: Iterable[Decoded]) -> dict[str, int]:
    """{language code: clips detected in it}, most frequent first."""
    counts: dict[str, int] = {}
    for item in decoded:
        if item.detected_language is not None:
            counts[item.detected_language] = counts.get(item.detected_language, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def row_languages(
    examples: Iterable, default: str | None, added: tuple[str, ...] = ()
) -> list[str | None]:
    """The language each example is decoded in on a multilingual model: its own `language`
    (the data's column), else `default` (the set's), else None: detected from its audio.
    `added`: the model's languages beyond Whisper's (`added_languages`)."""
    default = language_code(default, added)
    return [language_code(example.language, added) or default for example in examples]


def _feature_batches(
    examples,
    processor,
    batch_size: int,
    skipped: list[dict],
    kept: list,
    default_language: str | None = None,
    longer: list | None = None,
    added: tuple[str, ...] = (),
):
    """Examples → batches {"input_features": (batch, n_mels, 3000), "texts", "languages"}
    (`row_languages`); bad clips skipped; clips over 30 s appended to `longer` (to be decoded
    long-form: the log-mel of one window would silently keep only their first 30 s)."""
    log_mel = LogMel(processor.feature_extractor)
    for first in range(0, len(examples), batch_size):
        clips, texts = [], []
        for example in examples[first : first + batch_size]:
            try:
                clips.append(load_audio(example.audio, start=example.start, end=example.end))
            except AudioError as exc:
                skipped.append({"audio": example.audio, "reason": exc.reason})
                continue
            if longer is not None and len(clips[-1]) > N_SAMPLES:
                longer.append(example)
                clips.pop()
                continue
            texts.append(example.text)
            kept.append(example)
        if clips:
            languages = row_languages(kept[-len(clips) :], default_language, added)
            yield {
                "input_features": log_mel(clips),
                "content_frames": content_frames(clips),
                "texts": texts,
                "languages": languages,
                "size": len(clips),
            }


@torch.no_grad()
def run_evaluation(
    model,
    loader,
    processor,
    accelerator,
    normalizer: Normalizer | None,
    max_length: int,
    step: int,
    decoding: DecodingOptions | None = None,
    languages: Sequence[str | None] | None = None,
) -> dict:
    """Evaluation during training: validation loss (teacher-forced, mean over all label
    tokens) and WER of generated transcripts, gathered over processes (each evaluates its share
    of the loader). Returns a metrics row: {"step", "eval_loss", "wer", "repeated_ngram_rate",
    "insertion_rate", "deletion_rate"}, plus on a multilingual model the languages detected
    (`detected_languages`: {code: clips}) and, where `languages` states them,
    `language_id_accuracy`.

    `languages`: the language of each example of the loader's dataset (indexed by the batch's
    `indices`), a code or None (detect it); None: the model's generation config decides.
    `normalizer` None: `normalizer_for` the languages the clips were decoded in.

    `loader` holds this process's share of the set (`data.loaders.evaluation_loader`: each clip
    on one process, every process the same number of batches, some empty); the shares are
    brought together once, at the end, so every clip is scored once (`clips` in the row)."""
    was_training = model.training
    model.eval()
    loss_and_tokens = torch.zeros(2, device=accelerator.device)  # summed token losses, tokens
    references, hypotheses, decoded, expected = [], [], [], []
    # Without DDP's wrapper (its autocast kept): a DDP forward may hold collectives, and a
    # process whose share ran out runs fewer forwards than the others.
    unwrapped = accelerator.unwrap_model(model)
    for batch in loader:
        if not batch["size"]:  # a share padded to the others' length, or no readable clip
            continue
        if languages is not None:
            batch = {**batch, "languages": [languages[i] for i in batch["indices"].tolist()]}
        n_tokens = (batch["labels"] != IGNORE_INDEX).sum().float()
        loss_and_tokens += torch.stack(
            [training_loss(unwrapped, batch).detach().float() * n_tokens, n_tokens]
        )
        details: list[Decoded] = []
        texts = generate_texts(
            unwrapped, processor, [batch], max_length=max_length, decoding=decoding, details=details
        )
        references.extend(batch["texts"])
        hypotheses.extend(texts)
        decoded.extend(details)
        expected.extend(batch.get("languages") or [None] * len(texts))
    model.train(was_training)
    if accelerator.num_processes > 1:
        # Every process, whatever its share (none included), joins these two collectives.
        loss_and_tokens = accelerator.reduce(loss_and_tokens, reduction="sum")
        shares = gather_object([(references, hypotheses, decoded, expected)])
        references, hypotheses, decoded, expected = (
            [item for share in shares for item in share[column]] for column in range(4)
        )
    loss_sum, n_tokens = loss_and_tokens.tolist()
    if not references:
        return {"step": step, "eval_loss": float("nan"), "wer": float("nan")}
    if normalizer is None:
        normalizer = get_normalizer(normalizer_for(item.language for item in decoded))
    scores = score(references, hypotheses, normalizer=normalizer)
    row = {
        "step": step,
        "eval_loss": round(loss_sum / max(n_tokens, 1.0), 6),
        "wer": round(scores.wer, 6),
        "clips": len(references),
        # Loops and hallucinated words: what a WER drop on the target set can hide.
        "repeated_ngram_rate": round(scores.repeated_ngram_rate, 6),
        "insertion_rate": round(scores.insertion_rate, 6),
        "deletion_rate": round(scores.deletion_rate, 6),
    }
    if counts := detected_counts(decoded):
        row["detected_languages"] = counts
    if (identified := language_id(expected, decoded)) is not None:
        row["language_id_accuracy"] = round(identified.accuracy, 6)
    return row


def evaluate_examples(
    model,
    processor,
    examples: Sequence,
    *,
    batch_size: int = 8,
    normalizer: str | None = None,
    language: str | None = None,
    max_length: int = 225,
    num_beams: int = 1,
    model_name: str = "",
    progress: bool = False,
    decoding: DecodingOptions | None = None,
    long_form: bool = False,
    condition_on_previous_text: bool = False,
    assistant: Assistant | None = None,
) -> EvalReport:
    """Transcribe `examples` (whisper_train.data.examples.Example) and score them against their text.

    On a multilingual model each clip is decoded in its own `language` (the data's), else in
    `language`, else in the model's configured one, else in the language detected in it
    (openai-whisper's rule); every clip's detected language is recorded, and scored against
    the stated ones. `normalizer` None: `normalizer_for` the languages decoded in.

    `decoding`: the temperature fallback (None: on, openai-whisper's defaults); the report
    counts the utterances that needed it. Loop figures are scored on the kept transcripts.
    `progress`: a bar on a terminal, else a line every tenth of the batches (a log file).

    Clips over 30 s, and every clip when `long_form`, are decoded long-form
    (`evaluation.longform`: 30 s windows with timestamps, with the previous windows' text when
    `condition_on_previous_text`) and scored over their whole reference; their rows come after
    the others'. `assistant`: speculative decoding (`transcription.assistant`), the same text."""
    decoding = DecodingOptions() if decoding is None else decoding

    started = time.perf_counter()
    added = added_languages(model.generation_config)
    language = language_code(language, added)
    default = language or language_code(getattr(model.generation_config, "language", None), added)
    skipped: list[dict] = []
    kept: list = []
    examples = list(examples)
    longer: list = list(examples) if long_form else []
    windowed = [] if long_form else examples
    batches = _feature_batches(
        windowed, processor, batch_size, skipped, kept, default, longer, added
    )
    total = -(-len(windowed) // batch_size)
    show_bar = progress and progress_bars_wanted()
    if progress and not show_bar:
        batches = _progress_lines(batches, total, len(windowed), started)
    batches = tqdm(batches, total=total, desc="evaluate", unit="batch", disable=not show_bar)
    decoded: list[Decoded] = []
    hypotheses = generate_texts(
        model,
        processor,
        batches,
        max_length=max_length,
        num_beams=num_beams,
        decoding=decoding,
        details=decoded,
        assistant=assistant,
    )
    short = len(kept)
    pause_scores = None
    if longer:
        recordings = decode_recordings(
            model,
            processor,
            longer,
            beam_size=num_beams,
            decoding=decoding,
            condition_on_previous_text=condition_on_previous_text,
            languages=row_languages(longer, default, added),
            skipped=skipped,
            progress=progress,
            assistant=assistant,
        )
        kept += recordings.examples
        hypotheses += recordings.texts
        decoded += recordings.decoded
        pause_scores = recordings.pause_scores
    if not kept:
        first = skipped[0] if skipped else {"audio": "?", "reason": "no clips"}
        raise UserError(
            f"none of the {len(examples)} clips could be read; the first, {first['audio']}: "
            f"{first['reason']}"
        )
    if normalizer is None:
        normalizer = normalizer_for(item.language for item in decoded)
    scores = score([e.text for e in kept], hypotheses, normalizer=get_normalizer(normalizer))
    return EvalReport(
        model=model_name,
        normalizer=normalizer,
        language=language,
        expected_languages=row_languages(kept, language, added),
        scores=scores,
        audio=[e.audio for e in kept],
        skipped=skipped,
        seconds=time.perf_counter() - started,
        decoded=decoded,
        decoding=decoding,
        long_form=[index >= short for index in range(len(kept))],
        condition_on_previous_text=condition_on_previous_text,
        pauses=pause_scores,
        assistant=None if assistant is None else assistant.spec,
    )


def _progress_lines(batches, total: int, clips: int, started: float):
    """The batches, with a line on stderr after about every tenth of them: where no bar is
    drawn (a log file, a pipe), a long evaluation still says how far it got."""
    every = max(1, total // 10)
    done = 0
    for number, batch in enumerate(batches, start=1):
        yield batch  # transcribed before the generator is asked for the next one
        done += batch["size"]
        if number % every == 0 or number == total:
            seconds = time.perf_counter() - started
            print(
                f"evaluate: {done} of {clips} clips transcribed in {seconds:.0f} s",
                file=sys.stderr,
                flush=True,
            )


def report_to_dict(report: EvalReport) -> dict:
    """The JSON report: top-level `wer`, `cer`, `n`, every corpus figure, the fallback count
    (`fallback_utterances`) and decoding options, then the utterances (each with its
    temperature, mean log-prob, compression ratio and whether it needed the fallback)."""
    utterances = []
    n = len(report.scores.rows)
    decoded = report.decoded or [None] * n
    expected = report.expected_languages or [None] * n
    long_form = report.long_form or [False] * n
    for audio, row, item, want, whole in zip(
        report.audio, report.scores.rows, decoded, expected, long_form, strict=True
    ):
        utterance = {"audio": audio, **asdict(row), "errors": row.errors, "long_form": whole}
        if item is not None:
            utterance.update(item.report())
            if want is not None and item.detected_language is not None:
                utterance["stated_language"] = want
        utterances.append(utterance)
    identified = report.language_id
    languages = {}
    if counts := detected_counts(item for item in decoded if item is not None):
        languages["detected_languages"] = counts
    if identified is not None:
        languages["language_id_accuracy"] = round(identified.accuracy, 6)
        languages["language_id_clips"] = identified.n
    return {
        "model": report.model,
        "normalizer": report.normalizer,
        "language": report.language,
        **languages,
        **report.scores.summary(),
        "fallback_utterances": report.fallbacks,
        "no_speech_utterances": report.silenced,
        "fallback_unresolved": report.unresolved,
        "long_form_recordings": report.long_form_recordings,
        **(pause_figures(report.pauses) if report.pauses is not None else {}),
        "condition_on_previous_text": report.condition_on_previous_text,
        "decoding": report.decoding.to_dict() if report.decoding is not None else None,
        "assistant": report.assistant,
        "seconds": round(report.seconds, 3),
        "skipped": report.skipped,
        "utterances": utterances,
    }


def write_report_json(report: EvalReport, path: str | Path) -> Path:
    return write_json(report_to_dict(report), path)


def write_json(data: dict, path: str | Path) -> Path:
    """A report as readable JSON, written whole or not at all (a killed run leaves no half)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return path


# -- an evaluation, as `whisper-train evaluate` runs it -------------------------------------


@dataclass
class Evaluation:
    """What `evaluate` produced: the model's report, the baseline's (or None), and the report
    files written ([] when none was asked for)."""

    report: EvalReport
    baseline: EvalReport | None = None
    paths: list[Path] = field(default_factory=list)


def report_paths(
    model: str, *, output: str | Path | None = None, baseline: str | None = None
) -> list[Path]:
    """The report files an evaluation writes: [report.json, (baseline .json, .md, .png)].

    `output` is a file or a folder (which gets report.json). Without it, a comparison
    (`baseline`) goes into the run folder of `model` when it is one (RUN/evaluation/, beside
    the model it describes), else into the current folder; a lone evaluation writes nothing.
    """
    if output:
        path = Path(output)
        if path.is_dir() or str(output).endswith(("/", "\\")):
            path = path / REPORT_FILES[0]
    elif baseline:
        run = run_folder_of(Path(resolve_alias(model)).expanduser())
        path = (run / EVALUATION_DIR if run else Path.cwd()) / REPORT_FILES[0]
    else:
        return []
    if not baseline:
        return [path]
    return [
        path,
        path.with_name(path.stem + ".baseline.json"),
        path.with_suffix(".md"),
        path.with_suffix(".png"),
    ]


def evaluate(
    model: str,
    data: str | Path,
    *,
    data_format: str | None = None,
    output: str | Path | None = None,
    overwrite: bool = False,
    baseline: str | None = None,
    normalizer: str | None = None,
    batch_size: int = 8,
    eval_subset: int | None = None,
    language: str | None = None,
    beam_size: int = 1,
    max_length: int = 225,
    on_report: Callable[[str, EvalReport], None] | None = None,
    decoding: DecodingOptions | None = None,
    long_form: bool = False,
    condition_on_previous_text: bool = False,
    assistant: str | None = None,
) -> Evaluation:
    """Transcribe `data` with the model `model` (a spec: folder, hub id, run folder, tiny.en)
    and score it; with `baseline`, the same for that model and a comparison (report.md,
    report.png). Reports are written where `report_paths` says; existing ones are refused
    unless `overwrite`. `on_report("model" | "baseline", report)` is called as each model is
    scored, before the next one starts. `decoding`: the temperature fallback, the same for
    both models (None: on, with openai-whisper's defaults). `long_form`: `data` is long
    recordings, read whole (`data.recordings`) and decoded long-form; clips over 30 s are
    decoded long-form in any case (`evaluate_examples`). `assistant` drafts for `model` only."""
    require_positive("--batch-size", batch_size)
    require_positive("--beam-size", beam_size)
    require_positive("--max-length", max_length)
    if eval_subset is not None:
        require_positive("--eval-subset", eval_subset)
    examples = (load_recordings if long_form else load_examples)(data, data_format=data_format)
    if eval_subset:
        examples = examples[:eval_subset]
    if not examples:
        raise UserError(f"--data {data}: no utterances found")
    if not any(example.text.strip() for example in examples):  # said before decoding them all
        raise UserError(
            f"--data {data}: all {len(examples)} transcripts are empty, so its WER is "
            "undefined; a set where nobody speaks is scored by the words a model invents "
            f"there: give it as --data NAME:nonspeech={data}"
        )
    # None: chosen from the languages the model's clips are decoded in (`normalizer_for`); the
    # baseline is then scored with the model's choice, so the two are comparable.
    # Refuse before the (long) transcription, not after it.
    paths = report_paths(model, output=output, baseline=baseline)
    for path in paths:  # a report that cannot be written: said now, not after the work
        check_output_path(path, "--output" if output else "the report", folder=False)
    existing = [path for path in paths if path.exists()]
    if existing and not overwrite:
        flag = f"--output {output}" if output else "the default report location"
        raise UserError(
            f"{flag}: {existing[0]} already exists; add --overwrite to replace it, or pass "
            "another --output"
        )

    def run(spec: str, role: str) -> EvalReport:
        nonlocal normalizer
        loaded, processor = load_model(spec)
        if torch.cuda.is_available():
            loaded = loaded.to("cuda")
        aide = load_assistant(assistant, loaded, processor, beam_size) if role == "model" else None
        report = evaluate_examples(
            loaded,
            processor,
            examples,
            batch_size=batch_size,
            normalizer=normalizer,
            language=language,
            max_length=max_length,
            num_beams=beam_size,
            model_name=spec,
            progress=True,
            decoding=decoding,
            long_form=long_form,
            condition_on_previous_text=condition_on_previous_text,
            assistant=aide,
        )
        normalizer = report.normalizer
        if on_report is not None:
            on_report(role, report)
        return report

    result = Evaluation(run(model, "model"))
    if not paths:
        return result
    write_report_json(result.report, paths[0])
    if baseline:
        result.baseline = run(baseline, "baseline")
        _, baseline_json, markdown, png = paths
        write_report_json(result.baseline, baseline_json)
        write_comparison(result.baseline, result.report, markdown_path=markdown, png_path=png)
    result.paths = paths
    return result
