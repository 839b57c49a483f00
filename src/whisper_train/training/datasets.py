"""The run's data from its configuration: the training set (unless streamed) and every
evaluation set read, split, subset and screened before step 1, with what was skipped said once.

The recipe calls `prepare_datasets` and never needs to know how the data arrives: a streamed
`--data` is not read here but opened by its training data source (`data.source.StreamData`).
Each evaluation set's loader (`evaluation_loaders`) is made here too, for a run and for
`whisper-train average` over a finished one alike.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import WhisperProcessor

from whisper_train.audio import CHUNK_LENGTH
from whisper_train.config.record import EvalSet, RunRecord
from whisper_train.config.run import RunConfig
from whisper_train.data import streaming
from whisper_train.data.collate import SpeechCollator
from whisper_train.data.examples import Example, PackedExamples, Skip
from whisper_train.data.features import LogMel, SpeechDataset
from whisper_train.data.labels import LabelEncoder, label_length, with_language
from whisper_train.data.layouts import load_examples
from whisper_train.data.loaders import evaluation_loader
from whisper_train.data.nonspeech import (
    in_speech_languages,
    load_nonspeech,
    nonspeech_count,
    require_readable,
    training_nonspeech,
)
from whisper_train.data.prompts import longest_prompted_label
from whisper_train.data.recordings import load_recordings
from whisper_train.data.screening import (
    EMPTY_TRANSCRIPT,
    screen_set,
    split_examples,
    summarize_skips,
    unusable_until_one_passes,
)
from whisper_train.errors import UserError
from whisper_train.evaluation.evaluate import row_languages
from whisper_train.evaluation.longform import RECORDINGS_PER_BATCH, collate_recordings
from whisper_train.training.encoder_cache import CachedClip, EncoderCache, EncoderCacheCollator

log = logging.getLogger(__name__)


@dataclass
class Datasets:
    train: Sequence[Example]  # a PackedExamples from prepare_datasets
    eval: dict[str, list[Example]]  # evaluation set name → its utterances, in --eval-data order
    # `LabelEncoder.count_tokens` of each training utterance, counted once (by screening)
    train_label_tokens: list[int] | None = None
    # The longest label a training step may hold, a prompt counted where --prompt-probability
    # adds one: what the memory plan must fit (a stream's labels are unknown before step 1:
    # the longest the workers let through).
    longest_label_tokens: int | None = None

    def label_lengths(self, label_encoder: LabelEncoder) -> list[int]:
        """Every training label's length in tokens, counted at most once."""
        if self.train_label_tokens is None:
            self.train_label_tokens = label_encoder.count_tokens_batch(self.train)
        return self.train_label_tokens


def prepare_datasets(
    config: RunConfig,
    sets: Sequence[EvalSet],
    label_encoder: LabelEncoder,
    *,
    nonspeech: str | None,
    max_label_tokens: int,
    nonspeech_share: float = 0.0,
    nonspeech_seconds: float = CHUNK_LENGTH,
) -> Datasets:
    """Read, split, subset and screen the data and the evaluation `sets` (`config.resolve.
    evaluation_sets`), with the clips of `nonspeech` (`config.resolve.choose_nonspeech`; None:
    none), `nonspeech_share` of the epoch in pieces of at most `nonspeech_seconds`, mixed into
    training; report what was skipped and why."""
    d = config.data
    # A streamed --data is opened by its training data source (`data.source.StreamData`), never
    # read here; its evaluation sets are read whole like any other.
    streamed = config.stream_source() is not None
    examples = [] if streamed else load_examples(d.data, data_format=d.data_format)
    for eval_set in sets:
        if streaming.stream_source(eval_set.path) is not None and d.eval_data:
            raise UserError(
                f"--eval-data {eval_set.path}: evaluation sets are read whole, not streamed; "
                "give a manifest or folder layout (see `whisper-train check-data`)"
            )
    if sets and sets[0].split:  # a seeded split of --data
        train_examples, held_out = split_examples(examples, d.eval_split, config.train.seed)
        eval_sets = {sets[0].name: held_out}
    else:
        train_examples = examples
        # --data-format names --data's layout; each evaluation set's is detected on its own
        # (as on the streamed path: an evaluation set often comes from elsewhere). A set's stated
        # language (NAME:LANG=PATH) is its rows' label prefix too. A long-form set
        # (NAME:long=PATH) is read as whole recordings.
        # A non-speech set (NAME:nonspeech=PATH) is a folder of audio, any layout with empty
        # transcripts, or the built-in one.
        eval_sets = {s.name: with_language(_reader(s)(s.path), s.language) for s in sets}
    long_form = {s.name: s.long_form for s in sets}
    nonspeech_sets = {s.name for s in sets if s.nonspeech}
    if d.train_subset:
        train_examples = train_examples[: d.train_subset]
    if d.eval_subset:
        eval_sets = {name: subset[: d.eval_subset] for name, subset in eval_sets.items()}

    # The training set's audio headers are read before step 1 only under --strict (which must
    # stop on the first bad file); otherwise `SpeechDataset` checks each clip as it reads it, so
    # start-up costs no file access per row. Evaluation sets are read whole before step 1: each
    # evaluation scores the same utterances.
    train_screening = screen_set(
        train_examples, label_encoder, max_label_tokens, strict=d.strict, read_headers=d.strict
    )
    kept_train = [train_examples[index] for index in train_screening.kept]
    skipped = list(train_screening.skips)
    if not d.strict and (unusable := unusable_until_one_passes(kept_train)):
        kept_train, skipped = [], skipped + unusable
    kept_eval = {}
    for name, subset in eval_sets.items():
        if name in nonspeech_sets:
            # No transcript to screen; every clip is scored or the set refused before step 1.
            kept_eval[name] = require_readable(subset, name)
            continue
        # A long-form set's recordings are decoded whole: no 30 s or label-length limit (its
        # audio is still checked: missing or undecodable files are skipped and said).
        screening = screen_set(
            subset,
            label_encoder,
            sys.maxsize if long_form[name] else max_label_tokens,
            strict=d.strict,
            read_headers=True,
            max_seconds=math.inf if long_form[name] else CHUNK_LENGTH,
        )
        kept_eval[name] = [subset[index] for index in screening.kept]
        if subset and not kept_eval[name]:
            raise no_usable_eval_clips(next(s for s in sets if s.name == name), screening.skips)
        skipped += screening.skips
    if skipped:
        log.warning(summarize_skips(skipped))
    train_label_tokens = list(train_screening.label_tokens)
    if nonspeech and kept_train:
        # Clips where nobody speaks, --nonspeech-share of the epoch, their empty transcript
        # their label, in the speech's languages; never held out for evaluation.
        count = nonspeech_count(len(kept_train), nonspeech_share)
        extra = training_nonspeech(nonspeech, count, max_seconds=nonspeech_seconds)
        extra = in_speech_languages(extra, kept_train)
        kept_train += extra
        train_label_tokens += label_encoder.decoder_tokens_batch(extra)
    if not kept_train and not streamed:
        raise UserError(
            f"--data {d.data}: no usable training utterances after screening; "
            "run `whisper-train check-data` on it to see why"
        )
    # Screening counted decoder positions; the memory plan and the length sampler take whole
    # labels (`LabelEncoder.count_tokens`).
    label_tokens = [label_length(positions) for positions in train_label_tokens]
    longest = longest_prompted_label(
        max(label_tokens, default=max_label_tokens + 1), d.prompt_probability, max_label_tokens
    )
    # Packed now, so that no list of objects outlives start-up (see PackedExamples).
    return Datasets(PackedExamples(kept_train), kept_eval, label_tokens, longest)


def no_usable_eval_clips(eval_set: EvalSet, skips: Sequence[Skip]) -> UserError:
    """An evaluation set none of whose clips can be scored: its WER is undefined at every
    evaluation, so the run is refused before step 1, as `evaluate` refuses the set. A set of
    empty transcripts is one where nobody speaks: the NAME:nonspeech=PATH kind, scored by the
    words a model invents there."""
    named = (
        "--eval-split" if eval_set.split else f"--eval-data {eval_set.path} (set {eval_set.name})"
    )
    if skips and all(skip.reason == EMPTY_TRANSCRIPT for skip in skips):
        return UserError(
            f"{named}: all {len(skips)} transcripts are empty, so its WER is undefined; a set "
            f"where nobody speaks is scored by the words a model invents there: give it as "
            f"--eval-data {eval_set.name}:nonspeech={eval_set.path}"
        )
    return UserError(
        f"{named}: none of its {len(skips)} clips can be scored ({summarize_skips(skips)}); "
        "run `whisper-train check-data` on it to see why"
    )


def _reader(eval_set: EvalSet):
    if eval_set.nonspeech:
        return load_nonspeech
    return load_recordings if eval_set.long_form else load_examples


__all__ = ["Datasets", "prepare_datasets"]


# -- loaders ------------------------------------------------------------------------------


def batch_collator(
    processor: WhisperProcessor,
    encoder_cache: EncoderCache | None,
    language_targets: tuple[int, ...] = (),
    nospeech_target: int | None = None,
):
    """What makes a batch of a list of examples: log-mels and labels, or with the encoder
    cache, the cached encoder outputs in place of the clips'. `language_targets`: a run that
    adds a language learns to name each clip's; `nospeech_target`: the label encoder's
    (`data.collate`)."""
    log_mel = LogMel(processor.feature_extractor)
    pad_id = processor.tokenizer.pad_token_id

    def collator(examples):
        if encoder_cache is None:
            return SpeechCollator(
                pad_id,
                log_mel=log_mel,
                language_targets=language_targets,
                nospeech_target=nospeech_target,
            )
        return EncoderCacheCollator(
            pad_id, log_mel, encoder_cache, examples, language_targets, nospeech_target
        )

    return collator


def language_targets(record: RunRecord, model) -> tuple[int, ...]:
    """The language tokens a run that adds a language learns to predict after SOT (`data.collate`):
    every language the model maps; none for any other run."""
    return tuple(model.generation_config.lang_to_id.values()) if record.model.new_language else ()


def evaluation_loaders(
    record: RunRecord,
    *,
    processor: WhisperProcessor,
    label_encoder: LabelEncoder,
    datasets: Datasets,
    encoder_cache: EncoderCache | None,
    accelerator: Accelerator,
    targets: tuple[int, ...] = (),
) -> tuple[dict[str, DataLoader | list], dict[str, list | str | None]]:
    """This process's share of each evaluation set and the language each set is decoded in
    (a run's, and `whisper-train average`'s over a finished run). `targets`: the run's
    `language_targets`, so that a set's loss is the one training measures."""
    d = record.data
    collator = batch_collator(processor, encoder_cache, targets, label_encoder.nospeech_target)
    cached = CachedClip(encoder_cache) if encoder_cache is not None else None
    eval_loaders, eval_languages = {}, {}
    # Each set is decoded in its rows' languages, else its own, else each clip's detected
    # one: never the training language by default.
    for eval_set in record.evaluation.sets:
        name, examples = eval_set.name, datasets.eval[eval_set.name]
        eval_languages[name] = row_languages(
            examples, eval_set.language, label_encoder.added_languages
        )
        if eval_set.nonspeech:
            # Its clips themselves: every process decodes the whole (small) set, in its stated
            # language or each clip's detected one (`judge.RunEvaluations`).
            eval_loaders[name], eval_languages[name] = examples, eval_set.language
            continue
        if eval_set.long_form:
            # Whole recordings, read as each is decoded (no features, labels or encoder cache).
            eval_loaders[name] = evaluation_loader(
                list(enumerate(examples)),
                collate_recordings,
                batch_size=RECORDINGS_PER_BATCH,
                rank=accelerator.process_index,
                world=accelerator.num_processes,
                num_workers=0,
            )
            continue
        eval_dataset = SpeechDataset(
            examples, label_encoder, seed=record.training.seed, cached=cached
        )
        eval_loaders[name] = evaluation_loader(
            eval_dataset,
            collator(eval_dataset.examples),
            batch_size=d.clips_per_micro_batch,
            rank=accelerator.process_index,
            world=accelerator.num_processes,
            num_workers=d.num_workers,
        )
    return eval_loaders, eval_languages
