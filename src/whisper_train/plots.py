"""matplotlib, when the `plots` extra is installed: `make setup` leaves it out (~90 MB of a
demo's venv), and each picture not drawn is said in one line instead."""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display; must precede pyplot's import
    import matplotlib.pyplot as plt
except ImportError:
    plt = None

PLOTS_MISSING = "matplotlib is not installed: no {name}; pip install -e '.[plots]' draws it"


def missing(path: str | Path) -> bool:
    """Whether matplotlib is missing; then one line says which picture is not drawn."""
    if plt is None:
        print(PLOTS_MISSING.format(name=Path(path).name), file=sys.stderr, flush=True)
    return plt is None
