"""--new-language: a language token Whisper lacks, added to a seeded tiny multilingual model,
started from its neighbour's row, learnt (full, and under LoRA through peft's trainable
tokens), detected and decoded in; refused in one line where it cannot work."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import write_tone_dataset
from multilingual import (
    EOT,
    MULTILINGUAL_VOCAB,
    NO_TIMESTAMPS,
    SOT,
    TRANSCRIBE,
    make_tiny_multilingual_whisper,
)
from tiny_models import make_tiny_whisper
from transformers.models.whisper.tokenization_whisper import LANGUAGES

from whisper_train import memory
from whisper_train.config import RunConfig, named_sets
from whisper_train.data.collate import IGNORE_INDEX, SpeechCollator
from whisper_train.data.labels import LabelEncoder, language_code
from whisper_train.deploy.export import export_model
from whisper_train.errors import UserError
from whisper_train.models import folder_added_languages, load_model
from whisper_train.training import setup_phases
from whisper_train.training.new_language import add_language, frozen_encoder_advice
from whisper_train.training.recipe import FineTuneRecipe
from whisper_train.training.train import train
from whisper_train.transcription.decoding import DecodingOptions, generate_decoded
from whisper_train.transcription.languages import detect_languages

CHUNK_SECONDS = 1
SPANISH = SOT + 1 + list(LANGUAGES).index("es")
NEW = MULTILINGUAL_VOCAB  # the token goes after the last time token: no id moves


def with_esperanto(seed: int = 0):
    model, processor = make_tiny_multilingual_whisper(seed=seed, chunk_seconds=CHUNK_SECONDS)
    token_id = add_language(model, processor.tokenizer, "eo", init="es")
    return model, processor, token_id


def features(n: int = 2) -> torch.Tensor:
    return torch.randn(n, 80, 100 * CHUNK_SECONDS, generator=torch.Generator().manual_seed(0))


def test_the_new_token_starts_as_its_neighbour_and_is_one_of_the_models_languages():
    model, processor, token_id = with_esperanto()
    assert token_id == NEW and len(processor.tokenizer) == NEW + 1
    assert model.config.vocab_size == NEW + 1
    embeddings = model.get_input_embeddings().weight
    assert torch.equal(embeddings[NEW], embeddings[SPANISH])
    # The output projection shares the row: the new token's logit is Spanish's, everywhere.
    with torch.no_grad():
        logits = model(input_features=features(), decoder_input_ids=torch.tensor([[SOT]] * 2))
    # Equal rows, but the last column of the vocabulary may fall in another BLAS tile than
    # Spanish's (another summation order on another CPU): float32 rounding at the logits' scale.
    torch.testing.assert_close(
        logits.logits[:, -1, NEW], logits.logits[:, -1, SPANISH], rtol=1e-5, atol=1e-5
    )
    assert model.generation_config.lang_to_id["<|eo|>"] == NEW
    assert NEW in model.generation_config.suppress_tokens  # never written in text
    assert processor.tokenizer.decode([NEW, 65], skip_special_tokens=True) == "b"


def test_detection_can_return_it_and_a_clip_is_decoded_under_its_token(monkeypatch):
    model, processor, _ = with_esperanto()
    with torch.no_grad():  # every position's decoder output is e0: logit i = E[i, 0]
        decoder = model.model.decoder
        decoder.layer_norm.weight.zero_()
        decoder.layer_norm.bias.zero_()
        decoder.layer_norm.bias[0] = 1.0
        decoder.embed_tokens.weight[NEW, 0] = 50.0
    inputs = {"input_features": features()}
    assert [code for code, _ in detect_languages(model, inputs)] == ["eo", "eo"]
    prompts = []
    plain_generate = model.generate

    def recording_generate(*args, **kwargs):
        output = plain_generate(*args, **kwargs)
        prompts.append(getattr(output, "sequences", output)[:, 1].tolist())
        return output

    monkeypatch.setattr(model, "generate", recording_generate)
    options = DecodingOptions(temperatures=(0.0,), logprob_threshold=None)
    for languages in (None, ["eo", "eo"]):  # detected, and given
        decoded = generate_decoded(
            model, inputs, processor.tokenizer, max_length=6, options=options, languages=languages
        )
        assert [item.language for item in decoded] == ["eo", "eo"]
        assert prompts.pop() == [NEW, NEW]


def test_labels_take_the_new_code_only_where_the_model_has_it():
    _, processor, _ = with_esperanto()
    with pytest.raises(UserError, match="--new-language"):
        language_code("eo")
    assert language_code("<|eo|>", ("eo",)) == "eo"
    with pytest.raises(UserError, match="'eo' is not one Whisper knows"):
        LabelEncoder(processor.tokenizer, language="eo", multilingual=True)
    encoder = LabelEncoder(
        processor.tokenizer, language="eo", multilingual=True, added_languages=("eo",)
    )
    assert encoder.prefix_ids() == [SOT, NEW, TRANSCRIBE, NO_TIMESTAMPS]


def test_a_run_that_adds_a_language_learns_to_name_it_after_sot():
    """Detection reads the logit after SOT, so the language token must be a target there;
    the task and timestamp tokens stay masked, and without language targets all are."""
    tokens = [SOT, NEW, TRANSCRIBE, NO_TIMESTAMPS, 65, 66, EOT]
    plain = SpeechCollator(EOT).pad_labels([tokens], [4])["labels"][0].tolist()
    assert plain == [IGNORE_INDEX] * 3 + [65, 66, EOT]
    learnt = SpeechCollator(EOT, language_targets=[SPANISH, NEW]).pad_labels([tokens], [4])
    assert learnt["labels"][0].tolist() == [NEW, IGNORE_INDEX, IGNORE_INDEX, 65, 66, EOT]


def _step_loss(model) -> torch.Tensor:
    tokens = torch.tensor([[SOT, NEW, TRANSCRIBE, NO_TIMESTAMPS, 65, 66, EOT]] * 2)
    labels = tokens[:, 1:].clone()
    labels[:, 1:3] = IGNORE_INDEX  # the new token a target, as `language_targets` makes it
    output = model(input_features=features(), decoder_input_ids=tokens[:, :-1], labels=labels)
    return output.loss


def test_under_lora_the_new_row_trains_and_the_rest_of_the_vocabulary_does_not():
    model, _, _ = with_esperanto()
    spanish_row = model.get_input_embeddings().weight[SPANISH].detach().clone()
    lora = memory.LoraSettings(
        r=4, alpha=8, dropout=0.0, targets=("q_proj", "v_proj"), new_languages=("eo",)
    )
    wrapped = memory.prepare_model(model, mode="lora", checkpointing="off", lora=lora)
    trainable = {n: p for n, p in wrapped.named_parameters() if p.requires_grad}
    (delta_name,) = [n for n in trainable if "trainable_tokens_delta" in n]
    _step_loss(wrapped).backward()
    delta = trainable[delta_name]
    assert delta.shape[0] == 1 and delta.grad.abs().sum() > 0  # the one row, and it learns
    optimizer = torch.optim.SGD(trainable.values(), lr=1.0)
    optimizer.step()
    merged = wrapped.merge_and_unload()
    embeddings = merged.get_input_embeddings().weight
    assert not torch.equal(embeddings[NEW], spanish_row)  # moved by the step
    assert torch.equal(embeddings[SPANISH], spanish_row)  # the vocabulary as it was
    assert merged.get_output_embeddings().weight is embeddings  # still tied


@pytest.mark.parametrize(
    ("code", "init", "message"),
    [
        ("de", "es", "Whisper already has German (de); train under its own token"),
        ("german", "es", "Whisper already has German (de)"),
        ("e1", "es", "expected a language code of 2 to 8 letters"),
        ("eo", None, "needs --new-language-init LANG"),
        ("eo", "klingon", "'klingon' is not one Whisper knows"),
    ],
)
def test_a_new_language_that_cannot_be_added_is_refused_in_one_line(code, init, message):
    config = RunConfig()
    config.update({"new_language": code, "new_language_init": init})
    with pytest.raises(UserError, match=re.escape(message)) as refused:
        config.validate()
    assert "\n" not in str(refused.value)


def test_an_english_only_model_or_a_second_addition_is_refused():
    model, processor = make_tiny_whisper()
    with pytest.raises(UserError, match=r"English-only checkpoint \(\*\.en\)"):
        add_language(model, processor.tokenizer, "eo", init="en")
    model, processor, _ = with_esperanto()
    with pytest.raises(UserError, match="has <\\|eo\\|> already"):
        add_language(model, processor.tokenizer, "eo", init="es")
    config = RunConfig()
    config.update({"new_language_init": "es"})
    with pytest.raises(UserError, match="add --new-language CODE"):
        config.validate()
    config.update({"new_language": "eo", "compare_baseline": True})
    with pytest.raises(UserError, match="the base has no token to decode that language in"):
        config.validate()


@pytest.fixture(scope="module")
def esperanto_folder(tmp_path_factory):
    """A saved tiny multilingual model that has <|eo|>, and one clip said to be Esperanto."""
    folder = tmp_path_factory.mktemp("esperanto")
    model, processor, _ = with_esperanto()
    letter = processor.tokenizer.convert_tokens_to_ids("a")
    with torch.no_grad():  # it writes 'a' whatever it hears: a transcript the check can score
        decoder = model.model.decoder
        decoder.layer_norm.weight.zero_()  # every position's output is the bias: e0
        decoder.layer_norm.bias.zero_()
        decoder.layer_norm.bias[0] = 1.0
        decoder.embed_tokens.weight[:, 0] = -10.0  # tied with proj_out: logit i = E[i, 0]
        decoder.embed_tokens.weight[letter, 0] = 2.0
    model.generation_config.max_length = 10
    model.save_pretrained(folder / "model")
    processor.save_pretrained(folder / "model")
    clips = write_tone_dataset(folder / "clips", n=1, layout="manifest")
    row = json.loads(clips.read_text())
    clips.write_text(json.dumps({**row, "language": "eo"}) + "\n")
    return folder


@pytest.mark.parametrize(
    ("format", "runtime"),
    [("ct2", "faster-whisper"), ("ggml", "whisper.cpp"), ("openai", "openai-whisper")],
)
def test_a_runtime_with_a_fixed_language_table_is_refused_before_anything_is_written(
    format, runtime, esperanto_folder, tmp_path
):
    output = tmp_path / "export"
    with pytest.raises(UserError) as refused:
        export_model(str(esperanto_folder / "model"), format=format, output=output)
    said = str(refused.value)
    assert f"--format {format}" in said and "adds the language eo" in said
    assert runtime in said and "--format hf" in said and "\n" not in said
    assert not output.exists()


def test_the_transformers_export_runs_the_new_language_and_passes_its_check(
    esperanto_folder, tmp_path
):
    result = export_model(
        str(esperanto_folder / "model"),
        format="hf",
        output=tmp_path / "export",
        check_data=str(esperanto_folder / "clips" / "manifest.jsonl"),
        n_check_clips=1,
        device="cpu",
    )
    assert result.parity is not None and result.parity.passed
    # `evaluate --data NAME:eo=PATH` reads the languages a model adds from its small files.
    added = folder_added_languages(str(tmp_path / "export"))
    assert added == ("eo",)
    assert named_sets(["held:eo=clips/"], "--data", added) == {"held": ("clips/", "eo")}
    model, processor = load_model(str(tmp_path / "export"))
    assert model.generation_config.lang_to_id["<|eo|>"] == NEW
    assert processor.tokenizer.convert_tokens_to_ids("<|eo|>") == NEW


def test_a_lora_run_trains_under_the_new_token_evaluates_in_it_and_saves_it(tmp_path, tone_dataset):
    """The CLI's path end to end: labels and an evaluation set stated in the new language
    (refused without --new-language), LoRA, final/ and its card."""
    model, processor = make_tiny_multilingual_whisper(seed=0)
    model.save_pretrained(tmp_path / "base")
    processor.save_pretrained(tmp_path / "base")
    settings = {
        "data": str(tone_dataset),
        "eval_data": [f"held:eo={tone_dataset}"],
        "eval_subset": 2,
        "model": str(tmp_path / "base"),
        "output_dir": str(tmp_path / "out"),
        "mode": "lora",
        "language": "eo",
        "max_steps": 1,
        "batch_size": 4,
        "learning_rate": 1e-3,
        "seed": 0,
        "generation_max_length": 6,
        "temperatures": "0",
    }
    config = RunConfig()
    config.update(settings)
    with pytest.raises(UserError, match="'eo' is not one Whisper knows"):
        config.validate()
    config.update({"new_language": "eo", "new_language_init": "es"})
    result = train(config)
    rows = [row for row in result.evaluations if row["set"] == "held"]
    assert rows and rows[-1]["clips"] == 2
    saved, saved_processor = load_model(str(result.final_dir))
    assert saved.generation_config.lang_to_id["<|eo|>"] == NEW
    assert saved_processor.tokenizer.convert_ids_to_tokens(NEW) == "<|eo|>"
    card = (result.final_dir / "README.md").read_text()
    assert (
        "- added language: `eo` (the token <|eo|>, its embedding row initialised from <|es|>'s"
        in card
    )


@pytest.mark.parametrize(
    ("mode", "told"),
    [("freeze-encoder", "--mode full trains it too"), ("full", None), ("lora", None)],
)
def test_a_new_language_with_a_frozen_encoder_is_told_how_to_train_it(
    tmp_path, tone_dataset, capsys, mode, told
):
    """Its encoder never learns the new language's sounds (BENCHMARKS.md: 4-7x the held-out WER):
    one line at start, whose advice is a run that trains the encoder."""
    model, processor = make_tiny_multilingual_whisper(seed=0)
    model.save_pretrained(tmp_path / "base")
    processor.save_pretrained(tmp_path / "base")
    config = RunConfig()
    config.update(
        {
            "data": str(tone_dataset),
            "model": str(tmp_path / "base"),
            "output_dir": str(tmp_path / "out"),
            "only_train": True,
            "mode": mode,
            "language": "eo",
            "new_language": "eo",
            "new_language_init": "es",
        }
    )
    recipe = FineTuneRecipe(config)
    setup_phases.gather_facts(recipe.asked, process=setup_phases.join_processes(), saved=None)
    lines = [line for line in capsys.readouterr().out.splitlines() if "frozen encoder" in line]
    if told is None:
        assert lines == []
    else:
        assert len(lines) == 1 and lines[0].startswith("--new-language eo with a frozen encoder")
        assert lines[0].endswith(told)


def test_the_frozen_encoders_advice_names_every_flag_that_would_refuse_it():
    """Followed, the advice starts a run: full mode refuses --cache-encoder, so a run that
    asked for the cache is told to drop it; LoRA over a cached encoder is told to drop it."""
    assert frozen_encoder_advice("eo", "freeze-encoder", None).endswith("--mode full trains it too")
    assert frozen_encoder_advice("eo", "freeze-encoder", True).endswith(
        "--mode full trains it too (without --cache-encoder)"
    )
    advice = frozen_encoder_advice("eo", "lora", cache_encoder_asked=True)
    assert advice is not None and advice.endswith("drop --cache-encoder to put adapters in it")
    assert frozen_encoder_advice("eo", "lora", cache_encoder_asked=None) is None
    assert frozen_encoder_advice("eo", "full", cache_encoder_asked=None) is None
