"""whisper-train: fine-tune OpenAI Whisper on your own recordings.

The library entry points, for use without the CLI:

    from whisper_train import prepare_model, LoraSettings
    from whisper_train import load_model, RunConfig
    from whisper_train.training.train import train                    # the whole training run
    from whisper_train import doctor

They are imported on first use, so `import whisper_train` stays cheap.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

__version__ = "0.1.0"

# bitsandbytes (imported by peft, which training, `doctor` and `export` import, in every
# process a run starts) logs at import time that an optional CPU 4-bit kernel could not be
# fetched from the hub ("Skipping publisher trust check ...", "Failed to load CPU
# gemm_4bit_forward ..."): whisper-train never uses that kernel, and the lines would be the
# first a user reads. Set here, before any submodule can import peft.
for _logger in ("bitsandbytes", "kernels"):
    logging.getLogger(_logger).setLevel(logging.ERROR)

_LAZY = {
    "prepare_model": "whisper_train.memory",
    "LoraSettings": "whisper_train.memory",
    "load_model": "whisper_train.models",
    "RunConfig": "whisper_train.config",
    "UserError": "whisper_train.errors",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'whisper_train' has no attribute {name!r}")
