"""The run's record (`config.record`): every decision made once, written where the run is
described, and resumed by one rule.

* Every option lands in a field of the record, and every field has a resume class: a new option
  without one fails here.
* A changed mind: every option a user can change between runs (enumerated from the
  configuration) is resumed with a new value; the run takes it from the resume point (its new
  record shows it and a line said so, or the epoch is re-planned) or refuses it in one line
  naming the flag. `CHANGES` says how to change each option; an option it lacks fails.
* The defects the record fixed, each a test that failed before: a new weight decay kept the
  checkpoint's, a guard first given on resume claimed a start it never measured, a packed
  stream's --epochs counted rows for windows.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import metric_rows, record_of, write_tone_dataset

from whisper_train.config import GROUPS, RunConfig
from whisper_train.config.record import (
    FOLLOWS,
    MUST_EQUAL,
    NOT_RECORDED,
    REPLANS,
    RESUME_CLASSES,
    SLICES,
    RunRecord,
    options_recorded,
)
from whisper_train.errors import UserError
from whisper_train.training.train import train

OPTIONS = [f.name for group in GROUPS.values() for f in dataclasses.fields(group)]


def test_every_option_lands_in_the_record_and_every_field_has_a_resume_class():
    recorded = options_recorded()
    assert sorted(set(OPTIONS) - set(recorded) - set(NOT_RECORDED)) == []
    assert set(recorded) <= set(OPTIONS)  # no field names an option that does not exist
    for kind in SLICES.values():
        for field in dataclasses.fields(kind):
            assert field.metadata["resume"] in RESUME_CLASSES, field.name
            # A field made from no option says what it is (how a refusal names it).
            assert field.metadata["options"] or field.metadata["label"], field.name


def test_the_record_reads_back_from_whisper_train_yaml(tiny_run_config):
    config = tiny_run_config(
        mode="lora", eval_data=["target=t/", "g:en:long=g/"], only_train=False, guard="g"
    ).validate()
    record = record_of(config)
    again = RunRecord.from_yaml(record.to_yaml())
    assert again == record and again.asked == record.asked
    # The file works as --config: the options as asked, the record skipped.
    assert RunConfig().to_dict() != config.to_dict()
    reread = RunConfig()
    reread.update(yaml.safe_load(record.to_yaml()))
    assert reread.run_options() == config.run_options()


# -- a changed mind ---------------------------------------------------------------------------

# The run a change is resumed from: one step of the tiny model on the tone clips, saved
# (tiny_run_config's), with these settings besides.
CONTEXTS = {
    "plain": {},
    "evaluated": {"only_train": False, "generation_max_length": 4},
    "guarded": {"only_train": False, "generation_max_length": 4, "guard": "general"},
    "lora": {"mode": "lora"},
    "packed": {"packing": "on"},
    "unpacked": {"packing": "off"},
    "english": {"language": "en"},
    "checkpointed": {"gradient_checkpointing": "full"},
    "planned": {"gradient_checkpointing": "auto", "max_memory": "8GB"},
    "frozen": {"mode": "freeze-encoder"},
    "epochs": {"max_steps": None, "epochs": 1.0},
    "stream": {"data": "SHARDS", "only_train": True},
    "noisy": {"nonspeech": "builtin"},
    # A student of 1 decoder layer made from the tiny model (--model's) as its teacher.
    "distilled": {"teacher": "MODEL", "decoder_layers": 1, "mode": "freeze-encoder"},
}
# option: (context, new value). A value "OTHER_DATA" / "OTHER_MODEL" / "OTHER_DIR" is a folder
# made for the test; "SETS+" the evaluated sets and one more.
CHANGES = {
    "data": ("plain", "OTHER_DATA"),
    "eval_data": ("evaluated", "SETS+"),
    "data_format": ("plain", "audiofolder"),
    "streaming": ("plain", True),
    "shuffle_buffer": ("stream", 7),
    "eval_split": ("plain", 0.5),
    "train_subset": ("plain", 6),
    "eval_subset": ("evaluated", 2),
    "language": ("plain", "en"),
    "pin_language": ("english", True),
    "task": ("plain", "translate"),
    "timestamps": ("plain", True),
    "prompt_probability": ("plain", 0.5),
    "nonspeech": ("plain", "builtin"),
    "nonspeech_share": ("noisy", 0.3),
    "strict": ("plain", True),
    "spec_augment": ("plain", True),
    "audio_augment": ("plain", True),
    "packing": ("plain", "off"),
    "packing_timestamps": ("packed", "on"),
    "model": ("plain", "OTHER_MODEL"),
    "mode": ("plain", "lora"),
    "lora_r": ("lora", 8),
    "lora_alpha": ("lora", 8),
    "lora_dropout": ("lora", 0.1),
    "lora_targets": ("lora", ["q_proj", "v_proj"]),
    "lora_variant": ("lora", "dora"),
    # The adapters trained against the base as it was held: another holding is refused.
    "quantize_base": ("lora", "nf4"),
    "attn_implementation": ("plain", "eager"),
    # Each alone is refused by the other's absence; both on the English-only tiny model by it
    # (tests/test_new_language.py): a model's vocabulary does not change mid-run.
    "new_language": ("plain", "eo"),
    "new_language_init": ("plain", "es"),
    "gradient_checkpointing": ("plain", "full"),
    "max_memory": ("planned", "16GB"),
    "offload_activations": ("checkpointed", True),
    "precision": ("plain", "bf16"),
    "optim": ("plain", "adamw8bit"),
    "cache_encoder": ("frozen", False),
    "encoder_cache_dir": ("frozen", "OTHER_DIR"),
    "encoder_cache_max_size": ("frozen", "1GB"),
    "compile": ("plain", True),
    "output_dir": None,  # a resume continues in its own folder: nothing to change
    "epochs": ("epochs", 2.0),
    "max_steps": ("plain", 2),
    "batch_size": ("plain", 2),
    "gradient_accumulation": ("plain", 2),
    "learning_rate": ("plain", 5e-4),
    "encoder_lr_scale": ("plain", 2.0),
    "lr_scheduler": ("plain", "constant_with_warmup"),
    "warmup_steps": ("plain", 2),
    "weight_decay": ("plain", 0.5),
    "max_grad_norm": ("plain", 0.5),
    "seed": ("plain", 1),
    "eval_steps": ("evaluated", 1),
    "only_train": ("plain", False),
    "eval_at_start": ("evaluated", True),
    "metric_for_best": ("evaluated", "general"),
    "guard": ("evaluated", "general"),
    "max_regression": ("guarded", 5.0),
    "stop_on_regression": ("guarded", True),
    "max_nonspeech_rise": ("evaluated", 3.0),
    "preserve_base": ("unpacked", 0.5),
    "teacher": ("plain", "OTHER_MODEL"),
    "decoder_layers": ("distilled", 2),
    "distill_temperature": ("distilled", 1.0),
    "distill_kl_weight": ("distilled", 0.5),
    "distill_ce_weight": ("distilled", 1.0),
    "compare_baseline": ("evaluated", True),
    "logging_steps": ("plain", 2),
    "report_to": ("plain", ["none"]),
    "generation_max_length": ("evaluated", 6),
    "temperatures": ("evaluated", "0,0.5"),
    "compression_ratio_threshold": ("evaluated", "none"),
    "logprob_threshold": ("evaluated", "none"),
    "no_speech_threshold": ("evaluated", "0.9"),
    "condition_on_previous_text": ("evaluated", True),
    "num_workers": ("plain", 1),
    "group_by_length": ("unpacked", True),
    "save_steps": ("plain", 3),
    "save_total_limit": ("plain", 1),
    "average_checkpoints": ("evaluated", 2),
    "average_by": ("evaluated", "best"),
    "max_bad_steps": ("plain", 3),
    "nproc": ("plain", 2),
    "fsdp": ("plain", True),
}
CHANGED = [option for option in OPTIONS if option not in NOT_RECORDED]


def test_every_option_a_user_may_change_has_a_change_tried():
    assert sorted(set(CHANGED) - set(CHANGES)) == []


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory, tone_dataset, tiny_whisper_dir):
    """context -> (the folder of its saved run of one step, the settings it trained with)."""
    from test_streaming import write_shards

    root = tmp_path_factory.mktemp("saved-runs")
    sets = {
        "target": write_tone_dataset(root / "target", n=3, seed=1),
        "general": write_tone_dataset(root / "general", n=2, seed=2),
    }
    write_shards(root / "shards", "webdataset", [3, 3])
    base = {
        "data": str(tone_dataset),
        "model": str(tiny_whisper_dir),
        "max_steps": 1,
        "save_steps": 1,
        "batch_size": 4,
        "learning_rate": 1e-3,
        "seed": 0,
        "eval_split": 0.25,
        "only_train": True,
        "generation_max_length": 8,
        "temperatures": "0",
        "eval_data": [f"{name}={path}" for name, path in sets.items()],
        "encoder_cache_dir": str(root / "encoder-cache"),
        "nonspeech": "none",  # the tone clips alone; "noisy" trains with the built-in noise
    }
    runs = {"sets": sets, "root": root}
    for context, settings in CONTEXTS.items():
        values = {**base, **settings, "output_dir": str(root / context)}
        if values["only_train"] and context != "evaluated":
            values["eval_data"] = []
        if values["data"] == "SHARDS":
            values["data"] = str(root / "shards")
        if values.get("teacher") == "MODEL":
            values["teacher"] = values["model"]
        if values["max_steps"] is None:
            values["max_steps"] = None
            values["save_steps"] = 1
        config = RunConfig()
        config.update({k: v for k, v in values.items() if v is not None})
        train(config)
        runs[context] = (root / context, {k: v for k, v in values.items() if v is not None})
    return runs


def _value(option: str, value, runs, tmp_path: Path, tone_dataset, tiny_whisper_dir):
    if value == "OTHER_DATA":
        return str(shutil.copytree(tone_dataset, tmp_path / "other-data"))
    if value == "OTHER_MODEL":
        return str(shutil.copytree(tiny_whisper_dir, tmp_path / "other-model"))
    if value == "OTHER_DIR":
        return str(tmp_path / "other-cache")
    if value == "SETS+":
        sets = {**runs["sets"], "extra": runs["sets"]["target"]}
        return [f"{name}={path}" for name, path in sets.items()]
    return value


@pytest.mark.parametrize("option", CHANGED)
@pytest.mark.long
def test_a_changed_mind_takes_effect_from_the_resume_point_or_is_refused_in_one_line(
    option, saved_runs, tmp_path, tone_dataset, tiny_whisper_dir, capfd
):
    change = CHANGES[option]
    recorded = options_recorded()[option]
    classes = {
        f"{name}.{f.name}": f.metadata["resume"]
        for name, kind in SLICES.items()
        for f in dataclasses.fields(kind)
    }
    if change is None:  # follows the run itself (the folder it continues in)
        assert {classes[field] for field in recorded} == {FOLLOWS}
        return
    context, new = change
    folder, settings = saved_runs[context]
    out = shutil.copytree(folder, tmp_path / "run")
    flag = "--" + option.replace("_", "-")
    resumed = {**settings, "output_dir": str(out), "resume": "latest"}
    resumed[option] = _value(option, new, saved_runs, tmp_path, tone_dataset, tiny_whisper_dir)
    # The resume trains nothing more (a run's length is the change tried for --max-steps and
    # --epochs alone): what a change does from the resume point is in its record and its lines.
    before = yaml.safe_load((out / "whisper-train.yaml").read_text())["record"]
    config = RunConfig()
    config.update(resumed)
    capfd.readouterr()
    try:
        train(config)
    except UserError as refused:
        said = str(refused)
        if option == "nproc":  # said by the processes: once, by the first
            errors = [line for line in capfd.readouterr().err.splitlines() if "error:" in line]
            assert len(errors) == 1, errors
            said = errors[0]
        assert "\n" not in said.strip(), said
        # Refused: the option is named (or, refused by another option it forced, both are).
        assert flag in said, said
        assert any(classes[field] in (MUST_EQUAL, REPLANS) for field in recorded) or (
            "not supported with" in said or "needs" in said
        ), said
        return
    out_text = capfd.readouterr().out
    after = yaml.safe_load((out / "whisper-train.yaml").read_text())["record"]
    changed = [
        field
        for field in recorded
        if before[field.split(".")[0]][field.split(".")[1]]
        != after[field.split(".")[0]][field.split(".")[1]]
    ]
    assert changed, f"{flag}: resumed with a new value, and the record shows none"
    assert all(classes[field] != MUST_EQUAL for field in changed), changed
    said = [line for line in out_text.splitlines() if line.startswith("--resume: ")]
    assert said, out_text
    if any(classes[field] == REPLANS for field in changed):
        assert any("planned anew" in line for line in said), said


# -- what a change does ------------------------------------------------------------------------


def test_a_new_weight_decay_is_the_optimizers_from_the_resume_point(tmp_path, tiny_run_config):
    """Before the record, `optimizer.load_state_dict` restored the checkpoint's 0.0 in every
    group while whisper-train.yaml and the model card said 0.5."""
    train(tiny_run_config(max_steps=2, save_steps=2, weight_decay=0.0))
    train(tiny_run_config(max_steps=3, save_steps=3, weight_decay=0.5, resume="latest"))
    saved = torch.load(tmp_path / "out" / "checkpoint-3" / "optimizer.pt", weights_only=True)
    decays = sorted({group["weight_decay"] for group in saved["param_groups"]})
    assert decays == [0.0, 0.5]  # matrices decay; biases and norms never do (memory.optim)
    record = yaml.safe_load((tmp_path / "out" / "whisper-train.yaml").read_text())["record"]
    assert record["training"]["weight_decay"] == 0.5
    card = (tmp_path / "out" / "final" / "README.md").read_text()
    assert "weight decay 0.5" in card


def test_a_new_batch_replans_the_rest_of_the_epoch_and_trains_each_clip_once(
    tmp_path, tiny_run_config, monkeypatch, capsys
):
    """12 clips (the tone set, none held out: only training), 4 a step: a resume after step 1
    at 2 a step plans the other 8 anew."""
    import whisper_train.training.recipe as recipe_module

    trained: list[list[int]] = []
    real = recipe_module.loss_terms

    def recording(model, batch, **kwargs):
        trained.append(batch["indices"].tolist())
        return real(model, batch, **kwargs)

    monkeypatch.setattr(recipe_module, "loss_terms", recording)
    train(tiny_run_config(max_steps=1, save_steps=1))
    first = list(trained)
    trained.clear()
    capsys.readouterr()
    train(tiny_run_config(max_steps=5, batch_size=2, resume="latest"))
    out = capsys.readouterr().out
    assert "--resume: clips a step 4 -> 2: the rest of the epoch is planned anew" in out
    assert "epoch 0: its other 8 clips planned anew, 4 steps of 2 clips" in out
    clips = [clip for batch in first + trained for clip in batch]
    assert sorted(clips) == list(range(12))  # the epoch's 12 clips, each once
    assert [len(batch) for batch in trained] == [2, 2, 2, 2]


def test_a_guard_first_given_on_resume_is_measured_there_and_held_against_that(
    tmp_path, tiny_run_config, capsys
):
    """Before, no evaluation at the resume step, yet the run ended 'guard set within 2 points
    of its start' with a guard WER of 1348% (a start it never measured)."""
    sets = {
        "target": write_tone_dataset(tmp_path / "target", n=3, seed=1),
        "g": write_tone_dataset(tmp_path / "g", n=2, seed=2),
    }
    common = {
        "only_train": False,
        "eval_data": [f"{name}={path}" for name, path in sets.items()],
        "generation_max_length": 4,
    }
    train(tiny_run_config(max_steps=2, save_steps=2, **common))
    capsys.readouterr()
    result = train(tiny_run_config(max_steps=4, eval_steps=1, guard="g", resume="latest", **common))
    assert "guard set 'g' is new: its start is measured now, at step 2" in capsys.readouterr().out
    rows = [(row["step"], row["set"]) for row in metric_rows(result.output_dir) if "wer" in row]
    assert (2, "g") in rows  # measured at the resume step (and at step 2's end of the first run)
    assert result.guard_start == {"set": "g", "step": 2}
    wer = {row["step"]: row["wer"] for row in result.evaluations if row["set"] == "g"}
    if "within" in result.final_reason:
        assert "of its start (step 2)" in result.final_reason
        assert 100 * (wer[result.final_step] - wer[2]) <= 2.0
    else:
        assert "no evaluation stayed within 2 points of g WER at its start (step 2)" in (
            result.final_reason
        )


def test_a_packed_stream_counts_a_pass_in_clips(tmp_path, tiny_run_config):
    """--epochs on a packed stream counted rows / batch while its micro-batches held windows of
    several clips: 1 epoch ran as many passes as a window holds clips. Now a micro-batch is
    about --batch-size clips, so 1 epoch is one pass."""
    from test_streaming import write_shards

    data = tmp_path / "wds"
    write_shards(data, "webdataset", [12, 12])  # 24 clips of 1 s: 12 fit a window
    result = train(
        tiny_run_config(data=str(data), packing="on", batch_size=12, max_steps=None, epochs=1.0)
    )
    epochs = [row["epoch"] for row in metric_rows(result.output_dir) if "loss" in row]
    assert result.steps == 2 and math.isclose(epochs[-1], 1.0)
