"""`--model` resolution: alias, run folder, HF folder, CTranslate2 folder, hub id."""

from __future__ import annotations

import pytest
import torch

from whisper_train.errors import UserError
from whisper_train.models import is_multilingual, load_model, resolve_alias


def test_tiny_en_alias_resolves_to_the_packaged_model(tiny_en_ct2_dir):
    assert resolve_alias("tiny.en") == str(tiny_en_ct2_dir)
    model, processor = load_model("tiny.en")
    assert model.config.d_model == 384 and not is_multilingual(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert processor.tokenizer.convert_tokens_to_ids("<|notimestamps|>") == 50362


def test_run_folder_resolves_to_its_final_model(tmp_path, tiny_whisper_dir):
    import shutil

    shutil.copytree(tiny_whisper_dir, tmp_path / "run" / "final")
    model, _ = load_model(str(tmp_path / "run"))
    reference, _ = load_model(str(tiny_whisper_dir))
    assert torch.equal(model.proj_out.weight, reference.proj_out.weight)


def test_hub_id_offline_is_one_clear_error():
    with pytest.raises(UserError, match=r"--model openai/whisper-nonexistent-xyz: could not load"):
        load_model("openai/whisper-nonexistent-xyz")


def test_non_whisper_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(UserError, match="not a Whisper model config"):
        load_model(str(tmp_path))
