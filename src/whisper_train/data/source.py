"""The training data, whatever its layout: one interface for the recipe's step loop.

    data = build_training_data(...)      # WholeData (read whole, packed or not) or StreamData
    data.batches_per_epoch               # micro-batches of an epoch on each process (None: unknown)
    for micro_batches in data.steps(state):   # one optimizer step's micro-batches, in host memory
        ...
    data.restore(folder, state, reader)  # after --resume: continue exactly where the run was
    data.saved_position()                # what a checkpoint keeps beside TrainerState

Equal micro-batches on every process is owned here: a multi-process step all-reduces the loss's
token count and DDP all-reduces the gradients, so every process must run the same number of
micro-batches per step and per epoch, whatever its share of the data (and evaluation splits its
sets the same way, `evaluation_loader`). `shard_batches` gives each
process every N-th global batch and pads the shorter shares with empty micro-batches, which the
step loop runs with zero weight (`stand_in_batch`): nothing is read twice to even the shares out,
and every clip is seen exactly once per epoch.

Items are built one way (`features.SpeechDataset`); the batch plan of an epoch (shuffled order,
length groups, or packed windows) is a pure function of (seed, epoch), computed in the main
process, and each index handed to a loader worker carries its epoch: augmentation and timestamp
draws are a function of (seed, epoch, clip) with 0 or N workers, persistent or not, and after a
resume.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Sampler

from whisper_train.data import packing as packing_module
from whisper_train.data import prompts, streaming
from whisper_train.data.collate import IGNORE_INDEX
from whisper_train.data.examples import Example, Skip
from whisper_train.data.features import SpeechDataset
from whisper_train.data.labels import MAX_DECODER_TOKENS, body_length

# Re-exported: how the data is split over processes and reaches the device (`data.loaders`).
from whisper_train.data.loaders import (  # noqa: F401
    CUDA_DATA_WORKERS,
    default_num_workers,
    evaluation_loader,
    pins_memory,
    shard_batches,
)
from whisper_train.data.screening import read_audio_seconds, summarize_skips
from whisper_train.errors import AudioError, UserError
from whisper_train.runlog import say


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


def stand_in_batch(
    model_config, device: torch.device, *, encoder_outputs: bool, per_clip: bool = False
) -> dict:
    """What a process runs for an empty micro-batch: one silent row whose labels are all
    ignored. Its loss is a zero that reaches every parameter (`memory.loss_terms`), so the
    process takes part in DDP's gradient all-reduce with zero weight instead of skipping it.
    With `per_clip` (--packing per-clip) the row is a window holding one clip, routed as the
    other processes' windows are: their encoder forwards (the silence windows' among them), and
    under --fsdp their layers' all-gathers, are its own."""
    batch = {
        "decoder_input_ids": torch.full(
            (1, 1), model_config.decoder_start_token_id, dtype=torch.long, device=device
        ),
        "labels": torch.full((1, 1), IGNORE_INDEX, dtype=torch.long, device=device),
    }
    if encoder_outputs:
        shape = (1, model_config.max_source_positions, model_config.d_model)
        batch["encoder_hidden_states"] = torch.zeros(shape, device=device)
    else:
        frames = 2 * model_config.max_source_positions
        batch["input_features"] = torch.zeros((1, model_config.num_mel_bins, frames), device=device)
    if per_clip:
        batch["clip_windows"] = torch.zeros(1, dtype=torch.long, device=device)
        batch["clip_positions"] = torch.tensor([[0, 1]], dtype=torch.long, device=device)
    return batch


class _PlannedBatches(Sampler[list]):
    """The batch sampler of the training loader: the current epoch's micro-batches of this
    process, set by `WholeData` before each pass (in the main process, so workers never hold
    a stale plan)."""

    def __init__(self):
        self.batches: list[list] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class WholeData:
    """Training data read whole (`data.load_examples` layouts): shuffled by (seed + epoch),
    grouped by label length, or packed into 30 s windows (`packing`), sharded by
    `shard_batches`."""

    def __init__(
        self,
        dataset: SpeechDataset,
        collate: Callable,
        *,
        accelerator,
        batch_size: int,
        accumulation: int,
        seed: int,
        num_workers: int,
        data_spec: str,
        label_lengths: Sequence[int] | None = None,
        clip_sizes: Sequence[packing_module.ClipSize] | None = None,
        prefix_tokens: int = 0,
        timestamp_tokens: int = 0,
        max_tokens: int = MAX_DECODER_TOKENS,
        strict: bool = False,
    ):
        self.dataset = dataset
        self.strict = strict
        self.accelerator = accelerator
        self.batch_size = batch_size
        self.accumulation = accumulation
        self.seed = seed
        self.data_spec = data_spec
        self.label_lengths = label_lengths  # --group-by-length
        self.clip_sizes = clip_sizes  # --packing on
        self.prefix_tokens = prefix_tokens
        self.timestamp_tokens = timestamp_tokens
        self.max_tokens = max_tokens
        self.sampler = _PlannedBatches()
        self.loader = DataLoader(
            dataset,
            batch_sampler=self.sampler,
            collate_fn=collate,
            num_workers=num_workers,
            # Its own generator: each pass draws the workers' base seed from it, not from the
            # global RNG, whose state a checkpoint restores for dropout (a resumed run must
            # draw what the uninterrupted one drew). Every random draw of an item is seeded by
            # (seed, epoch, clip) anyway.
            generator=torch.Generator().manual_seed(seed),
            persistent_workers=num_workers > 0,
            prefetch_factor=4 if num_workers > 0 else None,
            pin_memory=pins_memory(accelerator),
        )
        # Clips the loader skipped on this process, by origin: said at the end of the epoch
        # they were first met in, and at the end of the run.
        self.clip_skips: dict[str, Skip] = {}
        self.reported_skips = 0
        # Packed, --batch-size counts clips: a micro-batch takes the windows that hold about
        # that many (from the first epoch's plan, fixed for the run: every epoch's steps carry
        # the clips a step of the recipe was measured with, whatever the clips' lengths).
        self.windows_per_batch = batch_size
        if clip_sizes is not None:
            self.windows_per_batch = packing_module.windows_per_batch(batch_size, self.windows(0))
        self.batches_per_epoch = len(self.process_batches(0))

    # -- the plan of an epoch -------------------------------------------------------------
    def windows(self, epoch: int) -> list[tuple[int, ...]]:
        """The packed windows of `epoch` (clip indices), the same on every process."""
        return packing_module.plan_windows(
            self.clip_sizes,
            seed=self.seed,
            epoch=epoch,
            prefix_tokens=self.prefix_tokens,
            max_tokens=self.max_tokens,
            gap_seconds=self.dataset.gap_seconds,
            timestamp_tokens=self.timestamp_tokens,
            padding_stride=self.dataset.padding_stride,
        )

    def global_batches(self, epoch: int) -> list[list]:
        """Every micro-batch of `epoch` across the processes, in order; an item is
        (epoch, clip index) or (epoch, window of clip indices)."""
        size = self.batch_size
        if self.clip_sizes is not None:
            size = self.windows_per_batch
            items: list = self.windows(epoch)
        elif self.label_lengths is not None:
            from whisper_train.data.sampling import LengthGroupedBatchSampler

            grouped = LengthGroupedBatchSampler(self.label_lengths, size, seed=self.seed)
            grouped.set_epoch(epoch)
            return [[(epoch, i) for i in batch] for batch in grouped]
        else:
            # The order of any epoch is known without replaying the ones before it: that of a
            # shuffling DataLoader whose generator is seeded (seed + epoch), which draws its
            # workers' base seed from it first, as whisper-train's orders always were.
            generator = torch.Generator().manual_seed(self.seed + epoch)
            torch.empty((), dtype=torch.int64).random_(generator=generator)
            items = torch.randperm(len(self.dataset), generator=generator).tolist()
        return [[(epoch, item) for item in items[i : i + size]] for i in range(0, len(items), size)]

    def process_batches(self, epoch: int) -> list[list]:
        a = self.accelerator
        return shard_batches(self.global_batches(epoch), a.process_index, a.num_processes)

    # -- the loop ---------------------------------------------------------------------------
    def steps(self, state) -> Iterator[list[dict]]:
        """Optimizer steps without end: each a list of up to `accumulation` micro-batches in
        host memory, from `state`'s place (epoch, micro-batches into it). `state` is kept
        current. The step loop moves each micro-batch to the device as it runs it, so one
        micro-batch's inputs are on the device at a time whatever the accumulation (the memory
        plan counts one)."""
        epoch = state.epoch
        skip = state.batches_in_epoch
        while True:
            yield from group_steps(self._epoch_batches(epoch, skip, state), self.accumulation)
            epoch, skip = epoch + 1, 0

    def _epoch_batches(self, epoch: int, skip: int, state) -> Iterator[dict]:
        accelerator = self.accelerator
        state.epoch, state.batches_in_epoch = epoch, skip
        self.sampler.batches = self.process_batches(epoch)[skip:]
        usable = 0
        for batch in self.loader:
            state.batches_in_epoch += 1
            usable += batch["size"]
            for item in batch["skipped"]:
                self.clip_skips.setdefault(item.origin, item)
            yield batch
        # Every process ends its epoch here (equal micro-batches): one verdict for all of them.
        if accelerator.num_processes > 1:
            total = torch.tensor([usable], device=accelerator.device)
            usable = int(accelerator.reduce(total, reduction="sum").item())
        if usable == 0 and not skip:
            where = (
                f" on process {accelerator.process_index}" if accelerator.num_processes > 1 else ""
            )
            raise UserError(
                f"--data {self.data_spec}: no usable training utterances in a whole epoch "
                f"({len(self.clip_skips)} skipped{where}: {self._skip_reasons()}); run "
                "`whisper-train check-data` on it"
            )
        self.report_skips(f"epoch {epoch}")

    def _skip_reasons(self) -> str:
        counts = Counter(item.reason for item in self.clip_skips.values())
        return ", ".join(f"{n} {reason}" for reason, n in counts.most_common())

    def report_skips(self, when: str) -> None:
        """The clips skipped by the loader (this process) that were not reported yet."""
        skips = list(self.clip_skips.values())[self.reported_skips :]
        if skips:
            self.reported_skips = len(self.clip_skips)
            if self.accelerator.num_processes > 1:
                when += " (process 0)"
            say(
                self.accelerator,
                f"{when}: clips skipped as they were read: " + summarize_skips(skips),
            )

    # -- checkpoints ------------------------------------------------------------------------
    def saved_position(self) -> dict | None:
        return None  # (epoch, micro-batches into it) is in the TrainerState

    def restore(self, folder, state, read_stream_position: Callable[[Path, int], dict]) -> str:
        """Continue where `state` says (a stream's saved place is not needed here)."""
        return f"epoch {state.epoch}, {state.batches_in_epoch} batches into it"

    def describe(self) -> str:
        text = f"{len(self.dataset)} training utterances"
        if self.clip_sizes is not None:
            windows = self.windows(0)
            fill = packing_module.fill_ratio(self.clip_sizes, windows)
            decoded = "each clip decoded on its own, " if self.dataset.per_clip else ""
            per_batch = self.windows_per_batch
            clips = per_batch * sum(len(window) for window in windows) / len(windows)
            text += (
                f", packed into {len(windows)} windows of <= 30 s (speech "
                f"{100 * fill:.0f}% of the encoder's input; {decoded}{per_batch} a micro-batch, "
                f"~{clips:.1f} clips; --packing off trains them one by one)"
            )
        if not self.strict:
            text += (
                " (training audio is checked as each clip is read; `whisper-train check-data` "
                "checks it all first)"
            )
        return text


class StreamData:
    """This process's share of a streamed --data (`streaming`), decoded in the loader workers.

    A stream's pass ends on each process at its own micro-batch; the next pass follows at once,
    so steps group micro-batches across passes and every process runs the same number of
    micro-batches per optimizer step. Its position (pass, rows each worker handed out) is
    saved beside the TrainerState and replayed without decoding on --resume.
    """

    def __init__(
        self,
        source: streaming.StreamSource,
        label_encoder,
        collate: Callable,
        *,
        accelerator,
        config,
        max_label_tokens: int,
        augmenter=None,
    ):
        c, t = config, config.train
        self.source = source
        self.accelerator = accelerator
        self.config = config
        self.accumulation = t.gradient_accumulation
        self.stream_samples: int | None = None  # samples in one pass, when counted
        if t.max_steps is None:
            rows, self.count_seconds = streaming.timed_count(
                source, rank=accelerator.process_index, world_size=accelerator.num_processes
            )
            total = torch.tensor([rows], device=accelerator.device)
            self.stream_samples = int(accelerator.reduce(total, reduction="sum").item())
        self.dataset = streaming.training_stream(
            source,
            label_encoder,
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            seed=t.seed,
            shuffle_buffer=c.data.shuffle_buffer,
            max_label_tokens=max_label_tokens,
            augmenter=augmenter,
            packing=config.packing_on,
            packing_timestamps=config.packing_timestamps_on,
        )
        # What decides which rows a worker's first n are: a resume must match all of them.
        self.position = streaming.StreamPosition(
            settings={
                "seed": t.seed,
                "shuffle_buffer": c.data.shuffle_buffer,
                "batch_size": t.batch_size,
                "num_workers": t.num_workers,
                "packing": c.data.packing,
                # it sets the windows' token budget, so where a window ends
                "packing_timestamps": c.data.packing_timestamps,
            }
        )
        # Not persistent: the workers are started afresh each pass, with that pass's epoch and
        # rows to replay.
        self.loader = DataLoader(
            self.dataset,
            batch_size=t.batch_size,
            collate_fn=streaming.StreamCollator(collate),
            num_workers=t.num_workers,
            prefetch_factor=4 if t.num_workers > 0 else None,
            pin_memory=pins_memory(accelerator),
        )
        if self.stream_samples is None:  # --max-steps: the run's length stands in for it
            self.batches_per_epoch = t.max_steps * t.gradient_accumulation
        else:
            per_process = math.ceil(self.stream_samples / accelerator.num_processes)
            self.batches_per_epoch = math.ceil(per_process / t.batch_size)

    def steps(self, state) -> Iterator[list[dict]]:
        def passes():
            while True:
                yield from self._pass(state)

        yield from group_steps(passes(), self.accumulation)

    def _pass(self, state) -> Iterator[dict]:
        """This process's next pass over its stream, from its saved place after a resume: the
        micro-batches not yet trained on, in host memory (see `WholeData.steps`)."""
        position, accelerator = self.position, self.accelerator
        self.dataset.set_epoch(position.epoch)
        self.dataset.replay_rows = dict(position.rows)
        # Each worker hands out as many REPLAYED items as it had handed out (None: a checkpoint
        # that did not count them; one a row then, exact only without --packing).
        self.dataset.replay_items = {} if position.items is None else dict(position.items)
        state.epoch = position.epoch
        replayed, usable = sum(position.rows.values()), 0
        for batch in streaming.in_one_line(self.loader):
            position.advance(batch.pop("stream_rows"), batch.pop("stream_items"))
            if batch.get("replayed"):
                continue
            position.count_skips(batch["skipped"])
            usable += batch["size"]
            state.batches_in_epoch += 1
            yield batch
        skipped = position.skipped
        rows = position.finish_epoch()
        state.batches_in_epoch = 0
        self.dataset.replay_rows, self.dataset.replay_items = {}, {}
        where = f"--data {self.source.spec}"
        if rows == 0:
            raise UserError(
                f"{where}: process {accelerator.process_index} got no samples in a pass: the "
                f"stream has fewer shards or samples than processes x workers; use fewer "
                "--nproc or --num-workers, or more shards"
            )
        if usable == 0 and replayed == 0:
            raise UserError(
                f"{where}: no usable clip in a whole pass ({rows} samples, "
                f"{streaming.skip_summary(skipped)}); run `whisper-train check-data` on it"
            )
        if self.stream_samples is None and position.epoch == 1:  # now the length of a pass
            t = self.config.train
            self.batches_per_epoch = max(1, math.ceil(rows / t.batch_size))
        say(
            accelerator,
            f"stream pass {position.epoch - 1} ended on process 0: {rows} samples, "
            f"{streaming.skip_summary(skipped)}",
        )

    def report_skips(self, when: str) -> None:
        pass  # each pass reports its own at its end

    def saved_position(self) -> dict | None:
        return self.position.to_dict()

    def restore(self, folder, state, read_stream_position: Callable[[Path, int], dict]) -> str:
        """Continue at this process's saved place in the stream, read from checkpoint `folder`
        by `read_stream_position` (`training.checkpoints` owns what a checkpoint holds)."""
        saved = read_stream_position(folder, self.accelerator.process_index)
        position = streaming.StreamPosition.from_dict(saved)
        position.check_resumable(self.position.settings, folder)
        self.position = position
        return (
            f"stream pass {position.epoch}, {sum(position.rows.values())} samples into it on "
            "this process: read again, not decoded"
        )

    def describe(self) -> str:
        counted = ""
        if self.stream_samples is not None:
            counted = (
                f", {self.stream_samples} samples a pass (counted in {self.count_seconds:.1f} s; "
                "--max-steps skips the count)"
            )
        return (
            f"streaming {self.source.describe()}{counted}; shuffle buffer "
            f"{self.config.data.shuffle_buffer}"
        )


# -- packing's view of the clips --------------------------------------------------------------
def clip_sizes(
    examples: Sequence[Example],
    label_lengths: Sequence[int],
    label_encoder,
    *,
    stretch: float = 1.0,
) -> list[packing_module.ClipSize]:
    """Each training clip's seconds (stated by the data, else its header, read now in threads;
    x `stretch`: the worst-case slowing of --audio-augment) and its transcript's tokens.
    A clip whose header does not read is given a window of its own: the loader skips it."""
    unknown = [e.audio for e in examples if e.duration is None and e.end is None]
    headers = read_audio_seconds(unknown) if unknown else {}
    prefix_lengths: dict[str | None, int] = {}
    sizes = []
    for example, n_tokens in zip(examples, label_lengths, strict=True):
        if example.duration is not None:
            seconds = example.duration
        elif example.end is not None:
            seconds = example.end - (example.start or 0.0)
        else:
            length = headers[example.audio]
            seconds = (
                math.inf if isinstance(length, AudioError) else length - (example.start or 0.0)
            )
        if example.language not in prefix_lengths:
            prefix_lengths[example.language] = len(
                label_encoder.prefix_ids(example.language, timestamps=False)
            )
        text_tokens = body_length(n_tokens, prefix_lengths[example.language])
        sizes.append(
            packing_module.ClipSize(
                seconds=seconds * stretch,
                text_tokens=max(0, text_tokens),
                language=example.language,
                whole=bool(example.segments) or not math.isfinite(seconds),
            )
        )
    return sizes


def packing_budget(
    label_encoder, examples: Sequence[Example], *, packing_timestamps: bool = False
) -> tuple[int, int]:
    """(prefix tokens, tokens per clip beyond its text) that a window's label budget counts:
    the longest prefix any clip's language has, and 2 time tokens a clip with --timestamps or
    --packing-timestamps on (a window's label may then be timestamped)."""
    languages = {example.language for example in examples}
    prefix = max(len(label_encoder.prefix_ids(lang, timestamps=False)) for lang in languages)
    return prefix, 2 if label_encoder.timestamps or packing_timestamps else 0


def _prompter(config, examples, label_encoder, accelerator, max_label_tokens: int):
    """--prompt-probability's `prompts.Prompter`, None when it is 0 (labels as they were)."""
    probability = config.data.prompt_probability
    if not probability:
        return None
    say(accelerator, prompts.describe_prompting(examples, probability))
    return prompts.Prompter(
        label_encoder, probability, seed=config.train.seed, max_target_positions=max_label_tokens
    )


TrainingData = WholeData | StreamData


def build_training_data(
    config,
    datasets,
    label_encoder,
    collator: Callable[[Sequence], Callable],
    *,
    accelerator,
    max_label_tokens: int,
    cached: Callable | None = None,
) -> TrainingData:
    """The run's training data source: a stream when --data names one, else the examples
    `datasets.train` read whole (packed with --packing on). `collator(examples)` gives the
    training collate function for those examples (it may look clips up by index); `cached`
    tells which clips need no decoding (their frozen encoder outputs are on disk)."""
    c, t = config, config.train
    augmenter = None
    if c.data.audio_augment:
        from whisper_train.data.augment import WaveformAugmenter

        augmenter = WaveformAugmenter(seed=t.seed)
    source = config.stream_source()
    if source is not None:
        return StreamData(
            source,
            label_encoder,
            collator(()),
            accelerator=accelerator,
            config=config,
            max_label_tokens=max_label_tokens,
            augmenter=augmenter,
        )
    dataset = SpeechDataset(
        datasets.train,
        label_encoder,
        augmenter=augmenter,
        seed=t.seed,
        gap_seconds=(
            packing_module.per_clip_gap_seconds()
            if config.packing_per_clip
            else packing_module.DEFAULT_GAP_SECONDS
        ),
        padding_stride=packing_module.per_clip_padding_stride() if config.packing_per_clip else 0,
        cached=cached,
        packing_timestamps=config.packing_timestamps_on,
        per_clip=config.packing_per_clip,
        prompter=_prompter(config, datasets.train, label_encoder, accelerator, max_label_tokens),
    )
    sizes, prefix, per_clip = None, 0, 0
    if config.packing_on:
        # Speed perturbation may slow a clip down: plan for its longest form.
        stretch = 1.0 / augmenter.speed[0] if augmenter is not None else 1.0
        sizes = clip_sizes(
            dataset.examples, datasets.label_lengths(label_encoder), label_encoder, stretch=stretch
        )
        prefix, per_clip = packing_budget(
            label_encoder, dataset.examples, packing_timestamps=config.packing_timestamps_on
        )
    return WholeData(
        dataset,
        collator(dataset.examples),
        accelerator=accelerator,
        batch_size=t.batch_size,
        accumulation=t.gradient_accumulation,
        seed=t.seed,
        num_workers=t.num_workers,
        data_spec=str(c.data.data),
        label_lengths=(
            datasets.label_lengths(label_encoder) if t.group_by_length and sizes is None else None
        ),
        clip_sizes=sizes,
        prefix_tokens=prefix,
        timestamp_tokens=per_clip,
        max_tokens=max_label_tokens,
        strict=c.data.strict,
    )
