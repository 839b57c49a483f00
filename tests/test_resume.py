"""Checkpoints and --resume: a crashed run continues as if it had never stopped."""

from __future__ import annotations

import pytest
import torch
from conftest import crash_on_loss_call, metric_rows
from safetensors.torch import load_file

from whisper_train import checkpoints
from whisper_train.errors import UserError
from whisper_train.train import train


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_crashed_run_resumes_with_the_uninterrupted_loss_sequence(
    tmp_path, tiny_run_config, monkeypatch, mode
):
    # LoRA has dropout on the adapter path: equal losses also need the random state restored.
    reference = train(
        tiny_run_config(output_dir=str(tmp_path / "ref" / "out"), max_steps=5, mode=mode)
    )
    reference_rows = metric_rows(reference.output_dir)

    config = tiny_run_config(max_steps=5, mode=mode, save_steps=1, save_total_limit=1)
    with monkeypatch.context() as patch:
        crash_on_loss_call(
            patch, 3
        )  # dies during step 3, after checkpoint-2 (mid-epoch: 1 batch left)
        with pytest.raises(RuntimeError, match="simulated crash"):
            train(config)
    out = tmp_path / "out"
    assert [p.name for p in checkpoints.list_checkpoints(out)] == [
        "checkpoint-2"
    ]  # limit 1 kept the newest
    saved = load_file(out / "checkpoint-2" / checkpoints.WEIGHTS_FILE)
    if mode == "lora":  # only the adapters: the frozen base comes from --model again
        assert saved and all("lora_" in name for name in saved)
    else:
        assert any("encoder.layers.0" in name for name in saved)

    config.update({"resume": "latest"})
    resumed = train(config)
    assert resumed.steps == 5
    # The file reads like one run: the same rows, losses equal to the last bit.
    assert metric_rows(out) == reference_rows
    assert [row["step"] for row in reference_rows] == [1, 2, 3, 4, 5]


def test_resume_refuses_a_different_mode_and_a_fresh_run_refuses_old_checkpoints(
    tmp_path, tiny_run_config
):
    train(tiny_run_config(max_steps=1, save_steps=1))
    assert (tmp_path / "out" / "checkpoint-1" / "trainer_state.json").is_file()
    with pytest.raises(UserError, match="--resume"):
        train(tiny_run_config(max_steps=2))
    with pytest.raises(UserError, match="same --model, --mode"):
        train(tiny_run_config(max_steps=2, resume="latest", mode="freeze-encoder"))
    with pytest.raises(UserError, match="not a checkpoint folder"):
        train(tiny_run_config(resume=str(tmp_path / "nowhere")))


def test_rotation_keeps_the_newest_and_the_best_step(tmp_path):
    for step in (1, 2, 3, 4, 5):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        checkpoints.TrainerState(step=step).write(folder)
    (tmp_path / "checkpoint-6.tmp").mkdir()  # an interrupted write is never a checkpoint
    checkpoints.rotate_checkpoints(tmp_path, keep_last=2, keep_step=2)
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-5",
    ]
    checkpoints.rotate_checkpoints(tmp_path, keep_last=1, keep_step=None)
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == ["checkpoint-5"]
    assert checkpoints.resolve_resume("latest", tmp_path).name == "checkpoint-5"


@pytest.mark.compat  # a save and a load on the lowest accelerate (unwrap_model's arguments)
def test_checkpoint_state_loads_with_weights_only(tmp_path, tiny_run_config):
    train(tiny_run_config(max_steps=1, save_steps=1))
    folder = tmp_path / "out" / "checkpoint-1"
    for name in ("optimizer.pt", "scheduler.pt", "rng-0.pt"):
        assert torch.load(folder / name, weights_only=True)  # no pickled code needed
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_the_closing_line_after_a_resume_times_only_the_steps_it_ran():
    from whisper_train.recipe import trained_line

    assert trained_line(0, 30, 595.5) == "trained 30 steps in 595.5 s"
    assert trained_line(20, 30, 190.0) == (
        "trained steps 21-30 (10 after resuming at step 20; 30 in all) in 190.0 s"
    )
    assert trained_line(30, 30, 0.0) == "trained no further step: resumed at step 30, the last"


def test_the_printed_resume_command_works_after_an_overwrite_run(tmp_path, tiny_run_config):
    import shlex

    from whisper_train.cli import main
    from whisper_train.runlog import resume_command

    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')  # an earlier run, for --overwrite to move
    train(tiny_run_config(max_steps=2, save_steps=2, overwrite=True))
    command = resume_command(out / "whisper-train.yaml", out / "checkpoint-2")

    # The saved config records the run, not the first command's --overwrite (or --resume).
    argv = shlex.split(command)[1:]
    assert main([*argv, "--max-steps=3"]) == 0
    assert [row["step"] for row in metric_rows(out)] == [1, 2, 3]


@pytest.mark.parametrize(
    ("option", "changed", "saved"),
    [
        ("batch_size", 2, 4),
        ("gradient_accumulation", 2, 1),
        ("seed", 1, 0),
        ("train_subset", 6, None),
        ("eval_split", 0.5, 0.25),
        ("packing", "on", "off"),
    ],
)
def test_resume_refuses_options_an_exact_resume_depends_on(
    tmp_path, tiny_run_config, option, changed, saved
):
    out = tmp_path / "out"
    checkpoint = out / "checkpoint-1"
    checkpoint.mkdir(parents=True)  # what refuses is read before any training: no run needed
    (checkpoint / "whisper-train.yaml").write_text(tiny_run_config().to_saved_yaml())
    (checkpoint / "trainer_state.json").write_text("{}")
    flag = "--" + option.replace("_", "-")

    with pytest.raises(UserError) as caught:
        train(tiny_run_config(max_steps=2, resume="latest", **{option: changed}))

    assert f"{flag} {changed} differs from the checkpoint's {saved}" in str(caught.value)
    assert f"resume with {flag} {saved}" in str(caught.value)


def test_resume_refuses_other_data_but_not_the_same_folder_spelled_otherwise(
    tmp_path, tiny_run_config, tone_dataset
):
    checkpoint = tmp_path / "out" / "checkpoint-1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    saved = tiny_run_config(data=str(tmp_path / "recordings")).to_saved_yaml()
    (checkpoint / "whisper-train.yaml").write_text(saved)
    with pytest.raises(UserError, match=r"--data .* differs from the checkpoint's .*recordings"):
        train(tiny_run_config(max_steps=2, resume="latest"))

    respelled = tiny_run_config(data=str(tone_dataset / ".." / tone_dataset.name))
    (checkpoint / "whisper-train.yaml").write_text(respelled.to_saved_yaml())
    checkpoints.check_resume_options(checkpoint, tiny_run_config())  # no error


def test_a_new_learning_rate_applies_from_the_resume_point(tmp_path, tiny_run_config):
    constant = {"lr_scheduler": "constant_with_warmup", "warmup_steps": 0}
    train(tiny_run_config(max_steps=2, save_steps=2, learning_rate=1e-3, **constant))
    train(
        tiny_run_config(
            max_steps=4, save_steps=4, learning_rate=2.5e-4, resume="latest", **constant
        )
    )

    lrs = [row["lr"] for row in metric_rows(tmp_path / "out")]
    assert lrs == pytest.approx([1e-3, 1e-3, 2.5e-4, 2.5e-4], rel=1e-9)


def test_a_half_written_last_metrics_line_is_dropped_on_resume(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "lo')

    checkpoints.truncate_metrics(metrics, step=2)  # what --resume does before it continues

    assert metrics.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n'
