"""The batch asked is the batch trained (`data.step_plan`): a step trains --batch-size x
--gradient-accumulation x processes clips, packed or not, and which clips depends on the data,
the seed and that product alone, so N processes, accumulation and one process at the same
global batch train the same steps.

The plans are checked on clip sizes like the demo's (2-4 s sentences, per-clip packing's own
padding after each: ~4.4 clips a window), then a run of each kind on tone clips compares losses.
"""

from __future__ import annotations

import math
import random
import re

import numpy as np
import pytest
import torch
from conftest import SAME_RUN_LOSS_ATOL, metric_rows, train_in_subprocess, write_tone_dataset

from whisper_train.data import packing
from whisper_train.data.packing import ClipSize
from whisper_train.data.step_plan import Packing, StepShape, WholePlan, plan_steps, step_ends
from whisper_train.training.train import train


def demo_like_clips(n: int = 192, seed: int = 0) -> list[ClipSize]:
    rng = random.Random(seed)
    return [
        ClipSize(seconds=rng.uniform(2.0, 4.0), text_tokens=rng.randint(8, 20)) for _ in range(n)
    ]


def plan_of(
    batch: int, accumulation: int = 1, processes: int = 1, *, kind: str = "per-clip", n: int = 192
) -> WholePlan:
    """The plan of `n` demo-like clips: packed per clip (the default), packed joined, or off."""
    clips = demo_like_clips(n)
    packed = None
    if kind != "off":
        per_clip = kind == "per-clip"
        packed = Packing(
            clips,
            prefix_tokens=4,
            gap_seconds=0.0 if per_clip else packing.DEFAULT_GAP_SECONDS,
            padding_stride=packing.SAMPLED_PAD_STRIDE if per_clip else 0,
            per_clip=per_clip,
        )
    return WholePlan(
        n, batch_size=batch, accumulation=accumulation, processes=processes, seed=0, packing=packed
    )


def clips_a_step(plan: WholePlan, epoch: int = 0) -> list[int]:
    """Clips each step of `epoch` trains, over every process."""
    steps = plan.steps(epoch)
    size = (lambda item: len(item)) if plan.packing else (lambda item: 1)
    return [sum(size(i) for share in step for batch in share for i in batch) for step in steps]


def items_of(step) -> set:
    return {item for share in step for batch in share for item in batch}


def test_step_ends_fall_nearest_each_multiple_of_the_clips_asked():
    assert step_ends([1] * 10, 4) == [4, 8, 10]  # unpacked: exact, the last step shorter
    # Windows of 4 or 5 clips, 6 a step asked: the boundary nearest 6, 12, 18, 24.
    assert step_ends([4, 5, 4, 4, 5, 4], 6) == [1, 3, 4, 6]
    assert step_ends([4, 5, 4], 100) == [3]
    assert step_ends([], 4) == []


@pytest.mark.parametrize("processes", [1, 2, 3])
def test_every_item_once_and_every_process_the_same_micro_batches(processes):
    rng = random.Random(processes)
    counts = [rng.randint(1, 6) for _ in range(57)]
    steps = plan_steps(list(range(57)), counts, StepShape(12, 2, processes))
    trained = [item for step in steps for item in sorted(items_of(step))]
    assert sorted(trained) == list(range(57))
    for step in steps:
        assert len(step) == processes and len({len(share) for share in step}) == 1
        assert all(len(batch) <= 2 for share in step for batch in share)


@pytest.mark.parametrize("kind", ["per-clip", "on", "off"])
@pytest.mark.parametrize(
    "batch, accumulation, processes",
    [(1, 4, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 16, 1), (8, 1, 1), (3, 1, 1), (6, 1, 1)],
)
def test_a_step_trains_the_clips_asked(kind, batch, accumulation, processes):
    """Before the plan, a packed micro-batch was at least a window of ~4.4 clips: batch 1 x
    accumulation 4 trained 3x the clips a step of batch 4, and the seed's 1 x 16 ~70 clips."""
    asked = batch * accumulation * processes
    plan = plan_of(batch, accumulation, processes, kind=kind)
    clips = clips_a_step(plan)
    assert sum(clips) == 192  # every clip once an epoch
    mean = np.mean(clips[:-1])  # the last step takes what is left
    assert abs(mean - asked) <= 0.25 * asked, (mean, asked)
    if kind != "off":  # no window holds more clips than a step asks for
        assert max(len(window) for window in plan.windows(0)) <= asked


def test_length_grouping_spreads_the_noise_clips_through_the_steps():
    """--group-by-length with --nonspeech: the noise clips' labels (3 tokens) are the shortest,
    so grouping put them all into steps of noise alone (each such step moves the model toward
    writing nothing, as far as a step of speech moves it). Spread, every step of 8 clips holds
    the share asked: 2 in 10 here, never more than 3."""
    rng = random.Random(0)
    lengths = [rng.randint(12, 60) for _ in range(160)] + [3] * 40  # 40 of 200: a share of 0.2
    noise = set(range(160, 200))

    def steps(**spread) -> list:
        plan = WholePlan(
            200,
            batch_size=8,
            accumulation=1,
            processes=1,
            seed=0,
            group_by_length=True,
            label_lengths=lengths,
            **spread,
        )
        steps = plan.steps(0)
        assert sorted(i for step in steps for i in items_of(step)) == list(range(200))
        return steps

    assert max(len(items_of(step) & noise) for step in steps()) == 8  # before: steps of noise
    spread_steps = steps(nonspeech=noise)
    spread = [len(items_of(step) & noise) for step in spread_steps]
    assert min(spread) >= 1 and max(spread) <= 3, spread
    # Speech is still grouped: a step's labels span far less than the data's 12-60 tokens.
    spans = [
        max(lengths[i] for i in items_of(step) - noise)
        - min(lengths[i] for i in items_of(step) - noise)
        for step in spread_steps
    ]
    assert np.median(spans) <= 12, spans


def test_accumulation_and_batch_train_the_same_share_of_an_epoch_per_step():
    """The issue's case: 40 short clips, --batch-size 1 --gradient-accumulation 4 trained 0.333
    of an epoch a step, --batch-size 4 0.111."""
    shares = [1 / len(plan_of(b, a, n=40).steps(0)) for b, a in ((1, 4), (4, 1), (2, 2))]
    assert max(shares) <= 1.25 * min(shares), shares
    assert shares[0] == pytest.approx(4 / 40, rel=0.25)


def test_the_seeds_flags_train_about_16_clips_a_step():
    """`--batch-size 1 --gradient-accumulation 16`: 16 clips a step, in whole windows of ~4.4
    clips (so ~4 micro-batches of one window), and the start line says so."""
    plan = plan_of(1, 16)
    assert np.mean(clips_a_step(plan)[:-1]) == pytest.approx(16, rel=0.25)
    assert plan.shape.items_per_micro_batch == 1
    note = plan.batch_note(16)
    assert note.startswith("--batch-size 1 x --gradient-accumulation 16: 16 clips a step")
    assert "micro-batches a step, not 16" in note
    assert plan_of(8).batch_note(1) is None  # as asked: no line


@pytest.mark.parametrize("kind", ["per-clip", "on", "off"])
def test_processes_and_accumulation_train_what_one_process_does_at_the_same_global_batch(kind):
    one = plan_of(8, kind=kind).steps(1)
    for batch, accumulation, processes in ((4, 1, 2), (2, 2, 2), (4, 2, 1), (1, 8, 1)):
        other = plan_of(batch, accumulation, processes, kind=kind).steps(1)
        assert [items_of(step) for step in other] == [items_of(step) for step in one]


def test_a_replanned_epoch_trains_each_clip_once():
    """A resume with other clips a step plans the rest of the epoch from the clips its first
    steps (as the checkpoint planned them) have not trained."""
    before, after = plan_of(4), plan_of(16)
    trained = before.consumed(0, 5, clips_per_step=4, group_by_length=False)
    rest = after.steps(0, exclude=trained)
    replanned = [clip for step in rest for window in items_of(step) for clip in window]
    assert sorted([*trained, *replanned]) == list(range(192))
    assert np.mean(clips_a_step_of(rest)[:-1]) == pytest.approx(16, rel=0.25)


def clips_a_step_of(steps) -> list[int]:
    return [sum(len(w) for share in step for batch in share for w in batch) for step in steps]


# -- in a run: losses, at the same global batch ----------------------------------------------


def test_ddp_and_accumulation_equal_one_process_under_the_default_packing(
    tmp_path, tiny_whisper_dir, tiny_run_config
):
    """48 clips of 1.2 s packed per clip (~6 a window), 8 clips a step: one process at batch
    8, two at batch 4 (each takes a window of a step of two) and batch 4 x accumulation 2 train
    the same steps; their losses are token means over the same clips. Before the plan they
    differed by 2e-3 to 4e-2 (each process, and each micro-batch, packed its own windows).
    (--fsdp at the same global batch: tests/test_packing.py's per-clip-fsdp.)"""
    data = write_tone_dataset(tmp_path / "data", n=48)
    common = {
        "data": str(data),
        "eval_split": 0.0,
        "lr_scheduler": "constant_with_warmup",
        "max_steps": 3,
    }
    one = train(tiny_run_config(output_dir=str(tmp_path / "one"), batch_size=8, **common))
    accumulated = train(
        tiny_run_config(
            output_dir=str(tmp_path / "acc"), batch_size=4, gradient_accumulation=2, **common
        )
    )
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in common.items()]
    ddp = train_in_subprocess(
        [
            *flags,
            f"--model={tiny_whisper_dir}",
            "--learning-rate=1e-3",
            "--seed=0",
            "--only-train",
            "--nonspeech=none",  # as tiny_run_config's two runs
            "--nproc=2",
            "--batch-size=4",
            f"--output-dir={tmp_path / 'ddp'}",
        ]
    )
    per_step = re.search(r"steps an epoch of ~([\d.]+) clips", ddp.stdout).group(1)
    assert abs(float(per_step) - 8) <= 2, ddp.stdout  # whole windows of ~6 clips
    losses = {
        name: [row["loss"] for row in metric_rows(out) if "loss" in row]
        for name, out in (
            ("one", one.output_dir),
            ("accumulation", accumulated.output_dir),
            ("ddp", tmp_path / "ddp"),
        )
    }
    assert len(losses["one"]) == 3
    for name in ("accumulation", "ddp"):
        np.testing.assert_allclose(losses[name], losses["one"], rtol=0, atol=SAME_RUN_LOSS_ATOL)


def test_loader_workers_do_not_change_what_a_step_trains(tmp_path, tiny_run_config):
    """Read whole, the plan is made in the main process: 2 loader workers read the same
    micro-batches, so the losses are equal (a stream's are not: its start line says so)."""
    data = write_tone_dataset(tmp_path / "data", n=24)
    common = {"data": str(data), "eval_split": 0.0, "batch_size": 8, "max_steps": 3}
    alone = train(tiny_run_config(output_dir=str(tmp_path / "w0"), **common))
    workers = train(tiny_run_config(output_dir=str(tmp_path / "w2"), num_workers=2, **common))
    losses = [
        [r["loss"] for r in metric_rows(out)] for out in (alone.output_dir, workers.output_dir)
    ]
    np.testing.assert_allclose(losses[1], losses[0], rtol=0, atol=SAME_RUN_LOSS_ATOL)


def test_a_grouped_checkpoint_resumes_ungrouped_from_the_clips_its_steps_left(
    tmp_path, tiny_run_config, capsys
):
    """--group-by-length dropped on a --resume re-plans the rest of the epoch from the clips
    the checkpoint's grouped steps did not train; it stopped with a TypeError (the clips'
    label lengths were counted for a grouped run alone)."""
    data = write_tone_dataset(tmp_path / "data", n=16)
    common = {"data": str(data), "eval_split": 0.0, "batch_size": 4, "packing": "off"}
    train(tiny_run_config(group_by_length=True, max_steps=1, save_steps=1, **common))
    capsys.readouterr()
    result = train(tiny_run_config(max_steps=3, resume="latest", **common))
    assert "epoch 0: its other 12 clips planned anew, 3 steps of 4 clips" in capsys.readouterr().out
    assert result.final_step == 3


def _speech_and_noise(n_speech: int, n_noise: int, seed: int = 0) -> list[ClipSize]:
    """Speech clips of 3-5 s (the default path's usual) and --nonspeech pieces of 0.5-2 s."""
    rng = random.Random(seed)
    speech = [ClipSize(rng.uniform(3.0, 5.0), rng.randint(8, 40)) for _ in range(n_speech)]
    noise = [ClipSize(rng.uniform(0.5, 2.0), 0, nonspeech=True) for _ in range(n_noise)]
    return speech + noise


def _per_clip_plan(sizes, riders: bool, batch: int = 4, processes: int = 1) -> WholePlan:
    return WholePlan(
        len(sizes),
        batch_size=batch,
        accumulation=1,
        processes=processes,
        seed=0,
        packing=Packing(sizes, prefix_tokens=3, gap_seconds=0.0, padding_stride=8, riders=riders),
    )


@pytest.mark.parametrize("processes", [1, 2])
def test_noise_riding_alongside_leaves_every_step_of_speech_as_without_it(processes):
    """--packing per-clip's non-speech clips ride in the room the speech's windows leave: every
    step of every epoch trains the same speech clips, in the same windows, as the run without
    non-speech (so the speech learns what it learns without noise, and an epoch
    takes as many steps), each noise clip is trained once an epoch, at most one rides in a
    window of speech, and every window holds its clips and their own padding within 30 s.
    Before, the noise counted as a fifth of each step's clips: 1.25x the steps and windows."""
    sizes = _speech_and_noise(160, 40)
    speech = _per_clip_plan(sizes[:160], riders=False, processes=processes)
    alongside = _per_clip_plan(sizes, riders=True, processes=processes)
    assert alongside.shape == speech.shape
    for epoch in range(3):
        with_noise, without = alongside.steps(epoch), speech.steps(epoch)
        assert len(with_noise) == len(without)
        for ridden, plain in zip(with_noise, without, strict=True):
            # The step's windows of speech (over its processes, whose gradients are summed).
            spoken = {tuple(i for i in window if i < 160) for window in items_of(ridden)}
            assert spoken - {()} == items_of(plain)
        windows = alongside.windows(epoch)
        noise = [i for window in windows for i in window if i >= 160]
        assert sorted(noise) == list(range(160, 200))
        for window in windows:
            riders = [i for i in window if i >= 160]
            if len(riders) < len(window):
                assert len(riders) <= 1 and (not riders or window[-1] == riders[0])
            else:  # noise alone: no more decoder rows than a step's clips
                assert len(window) <= alongside.shape.clips
            room = sum(packing.footprint_seconds(sizes[i], 8) for i in window)
            assert room <= 30.0 + 1e-9
        # Riding costs few windows: those of noise alone hold what found no room (here half of
        # it: these windows of 3-5 s clips leave 0-3 s), an eighth more encoder passes at most.
        alone = [w for w in windows if all(i >= 160 for i in w)]
        assert len(windows) - len(alone) == len(speech.windows(epoch))
        assert len(alone) <= len(speech.windows(epoch)) / 8


def test_a_rider_takes_about_its_own_length_of_a_window():
    """A noise clip's own padding is sampled 64 times more coarsely than speech's: a 2 s piece
    takes 2.06 s of a window where a 2 s clip of speech takes 5.66 s."""
    noise, speech = ClipSize(2.0, 0, nonspeech=True), ClipSize(2.0, 10)
    assert packing.footprint_seconds(noise, 8) == pytest.approx(2.06)
    assert packing.footprint_seconds(speech, 8) == pytest.approx(2.0 + 0.02 * 175)
    assert packing.footprint_seconds(noise, 0) == 2.0  # no sampled padding: none of its own


# -- --nonspeech's clips dealt evenly through the steps ("spread") ----------------------------


def _noise_plan(sizes, kind: str, *, spread: bool, batch: int = 8, processes: int = 1):
    """The plan of `sizes` (speech, then --nonspeech's clips): unpacked ("off") or packed
    joined ("on"), the noise spread (the record's placement "spread") or shuffled in (a record
    written before it: "as-clips")."""
    return WholePlan(
        len(sizes),
        batch_size=batch // processes,
        accumulation=1,
        processes=processes,
        seed=0,
        packing=Packing(sizes, prefix_tokens=3) if kind == "on" else None,
        nonspeech=[i for i, size in enumerate(sizes) if size.nonspeech],
        spread_nonspeech=spread,
    )


def _clips_of(step, packed: bool) -> list[int]:
    return [clip for item in items_of(step) for clip in (item if packed else (item,))]


def _assert_noise_follows_its_share(steps, noise: set[int], packed: bool) -> None:
    """Unpacked, each step of k clips holds the floor or the ceiling of its share of noise (k x
    the epoch's noise over its clips). Packed, in whole windows: every run of steps holds its
    share to within the most noise a window holds (and one), and no two steps in a row none."""
    held = [len(set(_clips_of(step, packed)) & noise) for step in steps]
    clips = [len(_clips_of(step, packed)) for step in steps]
    share = sum(held) / sum(clips)
    if not packed:
        full = max(clips)
        bounds = (math.floor(full * share), math.ceil(full * share))
        assert all(h in bounds for h, c in zip(held, clips, strict=True) if c == full), held
        return
    most = max(len(set(w) & noise) for step in steps for w in items_of(step))
    for start in range(len(steps)):
        for end in range(start + 1, len(steps) + 1):
            off = sum(held[start:end]) - share * sum(clips[start:end])
            assert abs(off) <= most + 1, (start, end, held)
    assert all(held[k] or held[k + 1] for k in range(len(held) - 1)), held


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("kind", ["off", "on"])
def test_noise_is_dealt_evenly_through_every_step_of_the_shuffle_and_of_joined_packing(
    kind, processes
):
    """The plain shuffle and --packing on shuffled the noise in with the speech: a step of 8
    clips held 0 to 4 noise clips where a fifth was asked (1.6), runs of steps none. Spread,
    every clip is still trained once an epoch, in as many steps and (packed) windows, and the
    noise follows its share through the epoch: unpacked, each step of 8 holds 1 or 2 (the floor
    or the ceiling of 1.6), the speech in the order it had; packed (whole windows of up to 8
    clips), any run of steps holds its share to within a window's noise."""
    sizes = _speech_and_noise(160, 40)
    noise, packed = set(range(160, 200)), kind == "on"
    spread = _noise_plan(sizes, kind, spread=True, processes=processes)
    before = _noise_plan(sizes, kind, spread=False, processes=processes)
    for epoch in range(3):
        steps = spread.steps(epoch)
        assert len(steps) == len(before.steps(epoch))
        trained = [clip for step in steps for clip in _clips_of(step, packed)]
        assert sorted(trained) == list(range(200))  # every clip once an epoch
        _assert_noise_follows_its_share(steps, noise, packed)
        if packed:
            assert len(spread.windows(epoch)) == len(before.windows(epoch))  # as many passes
        else:  # only the noise moves
            order, old_order = spread.items(epoch)[0], before.items(epoch)[0]
            assert [i for i in order if i not in noise] == [i for i in old_order if i not in noise]


@pytest.mark.parametrize("kind", ["off", "on"])
def test_a_plan_without_spread_is_the_order_older_checkpoints_trained(kind):
    """A checkpoint whose record does not say "spread" resumes with the noise shuffled in as it
    trained: unpacked, the order of a shuffling DataLoader seeded (seed + epoch); packed, the
    windows `packing.plan_windows` planned with the noise among the speech."""
    sizes = _speech_and_noise(160, 40)
    plan = _noise_plan(sizes, kind, spread=False)
    for epoch in range(3):
        items, _ = plan.items(epoch)
        if kind == "off":
            loader = torch.utils.data.DataLoader(
                range(200), shuffle=True, generator=torch.Generator().manual_seed(epoch)
            )
            assert items == [int(batch) for batch in loader]
        else:
            assert items == packing.plan_windows(
                sizes, seed=0, epoch=epoch, prefix_tokens=3, max_tokens=448, max_clips=8
            )
        assert items != _noise_plan(sizes, kind, spread=True).items(epoch)[0]


@pytest.mark.parametrize("kind", ["off", "on"])
def test_a_spread_plan_is_replayed_exactly_and_replanned_spread_once_a_clip(kind):
    """The plan is a pure function of the clips, seed and epoch: a resumed run (a new plan of
    the same clips), and two processes at the same global batch, train every step as the run
    did; a resume at other clips a step plans the rest of the epoch from the clips the first
    steps have not trained, each clip once, its noise still dealt evenly."""
    sizes = _speech_and_noise(160, 40)
    noise, packed = set(range(160, 200)), kind == "on"
    plan = _noise_plan(sizes, kind, spread=True)
    for epoch in range(3):
        steps = [items_of(step) for step in plan.steps(epoch)]
        resumed = _noise_plan(sizes, kind, spread=True).steps(epoch)
        assert [items_of(step) for step in resumed] == steps
        _assert_noise_follows_its_share(resumed, noise, packed)
        two = _noise_plan(sizes, kind, spread=True, processes=2).steps(epoch)
        assert [items_of(step) for step in two] == steps
    trained = plan.consumed(1, 5, clips_per_step=8, group_by_length=False)
    rest = _noise_plan(sizes, kind, spread=True, batch=16).steps(1, exclude=trained)
    replanned = [clip for step in rest for clip in _clips_of(step, packed)]
    assert sorted([*trained, *replanned]) == list(range(200))
    _assert_noise_follows_its_share(rest, noise, packed)
