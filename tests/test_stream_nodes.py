"""A streamed --data across processes and nodes: each process reads its share by global rank
(two torchrun nodes on one machine), and a checkpoint resumed on another number of processes
finishes its interrupted pass with exactly the rows left, then splits the next pass by the new
count.

Which clips a step holds depends on how the shards fall to the processes (each process shuffles
its own share in its own buffer), so a streamed run on 2 processes does not train one process's
steps at twice the batch, as a run on data read whole does (tests/test_nodes.py): these tests
assert the exact rows each process trains in each pass instead.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import SAME_RUN_LOSS_ATOL, TRAIN_SUBPROCESS_TIMEOUT_S, metric_rows, train_argv
from test_nodes import run_nodes
from test_streaming import write_shards

from whisper_train.data import streaming
from whisper_train.data.stream_position import PassRest, StreamPosition
from whisper_train.errors import UserError
from whisper_train.training.checkpoints import checkpoint_step, list_checkpoints

SEED, BUFFER = 0, 3

# Loaded by every Python a test starts (PYTHONPATH): each micro-batch a training process trains
# is logged as one line of its transcripts, tab-separated, to rank<RANK>.txt in $TRAINED_LOG.
TRAINED_SITECUSTOMIZE = r"""
import os

if os.environ.get("TRAINED_LOG") and os.environ.get("WHISPER_TRAIN_TRACE_TRAINED") == "1":
    import whisper_train.training.recipe as recipe

    real_loss_terms = recipe.loss_terms

    def logged(model, batch, **kwargs):
        name = f"rank{os.environ.get('RANK', '0')}.txt"
        with open(os.path.join(os.environ["TRAINED_LOG"], name), "a") as log:
            log.write("\t".join(batch["texts"]) + "\n")
        return real_loss_terms(model, batch, **kwargs)

    recipe.loss_terms = logged
"""


@pytest.fixture
def trained_log(tmp_path, monkeypatch):
    """A folder where every training process this test starts logs what it trains; returns a
    function that reads {rank: [micro-batch as a list of transcripts]} and empties it."""
    hook, log = tmp_path / "hook", tmp_path / "trained"
    hook.mkdir()
    log.mkdir()
    (hook / "sitecustomize.py").write_text(TRAINED_SITECUSTOMIZE)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv("TRAINED_LOG", str(log))
    monkeypatch.setenv("WHISPER_TRAIN_TRACE_TRAINED", "1")

    def read() -> dict[int, list[list[str]]]:
        trained = {}
        for path in sorted(log.iterdir()):
            rank = int(path.stem.removeprefix("rank"))
            trained[rank] = [line.split("\t") for line in path.read_text().splitlines()]
            path.unlink()
        return trained

    return read


def share(source, *, rank, world_size, epoch) -> list[str]:
    """The transcripts process `rank` of `world_size` reads in pass `epoch`, in order."""
    dataset, columns = streaming.process_share(
        source, rank=rank, world_size=world_size, seed=SEED, shuffle_buffer=BUFFER
    )
    dataset.set_epoch(epoch)
    return [streaming.read_row(row, columns, "row").text for row in dataset]


def by_worker(dataset, columns, workers: int) -> list[list[str]]:
    """The transcripts each of `workers` loader workers reads of `dataset` (read, not decoded);
    with none, the main process's alone."""

    class Tagged(torch.utils.data.IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            for row in dataset:
                yield (info.id if info else 0), streaming.read_row(row, columns, "row").text

    found: list[list[str]] = [[] for _ in range(max(workers, 1))]
    loader = torch.utils.data.DataLoader(Tagged(), batch_size=None, num_workers=workers)
    for worker, text in loader:
        found[worker].append(text)
    return found


@pytest.mark.parametrize(
    ("sizes", "workers"),
    [
        ([3, 3, 3, 3], 0),  # 4 shards: whole shards to each of 2 processes
        ([4, 4, 3], 0),  # 3 shards: every 2nd row of the shuffled stream to each
        ([3, 2, 3, 2], 2),  # whole shards to each process, then one to each of its 2 workers
    ],
)
@pytest.mark.parametrize("new_count", [1, 3])
def test_the_rest_of_a_pass_is_every_row_its_processes_had_not_read(
    tmp_path, sizes, workers, new_count
):
    """2 processes read some rows, one into pass 1 and one still in pass 0: the rest dealt to
    `new_count` processes is every row they had not read of passes 0 and 1, once, and nothing
    else, about as many on each."""
    write_shards(tmp_path / "wds", "webdataset", sizes)
    source = streaming.stream_source(tmp_path / "wds")
    read = {0: 1, 1: 1} if workers else {0: 2}
    places = [(1, read), (0, {0: 1})]  # process 1 had its rest of pass 0 and all of pass 1 left
    expected_left: Counter = Counter()
    for process, (epoch, rows) in enumerate(places):
        for pass_ in range(epoch, 2):
            dataset, columns = streaming.process_share(
                source, rank=process, world_size=2, seed=SEED, shuffle_buffer=BUFFER
            )
            dataset.set_epoch(pass_)
            for worker, texts in enumerate(by_worker(dataset, columns, workers)):
                expected_left.update(texts[rows.get(worker, 0) if pass_ == epoch else 0 :])
    # Pass 1 whole but the 2 rows process 0 read, and process 1's share of pass 0 but 1 row.
    process_1_pass_0 = len(share(source, rank=1, world_size=2, epoch=0))
    assert sum(expected_left.values()) == sum(sizes) - 2 + process_1_pass_0 - 1
    rest = PassRest(2, places)
    columns = streaming.open_stream(source)[1]
    left, counts = Counter(), []
    for rank in range(new_count):
        dataset = streaming.RestOfPass(
            source, rest, rank=rank, world_size=new_count, seed=SEED, shuffle_buffer=BUFFER
        )
        got = [t for texts in by_worker(dataset, columns, workers) for t in texts]
        left.update(got)
        counts.append(len(got))
    assert left == expected_left  # none twice, none left out, none read before
    assert max(counts) - min(counts) <= max(workers, 1)


def test_a_checkpoint_at_a_pass_start_needs_no_rest():
    at_start = [StreamPosition(epoch=2), StreamPosition(epoch=2)]
    assert PassRest.of(at_start) is None
    assert PassRest.of([StreamPosition(epoch=2), StreamPosition(epoch=1, rows={0: 3})]) == PassRest(
        2, [(2, {}), (1, {0: 3})]
    )


@pytest.mark.parametrize("says_count", [True, False])
def test_a_checkpoint_s_positions_are_read_for_every_process_that_saved_one(tmp_path, says_count):
    """Process 0's position says how many processes saved one (a position saved before it did:
    each next one's until one is missing); a missing one of those it counts is an error."""
    saved = {
        rank: {**StreamPosition(epoch=1, rows={0: rank + 1}).to_dict(), "processes": 3}
        for rank in range(3)
    }
    if not says_count:
        saved = {
            rank: {k: v for k, v in p.items() if k != "processes"} for rank, p in saved.items()
        }

    def read(folder, rank):
        if rank not in saved:
            raise UserError(f"no stream-{rank}.json")
        return saved[rank]

    positions = streaming.saved_positions(tmp_path, read)
    assert [p.rows for p in positions] == [{0: 1}, {0: 2}, {0: 3}]
    del saved[2]
    if says_count:
        with pytest.raises(UserError, match="no stream-2.json"):
            streaming.saved_positions(tmp_path, read)


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "whisper_train", *argv],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=TRAIN_SUBPROCESS_TIMEOUT_S,
    )


FLAGS = [
    "--only-train",
    "--packing=off",
    "--nonspeech=none",
    f"--seed={SEED}",
    f"--shuffle-buffer={BUFFER}",
    "--learning-rate=1e-3",
    "--lr-scheduler=constant_with_warmup",
]


@pytest.mark.long
def test_two_localhost_nodes_read_each_row_once_a_pass_by_global_rank(
    tmp_path, tiny_whisper_dir, trained_log
):
    """2 nodes x 1 process, 12 rows in 4 shards, batch 2: each rank trains its share by global
    rank (the rows `split_dataset_by_node` gives rank r of 2, in their order), so pass 0 (3
    steps) trains every row once over the two nodes; step 4 starts pass 1, reshuffled."""
    written = write_shards(tmp_path / "wds", "webdataset", [3, 3, 3, 3])
    source = streaming.stream_source(tmp_path / "wds")
    run_nodes(
        [
            f"--data={tmp_path / 'wds'}",
            f"--model={tiny_whisper_dir}",
            f"--output-dir={tmp_path / 'out'}",
            *FLAGS,
            "--batch-size=2",
            "--max-steps=4",
        ]
    )
    trained = trained_log()
    assert sorted(trained) == [0, 1]
    for rank, batches in trained.items():
        assert [len(b) for b in batches] == [2, 2, 2, 2]
        rows = [text for batch in batches for text in batch]
        assert rows[:6] == share(source, rank=rank, world_size=2, epoch=0)
        assert rows[6:] == share(source, rank=rank, world_size=2, epoch=1)[:2]
    first_pass = [t for batches in trained.values() for b in batches[:3] for t in b]
    assert Counter(first_pass) == Counter(list(written))  # none twice, none left out


@pytest.mark.long
@pytest.mark.parametrize(
    ("before", "after"),
    [((2, 1), (1, 2)), ((1, 2), (2, 1))],
    ids=["2-processes-resumed-on-1", "1-process-resumed-on-2"],
)
def test_a_streamed_run_resumed_on_another_count_trains_each_row_of_the_pass_once(
    tmp_path, tiny_whisper_dir, trained_log, before, after
):
    """12 rows in 4 shards, 2 clips a step (2 processes x 1, or 1 x 2): a pass is 6 steps.
    Saved after step 2 (4 rows read), resumed on the other count: steps 3-6 train the 8 rows
    left of pass 0, each once, and step 7 the first rows of pass 1 as the new count splits it.
    The checkpoint of step 4, saved while that rest was trained, is refused on the first count
    again in one line (its rows are a rest of another count's shares: no exact way on), and
    resumed on its own count trains steps 5-7 as the run that saved it did."""
    written = write_shards(tmp_path / "wds", "webdataset", [3, 3, 3, 3])
    source = streaming.stream_source(tmp_path / "wds")
    out = tmp_path / "out"

    def argv(processes, batch, *flags):
        return train_argv(
            tmp_path / "wds", tiny_whisper_dir, out, *FLAGS, f"--nproc={processes}",
            f"--batch-size={batch}", *flags,
        )  # fmt: skip

    first = _run(argv(*before, "--max-steps=2", "--save-steps=2"))
    assert first.returncode == 0, first.stderr[-3000:]
    trained_before = trained_log()
    resumed = _run(
        argv(*after, "--max-steps=7", "--save-steps=4", "--save-total-limit=5", "--resume=latest")
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stdout
    assert f"--resume: processes {before[0]} -> {after[0]} from step 3 on" in said
    assert f"the rows {before[0]} process(es) had not read of it (they had read 4)" in said
    trained_after = trained_log()

    before_rows = [t for batches in trained_before.values() for b in batches for t in b]
    assert len(before_rows) == 4
    rest_steps = [t for batches in trained_after.values() for b in batches[:-1] for t in b]
    # Pass 0: the 4 rows before the checkpoint and the 8 after it are every row, once.
    assert Counter(before_rows + rest_steps) == Counter(list(written))
    # Step 7: pass 1, split by the new count as a run on it from the start splits it.
    new_count = after[0]
    for rank, batches in trained_after.items():
        assert len(batches) == 5
        first_of_pass_1 = share(source, rank=rank, world_size=new_count, epoch=1)
        assert batches[-1] == first_of_pass_1[: after[1]]

    refused = _run(argv(*before, "--max-steps=8", f"--resume={out / 'checkpoint-4'}"))
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, refused.stderr[-3000:]
    assert f"resume with --nproc {after[0]}" in errors[0]
    assert f"a stream pass begun on {before[0]}" in errors[0]
    assert "Traceback" not in refused.stderr
    assert (out / "checkpoint-7").is_dir()  # nothing set aside

    losses = [row["loss"] for row in metric_rows(out) if "loss" in row]
    again = _run(argv(*after, "--max-steps=7", f"--resume={out / 'checkpoint-4'}"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert {rank: batches[2:] for rank, batches in trained_after.items()} == trained_log()
    resumed_losses = [row["loss"] for row in metric_rows(out) if "loss" in row]
    assert len(losses) == len(resumed_losses) == 7
    np.testing.assert_allclose(resumed_losses, losses, rtol=0, atol=SAME_RUN_LOSS_ATOL)


@pytest.mark.long
def test_a_lost_node_s_command_finishes_the_streamed_pass_on_the_node_left(
    tmp_path, tiny_whisper_dir, trained_log
):
    """Two nodes stream 40 rows (4 shards) at 4 clips a step: 10 steps are one pass. Node 1 is
    killed once a checkpoint is kept; the command the node left prints, run as printed, trains
    the rows the two nodes had not, on one process: over the run every row once."""
    from test_node_faults import kill_node_1_after_a_checkpoint, start_nodes

    written = write_shards(tmp_path / "wds", "webdataset", [10, 10, 10, 10])
    run = tmp_path / "run"
    flags = train_argv(
        tmp_path / "wds", tiny_whisper_dir, run, *FLAGS, "--batch-size=2", "--max-steps=10",
        "--save-steps=2",
    )[1:]  # fmt: skip
    output, _ = kill_node_1_after_a_checkpoint(start_nodes([flags, flags]), run)
    kept = checkpoint_step(list_checkpoints(run)[-1])
    assert 0 < kept < 10, output[-3000:]
    advice = re.search(r"continue on the node left at 4 clips a step: (whisper-train .*)", output)
    assert advice, output[-3000:]
    before = trained_log()
    # The steps the checkpoint kept, on each node (one micro-batch a step); later ones are lost.
    kept_rows = [t for batches in before.values() for b in batches[:kept] for t in b]
    assert len(kept_rows) == 4 * kept

    resumed = _run(shlex.split(advice.group(1))[1:])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "--resume: processes 2 -> 1" in resumed.stdout
    after = trained_log()
    assert [len(b) for b in after[0]] == [4] * (10 - kept)
    rest_rows = [t for b in after[0] for t in b]
    assert Counter(kept_rows + rest_rows) == Counter(list(written))  # none twice, none left out
