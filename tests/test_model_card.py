"""The model card (README.md, the Hub's format) of a run's final/ and of `export --format hf`:
its numbers are the run's own, its base model is never a local path, and a run that measured
nothing claims nothing."""

from __future__ import annotations

import json
import shutil

from conftest import record_of, write_tone_dataset
from huggingface_hub import ModelCard

from whisper_train.cli import main
from whisper_train.training.model_card import base_license, base_model_id
from whisper_train.training.train import train

TASK = "automatic-speech-recognition"
# The card's WER is 100 * result.json's WER rounded to 2 decimals (points of percent).
ROUNDING = 0.005


def _card(folder) -> ModelCard:
    path = folder / "README.md"
    assert path.is_file(), f"no model card in {folder}"
    return ModelCard.load(path)


def _wers(card: ModelCard) -> dict[str, float]:
    """{evaluation set: WER in percent} of the card's model-index."""
    results = card.data.eval_results or []
    assert all(r.metric_type == "wer" and r.task_type == TASK for r in results)
    return {r.dataset_name: r.metric_value for r in results}


def _measured(output_dir) -> dict[str, float]:
    """{evaluation set: WER in percent} at the step final/ holds, from result.json."""
    result = json.loads((output_dir / "result.json").read_text())
    return {
        row["set"]: 100 * row["wer"]
        for row in result["evaluations"]
        if row["step"] == result["final_step"]
    }


def _guarded_run(tiny_run_config, tmp_path):
    sets = {
        "target": write_tone_dataset(tmp_path / "target", n=3, seed=1),
        "general": write_tone_dataset(tmp_path / "general", n=2, seed=2),
    }
    return train(
        tiny_run_config(
            only_train=False,
            mode="lora",
            eval_data=[f"{name}={path}" for name, path in sets.items()],
            guard="general",
            eval_steps=2,
            generation_max_length=4,
        )
    )


def test_final_card_holds_the_runs_own_wer_per_set_and_no_local_path(
    tiny_run_config, tmp_path, tiny_whisper_dir
):
    result = _guarded_run(tiny_run_config, tmp_path)
    card = _card(result.final_dir)
    measured = _measured(result.output_dir)

    assert set(measured) == {"target", "general"}
    wers = _wers(card)
    assert set(wers) == set(measured)
    for name, wer in measured.items():
        assert abs(wers[name] - wer) <= ROUNDING, (name, wers[name], wer)
    assert card.data.pipeline_tag == TASK
    assert {"whisper", "whisper-train", "lora"} <= set(card.data.tags)
    assert card.data.language == ["en"]  # the tiny model is English-only
    # The base was a local folder: no base_model, and no path of this machine anywhere.
    assert card.data.base_model is None
    text = (result.final_dir / "README.md").read_text()
    assert str(tmp_path) not in text and str(tiny_whisper_dir) not in text
    assert card.data.license is None  # the base's folder states none: none is invented
    # Before (step 0, which the guard evaluates) and after, with what they rest on.
    result_rows = json.loads((result.output_dir / "result.json").read_text())["evaluations"]
    guard_start = next(r for r in result_rows if r["step"] == 0 and r["set"] == "general")
    after = f"{measured['general']:.2f}%"
    assert f"{100 * guard_start['wer']:.2f}% → {after}" in card.text
    assert "`target`: 3 clips" in card.text and "`general`: 2 clips" in card.text
    assert "guard" in card.text and "held out" in card.text
    assert "- learning rate: 0.001" in card.text and "- precision: fp32" in card.text
    assert f"- training data: {result.train_examples} clips" in card.text

    # `export --format hf` of the run carries its card, and says what the export did.
    exported = tmp_path / "export"
    argv = ["export", "--model", str(result.output_dir), "--output", str(exported)]
    assert main([*argv, "--format", "hf", "--no-check"]) == 0
    carried = _card(exported)
    assert _wers(carried) == wers
    assert "export --format hf" in carried.text and "float32" in carried.text

    # A final/ from before cards (none in it): the card is made again from the run's files.
    (result.final_dir / "README.md").unlink()
    again = tmp_path / "export-again"
    argv = ["export", "--model", str(result.final_dir), "--output", str(again), "--no-check"]
    assert main(argv) == 0
    remade = _card(again)
    assert _wers(remade) == wers
    assert "- precision: fp32" in remade.text  # the run's record says what it resolved


def test_a_run_without_evaluation_has_a_card_without_results(tiny_run_config):
    result = train(tiny_run_config(only_train=True))
    card = _card(result.final_dir)
    assert card.data.eval_results is None
    assert "model-index" not in (result.final_dir / "README.md").read_text()
    assert "evaluated nothing" in card.text
    assert card.data.pipeline_tag == TASK and "full" in card.data.tags


def test_an_export_of_a_plain_model_folder_claims_no_results(tiny_whisper_dir, tmp_path):
    source = tmp_path / "my-whisper"
    shutil.copytree(tiny_whisper_dir, source)
    (source / "README.md").write_text("---\nlicense: mit\n---\n\n# someone's model\n")
    out = tmp_path / "export"
    assert main(["export", "--model", str(source), "--output", str(out), "--no-check"]) == 0
    card = _card(out)
    assert card.data.eval_results is None
    assert card.data.base_model is None and card.data.license == "mit"
    assert "my-whisper" in card.text and str(tmp_path) not in card.text
    assert "states no results" in card.text


def test_base_model_is_a_hub_id_or_nothing(tmp_path):
    assert base_model_id("openai/whisper-small") == "openai/whisper-small"
    assert base_model_id("tiny.en") == "openai/whisper-tiny.en"
    assert base_model_id("base") == "openai/whisper-base"
    local = tmp_path / "openai" / "whisper-small"
    local.mkdir(parents=True)
    assert base_model_id(str(local)) is None
    snapshot = tmp_path / "hub" / "models--openai--whisper-large-v3" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert base_model_id(str(snapshot)) == "openai/whisper-large-v3"
    assert base_license(str(local)) is None
    (local / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    assert base_license(str(local)) == "apache-2.0"


def test_the_card_reads_final_steps_rows_and_step_0_as_before(tmp_path):
    """final/ may hold an earlier step than the last: its rows are the card's, step 0's are
    the before, and a split of the training data is called what it is."""
    from whisper_train.config import RunConfig
    from whisper_train.runlog import TrainResult
    from whisper_train.training.model_card import run_card

    config = RunConfig()
    config.update({"model": "openai/whisper-small", "language": "german", "output_dir": "run1"})
    config.update({"precision": "bf16"})
    row = {"clips": 40, "repeated_ngram_rate": 0.0, "insertion_rate": 0.01}
    evaluations = [
        {**row, "step": 0, "set": "eval", "wer": 0.5, "language_id_accuracy": 0.9},
        {**row, "step": 4, "set": "eval", "wer": 0.2, "language_id_accuracy": 0.95},
        {**row, "step": 8, "set": "eval", "wer": 0.3, "language_id_accuracy": 0.97},
    ]
    result = TrainResult(
        tmp_path, None, 8, 360, 40, 0, evaluations, final_step=4, final_reason="the lowest"
    )
    card = ModelCard(run_card(record_of(config, width=768), result))
    assert _wers(card) == {"eval": 20.0}  # step 4's, not the last step's 30%
    assert card.data.base_model == "openai/whisper-small" and card.data.language == ["de"]
    assert "50.00% → 20.00%" in card.text and "90.00% → 95.00%" in card.text
    assert "random 0.1 split of the training data" in card.text
    assert "- precision: bf16" in card.text and "- training data: 360 clips" in card.text
    # Full fine-tuning's encoder steps at its own rate (--encoder-lr-scale): the card says both,
    # and what a step trained.
    config.update({"mode": "full", "learning_rate": 1e-5})
    card = run_card(record_of(config, width=768), result)
    assert "- learning rate: 1e-05, the encoder's 2.5e-05 (" in card
    assert "- batch: 8 clips per optimizer step (--batch-size 8 x --gradient-accumulation 1" in card


def test_a_card_that_cannot_be_made_costs_the_run_nothing(tiny_run_config, monkeypatch, caplog):
    import whisper_train.training.model_card as card_module

    def broken(spec):
        raise RuntimeError("unreadable base card")

    monkeypatch.setattr(card_module, "base_license", broken)
    result = train(tiny_run_config(only_train=True))
    assert (result.final_dir / "model.safetensors").is_file()
    assert not (result.final_dir / "README.md").exists()
    assert "the model card was not written (RuntimeError: unreadable base card)" in caplog.text
