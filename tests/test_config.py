"""Configuration: presets load, flags and YAML agree, illegal combinations are refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import record_of

from whisper_train.cli import build_parser, config_from_args, main
from whisper_train.config import RunConfig
from whisper_train.errors import UserError
from whisper_train.memory import LoraSettings
from whisper_train.training.train import train
from whisper_train.units import parse_bytes

PRESETS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_shipped_preset_loads_and_validates(preset):
    config = RunConfig.from_yaml(preset).validate()
    assert config.model.mode in preset.read_text()


def test_the_lora_preset_has_the_measured_rate_and_takes_only_train(tmp_path):
    lora = Path(__file__).parents[1] / "configs" / "lora.yaml"
    args = build_parser().parse_args(["train", "--config", str(lora), "--only-train"])
    config = config_from_args(args).validate()
    assert record_of(config).training.learning_rate == 1.5e-4 and config.train.only_train


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
    assert config.data.strict is True and config.train.learning_rate == 2e-4


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


def rates(values: dict, width: int = 384) -> tuple[float, float]:
    """(learning rate, the encoder's) the run's record holds for these options."""
    training = record_of(RunConfig.from_flat(values), width=width).training
    return training.learning_rate, training.encoder_learning_rate


def test_mode_dependent_defaults():
    assert rates({"mode": "lora"})[0] == 1.5e-4
    assert rates({"mode": "full"})[0] == 2e-5


def test_full_fine_tuning_steps_the_encoder_faster_by_default():
    """Full: the encoder at 2.5x the decoder's rate (measured on tiny.en); LoRA one rate; a
    frozen encoder has no rate, and a scale given for it is refused in one line."""
    assert rates({"mode": "full"}) == pytest.approx((2e-5, 5e-5))
    assert rates({"mode": "lora"}) == (1.5e-4, 1.5e-4)
    assert rates({"mode": "freeze-encoder"}) == (3e-5, 3e-5)
    assert rates({"mode": "full", "encoder_lr_scale": 1.0}) == (2e-5, 2e-5)
    with pytest.raises(UserError, match="^--encoder-lr-scale sets .* drop --encoder-lr-scale$"):
        RunConfig.from_flat({"mode": "freeze-encoder", "encoder_lr_scale": 2.0}).validate()
    # Each rate finite alone, the encoder's (2.5e308) past float range: refused before a step
    # turns it into NaN weights.
    with pytest.raises(UserError, match=r"^--learning-rate 1e\+308 x --encoder-lr-scale 2.5: "):
        RunConfig.from_flat({"mode": "full", "learning_rate": 1e308}).validate()


def test_lora_defaults_put_adapters_on_every_linear_layer():
    """The CLI's default targets and the library's (`LoraSettings()`) are one choice, written
    twice only because config stays torch-free above memory."""
    every_linear = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
    settings = record_of(RunConfig.from_flat({"mode": "lora"})).model.lora
    assert settings.targets == every_linear == LoraSettings().targets


@pytest.mark.parametrize(
    ("width", "rate"),
    # the decoder's, the encoder's 2.5x: tiny (measured), base, small, medium, large-v3 and
    # turbo; a test model narrower than tiny takes tiny's, one between two sizes the wider
    # size's (lower) rate
    [(None, 2e-5), (64, 2e-5), (384, 2e-5), (512, 1.7e-5), (768, 8.5e-6), (800, 4.2e-6),
     (1024, 4.2e-6), (1280, 2.9e-6), (2048, 2.9e-6)],
)  # fmt: skip
def test_full_fine_tuning_defaults_to_a_lower_rate_for_a_wider_model(width, rate):
    from whisper_train.config.options import default_learning_rate

    assert default_learning_rate("full", width) == rate
    if width is not None:
        assert rates({"mode": "full"}, width)[0] == rate
    for mode, own in (("lora", 1.5e-4), ("freeze-encoder", 3e-5)):  # adapters: not by width
        assert default_learning_rate(mode, width) == own
    assert rates({"mode": "full", "learning_rate": 7e-6}, width or 384)[0] == 7e-6  # the user's


def test_a_run_takes_its_models_width_for_the_default_rate(tiny_run_config, tiny_whisper):
    result = train(tiny_run_config(max_steps=1, mode="full"))
    record = yaml.safe_load((result.output_dir / "whisper-train.yaml").read_text())["record"]
    assert record["model"]["width"] == tiny_whisper[0].config.d_model == 64
    assert record["training"]["learning_rate"] == 1e-3  # tiny_run_config's, as given
    assert "model_width" not in result.output_dir.joinpath("whisper-train.yaml").read_text()
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


# -- YAML words stay words: the config file is read as YAML 1.2, whose only booleans
# are true and false. YAML 1.1 (PyYAML's default) also reads yes/no/on/off as booleans, which
# turned `language: no` (Norwegian) into False and `packing: on` into True.

# Every spelling YAML 1.1 resolves to a boolean (y/n only in the spec, PyYAML leaves them text).
YAML_1_1_BOOLEANS = [
    *("y", "Y", "n", "N"),
    *("yes", "Yes", "YES", "no", "No", "NO"),
    *("on", "On", "ON", "off", "Off", "OFF"),
    *("true", "True", "TRUE", "false", "False", "FALSE"),
]
TRUE_WORDS = {"y", "yes", "on", "true"}


def _from_yaml(tmp_path, text: str) -> RunConfig:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return RunConfig.from_yaml(path)


@pytest.mark.parametrize("word", YAML_1_1_BOOLEANS)
def test_a_text_option_keeps_the_word_written(tmp_path, word):
    language = _from_yaml(tmp_path, f"data: {{language: {word}}}\n").data.language
    # true/false are YAML 1.2's booleans: a text option reads them as their text.
    assert language == (word.lower() if word.lower() in ("true", "false") else word)


@pytest.mark.parametrize("word", YAML_1_1_BOOLEANS)
def test_a_boolean_option_takes_every_yes_no_word(tmp_path, word):
    config = _from_yaml(tmp_path, f"data: {{strict: {word}}}\ntrain: {{fsdp: {word}}}\n")
    assert config.data.strict is config.train.fsdp is (word.lower() in TRUE_WORDS)


@pytest.mark.parametrize("value", ["maybe", "2", "0.5"])
def test_a_boolean_option_refuses_other_values_in_one_line(tmp_path, value):
    with pytest.raises(UserError, match=rf"--strict {value}: expected true or false"):
        _from_yaml(tmp_path, f"data: {{strict: {value}}}\n")


def test_the_readme_spellings_validate(tmp_path):
    config = _from_yaml(
        tmp_path,
        "data: {language: no, packing: on, packing_timestamps: off}\n"
        "memory: {gradient_checkpointing: off}\n"
        "train: {compression_ratio_threshold: off, only_train: yes}\n",
    ).validate()
    record = record_of(config)
    assert config.data.language == "no" and record.data.packing == "on"
    assert not record.data.packing_timestamps
    assert record.memory.checkpointing == "off" and config.train.only_train is True
    assert record.evaluation.compression_ratio_threshold is None
    from whisper_train.data.labels import language_code

    assert language_code(config.data.language) == "no"  # Norwegian, as the user meant


def test_a_saved_config_reads_back_the_same_words(tmp_path):
    config = RunConfig()
    config.update(
        {
            "language": "no",
            "packing": "on",
            "gradient_checkpointing": "off",
            "metric_for_best": "yes",
            "data_format": "true",
            "eval_data": ["on=a/", "off=b/"],
            "strict": True,
        }
    )
    saved = tmp_path / "whisper-train.yaml"
    saved.write_text(record_of(config).to_yaml())  # the options as asked, then the record
    assert RunConfig.from_yaml(saved).to_dict() == config.run_options()
    # The file also reads the same with a YAML 1.1 reader (PyYAML's safe_load, which resume's
    # option check and export use): the words that are booleans there are written quoted.
    read_by_1_1 = yaml.safe_load(saved.read_text())
    assert {group: read_by_1_1[group] for group in ("data", "model", "memory")} == {
        group: config.to_dict()[group] for group in ("data", "model", "memory")
    }
    assert read_by_1_1["record"]["data"]["language"] == "no"


# -- numbers out of range: one line naming the flag and what it accepts, exit 2, before
# anything loads (`--learning-rate nan` was a traceback from torch's AdamW).


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--learning-rate", "nan"], "--learning-rate nan: expected a finite number above 0"),
        (["--learning-rate", "inf"], "--learning-rate inf: expected a finite number above 0"),
        (["--learning-rate=-1e-5"], "--learning-rate -1e-05: expected a finite number above"),
        (["--learning-rate", "0"], "--learning-rate 0: expected a finite number above 0"),
        (["--encoder-lr-scale", "0"], "--encoder-lr-scale 0: expected a finite multiple"),
        (["--encoder-lr-scale", "nan"], "--encoder-lr-scale nan: expected a finite multiple"),
        (["--weight-decay", "nan"], "--weight-decay nan: expected a finite number of 0 or more"),
        (["--weight-decay", "-0.1"], "--weight-decay -0.1: expected a finite number of 0 or"),
        (["--max-grad-norm", "nan"], "--max-grad-norm nan: expected a finite norm of 0 or more"),
        (["--max-grad-norm", "inf"], "--max-grad-norm inf: expected a finite norm of 0 or more"),
        (["--max-grad-norm", "-1"], "--max-grad-norm -1: expected a finite norm of 0 or more"),
        (["--epochs", "nan"], "--epochs nan: expected a finite number of passes above 0"),
        (["--epochs", "inf"], "--epochs inf: expected a finite number of passes above 0"),
        (["--eval-split", "nan"], "--eval-split nan: expected a fraction in [0, 1)"),
        (["--eval-split", "1"], "--eval-split 1: expected a fraction in [0, 1)"),
        (["--lora-dropout", "1.5"], "--lora-dropout 1.5: expected a probability in [0, 1)"),
        (["--lora-dropout", "nan"], "--lora-dropout nan: expected a probability in [0, 1)"),
        (["--preserve-base", "inf"], "--preserve-base inf: expected a finite weight of 0 (off)"),
        (["--preserve-base", "nan"], "--preserve-base nan: expected a finite weight of 0 (off)"),
        (["--lora-alpha", "0"], "--lora-alpha 0: must be at least 1"),
        (["--seed", "-1"], "--seed -1: expected a whole number from 0 to 4294967295"),
        (["--seed", "4294967296"], "--seed 4294967296: expected a whole number from 0 to"),
        (["--warmup-steps", "-1"], "--warmup-steps -1: expected 0 or more"),
        (["--num-workers", "-2"], "--num-workers -2: expected 0 or more"),
    ],
)
def test_numbers_out_of_range_are_one_line(capsys, flags, expected):
    assert main(["train", "--data", "x", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {err[0].removeprefix('error: ')}"]  # one line, no traceback
    assert expected in err[0]


def test_max_regression_out_of_range_is_one_line(capsys):
    argv = ["train", "--data", "x", "--eval-data", "a=a/", "--eval-data", "b=b/", "--guard", "b"]
    assert main([*argv, "--max-regression", "inf"]) == 2
    assert (
        "--max-regression inf: expected a finite number of points, 0 or more"
        in capsys.readouterr().err
    )


def test_a_non_finite_learning_rate_stops_the_real_process_in_one_line(
    tmp_path, tone_dataset, tiny_whisper_dir
):
    """In its own process, with real data and model: before the check, torch's AdamW raised
    `ValueError: Invalid learning rate: nan` with a traceback after the model had loaded."""
    argv = ["--data", str(tone_dataset), "--model", str(tiny_whisper_dir)]
    argv += ["--output-dir", str(tmp_path / "o"), "--only-train", "--learning-rate", "nan"]
    proc = subprocess.run(
        [sys.executable, "-m", "whisper_train", "train", *argv],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --learning-rate nan: expected a finite number above 0 (e.g. 1e-5)"
    ]


def test_resume_reads_the_saved_config_as_the_config_file_is_read(tmp_path):
    """A checkpoint's whisper-train.yaml written by hand (or by another YAML tool, or by a
    version that kept no record) with a plain `packing: on`: the resume check reads `on`, as
    --config would, not YAML 1.1's True."""
    from whisper_train.runfolder import CONFIG_FILE
    from whisper_train.training import resume
    from whisper_train.training.checkpoints.load import saved_record

    (tmp_path / CONFIG_FILE).write_text("data: {packing: on, language: no}\n")
    record, options = saved_record(tmp_path)
    assert record is None and options["data"]["packing"] == "on"
    config = RunConfig.from_flat({"packing": "on", "language": "no"}).validate()
    resume.check_recordless_options(tmp_path, options, config)  # the same options: no refusal
    config.data.packing = "off"
    with pytest.raises(UserError, match="--packing off differs from the checkpoint's on"):
        resume.check_recordless_options(tmp_path, options, config)
