"""What several bench scripts share: where the real recordings are, and a CPU-seconds clock.

The real clips (CMU AN4, LJ Speech, LibriVox) are a folder holding `manifest.jsonl` (one JSON
row a clip: `audio`, its path under the folder; `text`; `duration_s`; `source`) and the audio.
$WHISPER_TRAIN_REALSPEECH names it; else it is `shared/realspeech` beside the checkout, or beside
the folder above it (a git worktree's checkout sits one level deeper).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def realspeech() -> Path:
    """The real recordings' folder ($WHISPER_TRAIN_REALSPEECH, else the first that exists of
    ../shared/realspeech and ../../shared/realspeech; the first when none does), absolute: the
    manifests the scripts write name its clips for processes with other working folders."""
    if "WHISPER_TRAIN_REALSPEECH" in os.environ:
        return Path(os.environ["WHISPER_TRAIN_REALSPEECH"]).resolve()
    candidates = [REPO.parent / "shared" / "realspeech", REPO.parents[1] / "shared" / "realspeech"]
    return next((folder for folder in candidates if folder.is_dir()), candidates[0])


REALSPEECH = realspeech()


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (user + system): on a machine other
    work shares, a steadier measure of what a run cost than wall time."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system
