"""The run's data from its configuration: the training set (unless streamed) and every
evaluation set read, split, subset and screened before step 1, with what was skipped said once.

The recipe calls `prepare_datasets` and never needs to know how the data arrives: a streamed
`--data` is not read here but opened by its training data source (`data.source.StreamData`).
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from whisper_train.audio import CHUNK_LENGTH
from whisper_train.config.record import EvalSet
from whisper_train.config.run import RunConfig
from whisper_train.data import streaming
from whisper_train.data.examples import Example, PackedExamples
from whisper_train.data.labels import LabelEncoder, label_length, with_language
from whisper_train.data.layouts import load_examples
from whisper_train.data.nonspeech import (
    load_nonspeech,
    nonspeech_count,
    require_readable,
    training_nonspeech,
)
from whisper_train.data.prompts import longest_prompted_label
from whisper_train.data.recordings import load_recordings
from whisper_train.data.screening import (
    screen_set,
    split_examples,
    summarize_skips,
    unusable_until_one_passes,
)
from whisper_train.errors import UserError

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
    max_label_tokens: int,
) -> Datasets:
    """Read, split, subset and screen the data and the evaluation `sets` (`config.resolve.
    evaluation_sets`); report what was skipped and why."""
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
    nonspeech = {s.name for s in sets if s.nonspeech}
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
        if name in nonspeech:
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
        skipped += screening.skips
    if skipped:
        log.warning(summarize_skips(skipped))
    train_label_tokens = list(train_screening.label_tokens)
    if d.nonspeech and kept_train:
        # Clips where nobody speaks, --nonspeech-share of the epoch, their empty transcript
        # their label; never held out for evaluation.
        extra = training_nonspeech(d.nonspeech, nonspeech_count(len(kept_train), d.nonspeech_share))
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


def _reader(eval_set: EvalSet):
    if eval_set.nonspeech:
        return load_nonspeech
    return load_recordings if eval_set.long_form else load_examples


__all__ = ["Datasets", "prepare_datasets"]
