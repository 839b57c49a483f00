"""Export: LoRA merge, Hugging Face and CTranslate2 output, and the parity check."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
from transformers import WhisperForConditionalGeneration

from whisper_train.commands import export as export_command
from whisper_train.deploy.export import export_model
from whisper_train.deploy.parity import (
    ClipComparison,
    ParityCheck,
    logprob_tolerance,
    parity_failure,
)
from whisper_train.errors import UserError


def _inputs(seed: int = 0):
    """Fixed model inputs: features (1, 80, 3000) and a short decoder prefix."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(1, 80, 3000, generator=generator)
    decoder_input_ids = torch.tensor([[50257, 50362, 440, 2068, 7426]])
    return features, decoder_input_ids


def test_lora_run_folder_exports_merged_weights_equal_to_base_plus_adapter(
    tiny_whisper_dir, tmp_path
):
    from peft import LoraConfig, get_peft_model

    base = WhisperForConditionalGeneration.from_pretrained(tiny_whisper_dir).eval()
    # init_lora_weights=False: random A and B, so the adapter really changes the outputs.
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "fc1"], init_lora_weights=False
    )
    torch.manual_seed(0)
    peft_model = get_peft_model(base, lora).eval()
    run = tmp_path / "run"
    peft_model.save_pretrained(run / "final")
    adapter_config = run / "final" / "adapter_config.json"
    settings = json.loads(adapter_config.read_text())
    settings["base_model_name_or_path"] = str(tiny_whisper_dir)
    adapter_config.write_text(json.dumps(settings))

    result = export_model(str(run), format="hf", output=tmp_path / "merged", check=False)

    assert result.merged_lora
    saved = {p.name for p in (tmp_path / "merged").iterdir()}
    assert {
        "model.safetensors",
        "generation_config.json",
        "preprocessor_config.json",
        "tokenizer.json",
    } <= saved
    assert "adapter_config.json" not in saved
    merged = WhisperForConditionalGeneration.from_pretrained(tmp_path / "merged").eval()
    features, decoder_input_ids = _inputs()
    with torch.no_grad():
        expected = peft_model(input_features=features, decoder_input_ids=decoder_input_ids).logits
        plain = peft_model.get_base_model()
        with peft_model.disable_adapter():
            without_adapter = plain(
                input_features=features, decoder_input_ids=decoder_input_ids
            ).logits
        got = merged(input_features=features, decoder_input_ids=decoder_input_ids).logits
    # float32 merge: W + B·A·scale differs from the two-path sum only by rounding.
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert (without_adapter - expected).abs().max() > 1e-2, "the adapter must matter"


def test_hf_to_ct2_round_trip_keeps_the_weights(tiny_whisper_dir, tmp_path):
    from whisper_train.formats.ct2 import load_ct2_whisper

    source = WhisperForConditionalGeneration.from_pretrained(tiny_whisper_dir)
    result = export_model(
        str(tiny_whisper_dir),
        format="ct2",
        quantization="float32",
        output=tmp_path / "ct2",
        check=False,
    )
    assert (result.output / "model.bin").is_file()
    assert (result.output / "preprocessor_config.json").is_file()
    loaded, _ = load_ct2_whisper(result.output)
    loaded_state = loaded.state_dict()
    for name, tensor in source.state_dict().items():
        torch.testing.assert_close(loaded_state[name], tensor, atol=1e-6, rtol=0, msg=name)


@pytest.mark.speech
def test_an_exact_export_passes_though_the_runtimes_greedy_transcripts_differ(
    tiny_whisper_dir, tmp_path, monkeypatch
):
    """base exported to ct2 float16, bitwise equal to Systran's conversion, failed the
    check because faster-whisper's greedy decoder tipped 7 near-tied words. The verdict now
    rests on the runtime scoring the source's own tokens; the transcripts are only reported."""
    from dataclasses import replace

    from whisper_train.formats import registry

    def tipped(greedy):
        def decode(model_input, clips, language):  # another runtime's arithmetic, near ties
            return [
                f"{text} and also some other words" for text in greedy(model_input, clips, language)
            ]

        return decode

    tipping = [replace(fmt, greedy=tipped(fmt.greedy)) for fmt in registry.EXPORT_FORMATS]
    monkeypatch.setattr(registry, "EXPORT_FORMATS", tuple(tipping))
    model = WhisperForConditionalGeneration.from_pretrained(tiny_whisper_dir)
    model.generation_config.max_length = 12  # a random model's transcript: keep it short
    model.save_pretrained(tmp_path / "source")
    from transformers import WhisperProcessor

    WhisperProcessor.from_pretrained(tiny_whisper_dir).save_pretrained(tmp_path / "source")

    result = export_model(
        str(tmp_path / "source"),
        format="ct2",
        quantization="float16",
        output=tmp_path / "ct2",
        n_check_clips=2,
    )

    parity = result.parity
    assert parity.passed and parity.tokens >= 2
    assert parity.word_errors >= 10  # the greedy transcripts did differ: reported, not failed
    assert parity.deviation <= 1e-3  # float16 weights in CTranslate2's float32 CPU arithmetic
    assert "informative" in parity.summary() and "spelled alike" in parity.summary()


def test_the_failure_names_the_clips_and_what_differs():
    clip = ClipComparison(
        name="synthesised #1",
        reference="open the door",
        source="Open the door.",
        exported="Open the floor.",
        spelled="Open the door.",
        deviations=np.array([0.9, 1.2, 2.0, 0.4]),
        words=3,
        errors=1,
    )
    shifted = ClipComparison(**{**clip.__dict__, "name": "synthesised #2", "spelled": "Pqfo"})
    check = ParityCheck(
        runtime="faster-whisper",
        language=None,
        clips=[clip, shifted],
        tolerance=logprob_tolerance("int8"),
        quantization="int8",
        arithmetic="int8",
        source_wer=0.0,
        export_wer=0.3,
    )
    assert not check.passed and check.deviation == pytest.approx(1.125)
    message = str(parity_failure(check, "ct2"))
    assert "synthesised #1" in message and "'Open the door.'" in message
    assert "synthesised #2" in message and "'Pqfo'" in message  # the vocabulary's spelling
    assert "mean |Δ log p| 1.125" in message
    assert clip.spelled_alike and not shifted.spelled_alike
    exact = ParityCheck(
        **{**check.__dict__, "clips": [clip], "quantization": "float32", "arithmetic": "float32"}
    )
    exact.tolerance = logprob_tolerance("float32")
    assert "conversion itself is suspect" in str(parity_failure(exact, "ct2"))


def test_the_tolerance_follows_the_runtimes_arithmetic_not_the_file_alone():
    from whisper_train.deploy.parity import scoring_arithmetic

    assert logprob_tolerance("float32") < logprob_tolerance("float16") < logprob_tolerance("int8")
    # whisper.cpp multiplies float16 matrices; openai-whisper holds float16 weights in float32.
    assert scoring_arithmetic("ggml", "float16") == "float16"
    assert scoring_arithmetic("openai", "float16") == "float32"
    assert scoring_arithmetic("ct2", "int8_float16") == "int8"


@pytest.mark.speech
def test_export_command_ct2_int8_with_parity_check(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    export_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        [
            "export",
            "--model",
            "tiny.en",
            "--format",
            "ct2",
            "--quantization",
            "int8",
            "--output",
            str(tmp_path / "int8"),
            "--check-clips",
            "2",
        ]
    )
    assert args.handler(args) == 0
    assert "export check passed" in capsys.readouterr().out
    config = json.loads((tmp_path / "int8" / "generation_config.json").read_text())
    assert config["no_timestamps_token_id"] == 50362


def test_export_refuses_bad_requests(tiny_whisper_dir, tmp_path):
    with pytest.raises(UserError, match="--format ct2"):
        export_model(str(tiny_whisper_dir), format="hf", quantization="int8", output=tmp_path / "a")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(UserError, match="not empty"):
        export_model(str(tiny_whisper_dir), format="hf", output=tmp_path / "full")


def _hashes(folder):
    import hashlib

    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_ct2_default_quantization_follows_the_target_device(
    tiny_whisper_dir, tmp_path, monkeypatch, caplog
):
    import whisper_train.deploy.export as export_module

    caplog.set_level("INFO", logger="whisper_train.deploy.export")
    # --device defaults to this machine.
    monkeypatch.setattr(export_module.torch.cuda, "is_available", lambda: False)
    assert export_module.default_device() == "cpu"
    monkeypatch.setattr(export_module.torch.cuda, "is_available", lambda: True)
    assert export_module.default_device() == "cuda"
    monkeypatch.undo()

    # A CPU target gets float32: CTranslate2 would convert float16 on every CPU load.
    cpu = export_model(
        str(tiny_whisper_dir), format="ct2", device="cpu", output=tmp_path / "c", check=False
    )
    assert cpu.quantization == "float32"
    (chosen,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("quant")]
    assert "float32" in chosen and "--device cpu" in chosen and "--quantization" in chosen
    # A GPU target gets float16 (half the bytes); an explicit --quantization still wins.
    gpu = export_model(
        str(tiny_whisper_dir), format="ct2", device="cuda", output=tmp_path / "g", check=False
    )
    assert gpu.quantization == "float16"
    assert (gpu.output / "model.bin").stat().st_size < 0.6 * (
        cpu.output / "model.bin"
    ).stat().st_size
    explicit = export_model(
        str(tiny_whisper_dir),
        format="ct2",
        device="cpu",
        quantization="float16",
        output=tmp_path / "e",
        check=False,
    )
    assert explicit.quantization == "float16"


def test_export_over_an_earlier_export_is_refused_unless_overwrite(
    tiny_whisper_dir, tmp_path, capsys
):
    from whisper_train.cli import main

    out = tmp_path / "export"
    argv = ["export", "--model", str(tiny_whisper_dir), "--output", str(out), "--no-check"]
    assert main(argv) == 0
    before = _hashes(out)
    capsys.readouterr()

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and str(out) in err and "Traceback" not in err
    assert _hashes(out) == before

    assert main([*argv, "--overwrite"]) == 0
    (aside,) = tmp_path.glob("export.old-*")
    assert _hashes(aside) == before  # the earlier export, moved whole
    assert (out / "model.safetensors").is_file()

    # Re-exporting an export over itself would move away the model it reads.
    again = ["export", "--model", str(out), "--output", str(out), "--no-check", "--overwrite"]
    assert main(again) == 2
    assert "new folder" in capsys.readouterr().err
    assert len(list(tmp_path.glob("export.old-*"))) == 1

    # A folder of other files is never moved, even with --overwrite.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    assert (
        main(
            [
                "export",
                "--model",
                str(tiny_whisper_dir),
                "--output",
                str(mine),
                "--no-check",
                "--overwrite",
            ]
        )
        == 2
    )
    assert "other files" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["thesis.tex"]


@pytest.mark.parametrize(("format", "quantization"), [("ct2", "float32"), ("hf", "float32")])
def test_the_check_leaves_out_clips_whose_transcripts_overflow_the_decoder(
    tiny_whisper_dir, tmp_path, monkeypatch, caplog, format, quantization
):
    """A greedy transcript cut by the length limit (446 text tokens after the 2-token prompt:
    448 positions) leaves no room for <|endoftext|>, which CTranslate2's scoring feeds: the check
    failed on its own clip ("No position encodings are defined for positions >= 448"). Such
    clips are left out of every runtime's check, one line says how many, and the others are
    scored; with none left, the failure says why there was nothing to score."""
    import logging

    from transformers import WhisperProcessor

    from whisper_train.deploy import parity as parity_module
    from whisper_train.deploy.export import save_export

    model = WhisperForConditionalGeneration.from_pretrained(tiny_whisper_dir)
    processor = WhisperProcessor.from_pretrained(tiny_whisper_dir)
    assert model.config.max_target_positions == 448
    word = processor.tokenizer.encode(" the", add_special_tokens=False)[0]

    def transcripts(model, processor, clips, language):  # 1 s: 5 tokens; 2 s: cut at 448
        tokens = [[word] * (5 if len(audio) <= 16_000 else 446) for audio in clips]
        return [processor.tokenizer.decode(ids).strip() for ids in tokens], tokens

    monkeypatch.setattr(parity_module, "transformers_greedy_tokens", transcripts)
    tone = (0.1 * np.sin(np.arange(32_000) / 7)).astype(np.float32)
    clips = [("short.wav", tone[:16_000], "the", None), ("long.wav", tone, "the", None)]
    with caplog.at_level(logging.INFO):
        source = parity_module.score_source(model, processor, clips, None)
    save_export(model, processor, tmp_path / "out", format=format, quantization=quantization)
    check = parity_module.check_export(source, format, tmp_path / "out", quantization, greedy=False)
    assert check.runtime_error is None and check.passed, check.summary()
    assert [clip.name for clip in check.clips] == ["short.wav"] and check.tokens == 5
    assert check.left_out == 1 and "1 more clip(s) left out" in check.summary()
    said = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("export check: 1 of 2 clips left out (long.wav)")

    only_long = parity_module.score_source(model, processor, clips[1:2], None)
    nothing = parity_module.check_export(only_long, format, tmp_path / "out", quantization)
    assert not nothing.passed and nothing.left_out == 1
    assert "exceeded the decoder's positions" in str(parity_module.parity_failure(nothing, format))
