"""memory.py: freezing, LoRA, checkpointing policy, precision and optimiser choices."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from test_checkpointing_parity import pristine

from whisper_train.errors import UserError
from whisper_train.memory import (
    LoraSettings,
    Precision,
    build_optimizer,
    checkpointing_state,
    prepare_model,
    resolve_checkpointing,
    resolve_precision,
    trainable_parameter_summary,
)

CPU = torch.device("cpu")
SMALL_LORA = LoraSettings(r=4, alpha=8, dropout=0.0)


def fresh_model():
    """A seeded tiny Whisper with a 1-second encoder (a copy: building one costs more)."""
    return copy.deepcopy(pristine("sdpa"))


def trainable(model) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mode", ["full", "lora", "freeze-encoder"])
def test_encoder_positions_never_train(mode):
    model = fresh_model()
    model.model.encoder.embed_positions.requires_grad_(True)  # as 5.x from_pretrained leaves it
    prepared = prepare_model(model, mode=mode, lora=SMALL_LORA)
    assert not any("encoder.embed_positions" in name for name in trainable(prepared))


def test_freeze_encoder_trains_the_decoder_only_and_never_recomputes_the_encoder():
    model = fresh_model()
    prepared = prepare_model(model, mode="freeze-encoder", checkpointing="full")
    names = trainable(prepared)
    assert names and all(".decoder." in f".{n}" or n.startswith("proj_out") for n in names)
    modules = checkpointing_state(prepared)["modules"]
    assert modules and all(".decoder." in n for n in modules)


def test_lora_trains_only_adapters_and_checkpoints_non_reentrant():
    model = fresh_model()
    prepared = prepare_model(model, mode="lora", checkpointing="on", lora=SMALL_LORA)
    names = trainable(prepared)
    assert names and all("lora_" in n for n in names)
    assert any(".encoder." in n for n in names) and any(".decoder." in n for n in names)
    state = checkpointing_state(prepared)
    assert len(state["modules"]) == 4 and state["reentrant"] == []


def test_a_model_wrapped_with_peft_first_keeps_its_adapters():
    from peft import LoraConfig, get_peft_model

    model = fresh_model()
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["fc1"]))
    prepared = prepare_model(wrapped, mode="lora", checkpointing="full")
    assert prepared is wrapped
    assert all(".fc1.lora_" in n for n in trainable(prepared))
    assert checkpointing_state(prepared)["reentrant"] == []
    with pytest.raises(UserError, match="already wrapped"):
        prepare_model(wrapped, mode="full")


def test_off_switches_off_checkpointing_someone_else_enabled():
    model = fresh_model()
    model.gradient_checkpointing_enable()
    assert checkpointing_state(model)["enabled"]
    prepare_model(model, mode="full", checkpointing="off")
    assert not checkpointing_state(model)["enabled"]
    assert model.config.use_cache is False


def test_checkpointing_state_reads_reentrant_from_each_layer():
    """An empty kwargs dict falls back to torch's reentrant default (T9): reported as such."""
    model = fresh_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"preserve_rng_state": True})
    state = checkpointing_state(model)
    assert state["enabled"] and state["reentrant"] == state["modules"]
    assert set(state["use_reentrant"].values()) == {True}


def test_bad_inputs_are_one_line_user_errors():
    model = fresh_model()
    with pytest.raises(UserError, match="--mode"):
        prepare_model(model, mode="half")
    with pytest.raises(UserError, match="--gradient-checkpointing every-0"):
        prepare_model(model, checkpointing="every-0")
    with pytest.raises(UserError, match="--lora-targets"):
        prepare_model(model, mode="lora", lora=LoraSettings(targets=("no_such_layer",)))


def test_resolve_checkpointing_defaults_by_device():
    assert resolve_checkpointing(None, CPU) == "off"
    assert resolve_checkpointing(None, torch.device("cuda")) == "full"
    assert resolve_checkpointing("on", CPU) == "full"
    assert resolve_checkpointing("every-3", CPU) == "every-3"


def test_resolve_precision_on_a_cpu():
    assert resolve_precision("auto", CPU) == Precision("no", torch.float32, False)
    assert resolve_precision("bf16", CPU).mixed_precision == "bf16"
    with pytest.raises(UserError, match="--precision fp16 needs a CUDA GPU"):
        resolve_precision("fp16", CPU)


def test_resolve_precision_on_cuda_without_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    auto = resolve_precision("auto", torch.device("cuda"))
    assert auto.mixed_precision == "fp16" and auto.needs_scaler
    with pytest.raises(UserError, match="no bfloat16"):
        resolve_precision("bf16", torch.device("cuda"))


def test_optimizer_skips_frozen_weights_and_decays_only_matrices():
    model = fresh_model()
    model = prepare_model(model, mode="freeze-encoder")
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    by_decay = {g["weight_decay"]: g["params"] for g in optimizer.param_groups}
    assert all(p.ndim >= 2 for p in by_decay[0.1]) and all(p.ndim < 2 for p in by_decay[0.0])
    optimised = {id(p) for group in optimizer.param_groups for p in group["params"]}
    frozen = {id(p) for p in model.model.encoder.parameters()}
    assert not optimised & frozen
    assert len(optimised) == sum(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("name", ["adamw", "adamw-fused", "adamw8bit"])
def test_every_optimizer_trains(name):
    model = fresh_model()
    model = prepare_model(model, mode="lora", lora=SMALL_LORA).train()
    optimizer = build_optimizer(model, name=name, lr=1e-2)
    batch = {"input_features": torch.randn(1, 80, 100), "labels": torch.tensor([[1000, 50256]])}
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model(**batch).loss.backward()
    optimizer.step()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters() if n in before)


def test_optimizer_errors_name_the_flag(monkeypatch):
    model = fresh_model()
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    with pytest.raises(UserError, match=r"--optim adamw8bit needs bitsandbytes"):
        build_optimizer(model, name="adamw8bit", lr=1e-3)
    with pytest.raises(UserError, match="--optim sgd"):
        build_optimizer(model, name="sgd", lr=1e-3)
    model.requires_grad_(False)
    with pytest.raises(UserError, match="no trainable parameters"):
        build_optimizer(model, lr=1e-3)


def test_trainable_parameter_summary_counts_what_trains():
    model = fresh_model()
    prepared = prepare_model(model, mode="lora", lora=SMALL_LORA)
    n_lora = sum(p.numel() for n, p in prepared.named_parameters() if "lora_" in n)
    summary = trainable_parameter_summary(prepared)
    assert f"trainable parameters: {n_lora:,} of" in summary and f"lora {n_lora:,}" in summary
