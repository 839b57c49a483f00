"""Several evaluation sets, a guard against forgetting, and final/ as the best allowed step."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import metric_rows, record_of, write_tone_dataset
from safetensors.torch import load_file

import whisper_train.training.final as final_module
import whisper_train.training.judge as judge_module
from whisper_train.cli import build_parser
from whisper_train.commands.flags import config_from_args
from whisper_train.errors import UserError
from whisper_train.training.final import FinalRule, choose_final_step
from whisper_train.training.train import train


def _rows(table: dict[str, dict[int, float]]) -> list[dict]:
    """{set: {step: wer}} → metrics rows."""
    return [
        {"step": step, "set": name, "wer": wer}
        for name, by_step in table.items()
        for step, wer in by_step.items()
    ]


# -- choosing the step final/ holds --------------------------------------------------------


def test_final_is_the_lowest_primary_wer_among_steps_within_the_guard():
    rows = _rows(
        {
            "target": {0: 0.90, 2: 0.40, 4: 0.20, 6: 0.30},
            "guard": {0: 0.10, 2: 0.11, 4: 0.15, 6: 0.115},  # step 4 lost 5 points
        }
    )
    choice = choose_final_step(
        rows, FinalRule(primary_set="target", guard="guard", max_regression=2.0)
    )
    assert choice.step == 6 and "guard set 'guard' within 2 points" in choice.reason
    # Without the guard, step 4's lower WER wins.
    assert (
        choose_final_step(
            rows, FinalRule(primary_set="target", guard=None, max_regression=None)
        ).step
        == 4
    )


def test_final_never_picks_the_untrained_start_and_prefers_the_later_step_on_a_tie():
    rows = _rows({"eval": {0: 0.05, 2: 0.30, 4: 0.30}})
    assert (
        choose_final_step(rows, FinalRule(primary_set="eval", guard=None, max_regression=None)).step
        == 4
    )


def test_when_every_step_breaks_the_guard_final_is_the_last_and_says_why():
    rows = _rows({"target": {0: 0.9, 2: 0.5, 4: 0.4}, "guard": {0: 0.1, 2: 0.2, 4: 0.3}})
    choice = choose_final_step(
        rows, FinalRule(primary_set="target", guard="guard", max_regression=2.0)
    )
    assert choice.step == 4
    assert "no evaluation stayed within 2 points of guard WER at its start" in choice.reason
    assert (
        choose_final_step([], FinalRule(primary_set="eval", guard=None, max_regression=None)).step
        is None
    )


# -- options -------------------------------------------------------------------------------


def _config(*flags: str):
    return config_from_args(build_parser().parse_args(["train", "--data", "d", *flags]))


def test_eval_data_is_repeatable_with_names_and_a_bare_path_is_eval():
    config = _config("--eval-data", "target=t/", "--eval-data", "general=g/")
    assert config.eval_sets() == {"target": "t/", "general": "g/"}
    assert record_of(config).evaluation.primary == "target"
    assert _config("--eval-data", "held/").eval_sets() == {"eval": "held/"}
    guarded = _config("--eval-data", "general=g/", "--eval-data", "t=t/", "--guard", "general")
    assert record_of(guarded).evaluation.primary == "t"  # the first set that is not the guard


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--eval-data", "a=x", "--eval-data", "a=y"], "the name a is used twice"),
        (["--eval-data", "a=x", "--guard", "b"], "--guard b: no evaluation set of that name"),
        (["--eval-data", "a=x", "--guard", "a"], "it needs another set"),
        (["--eval-data", "a=x", "--metric-for-best", "z"], "--metric-for-best z: no evaluation"),
        (
            ["--eval-data", "a=x", "--eval-data", "b=y", "--guard", "a", "--metric-for-best", "a"],
            "name the same set",
        ),
        (["--max-regression", "3"], "need --guard NAME"),
        (["--eval-data", "a b=x"], "expected NAME=PATH"),
    ],
)
def test_bad_eval_set_options_name_the_flag(flags, message):
    with pytest.raises(UserError, match=message):
        _config(*flags)


# -- a run with several sets ---------------------------------------------------------------


@pytest.fixture
def two_sets(tmp_path):
    return {
        "target": write_tone_dataset(tmp_path / "target", n=3, seed=1),
        "general": write_tone_dataset(tmp_path / "general", n=2, seed=2),
    }


def test_every_evaluation_scores_every_set(tiny_run_config, two_sets, capsys):
    result = train(
        tiny_run_config(
            only_train=False,
            eval_data=[f"{name}={path}" for name, path in two_sets.items()],
            eval_steps=2,
            generation_max_length=4,
        )
    )
    evaluations = [row for row in metric_rows(result.output_dir) if "wer" in row]
    assert [(row["step"], row["set"]) for row in evaluations] == [
        (2, "target"),
        (2, "general"),
        (3, "target"),
        (3, "general"),
    ]
    for row in evaluations:
        assert set(row) == {
            "step",
            "set",
            "eval_loss",
            "wer",
            "clips",
            "repeated_ngram_rate",
            "insertion_rate",
            "deletion_rate",
        }
        assert math.isfinite(row["eval_loss"]) and row["wer"] >= 0
    out = capsys.readouterr().out
    assert "WER target | WER general" in out  # one WER column per set
    assert result.eval_examples == 5 and result.primary_set == "target"
    saved = json.loads((result.output_dir / "result.json").read_text())
    assert saved["final_step"] in (2, 3) and "lowest target WER" in saved["final_reason"]


def test_the_guard_stops_a_run_and_final_holds_the_best_allowed_step(
    tiny_run_config, two_sets, monkeypatch, capsys
):
    """Scripted evaluations (a random tiny model's WER cannot be steered): the target improves
    at every step, the guard holds at step 2 and collapses at step 4. With
    --stop-on-regression the run stops at step 4, and final/ holds step 2's weights, not the
    last ones."""
    target = {0: 0.9, 2: 0.6, 4: 0.3}
    guard = {0: 0.10, 2: 0.11, 4: 0.40}

    def scripted(model, loader, processor, accelerator, normalizer, max_length, step, *_, **__):
        name = "general" if sum(batch["size"] for batch in loader) == 2 else "target"
        wer = (guard if name == "general" else target)[step]
        return {"step": step, "eval_loss": 1.0, "wer": wer}

    monkeypatch.setattr(judge_module, "run_evaluation", scripted)
    result = train(
        tiny_run_config(
            only_train=False,
            eval_data=[f"{name}={path}" for name, path in two_sets.items()],
            guard="general",
            stop_on_regression=True,
            eval_steps=2,
            max_steps=8,
            save_total_limit=1,
        )
    )
    out = capsys.readouterr().out
    assert result.steps == 4, "stopped at the evaluation past the guard's limit"
    assert "guard general: WER +30.0 points over its start (step 0) at step 4" in out
    assert result.final_step == 2 and result.final_wer == 0.6
    saved = json.loads((result.output_dir / "result.json").read_text())
    assert (
        saved["final_step"] == 2 and "guard set 'general' within 2 points" in saved["final_reason"]
    )
    # final/ holds step 2's trained weights (kept in checkpoint-2), not step 4's.
    best = load_file(result.output_dir / "checkpoint-2" / "trainable.safetensors")
    final = load_file(result.output_dir / "final" / "model.safetensors")
    last = load_file(result.output_dir / "checkpoint-4" / "trainable.safetensors")
    name = "model.decoder.layers.0.fc1.weight"
    assert torch.equal(final[name], best[name])
    assert not torch.equal(final[name], last[name])


def test_an_evaluation_set_in_another_layout_than_a_forced_data_format_is_read(
    tmp_path, tiny_run_config
):
    from tiny_models import english_tokenizer

    from whisper_train.config.resolve import evaluation_sets
    from whisper_train.data.labels import LabelEncoder
    from whisper_train.training.datasets import prepare_datasets

    manifest = write_tone_dataset(tmp_path / "held", n=3, layout="jsonl")  # not an audiofolder
    config = tiny_run_config(data_format="audiofolder", only_train=False)
    config.update({"eval_data": [str(manifest)]})
    encoder = LabelEncoder(english_tokenizer(), language=None, multilingual=False)

    datasets = prepare_datasets(
        config, evaluation_sets(config), encoder, nonspeech=None, max_label_tokens=448
    )

    assert len(datasets.eval["eval"]) == 3


def test_the_baseline_comparison_holds_one_model_at_a_time(
    tmp_path, tiny_run_config, tiny_whisper_dir, monkeypatch
):
    import gc
    import weakref

    from whisper_train.data.examples import Example

    live = []
    real_load = final_module.load_model

    def load_model(spec, **kwargs):
        gc.collect()
        assert not [ref for ref in live if ref() is not None], "a model is still loaded"
        model, processor = real_load(spec, **kwargs)
        live.append(weakref.ref(model))
        return model, processor

    monkeypatch.setattr(final_module, "load_model", load_model)
    clips = write_tone_dataset(tmp_path / "clips", n=2, layout="jsonl")
    rows = [json.loads(line) for line in clips.read_text().splitlines()]
    examples = [Example(str(clips.parent / row["audio"]), row["text"]) for row in rows]
    config = tiny_run_config()

    final_module.compare_with_baseline(
        config.model.model,
        tiny_whisper_dir,
        examples,
        tmp_path,
        language=None,
        task="transcribe",
        batch_size=config.train.batch_size,
        max_length=4,
        decoding=record_of(config).evaluation.decoding,
        attn_implementation="sdpa",
    )

    assert len(live) == 2 and (tmp_path / "report.md").is_file()


def test_an_evaluation_set_of_empty_transcripts_is_refused_at_start(
    tiny_whisper_dir, tone_dataset, tmp_path, capsys
):
    """Every transcript of an --eval-data set empty: its WER is undefined at every evaluation
    (the run reported "final WER: nan%"). Refused before step 1 in one line naming the set and
    the NAME:nonspeech=PATH kind it is, as `evaluate` refuses it; nothing is written."""
    from whisper_train.cli import main

    manifest = tmp_path / "quiet.jsonl"
    manifest.write_text(
        "".join(
            json.dumps({"audio": str(tone_dataset / f"clip{i:03d}.wav"), "text": ""}) + "\n"
            for i in range(3)
        )
    )
    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny_whisper_dir), "--data", str(tone_dataset)]
    argv += ["--eval-data", f"quiet={manifest}", "--max-steps", "1", "--output-dir", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--eval-data {manifest} (set quiet): all 3 transcripts are empty" in err, err
    assert f"--eval-data quiet:nonspeech={manifest}" in err and "Traceback" not in err, err
    assert not (out / "final").exists()
