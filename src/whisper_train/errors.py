"""Errors a user can cause and fix.

The CLI prints a `UserError` as one line (`error: ...`) and exits with code 2, no traceback.
Library callers get an ordinary exception they can catch. Every message names the input that
is wrong and what to do about it.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input (path, data, flag combination) with a remedy in the text."""


class RunRefused(UserError):
    """A refusal every process of a multi-process run reaches alike (a --resume whose record
    differs): the first process says it, the others stop without repeating it."""


class AudioError(UserError):
    """One clip could not be used. Training skips it (and counts it) unless `--strict`."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class AlreadySaid(UserError):
    """A user error a process of the run has printed already (its one line): the launching
    process adds none of its own, and exits as that process did."""


def last_line(error: BaseException) -> str:
    """The error's type and its last line: torch's RuntimeErrors put the cause last, after a
    line naming the C++ source ("[enforce fail at inline_container.cc:664] ...")."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1].strip()}" if lines else type(error).__name__


# The lines of torch.load's weights_only refusal that say what it refused (torch 2.6+ puts them
# between paragraphs of advice to load the file unsafely, which whisper-train never does).
_REFUSAL_MARKERS = ("WeightsUnpickler error:", "Trying to load unsupported GLOBAL")


def unpickling_refusal(error: BaseException) -> str | None:
    """What torch.load(weights_only=True) refused to build, in one sentence ("Unsupported
    global: GLOBAL argparse.Namespace ..."); None for any other error."""
    for line in str(error).splitlines():
        for marker in _REFUSAL_MARKERS:
            if marker in line:
                reason = line.strip().removeprefix("WeightsUnpickler error:").strip()
                return f"weights-only loading refused it: {reason.split('. ')[0].rstrip('.')}"
    return None
