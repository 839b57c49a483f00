"""What each optimizer step trains: an epoch's items grouped into steps of the clips asked.

A step trains --batch-size x --gradient-accumulation x processes clips (`StepShape.clips`),
whatever the data's form. Read whole, an epoch is a list of items in a seeded order: clips, or
packed windows of several clips (`packing`, each window holding at most a step's clips).
`plan_steps` groups consecutive items into steps by their clip counts: step k ends at the item
boundary nearest k x clips, so an epoch of N clips takes about N / clips steps and a step holds
the clips asked (packed, whole windows: within half a window of it, exactly on average). A
step's items are cut into micro-batches of `StepShape.items_per_micro_batch` (clips unpacked;
packed, the windows that hold about --batch-size clips, at least one) and dealt to the
processes in turn: process r takes the step's micro-batches r, r + N, ..., and a process left
with fewer gets empty ones ([]), which the step loop runs with zero weight, so every process
runs the same micro-batches, hence the same collectives, in every step.

What a step trains therefore depends on the data, the seed, the epoch and the clips a step
asks for alone: N processes at batch b train what one process at batch N x b trains, and batch
b x accumulation a what batch a x b trains (the step's loss is the token mean over the same
clips), packed or not, whatever --num-workers. Unpacked, step s of process r is the global
micro-batches (s x a + i) x N + r, i < a, as it always was.

`WholePlan` is that plan for data read whole: an epoch's items (shuffled clips, length-grouped
clips, or packed windows) and its steps, with the clips an epoch has already trained excluded
when a resume re-plans the rest of it (`consumed`).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from whisper_train.data import packing as packing_module
from whisper_train.data.examples import Skip
from whisper_train.data.labels import MAX_DECODER_TOKENS
from whisper_train.data.sampling import LengthGroupedBatchSampler

Step = list[list[list]]  # [process][micro-batch] -> items


@dataclass(frozen=True)
class StepShape:
    """How an epoch's items become steps: the clips a step asks for, the items a micro-batch
    takes, and the processes that share each step."""

    clips: int  # --batch-size x --gradient-accumulation x processes
    items_per_micro_batch: int
    processes: int = 1


def step_ends(clip_counts: Sequence[int], clips_per_step: int) -> list[int]:
    """The index after each step's last item: step k ends at the item boundary whose cumulative
    clip count is nearest k x `clips_per_step` (on a tie, the later one); no step is empty, and
    the last takes what is left (items of no clips after it, non-speech riding alone, too)."""
    ends: list[int] = []
    start, total, target = 0, 0, clips_per_step
    for index, count in enumerate(clip_counts):
        before, total = total, total + count
        if total < target:
            continue
        # Close the step with this item or before it, whichever lands nearer the target (with
        # it when it is the step's only item).
        with_it = total - target <= target - before or index == start
        start = index + 1 if with_it else index
        ends.append(start)
        reached = total if with_it else before
        target += clips_per_step
        while target <= reached:  # an item of more clips than a step: no empty steps after it
            target += clips_per_step
    if start < len(clip_counts):
        if ends and not any(clip_counts[start:]):
            ends[-1] = len(clip_counts)
        else:
            ends.append(len(clip_counts))
    return ends


def plan_steps(items: Sequence, clip_counts: Sequence[int], shape: StepShape) -> list[Step]:
    """`items` (in the epoch's order; `clip_counts[i]` clips each) as steps: step[rank] is
    process `rank`'s micro-batches of that step, every process with as many (empty ones last)."""
    steps, start = [], 0
    size, processes = shape.items_per_micro_batch, shape.processes
    for end in step_ends(clip_counts, shape.clips):
        chunk = list(items[start:end])
        micro = [chunk[i : i + size] for i in range(0, len(chunk), size)]
        per_process = math.ceil(len(micro) / processes)
        shares = [micro[rank::processes] for rank in range(processes)]
        steps.append([share + [[]] * (per_process - len(share)) for share in shares])
        start = end
    return steps


def group_steps(micro_batches: Iterable[dict], accumulation: int) -> Iterator[list[dict]]:
    """Consecutive micro-batches in groups of `accumulation` (the last one may be shorter)."""
    step: list[dict] = []
    for batch in micro_batches:
        step.append(batch)
        if len(step) == accumulation:
            yield step
            step = []
    if step:
        yield step


@dataclass(frozen=True)
class Packing:
    """What packing needs besides the clips: a window's label budget and audio layout."""

    clip_sizes: Sequence[packing_module.ClipSize]
    prefix_tokens: int = 0
    timestamp_tokens: int = 0  # per clip: 2 where a window's label may be timestamped
    max_tokens: int = MAX_DECODER_TOKENS
    gap_seconds: float = packing_module.DEFAULT_GAP_SECONDS
    padding_stride: int = 0  # --packing per-clip's own padding (`packing.own_padding_seconds`)
    per_clip: bool = False  # each clip decoded on its own (--packing per-clip)
    # --nonspeech's clips ride in the speech's windows, no step counting them as clips
    # (`packing.plan_windows`' riders: the record's nonspeech placement "alongside")
    riders: bool = False
    # Clips whose audio header did not read when their seconds were: in no window (a window of
    # their own would be a micro-batch of silence), named by the loader's first report.
    unreadable: Mapping[int, Skip] = field(default_factory=dict)


def _noise_dealt_evenly(windows: list[tuple[int, ...]], noise: Sequence[bool]) -> list:
    """`windows` (clip indices; `noise[i]`: clip i is --nonspeech's) reordered so that the
    noise they hold is dealt evenly through them: those holding noise, in their order, each
    placed where the clips so far reach the place its noise has in an even spread (the noise
    before it and half its own, over the share), and those of speech alone, in their order,
    between them. The same windows, so the same work: only their order moves."""
    held = [sum(noise[i] for i in window) for window in windows]
    clips = sum(len(window) for window in windows)
    if not any(held):
        return windows
    share = sum(held) / clips
    noisy = [index for index, count in enumerate(held) if count]
    quiet = [index for index, count in enumerate(held) if not count]
    order: list[tuple[int, ...]] = []
    next_noisy = next_quiet = noise_so_far = clips_so_far = 0
    while len(order) < len(windows):
        if next_noisy < len(noisy):
            window = noisy[next_noisy]
            due = (noise_so_far + held[window] / 2) / share
            if next_quiet == len(quiet) or clips_so_far + len(windows[window]) / 2 >= due:
                order.append(windows[window])
                next_noisy += 1
                noise_so_far += held[window]
                clips_so_far += len(windows[window])
                continue
        window = quiet[next_quiet]
        order.append(windows[window])
        next_quiet += 1
        clips_so_far += len(windows[window])
    return order


class WholePlan:
    """The steps of every epoch of training data read whole: a pure function of (the clips,
    seed, epoch, clips a step, items a micro-batch, processes), the same on every process and
    in a resumed run.

    `packing`: pack clips into windows (each of at most a step's clips); `group_by_length`:
    group clips of similar `label_lengths`, but for those in `nonspeech` (--nonspeech's), dealt
    evenly through the steps; neither: a seeded shuffle, the order of a shuffling
    DataLoader seeded with (seed + epoch), as whisper-train's orders always were.

    `spread_nonspeech` (the record's nonspeech placement "spread"): --nonspeech's clips are
    dealt evenly through the steps whatever the order, so that each step trains about the
    share asked: unpacked, through the shuffle's order of the speech (`items`); packed
    without riders, through the order the windows are filled in (`packing.plan_windows`),
    and the windows then ordered so that the noise they hold follows its share
    (`_noise_dealt_evenly`). Without it (a record written before), they are shuffled in with
    the speech, as they were then.
    """

    def __init__(
        self,
        n_clips: int,
        *,
        batch_size: int,
        accumulation: int,
        processes: int,
        seed: int,
        packing: Packing | None = None,
        group_by_length: bool = False,
        label_lengths: Sequence[int] | None = None,
        nonspeech: Collection[int] = (),
        spread_nonspeech: bool = False,
    ):
        self.n_clips = n_clips
        self.batch_size = batch_size
        self.seed = seed
        self.packing = packing
        self.group_by_length = group_by_length
        self.label_lengths = label_lengths
        self.nonspeech = frozenset(nonspeech)
        self.spread_nonspeech = spread_nonspeech
        clips = batch_size * accumulation * processes
        per_micro_batch = batch_size
        if packing is not None:
            # A micro-batch takes the windows that hold about --batch-size clips (from the
            # first epoch's plan, fixed for the run), so its memory is that of --batch-size
            # clips unpacked or less (a window costs the encoder what one clip costs unpacked).
            per_micro_batch = packing_module.windows_per_batch(
                batch_size, self.items(0, clips_per_step=clips)[1]
            )
        self.shape = StepShape(clips, per_micro_batch, processes)

    # -- an epoch's items --------------------------------------------------------------------
    def windows(
        self, epoch: int, *, clips_per_step: int | None = None, exclude: Collection[int] = ()
    ) -> list[tuple[int, ...]]:
        """The packed windows of `epoch` (clip indices), the clips in `exclude` left out."""
        packing = self.packing
        sizes = packing.clip_sizes
        if packing.unreadable:
            exclude = set(exclude) | set(packing.unreadable)
        kept = [i for i in range(self.n_clips) if i not in exclude] if exclude else None
        windows = packing_module.plan_windows(
            sizes if kept is None else [sizes[i] for i in kept],
            seed=self.seed,
            epoch=epoch,
            prefix_tokens=packing.prefix_tokens,
            max_tokens=packing.max_tokens,
            gap_seconds=packing.gap_seconds,
            timestamp_tokens=packing.timestamp_tokens,
            padding_stride=packing.padding_stride,
            max_clips=clips_per_step or self.shape.clips,
            riders=packing.riders,
            spread_nonspeech=self.spread_nonspeech,
        )
        if kept is not None:
            windows = [tuple(kept[i] for i in w) for w in windows]
        if self.spread_nonspeech and not packing.riders:
            windows = _noise_dealt_evenly(windows, [size.nonspeech for size in sizes])
        return windows

    def items(
        self,
        epoch: int,
        *,
        clips_per_step: int | None = None,
        group_by_length: bool | None = None,
        exclude: Collection[int] = (),
    ) -> tuple[list, list[int]]:
        """(`epoch`'s items in order, the clips each holds): clip indices, or windows. The
        clips a step asks for and --group-by-length default to the plan's own (a checkpoint's
        are given to find what its steps trained)."""
        if self.packing is not None:
            windows = self.windows(epoch, clips_per_step=clips_per_step, exclude=exclude)
            if not self.packing.riders:
                return windows, [len(window) for window in windows]
            sizes = self.packing.clip_sizes  # riders are no step's clips
            return windows, [sum(not sizes[i].nonspeech for i in w) for w in windows]
        kept = [i for i in range(self.n_clips) if i not in exclude]
        if self.group_by_length if group_by_length is None else group_by_length:
            # Grouped a step at a time: a step's clips are of similar length, so are the
            # micro-batches cut from it, and the order depends on the clips a step asks for
            # alone, not on how they are split (batch x accumulation x processes).
            # The clips of --nonspeech are left out of the grouping, which would sort their
            # short labels into steps of noise alone, and dealt evenly through the grouped
            # order instead (whatever the placement): each step trains about the share asked.
            speech = [i for i in kept if i not in self.nonspeech]
            grouped = LengthGroupedBatchSampler(
                [self.label_lengths[i] for i in speech],
                clips_per_step or self.shape.clips,
                seed=self.seed,
            )
            grouped.set_epoch(epoch)
            order = [speech[i] for batch in grouped for i in batch]
            order = packing_module.dealt_evenly([i for i in kept if i in self.nonspeech], order)
        else:
            # The order of any epoch is known without replaying the ones before it: that of a
            # shuffling DataLoader whose generator is seeded (seed + epoch), which draws its
            # workers' base seed from it first.
            generator = torch.Generator().manual_seed(self.seed + epoch)
            torch.empty((), dtype=torch.int64).random_(generator=generator)
            order = [kept[i] for i in torch.randperm(len(kept), generator=generator).tolist()]
            if self.spread_nonspeech and self.nonspeech:
                # The speech in the shuffle's order, the noise in its own, dealt evenly through
                # it: only the noise moves. Shuffled in, a step held as many as it happened to.
                order = packing_module.dealt_evenly(
                    [i for i in order if i in self.nonspeech],
                    [i for i in order if i not in self.nonspeech],
                )
        return order, [1] * len(order)

    def steps(self, epoch: int, *, exclude: Collection[int] = ()) -> list[Step]:
        """Every step of `epoch` (the clips of `exclude` left out), on every process."""
        items, counts = self.items(epoch, exclude=exclude)
        return plan_steps(items, counts, self.shape)

    def consumed(
        self,
        epoch: int,
        steps_done: int,
        *,
        clips_per_step: int,
        group_by_length: bool,
        exclude: Collection[int] = (),
    ) -> set[int]:
        """The clips the first `steps_done` steps of `epoch` trained, as a checkpoint planned
        them (its `clips_per_step` and `group_by_length`), with the clips in `exclude` (trained
        before an earlier re-plan of the epoch): what a re-planned epoch leaves out."""
        items, counts = self.items(
            epoch,
            clips_per_step=clips_per_step,
            group_by_length=group_by_length,
            exclude=exclude,
        )
        shape = StepShape(clips_per_step, 1, 1)
        trained = plan_steps(items, counts, shape)[:steps_done]
        found = {item for step in trained for share in step for batch in share for item in batch}
        if self.packing is None:
            return found | set(exclude)
        return {clip for window in found for clip in window} | set(exclude)

    @property
    def steps_per_epoch(self) -> int:
        return len(self.steps(0))

    def summary(self) -> str:
        """The start line's account of the plan (its first epoch), short: clips, windows, steps
        and what a micro-batch holds; `describe` tells the whole of it."""
        items, counts = self.items(0)
        steps = plan_steps(items, counts, self.shape)
        text = f"{self.n_clips} clips"
        noise = (
            len(self.nonspeech)
            if self.packing is None
            else sum(size.nonspeech for size in self.packing.clip_sizes)
        )
        if self.packing is not None and self.packing.riders:
            text += f" ({noise} of noise riding)"
        elif self.spread_nonspeech and noise:
            text += f" ({noise} of noise dealt evenly)"
        if self.packing is not None:
            if self.packing.unreadable:
                text += f" ({len(self.packing.unreadable)} unreadable, left out)"
            text += f" packed into {len(items)} windows"
        text += f"; {len(steps)} steps an epoch of ~{sum(counts) / max(1, len(steps)):.1f} clips"
        if self.packing is not None:
            size = self.shape.items_per_micro_batch
            text += f", {size} window{'s' * (size > 1)} a micro-batch"
        return text

    def describe(self) -> str:
        """The whole account of the plan (its first epoch): clips, windows, how full they are,
        and what a step and a micro-batch hold."""
        items, counts = self.items(0)
        steps = plan_steps(items, counts, self.shape)
        text = f"{self.n_clips} training utterances"
        if self.packing is not None and self.packing.unreadable:
            text += f" ({len(self.packing.unreadable)} whose audio does not read left out)"
        if self.packing is not None:
            fill = packing_module.fill_ratio(self.packing.clip_sizes, items)
            decoded = "each clip decoded on its own; " if self.packing.per_clip else ""
            text += (
                f", packed into {len(items)} windows of <= 30 s ({decoded}speech "
                f"{100 * fill:.0f}% of the encoder's input; --packing off trains them one by one)"
            )
        clips_per_step = sum(counts) / max(1, len(steps))
        text += f"; {len(steps)} steps an epoch of ~{clips_per_step:.1f} clips"
        if self.packing is not None:
            size = self.shape.items_per_micro_batch
            text += (
                f" (~{len(items) / max(1, len(steps)):.1f} windows of "
                f"~{sum(counts) / max(1, len(items)):.1f} clips), "
                f"{size} window{'s' * (size > 1)} a micro-batch"
            )
        return text

    def batch_note(self, accumulation: int) -> str | None:
        """The line that says where a packed step's micro-batches are not the accumulation
        asked (a micro-batch is whole windows of several clips), else None."""
        if self.packing is None:
            return None
        items, counts = self.items(0)
        steps = plan_steps(items, counts, self.shape)
        per_step = sum(len(step[0]) for step in steps) / max(1, len(steps))
        if round(per_step) == accumulation:
            return None
        return (
            f"--batch-size {self.batch_size} x --gradient-accumulation {accumulation}"
            + (f" x {self.shape.processes} processes" if self.shape.processes > 1 else "")
            + f": {self.shape.clips} clips a step in windows of "
            f"~{sum(counts) / max(1, len(items)):.1f}, so ~{per_step:.1f} micro-batches "
            f"a step{' a process' if self.shape.processes > 1 else ''}, not {accumulation}"
        )


# -- a set of clips in a checkpoint ----------------------------------------------------------


def encode_clips(clips: Collection[int], n_clips: int) -> str:
    """A set of clip indices as base64 of a bitmap (n_clips / 8 bytes), for trainer_state.json."""
    bits = bytearray(math.ceil(n_clips / 8))
    for clip in clips:
        bits[clip // 8] |= 1 << (clip % 8)
    return base64.b64encode(bytes(bits)).decode("ascii")


def decode_clips(text: str) -> set[int]:
    """`encode_clips`'s set back."""
    bits = base64.b64decode(text.encode("ascii")) if text else b""
    return {8 * i + b for i, byte in enumerate(bits) for b in range(8) if byte >> b & 1}
