"""doctor.py: the pre-flight checks name the trigger that breaks a configuration, and pass ours."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import LORA, fresh_short_whisper, nonzero_lora_b, tiny_batch

from whisper_train import doctor
from whisper_train.config import RunConfig
from whisper_train.errors import UserError
from whisper_train.memory import prepare_model


def by_id(report: doctor.DoctorReport) -> dict[str, doctor.Check]:
    return {check.id: check for check in report.checks}


def by_id_static(model, **kwargs) -> dict[str, doctor.Check]:
    return {check.id: check for check in doctor.static_checks(model, refuse=False, **kwargs)}


def reentrant(model):
    """`model` with every layer checkpointed the reentrant way, as a hand-made setup does."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model


def peft_first_then_reentrant():
    """PEFT wrapped before checkpointing, checkpointing reentrant: the Unsloth/LoRA failure."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    return reentrant(get_peft_model(fresh_short_whisper(), lora))


@pytest.mark.parametrize(
    "mode,policy", [("full", "full"), ("lora", "full"), ("freeze-encoder", "every-2")]
)
def test_whisper_train_configurations_pass(mode, policy):
    report = doctor.run(
        fresh_short_whisper(), tiny_batch(), mode=mode, checkpointing=policy, lora=LORA
    )
    assert report.ok, doctor.format_report(report)
    checks = by_id(report)
    assert checks["parity"].status == "pass"
    assert "max abs difference 0;" in checks["parity"].message
    assert checks["reentrant"].status == "pass"


def test_lora_report_explains_the_zero_gradients_of_lora_a():
    """LoRA B starts at zero, so A's gradient is zero at step 0: reported as by design."""
    report = doctor.run(
        fresh_short_whisper(), tiny_batch(), mode="lora", checkpointing="full", lora=LORA
    )
    parity = by_id(report)["parity"]
    assert parity.status == "pass", parity.message
    # q_proj and v_proj in 2 encoder self-attentions and 2 decoder self- and cross-attentions,
    # each an A and a B matrix: 24 tensors, the 12 A matrices with a zero gradient.
    assert parity.message.startswith("all 24 trainable tensors get a gradient, 12 non-zero;")
    assert "the other 12 are LoRA A matrices" in parity.message
    assert "LoRA B starts at zero" in parity.message


def test_lora_with_a_trained_b_needs_no_explanation():
    model = prepare_model(fresh_short_whisper(), mode="lora", checkpointing="full", lora=LORA)
    nonzero_lora_b(model)  # as after some training steps
    parity = by_id(doctor.run(model, tiny_batch()))["parity"]
    assert parity.status == "pass"
    assert parity.message.startswith("all 24 trainable tensors get a gradient, 24 non-zero;")
    assert "LoRA" not in parity.message


def test_a_zero_gradient_lora_does_not_explain_fails():
    """A cut-off path (fc2 zeroed: fc1 and the layer norm before it learn nothing) is not
    LoRA's doing."""
    model = prepare_model(fresh_short_whisper(), mode="full", checkpointing="full")
    with torch.no_grad():
        model.model.decoder.layers[1].fc2.weight.zero_()
    report = doctor.run(model, tiny_batch())
    parity = by_id(report)["parity"]
    assert not report.ok and parity.status == "fail"
    assert parity.message.startswith("4 trainable tensors get an all-zero gradient (e.g. ")
    assert "decoder.layers.1.fc1." in parity.message


def test_a_trainable_parameter_without_any_gradient_fails():
    """None, not zero: the loss never reaches it, with or without checkpointing."""
    model = prepare_model(fresh_short_whisper(), mode="full", checkpointing="full")
    model.model.decoder.unused_scale = torch.nn.Parameter(torch.ones(4))
    report = doctor.run(model, tiny_batch())
    parity = by_id(report)["parity"]
    assert not report.ok and parity.status == "fail"
    assert parity.message == (
        "1 trainable parameters get no gradient, with or without checkpointing "
        "(e.g. model.decoder.unused_scale): the loss does not depend on them"
    )


def test_lora_wrapped_first_under_reentrant_checkpointing_fails_with_t2():
    report = doctor.run(peft_first_then_reentrant(), tiny_batch())
    assert not report.ok
    failed = {check.id: check.trigger for check in report.failed()}
    assert failed["frozen-input"] == "T2" and failed["parity"] == "T2" and failed["peft"] == "T2"
    assert "use_reentrant" in by_id(report)["parity"].remedy


def test_doctor_leaves_the_callers_model_alone():
    model = fresh_short_whisper()
    doctor.run(model, tiny_batch(), mode="lora", checkpointing="full", lora=LORA)
    assert not hasattr(model, "peft_config") and not model.training
    assert all(p.grad is None for p in model.parameters())


def test_trainer_kwargs_without_use_reentrant_fall_back_to_reentrant_t9():
    """{'preserve_rng_state': True} alone silently means reentrant on 4.x and 5.x."""
    from transformers import Seq2SeqTrainingArguments

    args = Seq2SeqTrainingArguments(
        output_dir="unused",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"preserve_rng_state": True},
        report_to=[],
        use_cpu=True,
    )
    report = doctor.run(fresh_short_whisper(), tiny_batch(), trainer_args=args)
    trainer = by_id(report)["trainer"]
    assert (trainer.status, trainer.trigger) == ("fail", "T9")
    assert "reentrant" in trainer.message and '"use_reentrant": False' in trainer.remedy


def test_static_checks_refuse_a_known_failure_and_pass_ours():
    with pytest.raises(UserError, match=r"\(T2\); use whisper_train.prepare_model"):
        doctor.static_checks(peft_first_then_reentrant())
    ours = prepare_model(fresh_short_whisper(), mode="lora", checkpointing="full", lora=LORA)
    checks = doctor.static_checks(ours)
    assert all(check.status == "pass" for check in checks)


def test_ddp_with_find_unused_and_reentrant_is_t3_and_layerdrop_without_it_is_t4():
    ddp = {"world_size": 2, "find_unused_parameters": True}
    check = by_id_static(reentrant(fresh_short_whisper()), ddp=ddp)["ddp"]
    assert (check.status, check.trigger) == ("fail", "T3")

    layerdrop = prepare_model(fresh_short_whisper(), mode="full", checkpointing="full")
    layerdrop.config.decoder_layerdrop = 0.1
    check = by_id_static(layerdrop, ddp={"world_size": 2, "find_unused_parameters": False})["ddp"]
    assert (check.status, check.trigger) == ("fail", "T4")
    check = by_id_static(layerdrop, ddp={"world_size": 1})["ddp"]
    assert check.status == "pass"


def test_ddp_static_graph_with_gradient_accumulation_fails_and_without_it_passes():
    ours = prepare_model(fresh_short_whisper(), mode="full", checkpointing="full")
    ddp = {"world_size": 2, "find_unused_parameters": False, "static_graph": True}
    check = by_id_static(ours, ddp={**ddp, "gradient_accumulation": 2})["ddp"]
    assert check.status == "fail" and "static_graph=False" in check.remedy
    assert by_id_static(ours, ddp={**ddp, "gradient_accumulation": 1})["ddp"].status == "pass"
    ddp["static_graph"] = False  # what the recipe runs with
    assert by_id_static(ours, ddp={**ddp, "gradient_accumulation": 2})["ddp"].status == "pass"


def test_compile_with_reentrant_checkpointing_is_t6():
    check = by_id_static(reentrant(fresh_short_whisper()), compile=True)["compile"]
    assert check.status == "fail"
    ours = prepare_model(fresh_short_whisper(), mode="full", checkpointing="full")
    check = by_id_static(ours, compile=True)["compile"]
    assert (check.status, check.trigger) == ("warn", "T6")


def test_forward_pre_hooks_on_checkpointed_layers_are_reported_where_they_replay():
    model = prepare_model(fresh_short_whisper(), mode="full", checkpointing="full")
    model.model.decoder.layers[0].register_forward_pre_hook(lambda *args: None)
    check = by_id_static(model)["hooks"]
    if doctor.hooks_replay_on_recompute():
        assert (check.status, check.trigger) == ("warn", "T8")
    else:
        assert check.status == "pass"


def test_a_checkpoint_function_that_does_not_recompute_fails_parity():
    """A replacement checkpoint function (T5) that silently keeps everything in memory."""
    model = prepare_model(fresh_short_whisper(), mode="full", checkpointing="full")
    for layer in model.model.decoder.layers:
        layer._gradient_checkpointing_func = lambda function, *args, **kwargs: function(*args)
    report = doctor.run(model, tiny_batch())
    checks = by_id(report)
    assert checks["reentrant"].status == "warn" and checks["reentrant"].trigger == "T5"
    assert checks["parity"].status == "fail" and "was not recomputed" in checks["parity"].message


def test_report_formats():
    report = doctor.run(peft_first_then_reentrant(), tiny_batch())
    text = doctor.format_report(report)
    assert "FAIL  frozen-input [T2]:" in text and "remedy: " in text
    assert text.splitlines()[-1].endswith("check(s) failed")
    as_json = json.loads(json.dumps(report.to_json()))
    assert as_json["ok"] is False
    assert {"id", "status", "message", "remedy"} <= set(as_json["checks"][0])


def doctor_command(model_dir, *flags: str) -> int:
    """`whisper-train doctor` on a LoRA (rank 4) of the model at `model_dir`, probing with one
    utterance (the fastest probe), plus `flags`; its exit code."""
    from whisper_train.cli import main

    argv = ["doctor", "--model", str(model_dir), "--mode", "lora", "--lora-r", "4"]
    return main([*argv, "--probe-batch-size", "1", *flags])


def test_doctor_command_prints_json_and_exits_0_for_our_configuration(tiny_whisper_dir, capsys):
    code = doctor_command(tiny_whisper_dir, "--gradient-checkpointing", "full", "--json")
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["ok"] is True
    parity = {c["id"]: c for c in out["checks"]}["parity"]
    assert parity["status"] == "pass" and "LoRA B starts at zero" in parity["message"]


def test_doctor_command_exits_1_when_a_check_fails(tiny_whisper_dir, monkeypatch, capsys):
    # A model whose layers come back reentrant, as a hand-made setup would.
    real_prepare = doctor.prepare_model
    monkeypatch.setattr(
        doctor, "prepare_model", lambda model, **kw: reentrant(real_prepare(model, **kw))
    )
    assert doctor_command(tiny_whisper_dir) == 1
    assert "FAIL  parity [T2]" in capsys.readouterr().out


def test_run_needs_labels():
    with pytest.raises(UserError, match="labels"):
        doctor.run(fresh_short_whisper(), {"input_features": torch.zeros(1, 80, 100)})


def test_doctor_checks_the_compile_the_run_decides_not_the_flag():
    """A GPU run given no --compile: the default per-clip packing trains uncompiled, so doctor
    must not check (and warn about) a compiled model; unpacked with --max-steps 5000 the run
    compiles, so doctor checks that; --no-compile is honoured on any length."""
    cuda = torch.device("cuda")
    config = RunConfig()
    config.data.data = "x.jsonl"
    assert doctor.doctor_compiles(config, cuda) is False
    config.data.packing = "off"
    config.train.max_steps = 5000
    assert doctor.doctor_compiles(config, cuda) is True
    assert doctor.doctor_compiles(config, torch.device("cpu")) is False
    config.memory.compile = False
    assert doctor.doctor_compiles(config, cuda) is False
