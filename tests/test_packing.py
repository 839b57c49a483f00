"""Packed 30-second windows and the training data source: the plan, the labels, the step loop.

Seeded tiny models on tone clips (conftest); nothing is downloaded.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
import types

import numpy as np
import pytest
import soundfile
import torch
from conftest import (
    SAME_RUN_LOSS_ATOL,
    crash_on_loss_call,
    losses_and_evaluations,
    metric_rows,
    train_in_subprocess,
    write_tone_dataset,
)
from tiny_models import english_tokenizer

from whisper_train.config.resolve import choose_packing
from whisper_train.data.augment import WaveformAugmenter
from whisper_train.data.features import SpeechDataset
from whisper_train.data.labels import LabelEncoder
from whisper_train.data.layouts import load_examples
from whisper_train.data.loaders import shard_batches
from whisper_train.data.packing import (
    OWNPAD,
    OWNPAD_GAP,
    PER_CLIP_ENCODER,
    SAMPLED_PAD,
    SAMPLED_PAD_STRIDE_VARIABLE,
    ClipSize,
    PackedWindow,
    own_padding_seconds,
    plan_windows,
    window_seconds,
)
from whisper_train.data.source import WholeData
from whisper_train.data.step_plan import WholePlan, group_steps
from whisper_train.errors import UserError
from whisper_train.training.checkpoints import TrainerState
from whisper_train.training.recipe import FineTuneRecipe
from whisper_train.training.train import train


def _random_clips(n: int, seed: int = 0) -> list[ClipSize]:
    rng = random.Random(seed)
    return [
        ClipSize(seconds=rng.uniform(0.5, 12.0), text_tokens=rng.randint(1, 120)) for _ in range(n)
    ]


def _plan(clips, epoch=0, seed=0, **kwargs):
    return plan_windows(clips, seed=seed, epoch=epoch, prefix_tokens=4, max_tokens=448, **kwargs)


def test_windows_hold_at_most_30_s_and_448_tokens_and_every_clip_once():
    clips = _random_clips(400)
    windows = _plan(clips)
    for window in windows:
        assert window_seconds(clips, window) <= 30.0 + 1e-9
        assert 4 + sum(clips[i].text_tokens for i in window) <= 448
    assert sorted(i for window in windows for i in window) == list(range(len(clips)))
    # The point of packing: far fewer encoder windows than clips (400 clips of 6 s on average).
    assert len(windows) < len(clips) / 3


def test_token_budget_binds_before_the_audio_budget():
    clips = [ClipSize(seconds=1.0, text_tokens=100) for _ in range(20)]
    windows = _plan(clips, timestamp_tokens=2)
    # 4 + 4 x 102 = 412 fits 448; a fifth clip would need 514 positions.
    assert all(len(window) <= 4 for window in windows)
    assert sorted(i for window in windows for i in window) == list(range(20))


def test_same_seed_same_windows_other_epoch_other_windows():
    clips = _random_clips(200, seed=1)
    assert _plan(clips, epoch=3) == _plan(clips, epoch=3)
    assert _plan(clips, epoch=3) != _plan(clips, epoch=4)
    assert _plan(clips, seed=1) != _plan(clips, seed=2)
    # Other epochs put other clips together, not just the same windows in another order.
    together = [{frozenset(w) for w in _plan(clips, epoch=e)} for e in (0, 1)]
    assert together[0] != together[1]


def test_subtitle_windows_and_languages_are_never_mixed():
    clips = [ClipSize(2.0, 5, language="en") for _ in range(6)]
    clips += [ClipSize(2.0, 5, language="de") for _ in range(6)]
    clips += [ClipSize(20.0, 50, language="en", whole=True)]
    windows = _plan(clips)
    assert (12,) in windows
    for window in windows:
        assert len({clips[i].language for i in window}) == 1


def test_shares_are_padded_with_empty_micro_batches():
    batches = [[i] for i in range(5)]
    shares = [shard_batches(batches, rank, 2) for rank in (0, 1)]
    assert shares == [[[0], [2], [4]], [[1], [3], []]]
    assert len(shares[0]) == len(shares[1])
    assert [len(step) for step in group_steps(range(5), 2)] == [2, 2, 1]


@pytest.fixture
def packed_dataset(tmp_path):
    data = write_tone_dataset(tmp_path / "data", n=6)
    examples = load_examples(str(data))
    tokenizer = english_tokenizer()

    def build(timestamps: bool = False, **kwargs) -> SpeechDataset:
        encoder = LabelEncoder(
            tokenizer, timestamps=timestamps, multilingual=False, timestamp_probability=1.0
        )
        return SpeechDataset(examples, encoder, seed=0, **kwargs)

    return build, tokenizer, examples


def test_a_packed_label_decodes_to_its_clips_transcripts_in_order(packed_dataset):
    build, tokenizer, examples = packed_dataset
    window = (4, 1, 3)
    item = build()[(0, window)]
    text = tokenizer.decode(item["tokens"][item["n_prefix"] :], skip_special_tokens=True)
    assert text.strip() == " ".join(examples[i].text for i in window)
    # 3 clips of 1.2 s and two gaps of 0.3 s
    assert len(item["audio"]) == pytest.approx(16_000 * (3 * 1.2 + 2 * 0.3), abs=3)


def test_packed_timestamps_sit_on_the_clip_boundaries(packed_dataset):
    build, tokenizer, examples = packed_dataset
    dataset = build(timestamps=True)
    window = (0, 5)
    item = dataset[(0, window)]
    begin = dataset.label_encoder.timestamp_begin_id
    body = item["tokens"][item["n_prefix"] : -1]
    times = [0.02 * (t - begin) for t in body if t >= begin]
    texts = tokenizer.decode([t for t in body if t < begin]).strip()
    assert texts == " ".join(examples[i].text for i in window)
    # clip 0: 0 - 1.2 s; gap 0.3 s; clip 5: 1.5 - 2.7 s, each within one 20 ms time step
    np.testing.assert_allclose(times, [0.0, 1.2, 1.5, 2.7], atol=0.02)


def _segments(label_encoder, tokenizer, tokens, n_prefix):
    """A label's body → ([(start s, end s)], [segment texts]); raises if not all segments."""
    begin = label_encoder.timestamp_begin_id
    body = tokens[n_prefix:-1]
    times, texts, words = [], [], []
    for token in body:
        if token >= begin:
            times.append(0.02 * (token - begin))
            if len(times) % 2 == 0:
                texts.append(tokenizer.decode(words).strip())
                words = []
        else:
            words.append(token)
    assert not words and len(times) % 2 == 0, "text outside a <|start|> ... <|end|> segment"
    return list(zip(times[::2], times[1::2], strict=True)), texts


@pytest.mark.parametrize("timestamps", [False, True])
def test_packing_timestamps_label_every_window_of_two_clips_with_its_clips_times(
    packed_dataset, timestamps
):
    build, tokenizer, examples = packed_dataset
    # --timestamps drawn with probability 0 (or not given): only the option timestamps windows
    on = build(timestamps=timestamps, packing_timestamps=True)
    on.label_encoder.timestamp_probability = 0.0
    window = (4, 1, 3)
    item = on[(0, window)]
    assert on.label_encoder.no_timestamps_id not in item["tokens"]
    spans, texts = _segments(on.label_encoder, tokenizer, item["tokens"], item["n_prefix"])
    assert texts == [examples[i].text for i in window]
    # 3 clips of 1.2 s with 0.3 s between them, each boundary within one 20 ms time step
    expected = [(0.0, 1.2), (1.5, 2.7), (3.0, 4.2)]
    np.testing.assert_allclose(spans, expected, atol=0.02)
    # A window of one clip is labelled as that clip is without packing.
    off = build(timestamps=timestamps)
    off.label_encoder.timestamp_probability = 0.0
    assert on[(0, (2,))]["tokens"] == off[2]["tokens"]
    # Off: today's label, the transcripts with no time token.
    plain = off[(0, window)]
    assert plain["tokens"][plain["n_prefix"] - 1] == off.label_encoder.no_timestamps_id
    assert max(plain["tokens"][plain["n_prefix"] : -1]) < off.label_encoder.timestamp_begin_id


def test_packing_timestamps_windows_count_their_time_tokens_in_the_label_budget(tmp_path):
    from whisper_train.data.source import clip_sizes, packing_budget

    examples = load_examples(str(write_tone_dataset(tmp_path / "data", n=24)))
    encoder = LabelEncoder(english_tokenizer(), multilingual=False)
    dataset = SpeechDataset(examples, encoder, seed=0, packing_timestamps=True)
    lengths = [len(encoder.encode(example)[0]) for example in examples]
    sizes = clip_sizes(examples, lengths, encoder)
    # A budget of 24 positions: about 3 clips' transcripts, 2 with their time tokens.
    max_tokens = 24

    def windows(timestamp_tokens):
        return plan_windows(
            sizes,
            seed=0,
            epoch=0,
            prefix_tokens=prefix,
            max_tokens=max_tokens,
            timestamp_tokens=timestamp_tokens,
        )

    def positions(window):  # decoder positions of the window's label: the first is read
        return len(dataset[(0, window)]["tokens"]) - 1

    prefix, per_clip = packing_budget(encoder, examples, packing_timestamps=True)
    assert per_clip == 2
    planned = windows(per_clip)
    assert any(len(window) > 1 for window in planned)
    assert max(positions(window) for window in planned) <= max_tokens
    # Counted without the time tokens, the same budget would be overrun.
    assert max(positions(window) for window in windows(0)) > max_tokens


def test_augmentation_is_drawn_per_clip_epoch_and_the_same_with_workers(packed_dataset):
    build, _, _ = packed_dataset
    accelerator = types.SimpleNamespace(
        process_index=0, num_processes=1, device=torch.device("cpu")
    )

    def audio_of_epochs(num_workers):
        dataset = build(augmenter=WaveformAugmenter(seed=0, p=1.0))
        plan = WholePlan(len(dataset), batch_size=2, accumulation=1, processes=1, seed=0)
        data = WholeData(
            plan,
            dataset,
            lambda items: {"audio": [x["audio"] for x in items], "size": len(items), "skipped": []},
            accelerator=accelerator,
            num_workers=num_workers,
            data_spec="tones",
        )
        state = TrainerState()
        steps = data.steps(state)
        epochs = []
        for _ in range(2):
            batches = [next(steps)[0] for _ in range(3)]
            epochs.append([a for batch in batches for a in batch["audio"]])
        return epochs

    alone, with_workers = audio_of_epochs(0), audio_of_epochs(2)
    for a, b in zip(alone[0] + alone[1], with_workers[0] + with_workers[1], strict=True):
        np.testing.assert_array_equal(a, b)
    # Epoch 1 draws other speeds and noise than epoch 0 (other order too: compare as sets).
    lengths = [sorted(len(a) for a in epoch) for epoch in alone]
    assert lengths[0] != lengths[1]


def _many_tones(tmp_path, n=48):
    """Tone clips of 1.2 s: with batch size 1, a handful of packed windows an epoch."""
    return write_tone_dataset(tmp_path / "many", n=n)


@pytest.mark.parametrize("packing", ["on", "per-clip"])
@pytest.mark.long
def test_packed_run_resumes_mid_epoch_with_the_uninterrupted_losses(
    packing, tmp_path, tiny_run_config, monkeypatch
):
    data = _many_tones(tmp_path)
    common = {"data": str(data), "packing": packing, "batch_size": 8, "eval_split": 0.0}
    reference = train(tiny_run_config(output_dir=str(tmp_path / "ref"), max_steps=10, **common))
    reference_losses, _ = losses_and_evaluations(reference.output_dir)
    config = tiny_run_config(max_steps=10, save_steps=1, save_total_limit=1, **common)
    with monkeypatch.context() as patch:
        crash_on_loss_call(patch, 3)  # dies during step 3, after checkpoint-2
        with pytest.raises(RuntimeError, match="simulated crash"):
            train(config)
    config.update({"resume": "latest"})
    train(config)
    losses, _ = losses_and_evaluations(tmp_path / "out")
    np.testing.assert_allclose(losses, reference_losses, rtol=0, atol=SAME_RUN_LOSS_ATOL)
    # 48 clips of 1.2 s, 8 a step (in windows of at most 8 clips; per-clip: ~6 a window, each
    # with its own padding): ~6 steps an epoch, so the 10 steps crossed an epoch boundary.
    epochs = [row["epoch"] for row in metric_rows(tmp_path / "out") if "loss" in row]
    assert epochs[-1] > 1.0


def test_packed_training_trains_on_windows_and_evaluates_single_clips(tmp_path, tiny_run_config):
    data = _many_tones(tmp_path, n=40)
    # 30 training clips in 2 windows: --batch-size counts clips, so 30 is both windows.
    config = tiny_run_config(
        data=str(data), packing="on", batch_size=30, only_train=False, eval_split=0.25
    )
    config.validate()
    recipe = FineTuneRecipe(config)
    recipe.setup()
    state = TrainerState()
    first = next(recipe.data.steps(state))[0]
    assert first["size"] == 2
    assert all(len(text.split()) > 3 for text in first["texts"])  # several 3-word clips each
    evaluated = [text for batch in recipe.judge.loaders["eval"] for text in batch["texts"]]
    assert sorted(evaluated) == sorted(e.text for e in recipe.datasets.eval["eval"])
    assert all(len(text.split()) == 3 for text in evaluated)


def _first_per_clip_batch(tmp_path, tiny_run_config):
    """(config, recipe, first micro-batch) of a --packing per-clip run on 40 tones of 1.2 s, 2
    windows a micro-batch (--batch-size counts clips: 12 is 2 windows of ~6 clips, each
    clip with its sampled padding 1.2 + 28.8 / 8 s)."""
    data = _many_tones(tmp_path, n=40)
    config = tiny_run_config(data=str(data), packing="per-clip", batch_size=12, eval_split=0.0)
    recipe = FineTuneRecipe(config.validate())
    recipe.setup()
    batch = next(recipe.data.steps(TrainerState()))[0]
    return config, recipe, batch


def test_per_clip_packing_decodes_each_clip_of_a_window_on_its_own(tmp_path, tiny_run_config):
    config, recipe, batch = _first_per_clip_batch(tmp_path, tiny_run_config)
    windows, positions = batch["clip_windows"], batch["clip_positions"]
    # Two windows through the encoder, several clips each through the decoder, each with its
    # own 3-word label (its own prefix and <|endoftext|>), not the window's joined one.
    assert batch["input_features"].shape[0] == batch["size"] == 2
    assert len(batch["texts"]) == len(windows) == batch["labels"].shape[0] > 2
    assert all(len(text.split()) == 3 for text in batch["texts"])
    eot = recipe.label_encoder.eot_id
    assert [(row == eot).sum().item() for row in batch["labels"]] == [1] * len(windows)
    # Each clip's encoder positions: 1.2 s of audio (60 positions, +1 where it straddles one),
    # in order in its window, none shared with the clip before it (its own padding between:
    # 180 positions by default, the test below; 15 with another context's 0.3 s gaps).
    lengths = (positions[:, 1] - positions[:, 0]).tolist()
    assert all(60 <= n <= 61 for n in lengths)
    for window in (0, 1):
        spans = positions[windows == window].tolist()
        assert all(later[0] >= earlier[1] + 14 for earlier, later in itertools.pairwise(spans))
    config.update({"output_dir": str(tmp_path / "trained"), "max_steps": 2})
    losses, _ = losses_and_evaluations(train(config.validate()).output_dir)
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


def test_per_clip_packing_with_own_padding_plans_longer_gaps(
    tmp_path, tiny_run_config, monkeypatch
):
    """WHISPER_TRAIN_PER_CLIP_ENCODER=block-restart-ownpad: 1.0 s between two clips of a
    window (50 encoder positions, 49 where a clip straddles one), each clip's own padding."""
    monkeypatch.setenv(PER_CLIP_ENCODER, OWNPAD)
    monkeypatch.delenv(OWNPAD_GAP, raising=False)
    _, _, batch = _first_per_clip_batch(tmp_path, tiny_run_config)
    windows, positions = batch["clip_windows"], batch["clip_positions"]
    assert len(windows) > 2
    for window in (0, 1):
        spans = positions[windows == window].tolist()
        assert all(
            49 <= later[0] - earlier[1] <= 51 for earlier, later in itertools.pairwise(spans)
        )


def test_a_clips_sampled_padding_is_planned_and_laid_after_it():
    """SAMPLED_PAD: a clip of n encoder positions is followed by ceil((1500 - n) / stride)
    positions of its own padding, in the plan's 30 s as in the window's audio."""
    assert own_padding_seconds(3.0, 8) == pytest.approx(169 * 0.02)  # (1500 - 150) / 8
    assert own_padding_seconds(29.9, 8) == pytest.approx(0.02)  # 5 positions alone: 1
    assert own_padding_seconds(29.99, 8) == 0.0  # 1500: none
    assert own_padding_seconds(3.0, 0) == 0.0
    clips = _random_clips(200)
    for window in _plan(clips, gap_seconds=0.0, padding_stride=8):
        footprints = sum(
            clips[i].seconds + own_padding_seconds(clips[i].seconds, 8) for i in window
        )
        assert footprints <= 30.0 + 1e-9
    window = PackedWindow(0.0, padding_stride=8)
    clip = np.ones(3 * 16000, dtype=np.float32)
    while window.fits(clip):
        window.add(clip, "a")
    # 150 + 169 positions a clip: 4 fit in 1500 (a fifth would end at 1595)
    assert len(window) == 4
    starts = [start for start, _ in window.spans]
    assert np.diff(starts) == pytest.approx([3.0 + 169 * 0.02] * 3)
    assert len(window.audio()) == 4 * (48000 + 169 * 320)
    assert not window.audio()[48000 : 48000 + 169 * 320].any()  # silence after the first


def test_per_clip_packing_with_sampled_padding_gives_each_clip_its_own(
    tmp_path, tiny_run_config, monkeypatch
):
    """WHISPER_TRAIN_PER_CLIP_ENCODER=block-restart-ownpad-sampled: after each 1.2 s clip (60
    encoder positions, 61 where it straddles one) its own padding, (1500 - 60) / 8 = 180
    positions, no other gap: at most 6 clips a window; a step trains."""
    monkeypatch.setenv(PER_CLIP_ENCODER, SAMPLED_PAD)
    monkeypatch.delenv(OWNPAD_GAP, raising=False)
    monkeypatch.delenv(SAMPLED_PAD_STRIDE_VARIABLE, raising=False)
    config, _, batch = _first_per_clip_batch(tmp_path, tiny_run_config)
    windows, positions = batch["clip_windows"], batch["clip_positions"]
    for window in (0, 1):
        spans = positions[windows == window].tolist()
        assert 2 <= len(spans) <= 6
        assert all(
            179 <= later[0] - earlier[1] <= 181 for earlier, later in itertools.pairwise(spans)
        )
    config.update({"output_dir": str(tmp_path / "trained"), "max_steps": 2})
    losses, _ = losses_and_evaluations(train(config.validate()).output_dir)
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


def test_packing_is_refused_with_the_encoder_cache_and_reads_yaml_booleans(tiny_run_config):
    with pytest.raises(UserError, match="--packing on with the frozen encoder's cache"):
        tiny_run_config(packing="on", mode="freeze-encoder").validate()
    tiny_run_config(packing="on", mode="freeze-encoder", cache_encoder=False).validate()
    config = tiny_run_config(packing=True)  # YAML reads `packing: on` as true
    assert config.validate().data.packing == "on"
    with pytest.raises(UserError, match="--packing maybe: expected on, per-clip, auto or off"):
        tiny_run_config(packing="maybe").validate()


def test_packing_auto_packs_per_clip_unless_an_option_cannot_meet_it(tiny_run_config):
    """The default: per-clip; off with what per-clip is refused with (the matrix covers
    streams and the encoder cache, `test_packing_auto_is_per_clip_wherever_the_matrix_...`)
    and with what any packing is, never an error of its own; the line the run prints says
    which and why."""
    packing, note = choose_packing(tiny_run_config().validate())
    assert packing == "per-clip" and note.startswith("packing auto -> per-clip")
    for options, why in (
        ({"preserve_base": 0.5}, "--preserve-base"),
        ({"compile": True}, "--compile"),
        ({"group_by_length": True}, "--group-by-length"),
        ({"mode": "freeze-encoder"}, "encoder's cache"),  # its encoder cache, on by default
    ):
        packing, note = choose_packing(tiny_run_config(**options).validate())
        assert packing == "off" and note.startswith("packing auto -> off") and why in note
    uncached = tiny_run_config(mode="freeze-encoder", cache_encoder=False)
    assert choose_packing(uncached.validate())[0] == "per-clip"
    # The asked options keep what was asked: auto.
    assert tiny_run_config().validate().data.packing == "auto"
    # Asked for by name, per-clip with such an option is refused, not turned off.
    with pytest.raises(UserError, match="--packing per-clip is not supported with --compile"):
        tiny_run_config(packing="per-clip", compile=True).validate()


def test_packing_timestamps_is_a_flag_and_a_yaml_key_and_needs_packing(tiny_run_config):
    import argparse

    from whisper_train.commands.flags import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--packing", "on", "--packing-timestamps", "on"])
    assert config_from_args(args).data.packing_timestamps == "on"
    assert config_from_args(parser.parse_args(["--packing", "on"])).data.packing_timestamps == "off"
    yaml_true = tiny_run_config(packing=True, packing_timestamps=True).validate()
    assert yaml_true.data.packing_timestamps == "on"
    with pytest.raises(
        UserError, match="--packing-timestamps on labels joined packed windows: add"
    ):
        tiny_run_config(packing_timestamps="on").validate()


def _varied_labels(tmp_path):
    """Tone clips whose transcripts have 1 to 8 words: label lengths differ a lot."""
    folder = write_tone_dataset(tmp_path / "varied", n=16)
    lines = (folder / "metadata.csv").read_text().splitlines()
    rng = random.Random(0)
    rows = [lines[0]]
    for line in lines[1:]:
        name, text = line.split(",", 1)
        rows.append(f"{name},{' '.join([text] * rng.randint(1, 3))[: rng.randint(5, 60)]}")
    (folder / "metadata.csv").write_text("\n".join(rows) + "\n")
    return folder


def test_accumulation_is_the_token_mean_of_the_step(tmp_path, tiny_run_config):
    data = _varied_labels(tmp_path)
    common = {
        "data": str(data),
        "eval_split": 0.0,
        "lr_scheduler": "constant_with_warmup",
        "packing": "off",  # packed, a micro-batch is whole windows: 2 x 2 may hold more
    }
    four = train(tiny_run_config(output_dir=str(tmp_path / "b4"), batch_size=4, **common))
    two_by_two = train(
        tiny_run_config(
            output_dir=str(tmp_path / "b2x2"), batch_size=2, gradient_accumulation=2, **common
        )
    )
    np.testing.assert_allclose(
        losses_and_evaluations(two_by_two.output_dir)[0],
        losses_and_evaluations(four.output_dir)[0],
        rtol=0,
        atol=SAME_RUN_LOSS_ATOL,
    )


# The same global batch (--batch-size counts clips): one process at 2b, two at b; 66 clips of
# 1.2 s and one of 29 s that does not decode, in windows of at most 2b clips (on: ~20 a window
# by their seconds; per-clip: ~6, each clip with 3.6 s of its own padding), the long one alone
# in one more.
@pytest.mark.parametrize(
    "packing, sharding, windows, batch",
    [("on", [], 5, 13), ("per-clip", ["--fsdp"], 12, 6)],
    ids=["on", "per-clip-fsdp"],
)
@pytest.mark.long
def test_two_processes_packed_with_an_empty_share_equal_one(
    packing, sharding, windows, batch, tmp_path, tiny_whisper_dir
):
    """Per-clip under --fsdp: its silence windows' encoder forward all-gathers every encoder
    layer once more, so the process with nothing to read must run it too (a routed
    stand-in): else the two processes' all-gathers pair up wrong and the run hangs or fails."""
    data = _many_tones(tmp_path, n=66)
    # One clip of 29 s whose header reads but whose frames do not decode: alone in its window,
    # with one window a micro-batch a process's micro-batch holds nothing usable. (A missing
    # file, whose header does not read, is in no window: tests/test_combinations.py.)
    tone = (0.3 * np.sin(np.arange(29 * 16_000) / 5)).astype(np.float32)
    soundfile.write(data / "undecodable.flac", tone, 16_000)
    encoded = (data / "undecodable.flac").read_bytes()
    (data / "undecodable.flac").write_bytes(encoded[:200] + bytes(len(encoded) - 200))
    metadata = data / "metadata.csv"
    lines = metadata.read_text().splitlines()
    lines.append("undecodable.flac,alpha bravo charlie")
    metadata.write_text("\n".join(lines) + "\n")
    common = [
        f"--data={data}",
        f"--model={tiny_whisper_dir}",
        "--learning-rate=1e-3",
        "--seed=0",
        "--eval-split=0",
        "--only-train",
        "--lr-scheduler=constant_with_warmup",
        f"--packing={packing}",
        "--epochs=1",  # the whole epoch: the window that holds nothing too
        "--nonspeech=none",  # its own clips alone: the windows counted below
    ]
    alone = train_in_subprocess(
        [*common, f"--batch-size={2 * batch}", f"--output-dir={tmp_path / 'one'}"]
    )
    two_processes = train_in_subprocess(
        [
            *common,
            *sharding,
            "--nproc=2",
            f"--batch-size={batch}",
            f"--output-dir={tmp_path / 'two'}",
        ]
    )
    one = [row["loss"] for row in metric_rows(tmp_path / "one") if "loss" in row]
    two = [row["loss"] for row in metric_rows(tmp_path / "two") if "loss" in row]
    steps = int(re.search(r"(\d+) steps an epoch", alone.stdout).group(1))
    assert len(one) == steps > 1
    np.testing.assert_allclose(two, one, rtol=0, atol=SAME_RUN_LOSS_ATOL)
    # Named at the end of the epoch it was met in, once, whichever process's share held it.
    for run in (alone, two_processes):
        named = [line for line in run.stdout.splitlines() if "metadata.csv:68" in line]
        assert len(named) == 1 and "1 unreadable audio: " in named[0], run.stdout
        assert "skipped 1 clips during training" in run.stdout
    # The same windows, 2 a micro-batch on one process, 1 on each of two: a process's
    # micro-batch holding nothing usable must not hang or weigh.
    for run in (alone, two_processes):
        assert f"packed into {windows} windows" in run.stdout
    assert "2 windows a micro-batch" in alone.stdout
    assert "1 window a micro-batch" in two_processes.stdout


def test_a_clip_whose_encoder_output_is_cached_is_not_decoded_again(
    tmp_path, tiny_run_config, monkeypatch
):
    import whisper_train.data.features as features_module

    decoded = []
    real = features_module.load_audio

    def counting(path, **window):
        decoded.append(path)
        return real(path, **window)

    monkeypatch.setattr(features_module, "load_audio", counting)
    # 12 training clips (only_train: none held out), 3 micro-batches an epoch: 6 steps are 2
    # epochs; the second reads every clip's encoder output from the cache and decodes none.
    # Clips of its own: the session's encoder cache may hold the shared tone clips already.
    data = write_tone_dataset(tmp_path / "own", n=12)
    result = train(tiny_run_config(data=str(data), mode="freeze-encoder", max_steps=6))
    assert result.steps == 6
    assert len(decoded) == 12 and len(set(decoded)) == 12


def _packed_stream(
    folder, label_encoder, *, max_label_tokens=24, packing_timestamps=False, batch_size=100
):
    """A packed stream whose windows are bound by their labels' tokens, not by the clips a
    micro-batch asks for (`batch_size` clips, 100 by default)."""
    from whisper_train.data import streaming

    return streaming.training_stream(
        streaming.stream_source(folder),
        label_encoder,
        rank=0,
        world_size=1,
        seed=0,
        shuffle_buffer=4,
        max_label_tokens=max_label_tokens,
        batch_size=batch_size,
        packing=True,
        packing_timestamps=packing_timestamps,
    )


def test_streamed_shards_pack_every_sample_once_and_resume_at_a_window(tmp_path):
    from test_streaming import write_shards

    from whisper_train.checkdata import label_encoder_for
    from whisper_train.data import streaming
    from whisper_train.data.collate import SpeechCollator

    tokenizer = english_tokenizer()
    encoder = label_encoder_for(tokenizer)
    written = write_shards(tmp_path / "wds", "webdataset", [5, 4])
    # A budget of 24 decoder positions holds 2-3 of these "sample N word word" labels; a
    # micro-batch asks for 3 clips: one or two windows (each of at most 3 clips).
    stream = _packed_stream(tmp_path / "wds", encoder, batch_size=3)
    collate = streaming.StreamCollator(SpeechCollator(tokenizer.pad_token_id))

    def micro_batches():
        loader = torch.utils.data.DataLoader(stream, batch_size=None, collate_fn=collate)
        return list(loader)

    batches = micro_batches()
    texts = [text for batch in batches for text in batch["texts"]]
    assert 1 < len(texts) < len(written)  # windows, not clips
    assert sorted(t for window in texts for t in _split_samples(window)) == sorted(written)
    for batch in batches:
        clips = [len(_split_samples(text)) for text in batch["texts"]]
        assert max(clips) <= 3 and abs(sum(clips) - 3) <= max(clips) / 2 or batch is batches[-1]
        for labels, text in zip(batch["labels"], batch["texts"], strict=True):
            decoded = tokenizer.decode(labels[labels >= 0], skip_special_tokens=True).strip()
            assert decoded == text
            assert (labels >= 0).sum() <= 24
    # A resumed worker replays the rows of the micro-batches already trained on, then hands
    # out the remaining ones exactly as the uninterrupted pass did.
    stream.replay_rows = dict(batches[1]["stream_rows"])
    stream.replay_batches = {0: 2}
    resumed = micro_batches()
    assert sum(1 for batch in resumed if batch.get("replayed")) == 2
    rest = [batch["texts"] for batch in resumed if not batch.get("replayed")]
    assert rest == [batch["texts"] for batch in batches[2:]]


def test_a_packed_stream_labels_windows_with_their_clips_times(tmp_path):
    from test_streaming import write_shards

    from whisper_train.checkdata import label_encoder_for

    tokenizer = english_tokenizer()
    encoder = label_encoder_for(tokenizer)
    written = write_shards(tmp_path / "wds", "webdataset", [5, 4])
    # 36 positions: 2-3 "sample N word word" clips with their time tokens
    stream = _packed_stream(tmp_path / "wds", encoder, max_label_tokens=36, packing_timestamps=True)
    windows = [item for micro_batch in stream for _, _, item in micro_batch]
    assert any(len(_split_samples(window["text"])) > 1 for window in windows)
    seen = []
    for window in windows:
        samples = _split_samples(window["text"])
        seen += samples
        assert len(window["tokens"]) - 1 <= 36
        if len(samples) == 1:
            continue
        spans, texts = _segments(encoder, tokenizer, window["tokens"], window["n_prefix"])
        assert texts == samples
        expected, at = [], 0.0
        for text in samples:
            seconds = len(written[text]) / 16_000
            expected.append((at, at + seconds))
            at += seconds + 0.3
        np.testing.assert_allclose(spans, expected, atol=0.02)
    assert sorted(seen) == sorted(written)


def _split_samples(window_text: str) -> list[str]:
    """'sample 3 a b sample 7 c d' → ['sample 3 a b', 'sample 7 c d']."""
    parts = window_text.split("sample ")[1:]
    return ["sample " + part.strip() for part in parts]


@pytest.mark.long
def test_a_packed_stream_resumes_mid_pass_with_the_uninterrupted_losses(
    tmp_path, tiny_run_config, monkeypatch
):
    from test_streaming import write_shards

    # 2 shards of 40 clips of 0.6 s, one a worker: a micro-batch asks for 33 clips, which fill
    # one window of 30 s with their gaps, so each worker's pass is 2 micro-batches of a window
    # (33 clips, then 7), a pass is 4, and the crash in step 3 leaves checkpoint-2 in the
    # middle of the first pass.
    data = tmp_path / "wds"
    write_shards(data, "webdataset", [40, 40])
    common = {
        "data": str(data),
        "packing": "on",
        "batch_size": 33,
        "num_workers": 2,
        "shuffle_buffer": 8,
        "max_steps": 5,
        "lr_scheduler": "constant_with_warmup",
    }
    reference = train(tiny_run_config(output_dir=str(tmp_path / "ref"), **common))
    reference_losses, _ = losses_and_evaluations(reference.output_dir)
    config = tiny_run_config(save_steps=1, save_total_limit=1, **common)
    with monkeypatch.context() as patch:
        crash_on_loss_call(patch, 3)  # dies during step 3, after checkpoint-2
        with pytest.raises(RuntimeError, match="simulated crash"):
            train(config)
    saved = json.loads((tmp_path / "out" / "checkpoint-2" / "stream-0.json").read_text())
    assert saved["epoch"] == 0 and 0 < sum(saved["rows"].values()) < 80
    config.update({"resume": "latest"})
    train(config)
    losses, _ = losses_and_evaluations(tmp_path / "out")
    np.testing.assert_allclose(losses, reference_losses, rtol=0, atol=SAME_RUN_LOSS_ATOL)
