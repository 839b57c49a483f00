"""End to end through `whisper-train train` on a seeded tiny model: what a user gets on disk."""

from __future__ import annotations

import csv
import json
import logging
import math
import re

import numpy as np
import pytest
import torch
import transformers
import yaml
from conftest import (
    SAME_RUN_LOSS_ATOL,
    losses_and_evaluations,
    train_in_subprocess,
    write_tone_dataset,
)

import whisper_train.evaluation.evaluate as evaluate_module
from whisper_train.cli import main
from whisper_train.runlog import START_LINE_CHARS, say
from whisper_train.training.train import train

# Training loss after each of 3 optimizer steps of conftest's tiny_run_config on the seeded tiny
# model and tone dataset (full fine-tune, batch 4, lr 1e-3 with the encoder at 2.5x, seed 0,
# fp32 CPU), stored from an AMD EPYC with AVX-512 (step 1, before any update: an Intel AVX-512
# machine gave 10.942263, an AMD AVX2 one 10.942265). Regenerate with:
#   .venv/bin/python -m pytest tests/test_train.py -k reference -s   (prints "losses: [...]")
REFERENCE_LOSSES = [10.942266, 10.729417, 10.681636]


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """Corpus WER as a user computes it: word edits (Levenshtein) after Whisper's English
    normalisation, over all reference words. Written out here, not borrowed from evaluate.py."""
    from whisper_normalizer.english import EnglishTextNormalizer

    normalize = EnglishTextNormalizer()
    edits = words = 0
    for reference, hypothesis in zip(references, hypotheses, strict=True):
        ref, hyp = normalize(reference).split(), normalize(hypothesis).split()
        # Edit distance from the reference words read so far to each hypothesis prefix.
        distances = list(range(len(hyp) + 1))
        for ref_word in ref:
            previous, distances = distances, [distances[0] + 1]
            for j, hyp_word in enumerate(hyp):
                deletion, insertion = previous[j + 1] + 1, distances[j] + 1
                substitution = previous[j] + (ref_word != hyp_word)
                distances.append(min(deletion, insertion, substitution))
        edits, words = edits + distances[-1], words + len(ref)
    return edits / words


def test_loss_matches_reference_and_metrics_are_written(tiny_run_config, tone_dataset, monkeypatch):
    # Keep what the evaluation transcribed, to score it again here.
    references, hypotheses = [], []
    real_generate_texts = evaluate_module.generate_texts

    def recording_generate_texts(model, processor, batches, **kwargs):
        batches = list(batches)
        texts = real_generate_texts(model, processor, batches, **kwargs)
        references.extend(text for batch in batches for text in batch["texts"])
        hypotheses.extend(texts)
        return texts

    monkeypatch.setattr(evaluate_module, "generate_texts", recording_generate_texts)
    # The reference is of clips one by one (tests/test_packing.py and the matrix: packed).
    result = train(tiny_run_config(only_train=False, packing="off"))
    losses, evaluations = losses_and_evaluations(result.output_dir)
    print("losses:", losses)  # as metrics.jsonl stores them (6 decimals)
    assert result.steps == 3
    np.testing.assert_allclose(losses, REFERENCE_LOSSES, rtol=0, atol=SAME_RUN_LOSS_ATOL)
    assert losses[-1] < losses[0]  # it learns
    assert result.train_examples == 9 and result.eval_examples == 3
    # One evaluation at the end, of the 3 held-out clips: the teacher-forced validation loss
    # and the WER of the transcripts generated for them. Whatever words a random model picks
    # (its close logits may tie differently on another CPU), the row is their WER.
    assert [row["step"] for row in evaluations] == [3]
    (evaluation,) = evaluations
    assert set(evaluation) == {
        "step",
        "set",
        "eval_loss",
        "wer",
        "clips",
        "repeated_ngram_rate",
        "insertion_rate",
        "deletion_rate",
    }
    assert evaluation["set"] == "eval" and evaluation["clips"] == 3  # the seeded split of --data
    assert 0 <= evaluation["repeated_ngram_rate"] <= 1 and evaluation["insertion_rate"] >= 0
    assert math.isfinite(evaluation["eval_loss"]) and evaluation["eval_loss"] > 0
    with (tone_dataset / "metadata.csv").open(encoding="utf-8") as metadata:
        transcripts = {row["transcription"] for row in csv.DictReader(metadata)}
    assert len(references) == len(hypotheses) == 3 and set(references) <= transcripts
    # metrics.jsonl keeps 6 decimals.
    assert evaluation["wer"] == round(word_error_rate(references, hypotheses), 6)
    assert (result.output_dir / "tensorboard").is_dir()


def test_final_folder_loads_in_a_transformers_pipeline(tiny_run_config, tiny_whisper_dir):
    result = train(tiny_run_config())
    final = result.final_dir
    saved = yaml.safe_load((final / "whisper-train.yaml").read_text())
    assert saved["model"]["model"] == str(tiny_whisper_dir) and saved["train"]["max_steps"] == 3
    asr = transformers.pipeline("automatic-speech-recognition", model=str(final), device="cpu")
    out = asr(np.zeros(16000, dtype=np.float32), generate_kwargs={"max_new_tokens": 5})
    assert isinstance(out["text"], str)
    # The weights on disk are the trained ones, not the starting point.
    trained = transformers.WhisperForConditionalGeneration.from_pretrained(final)
    start = transformers.WhisperForConditionalGeneration.from_pretrained(tiny_whisper_dir)
    assert not torch.equal(trained.proj_out.weight, start.proj_out.weight)
    # The fixed sinusoidal positions stay frozen (transformers 5.x would train them).
    torch.testing.assert_close(
        trained.model.encoder.embed_positions.weight,
        start.model.encoder.embed_positions.weight,
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("mode", ["lora", "freeze-encoder"])
def test_other_modes_train_only_what_they_should(tiny_run_config, tiny_whisper_dir, mode):
    result = train(tiny_run_config(mode=mode))
    trained = transformers.WhisperForConditionalGeneration.from_pretrained(result.final_dir)
    start = transformers.WhisperForConditionalGeneration.from_pretrained(tiny_whisper_dir)
    enc_same = all(
        torch.equal(a, b)
        for a, b in zip(
            trained.model.encoder.parameters(), start.model.encoder.parameters(), strict=True
        )
    )
    dec_q = trained.model.decoder.layers[0].self_attn.q_proj.weight
    assert not torch.equal(dec_q, start.model.decoder.layers[0].self_attn.q_proj.weight)
    if mode == "freeze-encoder":
        assert enc_same  # frozen encoder, cached outputs
    else:
        # LoRA merged into the full weights: every linear layer has an adapter by default and
        # changes; what has none (layer norms, embeddings, the convolutions) does not.
        assert not enc_same
        before = dict(start.named_parameters())
        changed = {n for n, p in trained.named_parameters() if not torch.equal(p, before[n])}
        linear = {
            f"{name}.weight"
            for name, module in start.named_modules()
            if name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
        }
        assert changed == linear


def test_encoder_cache_gives_the_uncached_loss_curve(tmp_path, tiny_run_config):
    cached = train(tiny_run_config(output_dir=str(tmp_path / "cached"), mode="freeze-encoder"))
    uncached = train(
        tiny_run_config(
            output_dir=str(tmp_path / "uncached"),
            mode="freeze-encoder",
            cache_encoder=False,
            packing="off",  # as --packing auto trains the cached run
        )
    )
    # Not bitwise: the cache encodes clip by clip, training encodes batches of 4 (other matrix
    # shapes, other summation order).
    np.testing.assert_allclose(
        losses_and_evaluations(cached.output_dir)[0],
        losses_and_evaluations(uncached.output_dir)[0],
        rtol=0,
        atol=SAME_RUN_LOSS_ATOL,
    )


def test_seed_project_flags_work_as_written(tmp_path, tiny_whisper_dir):
    """The issue's command line, with a local tiny model standing in for openai/whisper-small."""
    data = write_tone_dataset(tmp_path / "data", n=5)
    code = main(
        [
            "train",
            "--only-train",
            "--model",
            str(tiny_whisper_dir),
            "--batch-size",
            "1",
            "--gradient-accumulation",
            "16",
            "--epochs",
            "3",
            "--train-subset",
            "20",
            "--data",
            str(data),
            "--output-dir",
            str(tmp_path / "seed"),
        ]
    )
    assert code == 0
    losses, evaluations = losses_and_evaluations(tmp_path / "seed")
    # --only-train keeps all 5 clips for training; 16 micro-batches per step: one (partial)
    # accumulation per epoch still steps, so 3 epochs give 3 optimizer steps.
    assert len(losses) == 3 and evaluations == []
    assert (tmp_path / "seed" / "final" / "model.safetensors").exists()


def test_yaml_config_is_filled_and_flags_override(tmp_path, tone_dataset, tiny_whisper_dir):
    config_file = tmp_path / "run.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "data": {"data": str(tone_dataset)},
                "model": {"model": str(tiny_whisper_dir), "mode": "freeze-encoder"},
                "train": {
                    "max_steps": 5,
                    "batch_size": 4,
                    "only_train": True,
                    "output_dir": str(tmp_path / "y"),
                },
            }
        )
    )
    assert main(["train", "--config", str(config_file), "--max-steps", "2"]) == 0
    saved = yaml.safe_load((tmp_path / "y" / "final" / "whisper-train.yaml").read_text())
    assert saved["train"]["max_steps"] == 2 and saved["model"]["mode"] == "freeze-encoder"
    assert len(losses_and_evaluations(tmp_path / "y")[0]) == 2


def test_baseline_row_curves_and_before_after_report(tiny_run_config, tiny_whisper_dir):
    result = train(
        tiny_run_config(only_train=False, eval_at_start=True, compare_baseline=True, eval_steps=2)
    )
    _, evaluations = losses_and_evaluations(result.output_dir)
    assert [row["step"] for row in evaluations] == [0, 2, 3]
    assert (
        evaluations[0]["eval_loss"] > evaluations[-1]["eval_loss"]
    )  # training helped on held-out clips
    for name in ("curves.png", "report.md", "report.png", "report.json", "report.baseline.json"):
        assert (result.output_dir / name).stat().st_size > 0, name
    report = json.loads((result.output_dir / "report.json").read_text())
    assert report["n"] == result.eval_examples
    assert str(tiny_whisper_dir) in (result.output_dir / "report.md").read_text()


def test_bare_resume_flag_means_latest():
    from whisper_train.cli import build_parser, config_from_args

    args = build_parser().parse_args(["train", "--data", "d", "--resume"])
    assert config_from_args(args).train.resume == "latest"
    args = build_parser().parse_args(["train", "--data", "d", "--resume", "run/checkpoint-4"])
    assert config_from_args(args).train.resume == "run/checkpoint-4"


def test_auto_checkpointing_plans_within_the_budget_and_grouping_trains(tiny_run_config, capsys):
    result = train(
        tiny_run_config(gradient_checkpointing="auto", max_memory="64GB", group_by_length=True)
    )
    captured = capsys.readouterr()
    assert result.steps == 3
    # The plan is printed on stdout with the run's other lines, and only there: the budget, a
    # row per policy, the chosen one marked "->". A budget far above the need: the planner
    # keeps checkpointing off (no recompute cost), its estimate fits, and the run uses it.
    assert "budget 64.00 GiB" in captured.out
    chosen = [line.split() for line in captured.out.splitlines() if line.startswith("-> ")]
    assert len(chosen) == 1, captured.out
    policy, *_, total_gib, fits = chosen[0][1:]
    assert (policy, fits) == ("off", "yes") and float(total_gib) <= 64
    assert "mode full, checkpointing off," in captured.out
    # stderr carries the progress bars only: no second copy of the plan, no traceback.
    assert "memory plan" not in captured.err and "Traceback" not in captured.err


@pytest.mark.parametrize(
    "mode, context, encoder_rows",
    [("full", "block-restart-silence", 2), ("full", "", 1), ("lora", "", 1)],
)
def test_the_plan_counts_silence_windows_encoded_in_the_windows_batch(
    mode, context, encoder_rows, tiny_run_config, tmp_path, capsys, monkeypatch
):
    """--packing per-clip with block-restart-silence encodes a silence window beside each window
    in the windows' batch: the plan's encoder batch is twice the windows. By default (each
    clip with its own padding, sampled, in the window) it is the batch."""
    monkeypatch.setenv("WHISPER_TRAIN_PER_CLIP_ENCODER", context)
    data = write_tone_dataset(tmp_path / "many", n=24)
    result = train(
        tiny_run_config(
            data=str(data), packing="per-clip", batch_size=1, mode=mode, eval_split=0.0,
            gradient_checkpointing="auto", max_memory="64GB", max_steps=1,
        )
    )  # fmt: skip
    assert result.steps == 1
    header = next(line for line in capsys.readouterr().out.splitlines() if "mode " in line)
    assert ("batch 1 (encoder 2)" in header) == (encoder_rows == 2), header


def test_auto_checkpointing_refuses_an_impossible_budget(tiny_run_config):
    from whisper_train.errors import UserError

    with pytest.raises(UserError, match="--max-memory"):
        train(tiny_run_config(gradient_checkpointing="auto", max_memory="1MB"))


def test_a_second_run_in_one_process_may_use_another_precision(tiny_run_config, tmp_path):
    """A notebook trains, then trains again in bf16: accelerate's process-wide state would
    refuse the second precision ("restart your runtime") unless each run starts it afresh."""
    first = train(tiny_run_config(max_steps=1, output_dir=str(tmp_path / "fp32")))
    second = train(
        tiny_run_config(max_steps=1, precision="bf16", output_dir=str(tmp_path / "bf16"))
    )
    assert first.steps == second.steps == 1
    for run in (first, second):
        (loss,) = losses_and_evaluations(run.output_dir)[0]
        assert math.isfinite(loss)


def test_a_first_run_prints_each_start_line_in_a_terminal_width(
    tmp_path, tone_dataset, tiny_whisper_dir
):
    """What a run says before its first step (its record's notes, the model, the data, the
    evaluation sets, the memory plan, the screening) fits a terminal: each line at most
    START_LINE_CHARS (the data line was 383 characters); the rest is with -v and in
    OUTPUT/whisper-train.yaml. The run has what a first run often has: --packing and
    --nonspeech auto, two evaluation sets (named at length: the line counts them), a guard and
    --gradient-checkpointing auto."""
    held = write_tone_dataset(tmp_path / "held", n=4, seed=1)
    guard = write_tone_dataset(tmp_path / "guard", n=4, seed=2)
    held_name = "held-out-speakers-reading-words-training-never-met"
    guard_name = "general-english-sentences-read-in-the-default-voice"
    result = train_in_subprocess(
        [
            f"--data={tone_dataset}",
            f"--model={tiny_whisper_dir}",
            f"--eval-data={held_name}={held}",
            f"--eval-data={guard_name}={guard}",
            f"--guard={guard_name}",
            "--gradient-checkpointing=auto",
            "--max-memory=64GB",
            "--max-steps=1",
            "--batch-size=4",
            "--generation-max-length=8",
            "--temperatures=0",
            f"--output-dir={tmp_path / 'out'}",
        ]
    )
    out = result.stdout.splitlines()
    first_step = next(i for i, line in enumerate(out) if re.match(r"\s*Step \||step 1/", line))
    assert first_step > 0, result.stdout
    start = out[:first_step] + result.stderr.splitlines()
    for said in ("packing auto ->", "nonspeech auto ->", "model:", "trainable parameters:"):
        assert any(line.startswith(said) for line in start), (said, start)
    # 12 tone clips and the built-in non-speech clips, in windows; the memory plan's budget
    assert re.search(
        r"^data: \d+ clips \(3 of noise riding\) packed into \d+ windows; ", result.stdout, re.M
    )
    assert "budget 64.00 GiB" in result.stdout
    assert "evaluation: 8 clips in 2 sets" in out  # each set by name with -v
    too_long = [line for line in start if len(line) > START_LINE_CHARS]
    assert not too_long, too_long


def test_a_start_line_s_detail_is_printed_with_verbose_only(capsys, caplog):
    """`say(..., detail=...)`: the line always, its detail under it with -v (DEBUG)."""
    from types import SimpleNamespace

    main_process = SimpleNamespace(is_main_process=True)
    say(main_process, "data: 12 clips", detail="each clip decoded on its own")
    assert capsys.readouterr().out == "data: 12 clips\n"
    caplog.set_level(logging.DEBUG, logger="whisper_train")
    say(main_process, "data: 12 clips", detail="each clip decoded on its own")
    assert capsys.readouterr().out == "data: 12 clips\n  each clip decoded on its own\n"
    say(SimpleNamespace(is_main_process=False), "data: 12 clips", detail="more")
    assert capsys.readouterr().out == ""
