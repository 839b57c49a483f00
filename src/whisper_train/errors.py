"""Errors a user can cause and fix.

The CLI prints a `UserError` as one line (`error: ...`) and exits with code 2, no traceback.
Library callers get an ordinary exception they can catch. Every message names the input that
is wrong and what to do about it.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input (path, data, flag combination) with a remedy in the text."""


class AudioError(UserError):
    """One clip could not be used. Training skips it (and counts it) unless `--strict`."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")
