"""`whisper-train average RUN_DIR`: a finished run's checkpoints averaged after the fact,
evaluated on the run's own sets by the run's own rule, written to --output or kept as final/
only where it wins (said in one line); what a user can get wrong, one line and exit 2.

One LoRA run and one full run of the tiny model (2 steps, a checkpoint and an evaluation at
each), shared by the module's tests.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from whisper_train.cli import main
from whisper_train.training import judge as judge_module
from whisper_train.training.average_run import average_run
from whisper_train.training.averaging import average_weights
from whisper_train.training.checkpoints import WEIGHTS_FILE
from whisper_train.training.train import train

SETTINGS = {
    "max_steps": 2,
    "save_steps": 1,
    "eval_steps": 1,
    "eval_subset": 1,
    "only_train": False,
    "generation_max_length": 2,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tone_dataset, tiny_whisper_dir):
    """{mode: a finished run's folder} for LoRA and full fine-tuning."""
    from whisper_train.config import RunConfig

    root = tmp_path_factory.mktemp("runs")
    folders = {}
    for mode in ("lora", "full"):
        config = RunConfig()
        config.update(
            {
                "data": str(tone_dataset),
                "model": str(tiny_whisper_dir),
                "output_dir": str(root / mode),
                "batch_size": 4,
                "learning_rate": 1e-3,
                "seed": 0,
                "eval_split": 0.25,
                "temperatures": "0",
                "mode": mode,
                **SETTINGS,
            }
        )
        train(config)
        folders[mode] = root / mode
    return folders


def _copy(runs, mode: str, tmp_path):
    return shutil.copytree(runs[mode], tmp_path / mode)


def test_a_lora_average_is_written_where_asked_and_final_is_kept(
    runs, tmp_path, capsys, tiny_whisper_dir
):
    run = _copy(runs, "lora", tmp_path)
    final_before = load_file(run / "final" / "model.safetensors")
    result_before = (run / "result.json").read_text()
    outcome = average_run(run, count=2, by="last", output=tmp_path / "averaged")
    assert outcome.steps == (1, 2) and [r["averaged"] for r in outcome.rows] == [[1, 2]]
    said = capsys.readouterr().out
    assert "the average of steps 1, 2; it does not beat final/" in said  # the random model ties
    # final/ and result.json as they were; the average merged into --output: the base weight
    # plus alpha / r times the averaged B @ A.
    assert (run / "result.json").read_text() == result_before
    final_after = load_file(run / "final" / "model.safetensors")
    assert all(torch.equal(final_after[name], w) for name, w in final_before.items())
    adapters = average_weights([run / "checkpoint-1", run / "checkpoint-2"])
    [a_name] = [n for n in adapters if "encoder.layers.0.self_attn.q_proj.lora_A" in n]
    a, b = adapters[a_name], adapters[a_name.replace("lora_A", "lora_B")]
    record = json.loads(result_before)["record"]["model"]
    scale = record["lora_alpha"] / record["lora_r"]
    name = "model.encoder.layers.0.self_attn.q_proj.weight"
    base = load_file(tiny_whisper_dir / "model.safetensors")[name]
    averaged = load_file(tmp_path / "averaged" / "model.safetensors")
    expected = base + scale * (b @ a)
    torch.testing.assert_close(averaged[name], expected, rtol=0, atol=1e-6)
    assert (
        "final/ holds the average of the checkpoints of steps 1, 2"
        in (tmp_path / "averaged" / "README.md").read_text()
    )


def test_a_full_average_that_wins_replaces_final_and_says_so(runs, tmp_path, monkeypatch, capsys):
    run = _copy(runs, "full", tmp_path)
    real = judge_module.RunEvaluations.evaluate_average

    def evaluate_average(self, model, step, steps):  # the random model's WERs tie: a win
        rows = real(self, model, step, steps)
        rows[0]["wer"] = min(r["wer"] for r in self.rows if r["step"] > 0) - 0.01
        return rows

    monkeypatch.setattr(judge_module.RunEvaluations, "evaluate_average", evaluate_average)
    outcome = average_run(run, count=2)  # the run's own rule: the last 2
    assert outcome.wins and outcome.written == run / "final"
    said = capsys.readouterr().out
    assert "final/: replaced by the average of the checkpoints of steps 1, 2" in said
    expected = average_weights([run / "checkpoint-1", run / "checkpoint-2"])
    final = load_file(run / "final" / "model.safetensors")
    for name, weight in expected.items():
        if name in final:  # the output head is tied to the token embedding: saved once
            torch.testing.assert_close(final[name], weight, rtol=0, atol=0)
    saved = json.loads((run / "result.json").read_text())
    assert saved["final_averaged"] == [1, 2] and saved["final_step"] == 2
    assert [r["averaged"] for r in saved["evaluations"] if r.get("averaged")] == [[1, 2]]
    assert (
        "final/ holds the average of the checkpoints of steps 1, 2"
        in (run / "final" / "README.md").read_text()
    )


def test_what_a_user_can_get_wrong_is_one_line_and_exit_2(runs, tmp_path, capsys):
    run = _copy(runs, "full", tmp_path)
    (tmp_path / "empty").mkdir()
    damaged = shutil.copytree(run, tmp_path / "damaged")
    weights = damaged / "checkpoint-1" / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    cases = [
        ([str(tmp_path / "empty")], "not a finished whisper-train run"),
        ([str(run), "--average-checkpoints", "3"], "fewer than --average-checkpoints 3"),
        ([str(run)], "give 2 or more checkpoints to average (the run averaged none)"),
        ([str(damaged), "--average-checkpoints", "2"], "checkpoint-1"),
        ([str(run), "--average-checkpoints", "2", "--output", str(run)], "not empty"),
    ]
    for argv, named in cases:
        assert main(["average", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert named in err and "\n" not in err and "Traceback" not in err, (argv, err)
    assert "cannot be averaged" in main_err(damaged, capsys)


def main_err(run, capsys) -> str:
    main(["average", str(run), "--average-checkpoints", "2"])
    return capsys.readouterr().err


class Killed(BaseException):
    """A kill at a file operation: nothing after it runs (no handler catches a BaseException)."""


def test_a_kill_while_the_average_is_written_loses_nothing(runs, tmp_path, monkeypatch):
    """Killed at each rename of writing final/ and result.json (the old final/ moved aside,
    the new one put in place, result.json replaced): the checkpoints are untouched, a whole
    final/ (or the old one moved aside, whole) is on disk, and the command run again leaves
    final/ the average and result.json saying so."""
    import os

    real = judge_module.RunEvaluations.evaluate_average

    def evaluate_average(self, model, step, steps):  # a win, so that final/ is replaced
        rows = real(self, model, step, steps)
        rows[0]["wer"] = min(r["wer"] for r in self.rows if r["step"] > 0) - 0.01
        return rows

    monkeypatch.setattr(judge_module.RunEvaluations, "evaluate_average", evaluate_average)
    real_rename, real_replace = type(tmp_path).rename, os.replace
    for kill_at in (1, 2, 3):  # final/ -> final.old, final.tmp -> final, result.json's
        run = _copy(runs, "full", tmp_path / f"kill-{kill_at}")
        checkpoints = {p: p.read_bytes() for p in run.glob("checkpoint-*/*") if p.is_file()}
        old_final = load_file(run / "final" / "model.safetensors")
        count = [0]

        def counted(real, count=count, kill_at=kill_at):
            def call(*args):
                names = ("final", "final.tmp", "result.json")
                if any(str(a).endswith(names) for a in args):
                    count[0] += 1
                    if count[0] == kill_at:
                        raise Killed
                return real(*args)

            return call

        with monkeypatch.context() as patch:
            patch.setattr(type(tmp_path), "rename", counted(real_rename))
            patch.setattr(os, "replace", counted(real_replace))
            with pytest.raises(Killed):
                average_run(run, count=2)
        assert {p: p.read_bytes() for p in checkpoints} == checkpoints
        whole = [run / "final", run / "final.old"]
        saved = [load_file(f / "model.safetensors") for f in whole if f.is_dir()]
        assert any(all(torch.equal(s[n], w) for n, w in old_final.items()) for s in saved) or (
            kill_at == 3 and saved
        )
        average_run(run, count=2)
        assert json.loads((run / "result.json").read_text())["final_averaged"] == [1, 2]
        expected = average_weights([run / "checkpoint-1", run / "checkpoint-2"])
        final = load_file(run / "final" / "model.safetensors")
        assert all(torch.equal(final[n], w) for n, w in expected.items() if n in final)


def _winning_average(monkeypatch) -> None:
    """The average's WER made better than every step's: without a refusal, final/ is replaced."""
    real = judge_module.RunEvaluations.evaluate_average

    def evaluate_average(self, model, step, steps):
        rows = real(self, model, step, steps)
        rows[0]["wer"] = min(r["wer"] for r in self.rows if r["step"] > 0) - 0.01
        return rows

    monkeypatch.setattr(judge_module.RunEvaluations, "evaluate_average", evaluate_average)


def _folder_bytes(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _as_saved(weights_file) -> None:
    """The checkpoint's manifest.json made to list `weights_file` as it is now: a checkpoint
    saved so (by another run, or by a run whose update went bad), not damaged on disk."""
    manifest = weights_file.parent / "manifest.json"
    sizes = json.loads(manifest.read_text())
    sizes["files"][weights_file.name] = weights_file.stat().st_size
    manifest.write_text(json.dumps(sizes))


@pytest.mark.parametrize("damage", ["nan", "inf", "shape"])
def test_a_checkpoint_with_a_nonfinite_or_misshapen_tensor_is_refused_and_final_kept(
    runs, tmp_path, monkeypatch, capsys, damage
):
    """One NaN (or infinity) in a checkpoint's trained weights makes the average NaN; a tensor
    of another shape cannot be added: refused in one line naming the checkpoint and the remedy
    (exit 2), though the average would win, and final/ and result.json as they were."""
    from safetensors.torch import save_file

    _winning_average(monkeypatch)
    run = _copy(runs, "full", tmp_path)
    final_before, result_before = _folder_bytes(run / "final"), (run / "result.json").read_bytes()
    weights_file = run / "checkpoint-1" / WEIGHTS_FILE
    weights = load_file(weights_file)
    name = sorted(weights)[len(weights) // 2]
    if damage == "shape":
        weights[name] = weights[name].flatten()[:3].clone()
    else:
        weights[name] = weights[name].clone()
        weights[name].view(-1)[0] = float(damage)
    save_file(weights, weights_file)
    _as_saved(weights_file)
    assert main(["average", str(run), "--average-checkpoints", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "checkpoint-1" in err and "cannot be averaged" in err and "--average-by" in err, err
    assert ("shape" if damage == "shape" else "NaN or infinite") in err, err
    assert "\n" not in err and "Traceback" not in err, err
    assert _folder_bytes(run / "final") == final_before
    assert (run / "result.json").read_bytes() == result_before


def test_average_waits_for_a_run_that_holds_the_folder(runs, tmp_path, monkeypatch, capsys):
    """A `train --resume` holding the run folder's lock: `average` refuses in one line naming
    the folder and leaves final/ as it is; once the lock is let go, it runs."""
    from whisper_train.runfolder import RunLock

    _winning_average(monkeypatch)
    run = _copy(runs, "full", tmp_path)
    final_before = _folder_bytes(run / "final")
    with RunLock(run):  # what `train --output-dir RUN --resume latest` holds while it runs
        assert main(["average", str(run), "--average-checkpoints", "2"]) == 2
        err = capsys.readouterr().err.strip()
        assert f"average {run} is in use by another whisper-train run (PID" in err, err
        assert "wait for it to end or stop it" in err and "\n" not in err, err
        assert _folder_bytes(run / "final") == final_before
    assert main(["average", str(run), "--average-checkpoints", "2"]) == 0
    assert "final/: replaced by the average" in capsys.readouterr().out


def test_the_run_end_average_skips_a_checkpoint_it_cannot_average(runs, tmp_path, capsys):
    """--average-checkpoints N at the end of a run: a checkpoint with a NaN is not averaged in
    (one line says so) and the run keeps its chosen step, its model as it was."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from whisper_train.training.averaging import average_at_end
    from whisper_train.training.final import FinalChoice

    run = _copy(runs, "full", tmp_path)
    weights_file = run / "checkpoint-1" / WEIGHTS_FILE
    weights = load_file(weights_file)
    name = sorted(weights)[0]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, weights_file)
    record = SimpleNamespace(output=SimpleNamespace(average_checkpoints=2, average_by="last"))
    chosen = FinalChoice(2, "the last step")

    class Judge:
        rows: list = []

        def evaluate_average(self, *args):
            raise AssertionError("a NaN checkpoint was averaged and evaluated")

    class Quiet:
        is_main_process = True

    choice = average_at_end(
        record=record,
        output_dir=run,
        last_step=2,
        chosen=chosen,
        model=None,
        judge=Judge(),
        accelerator=Quiet(),
    )
    assert choice is chosen
    said = capsys.readouterr().out
    assert "--average-checkpoints 2: nothing averaged: " in said and "checkpoint-1" in said
