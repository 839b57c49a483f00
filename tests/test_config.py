"""Configuration: presets load, flags and YAML agree, illegal combinations are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from whisper_train.cli import build_parser, config_from_args
from whisper_train.config import RunConfig, parse_bytes
from whisper_train.errors import UserError

PRESETS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_shipped_preset_loads_and_validates(preset):
    config = RunConfig.from_yaml(preset).validate()
    assert config.model.mode in preset.read_text()


def test_the_lora_preset_has_the_measured_rate_and_takes_only_train(tmp_path):
    lora = Path(__file__).parents[1] / "configs" / "lora.yaml"
    args = build_parser().parse_args(["train", "--config", str(lora), "--only-train"])
    config = config_from_args(args).validate()
    assert config.learning_rate == 3e-4 and config.train.only_train


def test_presets_exist():
    assert {p.name for p in PRESETS} >= {"full.yaml", "lora.yaml", "freeze-encoder.yaml"}


def test_flags_override_yaml_and_types_are_coerced(tmp_path):
    preset = tmp_path / "c.yaml"
    preset.write_text("model: {mode: lora, lora_r: 8}\ntrain: {batch_size: 4}\n")
    args = build_parser().parse_args(
        [
            "train",
            "--config",
            str(preset),
            "--lora-r",
            "16",
            "--lora-targets",
            "q_proj,k_proj,v_proj",
            "--strict",
            "--learning-rate",
            "2e-4",
        ]
    )
    config = config_from_args(args)
    assert config.model.lora_r == 16 and config.train.batch_size == 4
    assert config.model.lora_targets == ["q_proj", "k_proj", "v_proj"]
    assert config.data.strict is True and config.learning_rate == 2e-4


def test_resolved_config_round_trips_through_yaml(tmp_path):
    config = RunConfig()
    config.update({"mode": "freeze-encoder", "epochs": 2.5, "gradient_checkpointing": "every-2"})
    path = tmp_path / "resolved.yaml"
    path.write_text(config.to_yaml())
    assert RunConfig.from_yaml(path).to_dict() == config.to_dict()


def test_unknown_yaml_key_names_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {batchsize: 4}\n")
    with pytest.raises(UserError, match="train.batchsize"):
        RunConfig.from_yaml(bad)


def test_mode_dependent_defaults():
    assert RunConfig.from_flat({"mode": "lora"}).learning_rate == 3e-4
    assert RunConfig.from_flat({"mode": "freeze-encoder"}).cache_encoder is True
    assert (
        RunConfig.from_flat({"mode": "freeze-encoder", "audio_augment": True}).cache_encoder
        is False
    )
    assert RunConfig.from_flat({"mode": "full"}).cache_encoder is False


def test_sizes_parse():
    assert parse_bytes("4GB") == 4 * 2**30 and parse_bytes("512MiB") == 512 * 2**20
    with pytest.raises(UserError, match="--max-memory lots"):
        parse_bytes("lots", flag="--max-memory")
