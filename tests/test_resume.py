"""Checkpoints and --resume: a crashed run continues as if it had never stopped."""

from __future__ import annotations

import pytest
import torch
from conftest import metric_rows
from safetensors.torch import load_file

import whisper_train.recipe as recipe_module
from whisper_train import checkpoints
from whisper_train.errors import UserError
from whisper_train.train import train


def _crash_on_call(monkeypatch, n: int) -> None:
    """Make the n-th training forward raise, as a crash or power cut would stop the run."""
    real = recipe_module.loss_terms
    calls = {"n": 0}

    def crashing(model, batch, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise RuntimeError("simulated crash")
        return real(model, batch, **kwargs)

    monkeypatch.setattr(recipe_module, "loss_terms", crashing)


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
        _crash_on_call(patch, 3)  # dies during step 3, after checkpoint-2 (mid-epoch: 1 batch left)
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
