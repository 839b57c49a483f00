"""Checkpoints and --resume: a crashed run continues as if it had never stopped."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml
from conftest import crash_on_loss_call, metric_rows
from safetensors.torch import load_file

from whisper_train.errors import UserError
from whisper_train.training import checkpoints, resume, retention
from whisper_train.training.train import train


@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.long
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
    with pytest.raises(UserError, match="--mode freeze-encoder differs from the checkpoint's"):
        train(tiny_run_config(max_steps=2, resume="latest", mode="freeze-encoder"))
    with pytest.raises(UserError, match="not a checkpoint folder"):
        train(tiny_run_config(resume=str(tmp_path / "nowhere")))


def test_rotation_keeps_the_newest_and_the_best_step(tmp_path):
    for step in (1, 2, 3, 4, 5):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        checkpoints.TrainerState(step=step).write(folder)
    (tmp_path / "checkpoint-6.tmp").mkdir()  # an interrupted write is never a checkpoint
    retention.rotate_checkpoints(tmp_path, keep_last=2, keep_steps=(2,), saved_step=5)
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-5",
    ]
    retention.rotate_checkpoints(tmp_path, keep_last=1, keep_steps=(), saved_step=5)
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == ["checkpoint-5"]


def test_rotation_never_deletes_the_checkpoint_just_saved_for_a_later_one(tmp_path):
    for step in (4, 6, 8):  # 8: a later step than the one just saved (6)
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        checkpoints.TrainerState(step=step).write(folder)
    retention.rotate_checkpoints(tmp_path, keep_last=1, keep_steps=(), saved_step=6)
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == [
        "checkpoint-6",
        "checkpoint-8",
    ]


@pytest.mark.compat  # a save and a load on the lowest accelerate (unwrap_model's arguments)
def test_checkpoint_state_loads_with_weights_only(tmp_path, tiny_run_config):
    train(tiny_run_config(max_steps=1, save_steps=1))
    folder = tmp_path / "out" / "checkpoint-1"
    for name in ("optimizer.pt", "scheduler.pt", "rng-0.pt"):
        assert torch.load(folder / name, weights_only=True)  # no pickled code needed
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_the_closing_line_after_a_resume_times_only_the_steps_it_ran():
    from whisper_train.training.finish import trained_line

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


@pytest.fixture
def saved_run(tmp_path, tiny_run_config):
    """A run of one step saved in checkpoint-1 (tmp_path/out): what a resume is held against."""
    train(tiny_run_config(max_steps=1, save_steps=1))
    return tmp_path / "out" / "checkpoint-1"


@pytest.mark.parametrize(
    ("option", "changed", "saved"),
    [
        ("seed", 1, 0),
        ("train_subset", 6, None),
        ("eval_split", 0.5, 0.25),
        ("packing", "on", "per-clip"),  # the default's choice, asked for by name
        ("mode", "freeze-encoder", "full"),
    ],  # --nproc: tests/test_record.py's changed mind, in two processes
)
def test_resume_refuses_what_an_exact_resume_depends_on(
    saved_run, tiny_run_config, option, changed, saved
):
    """Refused in one line naming both values and the remedy, before anything trains."""
    flag = "--" + option.replace("_", "-")
    with pytest.raises(UserError) as caught:
        train(tiny_run_config(max_steps=2, resume="latest", **{option: changed}))
    said = str(caught.value)
    shown = "none" if saved is None else saved
    assert f"{flag} {changed} differs from the checkpoint's {shown}" in said
    # The advice works: the checkpoint's value, or (not given) the flag left out.
    assert (f"resume without {flag}" if saved is None else f"resume with {flag} {saved}") in said
    assert not (saved_run.parent / "checkpoint-2").exists()


def test_packing_auto_resumes_with_the_checkpoints_packing_or_names_what_refuses_it(
    tmp_path, tiny_run_config, capsys
):
    """A run that trained unpacked continues unpacked under --packing auto, and says so; a
    per-clip run resumed with an option per-clip cannot meet is refused, naming it."""
    train(tiny_run_config(max_steps=1, save_steps=1, packing="off"))
    capsys.readouterr()
    train(tiny_run_config(max_steps=2, resume="latest"))
    assert "packing auto -> off: as the checkpoint trained" in capsys.readouterr().out
    record = yaml.safe_load((tmp_path / "out" / "whisper-train.yaml").read_text())["record"]
    assert record["data"]["packing"] == "off"

    per_clip = tiny_run_config(max_steps=1, save_steps=1, output_dir=str(tmp_path / "pc"))
    train(per_clip)
    with pytest.raises(UserError) as caught:
        train(
            tiny_run_config(
                max_steps=2, resume="latest", compile=True, output_dir=str(tmp_path / "pc")
            )
        )
    said = str(caught.value)
    assert "--packing off differs from the checkpoint's per-clip (packing auto -> off: " in said
    assert "trained with --packing per-clip, which is not supported with --compile" in said
    # Asked for by name, a packing other than the checkpoint's is refused as before.
    with pytest.raises(UserError, match="--packing off differs from the checkpoint's per-clip"):
        train(
            tiny_run_config(
                max_steps=2, resume="latest", packing="off", output_dir=str(tmp_path / "pc")
            )
        )


def test_resume_refuses_other_data_but_not_the_same_folder_spelled_otherwise(
    saved_run, tiny_run_config, tone_dataset, tmp_path
):
    other = shutil.copytree(tone_dataset, tmp_path / "recordings")
    with pytest.raises(UserError, match=r"--data .*recordings differs from the checkpoint's "):
        train(tiny_run_config(max_steps=2, resume="latest", data=str(other)))
    respelled = str(tone_dataset / ".." / tone_dataset.name)
    assert train(tiny_run_config(max_steps=2, resume="latest", data=respelled)).steps == 2


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


def test_a_checkpoint_of_one_rate_resumes_only_with_one_rate(tmp_path, tiny_run_config):
    """Full fine-tuning gives the encoder its own learning rate (groups of its own in the
    optimizer); a checkpoint whose run gave the whole model one rate (--encoder-lr-scale 1, or
    a full run before that default) resumes with that, and the other way refuses in one line."""
    train(tiny_run_config(max_steps=2, save_steps=2, encoder_lr_scale=1.0))
    with pytest.raises(UserError, match=r"resume with --encoder-lr-scale 1 \(the scale it"):
        train(tiny_run_config(max_steps=4, resume="latest"))
    train(tiny_run_config(max_steps=4, save_steps=4, encoder_lr_scale=1.0, resume="latest"))
    assert [row["step"] for row in metric_rows(tmp_path / "out")] == [1, 2, 3, 4]


def test_a_half_written_last_metrics_line_is_dropped_on_resume(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "lo')

    resume.truncate_metrics(metrics, step=2)  # what --resume does before it continues

    assert metrics.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n'


def test_resuming_from_an_older_checkpoint_sets_the_abandoned_later_ones_aside(
    tmp_path, tiny_run_config, capsys
):
    out = tmp_path / "out"
    # A constant learning rate: the continuation's shorter --max-steps leaves it as it was.
    constant = {"lr_scheduler": "constant_with_warmup", "warmup_steps": 0}
    train(tiny_run_config(max_steps=8, save_steps=2, save_total_limit=4, **constant))
    first_rows = metric_rows(out)
    abandoned_weights = load_file(out / "checkpoint-8" / checkpoints.WEIGHTS_FILE)

    # Back to step 4, this time to step 6, keeping one checkpoint: the abandoned run's 6 and 8
    # must neither count as the newest nor make rotation delete the checkpoint just saved.
    back = {"resume": str(out / "checkpoint-4"), "save_steps": 2, "save_total_limit": 1}
    train(tiny_run_config(max_steps=6, **back, **constant))
    said = capsys.readouterr().out
    aside = out / "abandoned-after-step-4"
    assert [p.name for p in checkpoints.list_checkpoints(out)] == ["checkpoint-6"]
    assert (
        f"moved the later checkpoints (checkpoint-6, checkpoint-8) and their metrics.jsonl "
        f"rows to {aside}/" in said
    )
    # Nothing lost: the abandoned checkpoints and their metrics rows are in the aside folder.
    assert [p.name for p in checkpoints.list_checkpoints(aside)] == [
        "checkpoint-6",
        "checkpoint-8",
    ]
    assert torch.equal(
        load_file(aside / "checkpoint-8" / checkpoints.WEIGHTS_FILE)[
            "model.decoder.embed_tokens.weight"
        ],
        abandoned_weights["model.decoder.embed_tokens.weight"],
    )
    assert metric_rows(aside) == first_rows[4:]

    train(tiny_run_config(max_steps=7, resume="latest", save_steps=2, **constant))
    assert f"resuming from {out / 'checkpoint-6'} at step 6" in capsys.readouterr().out
    # One run's rows: steps 1-6 as the continuation trained them (equal to the first run's:
    # the same data order from the same state), then step 7.
    rows = metric_rows(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert rows[:6] == first_rows[:6]


def _copy_of_run(out, name):
    import shutil

    copy = out.with_name(name)
    shutil.copytree(out, copy)
    return copy


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    return errors[0]


def test_resume_latest_skips_a_damaged_newest_checkpoint_and_trains_on_exactly(
    tmp_path, tiny_run_config, capsys
):
    out = tmp_path / "out"
    train(tiny_run_config(max_steps=4, save_steps=2))  # checkpoint-2 and checkpoint-4
    reference = metric_rows(out)
    for name in ("trainable.safetensors", "optimizer.pt", "trainer_state.json", "rng-0.pt"):
        run = _copy_of_run(out, f"damaged-{name}")
        _truncate(run / "checkpoint-4" / name)  # as a power cut or a partial copy leaves it
        capsys.readouterr()

        train(tiny_run_config(output_dir=str(run), max_steps=4, save_steps=2, resume="latest"))

        said = capsys.readouterr().out
        assert f"--resume: skipping {run / 'checkpoint-4'}, it is damaged: {name} is " in said
        assert f"resuming from {run / 'checkpoint-2'} at step 2" in said
        assert metric_rows(run) == reference, name  # steps 3 and 4 trained again, the same
        # The damaged checkpoint is kept aside (its other files may be what the user wants).
        assert (run / "abandoned-after-step-2" / "checkpoint-4" / name).is_file()


def test_a_damaged_checkpoint_named_or_no_intact_one_is_one_line_and_exit_2(
    tmp_path, tiny_run_config, tone_dataset, tiny_whisper_dir, capsys
):
    from conftest import train_argv

    from whisper_train.cli import main

    out = tmp_path / "out"
    train(tiny_run_config(max_steps=4, save_steps=2))
    flags = ["--max-steps=4", "--batch-size=4", "--eval-split=0.25", "--only-train"]
    argv = [*train_argv(tone_dataset, tiny_whisper_dir, out), *flags, "--seed=0"]
    optimizer_file = out / "checkpoint-4" / "optimizer.pt"
    size = optimizer_file.stat().st_size
    _truncate(optimizer_file)
    capsys.readouterr()

    assert main([*argv, f"--resume={out / 'checkpoint-4'}"]) == 2
    line = _one_error_line(capsys)
    assert f"--resume {out / 'checkpoint-4'}: the checkpoint is damaged: optimizer.pt is " in line
    assert f"truncated: {size // 2} bytes, {size} when saved" in line
    assert f"resume from an earlier one with --resume {out / 'checkpoint-2'}" in line

    _truncate(out / "checkpoint-2" / "rng-0.pt")
    assert main([*argv, "--resume=latest"]) == 2
    line = _one_error_line(capsys)
    assert f"no intact checkpoint in {out}: checkpoint-4: optimizer.pt is truncated" in line
    assert "(and the 1 older one)" in line and "--overwrite" in line


def test_a_file_that_fails_to_load_is_one_line_naming_it(
    tmp_path, tiny_run_config, tone_dataset, tiny_whisper_dir, capsys
):
    import argparse

    from conftest import train_argv

    from whisper_train.cli import main

    out = tmp_path / "out"
    train(tiny_run_config(max_steps=4, save_steps=2))
    # What the cheap checks cannot see: a well-formed file of the wrong contents, here a
    # pickled object that weights_only loading refuses to build (no code from a checkpoint),
    # in a checkpoint without a manifest (as an older version wrote them).
    (out / "checkpoint-4" / "manifest.json").unlink(missing_ok=True)
    torch.save(argparse.Namespace(step=4), out / "checkpoint-4" / "rng-0.pt")
    flags = ["--max-steps=4", "--batch-size=4", "--eval-split=0.25", "--only-train"]
    argv = [*train_argv(tone_dataset, tiny_whisper_dir, out), *flags, "--seed=0"]
    capsys.readouterr()

    assert main([*argv, "--resume=latest"]) == 2
    line = _one_error_line(capsys)
    assert f"--resume {out / 'checkpoint-4'}: rng-0.pt could not be loaded (" in line
    assert "argparse.Namespace" in line
    assert f"resume from an earlier one with --resume {out / 'checkpoint-2'}" in line
