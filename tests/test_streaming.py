"""Streamed --data: WebDataset and Parquet shards, rank x worker sharding, exact resume,
check-data on shards, hub ids decoded in memory."""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import SAME_RUN_LOSS_ATOL, crash_on_loss_call, metric_rows, train_in_subprocess
from tiny_models import english_tokenizer

import whisper_train.training.recipe as recipe_module
from whisper_train.checkdata import check_data, label_encoder_for
from whisper_train.config import RunConfig
from whisper_train.data import streaming
from whisper_train.data.collate import SpeechCollator
from whisper_train.data.examples import Skip
from whisper_train.errors import UserError
from whisper_train.training import checkpoints
from whisper_train.training.train import train

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


def _clip(rng: np.random.Generator, sample_rate: int, seconds: float = 0.6) -> np.ndarray:
    t = np.arange(int(sample_rate * seconds)) / sample_rate
    pitch = rng.integers(200, 600)
    return (0.2 * np.sin(2 * np.pi * pitch * t) + 0.01 * rng.standard_normal(t.size)).astype(
        np.float32
    )


def _encoded(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, sample_rate, format=fmt)
    return buffer.getvalue()


def write_shards(
    folder: Path,
    kind: str,
    sizes: list[int],
    *,
    seed: int = 0,
    text_field: str = "json",
    special: dict[int, tuple[bytes | None, str]] | None = None,
) -> dict[str, np.ndarray]:
    """Shards of short tone clips (FLAC in WebDataset tars, WAV bytes in Parquet), `sizes[i]`
    samples in shard i; sample n's transcript is "sample N <words>". `special` replaces sample
    n's (audio bytes, text). Returns {transcript: the samples written, at 16 kHz}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    written, n = {}, 0
    for shard, size in enumerate(sizes):
        rows = []
        for _ in range(size):
            samples = _clip(rng, 16000)
            text = f"sample {n} " + " ".join(rng.choice(WORDS, 2))
            audio = _encoded(samples, 16000, "FLAC" if kind == "webdataset" else "WAV")
            if special and n in special:  # None keeps the clip's own audio
                audio, text = special[n][0] or audio, special[n][1]
            written[text] = samples
            rows.append((f"s{shard:02d}k{n:04d}", audio, text))
            n += 1
        if kind == "webdataset":
            with tarfile.open(folder / f"train-{shard:06d}.tar", "w") as tar:
                for key, audio, text in rows:
                    label = (
                        json.dumps({"text": text, "language": "en"}).encode()
                        if text_field == "json"
                        else text.encode()
                    )
                    for name, data in ((f"{key}.flac", audio), (f"{key}.{text_field}", label)):
                        info = tarfile.TarInfo(name)
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
        else:
            table = pa.Table.from_pylist(
                [{"audio": {"bytes": a, "path": f"{k}.wav"}, "text": t} for k, a, t in rows]
            )
            pq.write_table(table, folder / f"train-{shard:05d}.parquet")
    return written


@pytest.fixture(scope="module")
def label_encoder():
    return label_encoder_for(english_tokenizer())


@pytest.fixture(autouse=True)
def no_parquet_shutdown_wait(monkeypatch):
    """`datasets` waits 5 s after each pass that interleaved Parquet shards in threads (its guard
    against apache/arrow#45214 at interpreter exit); tests make many short passes."""
    import datasets

    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)


def _stream_items(source, label_encoder, *, rank=0, world_size=1, workers=0, epoch=0):
    """Every item process `rank` of `world_size` gets in one pass, through `workers` workers."""
    stream = streaming.training_stream(
        source,
        label_encoder,
        rank=rank,
        world_size=world_size,
        seed=0,
        shuffle_buffer=4,
        max_label_tokens=448,
        batch_size=2,
    )
    stream.set_epoch(epoch)
    loader = torch.utils.data.DataLoader(
        stream, batch_size=None, num_workers=workers, collate_fn=lambda triples: triples
    )
    return [item for batch in loader for _, _, item in batch]


def test_shards_are_named_by_folder_brace_pattern_or_glob(tmp_path):
    write_shards(tmp_path / "wds", "webdataset", [1, 1, 1])
    folder = streaming.stream_source(tmp_path / "wds")
    braces = streaming.stream_source(str(tmp_path / "wds" / "train-{000000..000002}.tar"))
    pattern = streaming.stream_source(str(tmp_path / "wds" / "*.tar"))
    assert folder.kind == braces.kind == pattern.kind == "webdataset"
    assert folder.files == braces.files == pattern.files and len(folder.files) == 3
    assert streaming.expand_braces("a-{08..10}-{x,y}.tar") == [
        "a-08-x.tar",
        "a-08-y.tar",
        "a-09-x.tar",
        "a-09-y.tar",
        "a-10-x.tar",
        "a-10-y.tar",
    ]
    write_shards(tmp_path / "pq", "parquet", [1])
    assert streaming.stream_source(tmp_path / "pq").kind == "parquet"
    with pytest.raises(UserError, match="2 of 4 shards missing"):
        streaming.stream_source(str(tmp_path / "wds" / "train-{000001..000004}.tar"))
    with pytest.raises(UserError, match="--streaming: only WebDataset or Parquet"):
        streaming.stream_source(tmp_path / "pq" / "train-00000.parquet.txt", streaming=True)


@pytest.mark.parametrize("kind", ["webdataset", "parquet"])
def test_two_ranks_times_two_workers_read_every_sample_once(tmp_path, kind, label_encoder):
    # 4 shards of unequal size: split by shard over 2 ranks, then over each rank's 2 workers.
    written = write_shards(tmp_path / kind, kind, [3, 2, 3, 2])
    source = streaming.stream_source(tmp_path / kind)
    assert source.kind == kind
    seen = []
    for rank in range(2):
        items = _stream_items(source, label_encoder, rank=rank, world_size=2, workers=2)
        assert items and not [i for i in items if isinstance(i, Skip)]
        seen += [item["text"] for item in items]
        for item in items:  # decoded in memory, equal to the clip written (16-bit rounding)
            np.testing.assert_allclose(item["audio"], written[item["text"]], atol=2 / 32768)
    assert Counter(seen) == Counter(list(written))  # none twice, none missing
    assert sum(streaming.count_rows(source, rank=r, world_size=2) for r in range(2)) == 10


def test_shuffle_is_seeded_and_differs_by_epoch(tmp_path, label_encoder):
    write_shards(tmp_path / "wds", "webdataset", [6, 6], text_field="txt")
    source = streaming.stream_source(tmp_path / "wds")

    def order(epoch):
        return [item["text"] for item in _stream_items(source, label_encoder, epoch=epoch)]

    assert order(0) == order(0)
    assert order(0) != order(1) and sorted(order(0)) == sorted(order(1))


def test_bad_clips_are_skipped_and_counted_not_fatal(tmp_path, label_encoder):
    long_text = " ".join(["word"] * 500)  # well over the decoder's 448 positions
    write_shards(
        tmp_path / "wds",
        "webdataset",
        [5],
        special={1: (b"not audio at all", "broken clip"), 2: (None, "   "), 3: (None, long_text)},
    )
    items = _stream_items(streaming.stream_source(tmp_path / "wds"), label_encoder)
    reasons = Counter(item.reason for item in items if isinstance(item, Skip))
    assert reasons == {
        "unreadable audio": 1,
        "empty transcript": 1,
        "label longer than 448 tokens": 1,
    }
    assert len([item for item in items if not isinstance(item, Skip)]) == 2


def test_streamed_clips_with_nan_samples_are_skipped_and_found_by_check_data(
    tmp_path, label_encoder
):
    nan = _clip(np.random.default_rng(1), 16000)
    nan[100:110] = np.nan
    float_wav = io.BytesIO()
    sf.write(float_wav, nan, 16000, format="WAV", subtype="FLOAT")
    write_shards(tmp_path / "pq", "parquet", [4], special={2: (float_wav.getvalue(), "nan clip")})
    source = streaming.stream_source(tmp_path / "pq")

    items = _stream_items(source, label_encoder)

    assert [item.reason for item in items if isinstance(item, Skip)] == ["non-finite audio samples"]
    assert all(np.isfinite(item["audio"]).all() for item in items if not isinstance(item, Skip))
    problems = [f for f in check_data(tmp_path / "pq").problems]
    assert [(f.kind, f.origin.split("/")[-1]) for f in problems] == [("non_finite", "s00k0002.wav")]


def test_a_resumed_worker_replays_its_rows_without_decoding(tmp_path, label_encoder):
    write_shards(tmp_path / "wds", "webdataset", [4])
    stream = streaming.training_stream(
        streaming.stream_source(tmp_path / "wds"),
        label_encoder,
        rank=0,
        world_size=1,
        seed=0,
        shuffle_buffer=4,
        max_label_tokens=448,
        batch_size=2,
    )
    collate = streaming.StreamCollator(SpeechCollator(50256))

    def one_pass():
        return list(torch.utils.data.DataLoader(stream, batch_size=None, collate_fn=collate))

    full = one_pass()
    stream.replay_rows, stream.replay_batches = {0: 2}, {0: 1}
    resumed = one_pass()
    assert resumed[0] == {"replayed": True, "stream_rows": {0: 2}, "stream_batches": {}}
    # Then the rest of the pass as an uninterrupted one has it, and nothing more.
    assert len(full) == len(resumed) == 2
    assert resumed[1]["texts"] == full[1]["texts"]


@pytest.mark.parametrize("interrupted_after", [1, 2, 3])
def test_a_resumed_packed_stream_with_two_workers_hands_out_the_uninterrupted_batches(
    tmp_path, label_encoder, interrupted_after
):
    # 22 clips in 4 shards, 2 workers (2 shards each); a label budget of 16 positions packs 2
    # clips a window and a micro-batch asks for 4 clips, so a worker's rows and the
    # micro-batches it handed out differ in number.
    write_shards(tmp_path / "wds", "webdataset", [6, 5, 6, 5])
    stream = streaming.training_stream(
        streaming.stream_source(tmp_path / "wds"),
        label_encoder,
        rank=0,
        world_size=1,
        seed=0,
        shuffle_buffer=4,
        max_label_tokens=16,
        batch_size=4,
        packing=True,
    )
    collate = streaming.StreamCollator(SpeechCollator(50256))

    def one_pass() -> list[dict]:
        loader = torch.utils.data.DataLoader(
            stream, batch_size=None, num_workers=2, collate_fn=collate
        )
        return list(loader)

    full = one_pass()
    assert len(full) > interrupted_after + 1 and any(len(b["texts"][0].split()) > 4 for b in full)
    position = streaming.StreamPosition()  # as the training loop keeps it, then saves it
    for batch in full[:interrupted_after]:
        position.advance(batch["stream_rows"], batch["stream_batches"])
    assert position.rows != position.batches  # packed: more rows than micro-batches
    saved = streaming.StreamPosition.from_dict(
        json.loads(json.dumps(position.to_dict())), folder=tmp_path
    )
    stream.replay_rows, stream.replay_batches = saved.rows, saved.batches

    resumed = [batch for batch in one_pass() if not batch.get("replayed")]

    assert [b["texts"] for b in resumed] == [b["texts"] for b in full[interrupted_after:]]


def _shard_run(tiny_run_config, data, output_dir, **overrides) -> RunConfig:
    return tiny_run_config(
        data=str(data),
        output_dir=str(output_dir),
        batch_size=2,
        shuffle_buffer=3,
        lr_scheduler="constant_with_warmup",
        **overrides,
    )


def test_streamed_run_resumes_with_the_uninterrupted_losses(tmp_path, tiny_run_config, monkeypatch):
    # 5 samples in 3 shards, 2 workers (one reads 2 shards), batches of 2: 3 micro-batches a
    # pass; 5 steps cross into the second pass, and the crash in step 3 leaves checkpoint-2
    # mid-pass, one batch from each worker consumed.
    data = tmp_path / "wds"
    write_shards(data, "webdataset", [2, 2, 1])
    common = {"max_steps": 5, "num_workers": 2}
    reference = train(_shard_run(tiny_run_config, data, tmp_path / "ref", **common))
    reference_rows = metric_rows(reference.output_dir)

    out = tmp_path / "out"
    config = _shard_run(tiny_run_config, data, out, save_steps=1, save_total_limit=1, **common)
    with monkeypatch.context() as patch:
        crash_on_loss_call(patch, 3)  # dies during step 3, after checkpoint-2
        with pytest.raises(RuntimeError, match="simulated crash"):
            train(config)
    saved = json.loads((out / "checkpoint-2" / "stream-0.json").read_text())
    assert saved["epoch"] == 0 and saved["rows"] == {"0": 2, "1": 2}
    config.update({"resume": "latest"})
    resumed_calls, real = [], recipe_module.loss_terms

    def counting(model, batch, **kwargs):
        resumed_calls.append(batch["size"])
        return real(model, batch, **kwargs)

    # A run that ignored the checkpoint and trained 5 steps from scratch would log the same
    # losses: the resumed run must train only steps 3-5, one micro-batch each.
    with monkeypatch.context() as patch:
        patch.setattr(recipe_module, "loss_terms", counting)
        resumed = train(config)
    assert resumed.steps == 5 and len(resumed_calls) == 3
    reference_losses = [row["loss"] for row in reference_rows]
    losses = [row["loss"] for row in metric_rows(out)]
    assert len(reference_losses) == 5  # every step, each compared
    np.testing.assert_allclose(losses, reference_losses, rtol=0, atol=SAME_RUN_LOSS_ATOL)
    # A resume with other workers would read other rows: refused, naming the flag.
    config.update({"num_workers": 0})
    with pytest.raises(UserError, match="--num-workers 2"):
        train(config)


def test_a_packed_stream_with_two_workers_resumes_with_the_uninterrupted_losses(
    tmp_path, tiny_run_config, monkeypatch
):
    # 14 clips of 12 s in 4 shards: two fill a 30 s window, and a micro-batch asks for 2
    # clips, so each of the 2 workers hands out 4 micro-batches of a window a pass from its 7
    # rows. The crash in step 2 leaves checkpoint-1 after one micro-batch of worker 0: 2 rows.
    rng = np.random.default_rng(3)
    long_clips = {
        n: (_encoded(_clip(rng, 16000, seconds=12.0), 16000, "FLAC"), f"long {n} {WORDS[n % 8]}")
        for n in range(14)
    }
    data = tmp_path / "wds"
    write_shards(data, "webdataset", [4, 4, 3, 3], special=long_clips)
    common = {"max_steps": 5, "num_workers": 2, "packing": "on"}
    reference = train(_shard_run(tiny_run_config, data, tmp_path / "ref", **common))

    out = tmp_path / "out"
    config = _shard_run(tiny_run_config, data, out, save_steps=1, save_total_limit=1, **common)
    with monkeypatch.context() as patch:
        crash_on_loss_call(patch, 2)
        with pytest.raises(RuntimeError, match="simulated crash"):
            train(config)
    saved = json.loads((out / "checkpoint-1" / "stream-0.json").read_text())
    assert saved["rows"] == {"0": 2} and saved["batches"] == {"0": 1}
    config.update({"resume": "latest"})
    resumed = train(config)

    assert resumed.steps == 5
    reference_losses = [row["loss"] for row in metric_rows(reference.output_dir)]
    assert len(reference_losses) == 5
    losses = [row["loss"] for row in metric_rows(out)]
    np.testing.assert_allclose(losses, reference_losses, rtol=0, atol=SAME_RUN_LOSS_ATOL)


# Loaded by every Python the launcher starts (PYTHONPATH): in each training process (RANK
# set), every row a DataLoader worker decodes is logged as "rank pass transcript" to a file of
# that worker, so a test sees which samples each process trained on, not only how many.
TRACE_SITECUSTOMIZE = r"""
import os

if os.environ.get("RANK") is not None and os.environ.get("STREAM_TRACE_DIR"):
    from whisper_train.data import streaming

    real_item = streaming.SpeechStream._item

    def traced(self, row, worker, index):
        item = real_item(self, row, worker, index)
        name = f"rank{os.environ['RANK']}-pid{os.getpid()}.txt"
        with open(os.path.join(os.environ["STREAM_TRACE_DIR"], name), "a") as log:
            log.write(f"{os.environ['RANK']}\t{self.epoch}\t{item['text']}\n")
        return item

    streaming.SpeechStream._item = traced
"""


def test_two_processes_share_one_pass(tmp_path, tiny_whisper_dir, monkeypatch):
    # 16 samples in 4 shards over 2 processes x 2 workers: a pass is 8 samples on each.
    data = tmp_path / "pq"
    written = write_shards(data, "parquet", [4, 4, 4, 4])
    hook, trace = tmp_path / "hook", tmp_path / "trace"
    hook.mkdir()
    trace.mkdir()
    (hook / "sitecustomize.py").write_text(TRACE_SITECUSTOMIZE)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv("STREAM_TRACE_DIR", str(trace))
    out = tmp_path / "two"
    args = [
        f"--data={data}",
        f"--model={tiny_whisper_dir}",
        f"--output-dir={out}",
        "--only-train",
        "--nproc=2",
        "--num-workers=2",
        "--batch-size=2",
        "--epochs=1.5",  # counted: 16 / (2 x 2) = 4 steps a pass, 6 in all
        "--save-steps=100",
        "--learning-rate=1e-3",
    ]
    result = train_in_subprocess(args)
    assert "16 samples a pass" in result.stdout
    assert "stream pass 0 ended on process 0: 8 samples" in result.stdout
    (checkpoint,) = checkpoints.list_checkpoints(out)
    assert checkpoints.checkpoint_step(checkpoint) == 6
    passes = [json.loads((checkpoint / f"stream-{r}.json").read_text()) for r in range(2)]
    assert [p["epoch_rows"] for p in passes] == [{"0": 8}, {"0": 8}]
    # Counts alone would pass if both processes read the same half (a rank lost on the way to
    # the stream): pass 0, fully read, holds every sample once over the processes, 8 on each.
    rows = [line.split("\t") for f in trace.iterdir() for line in f.read_text().splitlines()]
    first_pass = [(rank, text) for rank, epoch, text in rows if epoch == "0"]
    assert Counter(text for _, text in first_pass) == Counter(list(written))
    assert Counter(rank for rank, _ in first_pass) == {"0": 8, "1": 8}


def test_hub_id_streams_and_decodes_in_memory(tmp_path, monkeypatch, label_encoder):
    import datasets

    written = write_shards(tmp_path / "hub", "parquet", [3])
    asked = []
    real_load = datasets.load_dataset

    def fake_hub(name, config=None, split=None, streaming=False, **kwargs):
        asked.append((name, config, split, streaming))
        files = sorted(str(p) for p in (tmp_path / "hub").glob("*.parquet"))
        return real_load("parquet", data_files={"train": files}, split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    monkeypatch.setenv("WHISPER_TRAIN_CACHE", str(tmp_path / "cache"))
    source = streaming.stream_source("someone/speech:clean:train", streaming=True)
    assert source.kind == "hub"
    items = _stream_items(source, label_encoder)
    assert asked == [("someone/speech", "clean", "train", True)]
    assert sorted(item["text"] for item in items) == sorted(written)
    for item in items:  # decoded from the bytes in the rows, equal to the clip written
        np.testing.assert_allclose(item["audio"], written[item["text"]], atol=2 / 32768)
    assert not (tmp_path / "cache").exists()  # nothing rewritten as WAV files


def test_check_data_streams_through_shards(tmp_path):
    data = tmp_path / "wds"
    write_shards(data, "webdataset", [3, 2], special={4: (b"garbage", "a broken sample")})
    report = check_data(data)
    assert report.clips == 5
    assert len(report.durations) == 4 and report.durations[0] == pytest.approx(0.6)
    assert report.sample_rates == {16000: 4} and report.languages == {"en": 5}
    assert [f.kind for f in report.problems] == ["unreadable"]
    assert "train-000001.tar:s01k0004" in report.problems[0].origin


def test_streamed_data_refuses_what_needs_it_whole(tmp_path, tiny_run_config):
    write_shards(tmp_path / "wds", "webdataset", [2])
    base = {"data": str(tmp_path / "wds")}
    with pytest.raises(UserError, match="cannot be split for evaluation"):
        tiny_run_config(**base, only_train=False).validate()
    with pytest.raises(UserError, match="--group-by-length needs --data read whole"):
        tiny_run_config(**base, group_by_length=True).validate()
    # A stream's clips have no fixed index to cache by: freeze-encoder caches data read whole only.
    assert tiny_run_config(mode="freeze-encoder").cache_encoder
    assert not tiny_run_config(**base, mode="freeze-encoder").cache_encoder
