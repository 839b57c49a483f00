"""Writing a file atomically: a reader sees the old file or the whole new one, never a part.

Whatever whisper-train leaves for a later run or another process to read (a cache entry, a
model's config) is written to a temporary file beside the target and renamed over it
(`os.replace`, atomic within one file system on POSIX). A process killed mid-write, a full disk
or a reader arriving early finds either no file or a whole one; the temporary is removed when
the write fails. There is no fsync (the encoder cache writes thousands of files): this guards
against a killed process, not a power cut, after which some file systems can show a file
renamed just before it as empty.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from whisper_train.errors import UserError


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[BinaryIO]:
    """A binary file to write `path`'s content into; it becomes `path` only when the block
    exits normally. An exception in the block (a failed check, a full disk, Ctrl-C) leaves
    `path` as it was and removes the temporary file."""
    # Beside the target so that the rename stays within one file system. The name is unique to
    # this writer (processes and threads writing the same target never share a temporary) and
    # "x" opens it only if new. Created by open() itself, so its permissions are what a plain
    # open() leaves (0o666 less the umask), not tempfile.mkstemp's owner-only 0o600.
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    file = temporary.open("xb")  # outside the try: a name that was taken is not ours to remove
    try:
        with file:
            yield file
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_atomically(path: Path, data: bytes | str) -> None:
    """`data` as the whole content of `path` (a str as UTF-8), through `atomic_output`."""
    with atomic_output(path) as file:
        file.write(data.encode("utf-8") if isinstance(data, str) else data)


def check_output_path(path: str | Path, flag: str, *, folder: bool) -> None:
    """Refuse, in one line naming `flag path`, an output that cannot be written, before any work
    is done for it: a file where a folder must be (or above it), a folder where a file must be,
    a place nothing can be created in (read-only, /proc). Asked by trying: `os.access` answers
    yes to root everywhere, /proc included, and a full evaluation or a run's set-up must not be
    spent before the write fails."""
    path = Path(path)
    existing = next(p for p in (path, *path.parents) if p.exists() or p == Path(p.anchor or "."))
    kind = "folder" if folder else "file"
    if existing.exists() and not existing.is_dir() and (folder or existing != path):
        where = f"{existing} is a file" if existing != path else "is a file"
        raise UserError(f"{flag} {path}: {where}; choose a {kind} path")
    if not folder and existing == path and path.is_dir():
        raise UserError(f"{flag} {path}: is a folder; choose a file path")
    place = existing if existing.is_dir() else existing.parent
    try:
        probe = place / f".whisper-train-probe-{secrets.token_hex(8)}"
        probe.open("xb").close()
        probe.unlink()
    except OSError as exc:
        raise UserError(
            f"{flag} {path}: nothing can be written in {place} ({exc.strerror or exc}); "
            f"choose another {kind}"
        ) from None


__all__ = ["atomic_output", "check_output_path", "write_atomically"]
