"""A resume on another number of processes: at the same clips a step (--batch-size x
--gradient-accumulation x processes) it continues the run exactly, since a step is planned whole
and then dealt to the processes (data.step_plan); at another it re-plans the rest of the epoch
and names the --batch-size that would have kept it; where each process saved a state of its own
(--fsdp's shards) it is refused in one line. A streamed --data finishes its interrupted pass on
the new count (tests/test_stream_nodes.py).

16 tone clips, 4 a step (1 process x 4, or 2 x 2): 4 steps an epoch, 6 steps in all, resumed
after step 3, so the resumed part crosses the epoch boundary. Unpacked, so that each of two
processes trains 2 of a step's clips (a packed step of these short clips is one window, which
one process would hold alone).
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from conftest import (
    SAME_RUN_LOSS_ATOL,
    metric_rows,
    record_of,
    train_argv,
    train_in_subprocess,
    write_tone_dataset,
)

from whisper_train.cli import main
from whisper_train.config import RunConfig
from whisper_train.config.record import resume_changes
from whisper_train.errors import RunRefused
from whisper_train.training.checkpoints import find_damage

STEPS, SAVED_AT = 6, 3
FLAGS = [
    "--only-train",
    "--packing=off",
    "--nonspeech=none",
    "--eval-split=0",
    "--seed=0",
    "--learning-rate=1e-3",
    "--lr-scheduler=constant_with_warmup",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_whisper_dir):
    """The data, and the uninterrupted run of one process at batch 4 (6 steps, a checkpoint at
    step 3): the clips each of its steps trained, recorded."""
    root = tmp_path_factory.mktemp("resume-processes")
    data = write_tone_dataset(root / "data", n=16)
    trained = train_recording(
        train_argv(
            data, tiny_whisper_dir, root / "one", *FLAGS, "--batch-size=4",
            f"--max-steps={STEPS}", f"--save-steps={SAVED_AT}",
        )
    )  # fmt: skip
    return {"root": root, "data": data, "model": tiny_whisper_dir, "one": trained}


@pytest.fixture(scope="module")
def two_processes_at_step_3(runs):
    """2 processes x batch 2 for 3 steps, checkpoint-3 saved: its run folder."""
    folder = runs["root"] / "two-processes"
    train_in_subprocess(
        train_argv(
            runs["data"], runs["model"], folder, *FLAGS, "--nproc=2", "--batch-size=2",
            f"--max-steps={SAVED_AT}", f"--save-steps={SAVED_AT}",
        )[1:]
    )  # fmt: skip
    return folder


def train_recording(argv: list[str]) -> list[list[int]]:
    """`whisper-train ARGV` in this process (asserts exit 0): the clips of each step it trained."""
    import whisper_train.training.recipe as recipe_module

    steps: list[list[int]] = []
    real = recipe_module.loss_terms

    def recording(model, batch, **kwargs):
        steps.append(batch["indices"].tolist())  # one micro-batch a step: batch 4, 1 process
        return real(model, batch, **kwargs)

    recipe_module.loss_terms = recording
    try:
        assert main(argv) == 0
    finally:
        recipe_module.loss_terms = real
    return steps


def losses(folder) -> list[float]:
    return [row["loss"] for row in metric_rows(folder) if "loss" in row]


def assert_continues_the_uninterrupted_run(folder, runs) -> None:
    """Every step logged once, in order, with the uninterrupted run's loss, and no clip
    skipped. Measured 1e-6 apart (float32 sums in another order, metrics.jsonl's 6 decimals);
    the same checkpoint resumed at 2 clips a step, other clips in each step, is 1e-2 apart at
    its first step and 6e-2 at its second."""
    rows = [row for row in metric_rows(folder) if "loss" in row]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    np.testing.assert_allclose(
        losses(folder), losses(runs["root"] / "one"), rtol=0, atol=SAME_RUN_LOSS_ATOL
    )
    assert [row["epoch"] for row in rows] == [
        row["epoch"] for row in metric_rows(runs["root"] / "one")
    ]
    result = json.loads((folder / "result.json").read_text())
    assert (result["steps"], result["train_examples"], result["skipped_clips"]) == (STEPS, 16, 0)


@pytest.mark.long
def test_two_processes_resumed_as_one_continue_exactly(runs, two_processes_at_step_3, capsys):
    two = shutil.copytree(two_processes_at_step_3, runs["root"] / "two")
    assert sorted(p.name for p in (two / "checkpoint-3").glob("rng-*.pt")) == [
        "rng-0.pt",
        "rng-1.pt",
    ]
    capsys.readouterr()
    trained = train_recording(
        train_argv(
            runs["data"], runs["model"], two, *FLAGS, "--batch-size=4",
            f"--max-steps={STEPS}", f"--save-steps={STEPS}", "--resume=latest",
        )
    )  # fmt: skip
    said = capsys.readouterr().out
    assert "--resume: processes 2 -> 1 from step 4 on" in said
    assert "planned anew" not in said  # the same clips a step: the plan goes on as it was
    # Steps 4-6 trained the uninterrupted run's clips, in its order: the rest of epoch 0 (the 4
    # clips steps 1-3 left), then epoch 1's first two steps.
    assert trained == runs["one"][SAVED_AT:]
    assert_continues_the_uninterrupted_run(two, runs)
    # The resumed run's checkpoints are its own process's: one random state, and whole for a
    # later --resume (which looks for one a process that saved it).
    assert [p.name for p in (two / "checkpoint-6").glob("rng-*.pt")] == ["rng-0.pt"]
    assert find_damage(two / "checkpoint-6") is None


@pytest.mark.long
def test_one_process_resumed_as_two_continues_exactly(runs):
    three = runs["root"] / "three"
    shutil.copytree(runs["root"] / "one", three)
    result = train_in_subprocess(
        train_argv(
            runs["data"], runs["model"], three, *FLAGS, "--nproc=2", "--batch-size=2",
            f"--max-steps={STEPS}", f"--save-steps={STEPS}",
            f"--resume={three / 'checkpoint-3'}",
        )[1:]
    )  # fmt: skip
    # Process 1 had no random state of its own: it took process 0's, as a run starts.
    assert "--resume: processes 1 -> 2 from step 4 on" in result.stdout
    assert_continues_the_uninterrupted_run(three, runs)
    assert sorted(p.name for p in (three / "checkpoint-6").glob("rng-*.pt")) == [
        "rng-0.pt",
        "rng-1.pt",
    ]
    assert find_damage(three / "checkpoint-6") is None


@pytest.mark.long
def test_another_global_batch_is_replanned_and_names_the_batch_that_keeps_it(
    runs, two_processes_at_step_3, capsys
):
    """One process at batch 2 from the 2 x 2 checkpoint: 2 clips a step, not 4. The rest of
    epoch 0 (4 clips) is planned anew, each clip once; the line names --batch-size 4, with
    which the run continues exactly (the test above)."""
    other = shutil.copytree(two_processes_at_step_3, runs["root"] / "other")
    capsys.readouterr()
    trained = train_recording(
        train_argv(
            runs["data"], runs["model"], other, *FLAGS, "--batch-size=2",
            f"--max-steps={SAVED_AT + 2}", "--resume=latest",
        )
    )  # fmt: skip
    said = [line for line in capsys.readouterr().out.splitlines() if "clips a step" in line]
    assert said == [
        "--resume: clips a step 4 -> 2: the rest of the epoch is planned anew from the clips it "
        "has not trained yet (2 processes -> 1; --batch-size 4 keeps 4 and continues exactly)"
    ]
    assert re.search(r"--batch-size (\d+) keeps", said[0]).group(1) == "4"
    # The 2 steps after the resume: the 4 clips of epoch 0 the 3 steps before it left.
    assert sorted(c for step in trained for c in step) == sorted(
        c for step in runs["one"][SAVED_AT:4] for c in step
    )
    assert [len(step) for step in trained] == [2, 2]


def record_of_processes(tmp_path, processes: int, options: dict, facts: dict):
    """The record of a run on `processes` at 4 clips a step (nothing is loaded)."""
    config = RunConfig()
    values = {"data": str(tmp_path), "model": "tiny", "output_dir": str(tmp_path / "out")}
    config.update({**values, "nproc": processes, "batch_size": 4 // processes, **options})
    return record_of(config, width=64, **facts)


def test_a_state_kept_by_each_process_refuses_another_count_in_one_line(tmp_path):
    saved = record_of_processes(tmp_path, 2, {"fsdp": True}, {})
    now = record_of_processes(tmp_path, 1, {}, {})
    with pytest.raises(RunRefused) as refused:
        resume_changes(saved, now, folder=tmp_path / "out" / "checkpoint-2", step=2)
    said = str(refused.value)
    assert "\n" not in said
    assert "1 process(es), the checkpoint's 2" in said
    assert "--fsdp saved the weights and optimizer state" in said
    assert "resume with --nproc 2" in said
    # The same count resumes (nothing else differs).
    assert resume_changes(saved, saved, folder=tmp_path, step=2).lines == []


def test_a_streamed_run_may_change_its_count_at_the_same_clips_a_step(tmp_path):
    """The record lets a stream's processes change (its interrupted pass is finished on the new
    count, `data.streaming`), said in one line; its clips a step must still equal."""
    facts = {"streamed": True}
    saved = record_of_processes(tmp_path, 2, {}, facts)
    now = record_of_processes(tmp_path, 1, {}, facts)
    folder = tmp_path / "out" / "checkpoint-2"
    assert resume_changes(saved, now, folder=folder, step=2).lines == [
        "--resume: --batch-size 2 -> 4 from step 3 on",
        "--resume: processes 2 -> 1 from step 3 on",
    ]
    other_batch = record_of_processes(tmp_path, 1, {"batch_size": 2}, facts)
    with pytest.raises(RunRefused) as refused:
        resume_changes(saved, other_batch, folder=folder, step=2)
    said = str(refused.value)
    assert "\n" not in said
    assert "a stream's place cannot be re-planned (2 processes -> 1; --batch-size 4 keeps 4" in said
