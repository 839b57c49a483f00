"""Prompts in training (--prompt-probability): a clip's previous text after <|startofprev|>,
before its label, exactly as transformers' generate(prompt_ids=...) feeds it, and never a
target of the loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import metric_rows, train_argv, write_tone_dataset
from test_streaming import write_shards
from tiny_models import EOT, NO_TIMESTAMPS, SOT, make_tiny_whisper

from whisper_train.cli import main
from whisper_train.data.collate import IGNORE_INDEX, SpeechCollator
from whisper_train.data.examples import Example
from whisper_train.data.features import LogMel, SpeechDataset
from whisper_train.data.labels import LabelEncoder, decoder_positions
from whisper_train.data.manifests import read_manifest
from whisper_train.data.prompts import Prompter, max_prompt_tokens
from whisper_train.data.subtitles import pack_segments
from whisper_train.memory import training_loss

PREVIOUS = ["", "alpha bravo charlie.", "and then Mr. Okonkwo said", "", "delta echo"]


@pytest.fixture(scope="module")
def prompted_manifest(tmp_path_factory) -> Path:
    """5 tone clips in a JSONL manifest; rows 1, 2 and 4 state a previous text (2 in a
    `prompt` column, the others in `previous_text`)."""
    folder = write_tone_dataset(tmp_path_factory.mktemp("prompted"), n=5, layout="manifest").parent
    rows = [json.loads(line) for line in (folder / "manifest.jsonl").read_text().splitlines()]
    for row, previous in zip(rows, PREVIOUS, strict=True):
        if previous:
            row["prompt" if "Okonkwo" in previous else "previous_text"] = previous
    manifest = folder / "prompted.jsonl"
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return manifest


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_whisper()


def _dataset(manifest: Path, processor, probability: float | None, **kwargs) -> SpeechDataset:
    encoder = LabelEncoder(processor.tokenizer, multilingual=False)
    prompter = None if probability is None else Prompter(encoder, probability, seed=0)
    return SpeechDataset(read_manifest(manifest), encoder, seed=0, prompter=prompter, **kwargs)


def _batch(dataset: SpeechDataset, processor, epoch: int = 0, indices=None) -> dict:
    collate = SpeechCollator(
        processor.tokenizer.pad_token_id, log_mel=LogMel(processor.feature_extractor)
    )
    indices = range(len(dataset)) if indices is None else indices
    return collate([dataset[(epoch, i)] for i in indices])


def test_prompt_tokens_are_masked_in_the_labels(prompted_manifest, tiny):
    _, processor = tiny
    tokenizer = processor.tokenizer
    dataset = _dataset(prompted_manifest, processor, 1.0)
    batch = _batch(dataset, processor)
    for row, example in enumerate(dataset.examples):
        text = tokenizer.encode(" " + example.text, add_special_tokens=False)
        prompt = tokenizer.get_prompt_ids(example.previous_text).tolist() if PREVIOUS[row] else []
        expected = [*prompt, SOT, NO_TIMESTAMPS, *text]
        assert batch["decoder_input_ids"][row, : len(expected)].tolist() == expected
        labels = batch["labels"][row]
        # prompt (<|startofprev|> is never a label: it is read first) and prefix: no loss
        n_masked = len(prompt) + 1
        assert (labels[:n_masked] == IGNORE_INDEX).all()
        assert labels[n_masked : n_masked + len(text) + 1].tolist() == [*text, EOT]
        assert (labels[n_masked + len(text) + 1 :] == IGNORE_INDEX).all()  # padding


def test_probability_0_gives_exactly_the_unprompted_batches(prompted_manifest, tiny):
    _, processor = tiny
    plain = _batch(_dataset(prompted_manifest, processor, None), processor, epoch=1)
    off = _batch(_dataset(prompted_manifest, processor, 0.0), processor, epoch=1)
    for key in ("decoder_input_ids", "labels", "input_features", "indices"):
        assert torch.equal(plain[key], off[key]), key


def test_probability_1_prompts_every_clip_with_a_previous_text(prompted_manifest, tiny):
    _, processor = tiny
    start_of_previous = processor.tokenizer.convert_tokens_to_ids("<|startofprev|>")
    dataset = _dataset(prompted_manifest, processor, 1.0)
    for epoch in range(3):
        first = _batch(dataset, processor, epoch)["decoder_input_ids"][:, 0].tolist()
        assert first == [start_of_previous if p else SOT for p in PREVIOUS]


def test_the_draw_is_a_function_of_seed_epoch_and_clip(tiny):
    _, processor = tiny
    encoder = LabelEncoder(processor.tokenizer, multilingual=False)

    def choices(seed: int, epoch: int) -> list[bool]:
        prompter = Prompter(encoder, 0.5, seed=seed)
        return [prompter.chosen(index, epoch) for index in range(400)]

    assert choices(0, 3) == choices(0, 3)  # a resumed run draws what the first one did
    assert 160 < sum(choices(0, 3)) < 240  # about half
    assert choices(0, 3) != choices(0, 4)  # drawn anew each epoch
    assert choices(0, 3) != choices(1, 3)


def test_the_same_clip_is_prompted_alike_in_a_fresh_dataset_cached_or_not(prompted_manifest, tiny):
    _, processor = tiny
    first = _dataset(prompted_manifest, processor, 0.5)
    again = _dataset(prompted_manifest, processor, 0.5, cached=lambda example: True)
    for epoch in range(4):
        for index in range(len(first)):
            assert first[(epoch, index)]["tokens"] == again[(epoch, index)]["tokens"]


def test_a_prompt_keeps_its_last_tokens_within_the_decoder(tiny):
    _, processor = tiny
    encoder = LabelEncoder(processor.tokenizer, multilingual=False)
    prompter = Prompter(encoder, 1.0, seed=0)
    words = " ".join(f"word{i}" for i in range(400))
    prompt = prompter.prompt_ids(words)
    assert len(prompt) == 1 + max_prompt_tokens(448) == 224  # generate's cut: 448 // 2 - 1
    assert prompt[1:] == encoder.text_ids(words)[-223:]  # the text nearest the clip
    # A long label leaves less room: the prompted label still fits 448 decoder positions.
    tokens, n_prefix = encoder.encode(Example(audio="", text=" ".join(["alpha"] * 400)))
    prompted, n_prompted = prompter.prompted(tokens, n_prefix, words, index=0, epoch=0)
    assert decoder_positions(len(prompted)) == 448
    assert prompted[n_prompted - n_prefix :] == tokens
    # no room at all: no prompt
    full, n_full = encoder.encode(Example(audio="", text=" ".join(["alpha"] * 446)))
    assert decoder_positions(len(full)) == 448
    assert prompter.prompted(full, n_full, words, index=0, epoch=0) == (full, n_full)


def test_special_tokens_never_enter_a_prompt(tiny):
    _, processor = tiny
    encoder = LabelEncoder(processor.tokenizer, multilingual=False)
    prompt = Prompter(encoder, 1.0, seed=0).prompt_ids("so <|endoftext|> it <|0.00|> goes")
    assert all(token < EOT for token in prompt[1:])


def test_a_prompted_loss_is_the_transcript_positions_cross_entropy(prompted_manifest, tiny):
    """Parity: the training loss of a prompted batch, and its gradient, equal the mean
    cross-entropy over the transcript's tokens alone, computed by hand from the full logits."""
    model, processor = tiny
    batch = _batch(_dataset(prompted_manifest, processor, 1.0), processor)
    model.train()
    loss = training_loss(model, batch)
    (ours,) = torch.autograd.grad(loss, model.model.decoder.embed_tokens.weight)

    logits = model(
        input_features=batch["input_features"], decoder_input_ids=batch["decoder_input_ids"]
    ).logits
    tokenizer = processor.tokenizer
    terms = []
    for row, example in enumerate(read_manifest(prompted_manifest)):
        text = tokenizer.encode(" " + example.text, add_special_tokens=False) + [EOT]
        n_prompt = len(tokenizer.get_prompt_ids(example.previous_text)) if PREVIOUS[row] else 0
        # the decoder input at position i predicts token i + 1: the first text token follows
        # the prompt, SOT and <|notimestamps|>
        first = n_prompt + 1
        row_logits = logits[row, first : first + len(text)]
        terms.append(torch.nn.functional.log_softmax(row_logits, -1)[range(len(text)), text])
    by_hand = -torch.cat(terms).mean()
    (expected,) = torch.autograd.grad(by_hand, model.model.decoder.embed_tokens.weight)
    torch.testing.assert_close(loss, by_hand, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-7)


def test_packed_windows_are_prompted_with_what_precedes_them(prompted_manifest, tiny):
    _, processor = tiny
    start_of_previous = processor.tokenizer.convert_tokens_to_ids("<|startofprev|>")
    joined = _dataset(prompted_manifest, processor, 1.0)[(0, (2, 0))]
    assert joined["tokens"][0] == start_of_previous  # clip 2's previous text
    assert joined["tokens"][: joined["n_prefix"]].count(SOT) == 1
    assert _dataset(prompted_manifest, processor, 1.0)[(0, (0, 2))]["tokens"][0] == SOT
    per_clip = _dataset(prompted_manifest, processor, 1.0, per_clip=True)[(0, (0, 2))]
    assert [clip["tokens"][0] for clip in per_clip["clips"]] == [SOT, start_of_previous]


def test_a_subtitled_recording_gives_each_window_the_one_before_as_previous_text():
    cues = [(0.0, 12.0, "one"), (12.5, 25.0, "two"), (26.0, 40.0, "three"), (41.0, 50.0, "four")]
    windows = pack_segments("/r.wav", cues, origin="r.srt")
    assert [w.text for w in windows] == ["one two", "three four"]
    assert [w.previous_text for w in windows] == [None, "one two"]


@pytest.mark.parametrize(
    "extra", [[], ["--mode", "freeze-encoder", "--preserve-base", "1"]], ids=["full", "preserve"]
)
def test_a_run_with_prompts_trains_and_its_loss_is_finite(
    extra, prompted_manifest, tiny_whisper_dir, tmp_path
):
    """With --preserve-base the frozen base reads the same prompted decoder input."""
    argv = train_argv(prompted_manifest, tiny_whisper_dir, tmp_path / "out")
    flags = ["--prompt-probability", "0.5", "--max-steps", "2", "--batch-size", "2", *extra]
    assert main([*argv, *flags, "--only-train", "--seed", "0"]) == 0
    losses = [row["loss"] for row in metric_rows(tmp_path / "out") if "loss" in row]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    saved = (tmp_path / "out" / "whisper-train.yaml").read_text()
    assert "prompt_probability: 0.5" in saved


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--prompt-probability", "1.5"], ["--prompt-probability 1.5", "[0, 1]"]),
        (["--prompt-probability", "nan"], ["--prompt-probability nan"]),
        (["--prompt-probability", "0.5"], ["--prompt-probability", "streamed"]),
    ],
    ids=["above-1", "nan", "streamed"],
)
def test_an_unusable_probability_is_refused_in_one_line(
    flags, named, prompted_manifest, tiny_whisper_dir, tmp_path, capsys
):
    data = prompted_manifest
    if "streamed" in named:  # WebDataset shards: rows through a shuffle buffer, no previous text
        write_shards(data := tmp_path / "shards", "webdataset", [1, 1])
    argv = train_argv(data, tiny_whisper_dir, tmp_path / "out")
    assert main([*argv, *flags, "--only-train", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: "), err
    assert all(text in err for text in named), err


def test_prompts_on_data_without_previous_text_are_refused(
    tone_dataset, tiny_whisper_dir, tmp_path, capsys
):
    argv = train_argv(tone_dataset, tiny_whisper_dir, tmp_path / "out")
    assert main([*argv, "--prompt-probability", "0.2", "--only-train", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no training clip has a previous text" in err, err
