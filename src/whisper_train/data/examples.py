"""One utterance of training data (`Example`), a compact list of them, and a clip left out
(`Skip`): what every reader returns and every later stage takes."""

from __future__ import annotations

import array
import marshal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from whisper_train.audio import (
    NonFiniteAudio,
)
from whisper_train.errors import AudioError

# The origin of a clip of --nonspeech (`data.nonspeech`): where nobody speaks, its empty
# transcript is its label (`labels.LabelEncoder`), not a row missing its text.
NONSPEECH_ORIGIN = "nonspeech:"


def is_nonspeech(example) -> bool:
    """Whether `example` is a clip of --nonspeech: trained with an empty target."""
    return (getattr(example, "origin", "") or "").startswith(NONSPEECH_ORIGIN) and not example.text


# slots: a corpus holds one Example a row, and a __dict__ apiece costs ~100 bytes more each.
@dataclass(frozen=True, slots=True)
class Example:
    """One training utterance: a whole audio file, or the window [start, end) s of one."""

    audio: str  # absolute path of the audio file
    text: str  # the transcript of the whole example (of the window when start/end are set)
    language: str | None = None  # ISO code from the data (e.g. "en"), None when not given
    start: float | None = None  # window start in seconds within the file
    end: float | None = None  # window end in seconds within the file
    duration: float | None = None  # seconds, when the data states it (saves a header read)
    segments: tuple[tuple[float, float, str], ...] = ()  # (start, end, text) from window start
    origin: str = ""  # where the example came from, e.g. "train.jsonl:12", for messages
    # what was said just before it (the recording's previous window, a manifest's column): the
    # prompt of --prompt-probability (`data.prompts`); None when not known
    previous_text: str | None = None


class PackedExamples(Sequence[Example]):
    """Examples kept as one byte buffer (a `marshal` record each) instead of Python objects.

    A training set is read by forked DataLoader workers, and a list of objects there is copied
    page by page as each worker touches the objects' reference counts (a known PyTorch pitfall):
    every worker came to hold its own copy of the whole list (200,000 rows: 130 MB a worker,
    8 MB packed; bench/data_scale.py). A buffer and its offsets are two objects, so workers
    share them; they are also ~2.5x smaller (~150 bytes a row). An item is decoded when asked
    for (~1.5 us).
    """

    _FIELDS = (
        "audio",
        "text",
        "language",
        "start",
        "end",
        "duration",
        "segments",
        "origin",
        "previous_text",
    )

    def __init__(self, examples: Iterable[Example]):
        buffer, offsets = bytearray(), array.array("q", [0])
        for example in examples:
            buffer += marshal.dumps(tuple(getattr(example, name) for name in self._FIELDS))
            offsets.append(len(buffer))
        self._buffer = np.frombuffer(buffer, dtype=np.uint8)
        self._offsets = np.frombuffer(offsets, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index):  # int → Example, slice → list of Examples
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"example {index} of {len(self)}")
        begin, end = self._offsets[index], self._offsets[index + 1]
        return Example(*marshal.loads(self._buffer[begin:end]))


@dataclass(frozen=True)
class Skip:
    """An example set aside, and why (`reason` is one of a few categories): by screening before
    step 1, or by the data loader as it reads the clip (and then counted by the training loop)."""

    origin: str
    reason: str
    detail: str = ""


NON_FINITE_SAMPLES = "non-finite audio samples"  # a Skip's reason: NaN or inf in a float file


def decode_skip(origin: str, error: AudioError) -> Skip:
    """The `Skip` of a clip whose audio `load_audio` refused: non-finite samples, or audio that
    does not decode."""
    reason = NON_FINITE_SAMPLES if isinstance(error, NonFiniteAudio) else "unreadable audio"
    return Skip(origin, reason, error.reason)


__all__ = [
    "Example",
    "PackedExamples",
    "Skip",
    "decode_skip",
]
