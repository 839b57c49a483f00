"""Sizes in bytes, read and written one way: binary units, whatever the suffix says.

`--max-memory 4GB` and `--encoder-cache-max-size 10GB` mean GiB (what `nvidia-smi` and `df -h`
show), so every size the tool prints is in the same binary units, with the unit named. Shares
are printed as percentages with the digits they need (`format_share`).
"""

from __future__ import annotations

import math
import re

from whisper_train.errors import UserError

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", flags=re.IGNORECASE)


def parse_bytes(text: str, *, flag: str = "size") -> int:
    """'4GB' / '512MiB' / '1.5G' → bytes (decimal and binary suffixes are both taken as 2^30)."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise UserError(f"{flag} {text}: expected a size such as 4GB or 512MB")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** " KMGT".index(unit or " "))


def format_bytes(n_bytes: float) -> str:
    """Bytes in the largest binary unit they reach: '2.00 GiB', '512.00 MiB', '12 B'."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{int(n_bytes)} B"


__all__ = ["format_bytes", "parse_bytes"]


def format_share(share: float) -> str:
    """A share (0.2, 0.999) as a percentage with the decimals it needs ('20%', '99.9%'): never
    rounded to a value it is not (0.999 is not '100%', 0.001 not '0%'); at most 6 decimals."""
    percent = share * 100
    for decimals in range(7):
        text = f"{percent:.{decimals}f}"
        if math.isclose(float(text), percent, rel_tol=1e-9, abs_tol=1e-12):
            return f"{text}%"
    return f"{percent:.6f}".rstrip("0").rstrip(".") + "%"
