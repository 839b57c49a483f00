"""The training data, whatever its layout: one interface for the recipe's step loop.

    plan = plan_training_data(...)       # WholePlan (read whole) or StreamPlan: every epoch's
                                         #   steps, made before the run's record
    data = open_training_data(plan, ...) # WholeData or StreamData: their loader
    data.steps_per_epoch                 # None: a stream not counted yet
    for micro_batches in data.steps(state):   # one optimizer step's micro-batches, in host memory
        ...
    data.restore(state, ...)             # after --resume: continue exactly where the run was
    data.saved_position()                # what a checkpoint keeps beside TrainerState

Equal micro-batches on every process is owned here: a multi-process step all-reduces the loss's
token count and DDP all-reduces the gradients, so every process must run the same number of
micro-batches per step and per epoch, whatever its share of the data (and evaluation splits its
sets the same way, `evaluation_loader`). Data read whole is planned step by step for all the
processes at once (`step_plan`): each takes its micro-batches of every step, the shorter shares
padded with empty ones, which the step loop runs with zero weight (`stand_in_batch`): nothing is
read twice to even the shares out, and every clip is seen exactly once per epoch. A stream has
no plan of the whole: each worker of each process makes its own micro-batches of about
--batch-size clips, and a step takes --gradient-accumulation of them on every process.

Items are built one way (`features.SpeechDataset`); an epoch's plan (shuffled order, length
groups, or packed windows) is a pure function of (seed, epoch, the clips a step asks for),
computed in the main process, and each index handed to a loader worker carries its epoch:
augmentation and timestamp draws are a function of (seed, epoch, clip) with 0 or N workers,
persistent or not, and after a resume.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch
from accelerate.utils import reduce
from torch.utils.data import DataLoader, Sampler

from whisper_train.choices import PER_CLIP
from whisper_train.data import packing as packing_module
from whisper_train.data import prompts, streaming
from whisper_train.data.augment import WaveformAugmenter
from whisper_train.data.collate import IGNORE_INDEX
from whisper_train.data.examples import Example, is_nonspeech
from whisper_train.data.features import SpeechDataset
from whisper_train.data.labels import body_length
from whisper_train.data.loader_skips import LoaderSkips
from whisper_train.data.loaders import pins_memory
from whisper_train.data.screening import (
    clip_problem,
    read_audio_seconds,
)
from whisper_train.data.step_plan import Packing, WholePlan, decode_clips, encode_clips
from whisper_train.data.streaming import StreamData, StreamPlan
from whisper_train.errors import AudioError, UserError
from whisper_train.runlog import say


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
    """The batch sampler of the training loader: this process's micro-batches of the steps
    left in the current epoch, set by `WholeData` before each pass (in the main process, so
    workers never hold a stale plan)."""

    def __init__(self):
        self.batches: list[list] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class WholeData:
    """Training data read whole (`data.load_examples` layouts), its steps planned by a
    `step_plan.WholePlan`: this process's micro-batches of each step, read by one loader."""

    def __init__(
        self,
        plan: WholePlan,
        dataset: SpeechDataset,
        collate: Callable,
        *,
        accelerator,
        num_workers: int,
        data_spec: str,
        strict: bool = False,
    ):
        self.plan = plan
        self.dataset = dataset
        self.strict = strict
        self.accelerator = accelerator
        self.data_spec = data_spec
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
            generator=torch.Generator().manual_seed(plan.seed),
            persistent_workers=num_workers > 0,
            prefetch_factor=4 if num_workers > 0 else None,
            pin_memory=pins_memory(accelerator),
        )
        # Clips the loader skipped, every process's: each named at the end of the epoch it
        # was first met in (or of the run), once.
        self.skips = LoaderSkips()
        if plan.packing is not None and accelerator.is_main_process:  # named once, by one
            self.skips.add(plan.packing.unreadable.values())
        self.steps_per_epoch = plan.steps_per_epoch

    # -- the loop ---------------------------------------------------------------------------
    def steps(self, state) -> Iterator[list[dict]]:
        """Optimizer steps without end, each this process's micro-batches in host memory, from
        `state`'s place (epoch, steps into it, clips a re-plan left out of it), which is kept
        current. The step loop moves each micro-batch to the device as it runs it, so one
        micro-batch's inputs are on the device at a time (the memory plan counts one)."""
        while True:
            yield from self._epoch_steps(state)
            state.epoch, state.steps_in_epoch, state.trained_before_replan = state.epoch + 1, 0, ""

    def _epoch_steps(self, state) -> Iterator[list[dict]]:
        accelerator = self.accelerator
        rank = accelerator.process_index
        steps = self.plan.steps(state.epoch, exclude=decode_clips(state.trained_before_replan))
        left = [step[rank] for step in steps[state.steps_in_epoch :]]
        # Each item carries its epoch to the loader workers (`SpeechDataset.__getitem__`).
        epoch = state.epoch
        self.sampler.batches = [
            [(epoch, item) for item in batch] for share in left for batch in share
        ]
        batches, usable = iter(self.loader), 0
        for share in left:
            micro_batches = [next(batches) for _ in share]
            for batch in micro_batches:
                usable += batch["size"]
                self.skips.add(batch["skipped"])
            state.steps_in_epoch += 1
            yield micro_batches
        # Every process ends its epoch here (the same steps): one verdict for all of them, and
        # the same collectives (the sum, then the skips' gather) whatever its share held.
        if accelerator.num_processes > 1:
            total = torch.tensor([usable], device=accelerator.device)
            usable = int(reduce(total, reduction="sum").item())
        new = self.skips.gather(accelerator)
        if usable == 0 and len(left) == len(steps):
            raise UserError(
                f"--data {self.data_spec}: no usable training utterances in a whole epoch "
                f"({len(self.skips.named)} skipped: {self.skips.reasons()}); run "
                "`whisper-train check-data` on it"
            )
        self.skips.say(accelerator, f"epoch {state.epoch}", new, state)

    def report_skips(self, when: str, state) -> None:
        """The clips skipped by any process's loader that were not named yet (every process
        calls this at the same step: it gathers)."""
        self.skips.say(self.accelerator, when, self.skips.gather(self.accelerator), state)

    # -- checkpoints ------------------------------------------------------------------------
    def saved_position(self) -> dict | None:
        return None  # (epoch, steps into it, clips left out) is in the TrainerState

    def restore(
        self,
        state,
        *,
        replan: bool,
        saved_clips_per_step: int | None,
        saved_group_by_length: bool,
        **_,
    ) -> str:
        """Continue where `state` says; with `replan` (a resume with other clips a step, or
        --group-by-length changed) the rest of the epoch is planned anew from the clips that
        its first steps, as the checkpoint planned them (`saved_*`), have not trained."""
        if not replan:
            return f"epoch {state.epoch}, {state.steps_in_epoch} steps into it"
        left_out = decode_clips(state.trained_before_replan)
        trained = self.plan.consumed(
            state.epoch,
            state.steps_in_epoch,
            clips_per_step=saved_clips_per_step,
            group_by_length=saved_group_by_length,
            exclude=left_out,
        )
        state.trained_before_replan = encode_clips(trained, self.plan.n_clips)
        state.steps_in_epoch = 0
        left = self.plan.n_clips - len(trained)
        return (
            f"epoch {state.epoch}: its other {left} clips planned anew, "
            f"{len(self.plan.steps(state.epoch, exclude=trained))} steps of "
            f"{self.plan.shape.clips} clips"
        )

    def summary(self) -> str:
        return self.plan.summary()

    def describe(self) -> str:
        return self.plan.describe() + (
            ""
            if self.strict
            else " (training audio is checked as each clip is read; `whisper-train check-data` "
            "checks it all first)"
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
    A clip whose header does not read is given a window of its own (`plan_training_data` leaves
    it out of every window, and names it)."""
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
        if is_nonspeech(example):  # adds nothing to a window's label, and states no language
            text_tokens = 0
        else:
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
                nonspeech=is_nonspeech(example),
            )
        )
    return sizes


def packing_budget(
    label_encoder, examples: Sequence[Example], *, packing_timestamps: bool = False
) -> tuple[int, int]:
    """(prefix tokens, tokens per clip beyond its text) that a window's label budget counts:
    the longest prefix any clip's language has, and 2 time tokens a clip with --timestamps or
    --packing-timestamps on (a window's label may then be timestamped)."""
    # A clip where nobody speaks has no language of its own: its label takes the run's prefix.
    languages = {example.language for example in examples if not is_nonspeech(example)}
    languages = languages or {label_encoder.language}
    prefix = max(len(label_encoder.prefix_ids(lang, timestamps=False)) for lang in languages)
    return prefix, 2 if label_encoder.timestamps or packing_timestamps else 0


def _prompter(probability, examples, label_encoder, process, *, seed, max_label_tokens):
    """--prompt-probability's `prompts.Prompter`, None when it is 0 (labels as they were)."""
    if not probability:
        return None
    say(process, prompts.describe_prompting(examples, probability))
    return prompts.Prompter(
        label_encoder, probability, seed=seed, max_target_positions=max_label_tokens
    )


TrainingPlan = WholePlan | StreamPlan
TrainingData = WholeData | StreamData


def plan_training_data(
    datasets,
    label_encoder,
    *,
    stream: streaming.StreamSource | None,
    packing: str,
    packing_timestamps: bool,
    batch_size: int,
    accumulation: int,
    group_by_length: bool,
    seed: int,
    audio_augment: bool,
    shuffle_buffer: int,
    max_label_tokens: int,
    counted: bool,
    process,
    nonspeech_alongside: bool = False,
    nonspeech_spread: bool = False,
) -> TrainingPlan:
    """What every epoch of the training data trains (`step_plan`): a stream's share (counted
    unless not `counted`), else the examples `datasets.train` read whole, shuffled, grouped by
    label length or packed (`packing`: off, on or per-clip) into steps of the clips asked."""
    augmenter = None
    if audio_augment:
        augmenter = WaveformAugmenter(seed=seed)
    if stream is not None:
        return StreamPlan(
            stream,
            process=process,
            batch_size=batch_size,
            accumulation=accumulation,
            seed=seed,
            shuffle_buffer=shuffle_buffer,
            packing=packing != "off",
            packing_timestamps=packing_timestamps,
            counted=counted,
            augmenter=augmenter,
        )
    examples = datasets.train
    packed = None
    if packing != "off":
        per_clip = packing == PER_CLIP
        # Speed perturbation may slow a clip down: plan for its longest form.
        stretch = 1.0 / augmenter.speed[0] if augmenter is not None else 1.0
        prefix, per_clip_tokens = packing_budget(
            label_encoder, examples, packing_timestamps=packing_timestamps
        )
        sizes = clip_sizes(
            examples, datasets.label_lengths(label_encoder), label_encoder, stretch=stretch
        )
        packed = Packing(
            sizes,
            prefix_tokens=prefix,
            timestamp_tokens=per_clip_tokens,
            max_tokens=max_label_tokens,
            gap_seconds=(
                packing_module.per_clip_gap_seconds()
                if per_clip
                else packing_module.DEFAULT_GAP_SECONDS
            ),
            padding_stride=packing_module.per_clip_padding_stride() if per_clip else 0,
            per_clip=per_clip,
            riders=per_clip and nonspeech_alongside,
            unreadable={
                index: problem
                for index, size in enumerate(sizes)
                if math.isinf(size.seconds)  # its header did not read
                and (problem := clip_problem(examples[index])) is not None
            },
        )
    plan = WholePlan(
        len(examples),
        batch_size=batch_size,
        accumulation=accumulation,
        processes=process.num_processes,
        seed=seed,
        packing=packed,
        group_by_length=group_by_length,
        # Counted by screening, and needed without --group-by-length too: a resume re-plans
        # from what a grouped checkpoint's steps trained (`WholePlan.consumed`).
        label_lengths=datasets.label_lengths(label_encoder),
        nonspeech=[i for i, e in enumerate(examples) if is_nonspeech(e)],
        spread_nonspeech=nonspeech_spread,
    )
    plan.augmenter = augmenter
    return plan


def open_training_data(
    plan: TrainingPlan,
    datasets,
    label_encoder,
    collator: Callable[[Sequence], Callable],
    *,
    accelerator,
    num_workers: int,
    data_spec: str,
    strict: bool,
    prompt_probability: float,
    packing_timestamps: bool,
    max_label_tokens: int,
    cached: Callable | None = None,
) -> TrainingData:
    """The loader of `plan`: `collator(examples)` gives the training collate function for those
    examples (it may look clips up by index); `cached` tells which clips need no decoding
    (their frozen encoder outputs are on disk)."""
    if isinstance(plan, StreamPlan):
        return StreamData(
            plan,
            label_encoder,
            collator(()),
            accelerator=accelerator,
            num_workers=num_workers,
            max_label_tokens=max_label_tokens,
        )
    packed = plan.packing
    dataset = SpeechDataset(
        datasets.train,
        label_encoder,
        augmenter=plan.augmenter,
        seed=plan.seed,
        gap_seconds=packed.gap_seconds if packed else packing_module.DEFAULT_GAP_SECONDS,
        padding_stride=packed.padding_stride if packed else 0,
        riders=bool(packed and packed.riders),
        cached=cached,
        packing_timestamps=packing_timestamps,
        per_clip=bool(packed and packed.per_clip),
        prompter=_prompter(
            prompt_probability,
            datasets.train,
            label_encoder,
            accelerator,
            seed=plan.seed,
            max_label_tokens=max_label_tokens,
        ),
    )
    return WholeData(
        plan,
        dataset,
        collator(dataset.examples),
        accelerator=accelerator,
        num_workers=num_workers,
        data_spec=data_spec,
        strict=strict,
    )
