"""whisper_train.memory: freezing, LoRA, checkpointing policy, loss, precision, optimiser."""

from __future__ import annotations

import copy
import dataclasses
import sys

import pytest
import torch
from conftest import record_of
from tiny_models import (
    LORA,
    fresh_short_whisper,
    nonzero_lora_b,
    tiny_batch,
    trainable_gradients,
)

from whisper_train.errors import UserError
from whisper_train.memory import (
    LoraSettings,
    Precision,
    build_optimizer,
    checkpointed_layers,
    checkpointing_policy,
    checkpointing_state,
    parse_every_n,
    prepare_model,
    resolve_checkpointing,
    resolve_precision,
    trainable_parameter_summary,
    training_loss,
    whisper_of,
)

CPU = torch.device("cpu")
SMALL_LORA = LoraSettings(r=4, alpha=8, dropout=0.0)


def trainable(model) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mode", ["full", "lora", "freeze-encoder"])
def test_encoder_positions_never_train(mode):
    model = fresh_short_whisper()
    model.model.encoder.embed_positions.requires_grad_(True)  # as 5.x from_pretrained leaves it
    prepared = prepare_model(model, mode=mode, lora=SMALL_LORA)
    assert not any("encoder.embed_positions" in name for name in trainable(prepared))


def test_freeze_encoder_trains_the_decoder_only_and_never_recomputes_the_encoder():
    model = fresh_short_whisper()
    prepared = prepare_model(model, mode="freeze-encoder", checkpointing="full")
    names = trainable(prepared)
    assert names and all(".decoder." in f".{n}" or n.startswith("proj_out") for n in names)
    modules = checkpointing_state(prepared)["modules"]
    assert modules and all(".decoder." in n for n in modules)


def test_lora_trains_only_adapters_and_checkpoints_non_reentrant():
    model = fresh_short_whisper()
    prepared = prepare_model(model, mode="lora", checkpointing="on", lora=SMALL_LORA)
    names = trainable(prepared)
    assert names and all("lora_" in n for n in names)
    assert any(".encoder." in n for n in names) and any(".decoder." in n for n in names)
    state = checkpointing_state(prepared)
    assert len(state["modules"]) == 4 and state["reentrant"] == []


def test_a_model_wrapped_with_peft_first_keeps_its_adapters():
    from peft import LoraConfig, get_peft_model

    model = fresh_short_whisper()
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["fc1"]))
    prepared = prepare_model(wrapped, mode="lora", checkpointing="full")
    assert prepared is wrapped
    assert all(".fc1.lora_" in n for n in trainable(prepared))
    assert checkpointing_state(prepared)["reentrant"] == []
    with pytest.raises(UserError, match="already wrapped"):
        prepare_model(wrapped, mode="full")


def test_off_switches_off_checkpointing_someone_else_enabled():
    model = fresh_short_whisper()
    model.gradient_checkpointing_enable()
    assert checkpointing_state(model)["enabled"]
    prepare_model(model, mode="full", checkpointing="off")
    assert not checkpointing_state(model)["enabled"]
    assert model.config.use_cache is False


def test_checkpointing_state_reads_reentrant_from_each_layer():
    """An empty kwargs dict falls back to torch's reentrant default (T9): reported as such."""
    model = fresh_short_whisper()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"preserve_rng_state": True})
    state = checkpointing_state(model)
    assert state["enabled"] and state["reentrant"] == state["modules"]
    assert set(state["use_reentrant"].values()) == {True}


def test_bad_inputs_are_one_line_user_errors():
    model = fresh_short_whisper()
    with pytest.raises(UserError, match="--mode"):
        prepare_model(model, mode="half")
    with pytest.raises(UserError, match="--gradient-checkpointing every-0"):
        prepare_model(model, checkpointing="every-0")
    with pytest.raises(UserError, match="--lora-targets"):
        prepare_model(model, mode="lora", lora=LoraSettings(targets=("no_such_layer",)))


def test_every_n_policies_have_one_spelling():
    parsed = [parse_every_n(p) for p in ("every-1", "every-12", "every-0", "every-02", "every-")]
    assert parsed == [1, 12, None, None, None]
    assert parse_every_n("full") is None and parse_every_n("every-2\n") is None


def _flagged_layers(whisper) -> set[tuple[str, int]]:
    stacks = {"encoder": whisper.model.encoder.layers, "decoder": whisper.model.decoder.layers}
    return {
        (stack, index)
        for stack, layers in stacks.items()
        for index, layer in enumerate(layers)
        if layer.gradient_checkpointing
    }


@pytest.mark.parametrize("policy", ["full", "encoder", "every-2"])
@pytest.mark.parametrize("mode", ["full", "lora", "freeze-encoder"])
def test_prepare_model_and_the_planner_checkpoint_the_same_layers(mode, policy):
    """`checkpointed_layers` is the one place that picks a policy's layers: the flags that
    `prepare_model` sets are exactly its answer, and `checkpointing_policy` (the planner's
    temporary switch) sets the same flags and restores the old ones afterwards."""
    prepared = prepare_model(
        fresh_short_whisper(), mode=mode, checkpointing=policy, lora=SMALL_LORA
    )
    whisper = whisper_of(prepared)
    chosen = checkpointed_layers(whisper, policy)
    assert _flagged_layers(whisper) == chosen
    if mode == "freeze-encoder":  # nothing at or below the encoder trains: never recomputed
        assert all(stack == "decoder" for stack, _ in chosen)
        assert bool(chosen) == (policy != "encoder")
    full = prepare_model(fresh_short_whisper(), mode=mode, checkpointing="full", lora=SMALL_LORA)
    before = _flagged_layers(whisper_of(full))
    with checkpointing_policy(full, policy):
        assert _flagged_layers(whisper_of(full)) == chosen
    assert _flagged_layers(whisper_of(full)) == before


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
    model = fresh_short_whisper()
    model = prepare_model(model, mode="freeze-encoder")
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    by_decay = {g["weight_decay"]: g["params"] for g in optimizer.param_groups}
    assert all(p.ndim >= 2 for p in by_decay[0.1]) and all(p.ndim < 2 for p in by_decay[0.0])
    optimised = {id(p) for group in optimizer.param_groups for p in group["params"]}
    frozen = {id(p) for p in model.model.encoder.parameters()}
    assert not optimised & frozen
    assert len(optimised) == sum(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_the_encoder_steps_at_its_own_rate(mode):
    # AdamW's first step moves each weight by lr |g| / (|g| + eps) (no decay here): lr itself
    # wherever a gradient is far above eps = 1e-8, so the largest move in each part is its rate,
    # to float32 rounding of weights below ~10 (1e-6 of a 1e-3 move: rel 1e-3 is ample).
    # Wrapped by peft (LoRA) the encoder's names gain a prefix; its adapters step at its rate.
    model = prepare_model(fresh_short_whisper(), mode=mode, lora=SMALL_LORA).train()
    optimizer = build_optimizer(model, lr=1e-3, encoder_lr_scale=2.5)
    encoder = {id(p) for p in model.get_encoder().parameters() if p.requires_grad}
    for group in optimizer.param_groups:
        in_encoder = {id(p) in encoder for p in group["params"]}
        assert in_encoder == {group["lr"] == 2.5e-3}, group["lr"]
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    training_loss(model, tiny_batch()).backward()
    optimizer.step()
    moved = {"encoder": 0.0, "rest": 0.0}
    for name, p in model.named_parameters():
        if name in before:
            part = "encoder" if id(p) in encoder else "rest"
            moved[part] = max(moved[part], (p.detach() - before[name]).abs().max().item())
    assert moved["encoder"] == pytest.approx(2.5e-3, rel=1e-3)
    assert moved["rest"] == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("name", ["adamw", "adamw-fused", "adamw8bit"])
def test_every_optimizer_trains(name):
    model = fresh_short_whisper()
    model = prepare_model(model, mode="lora", lora=SMALL_LORA).train()
    optimizer = build_optimizer(model, name=name, lr=1e-2)
    batch = {"input_features": torch.randn(1, 80, 100), "labels": torch.tensor([[1000, 50256]])}
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model(**batch).loss.backward()
    optimizer.step()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters() if n in before)


def test_adamw_steps_with_the_fused_kernel_and_torchs_update():
    # The fused kernel and torch's loop compute the same float32 formula,
    # p (1 - lr wd) - lr m^/(sqrt(v^) + eps), each rounding its few operations in its own order
    # (and vector width: AVX2 or AVX-512): from the same gradients they differ by a few ulps of
    # max(|p|, lr). 16 float32 epsilons of that is the bound, as tests/test_gpu.py allows on
    # CUDA; a wrong bias correction, decay or moment is off by ~lr = 1e-2. One step: after it,
    # float noise would enter the gradients too.
    model = prepare_model(fresh_short_whisper(), mode="full").train()
    reference = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    fused = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    assert fused.defaults["fused"] is True
    default = torch.optim.AdamW(
        [
            {"params": [p for p in reference.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in reference.parameters() if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    batch = tiny_batch()
    for net, optimizer in ((model, fused), (reference, default)):
        training_loss(net, batch).backward()
        optimizer.step()
    moved = 0
    for (name, p), q, before in zip(
        model.named_parameters(), reference.parameters(), start, strict=True
    ):
        moved += not torch.equal(p, before)
        bound = 16 * torch.finfo(torch.float32).eps * max(q.abs().max().item(), 1e-2)
        torch.testing.assert_close(p, q, rtol=0, atol=bound, msg=name)
    assert moved == len(start) - 1  # all but the frozen encoder positions stepped


def test_optimizer_errors_name_the_flag(monkeypatch):
    model = fresh_short_whisper()
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    with pytest.raises(UserError, match=r"--optim adamw8bit needs bitsandbytes"):
        build_optimizer(model, name="adamw8bit", lr=1e-3)
    with pytest.raises(UserError, match="--optim sgd"):
        build_optimizer(model, name="sgd", lr=1e-3)
    model.requires_grad_(False)
    with pytest.raises(UserError, match="no trainable parameters"):
        build_optimizer(model, lr=1e-3)


def test_trainable_parameter_summary_counts_what_trains():
    model = fresh_short_whisper()
    prepared = prepare_model(model, mode="lora", lora=SMALL_LORA)
    n_lora = sum(p.numel() for n, p in prepared.named_parameters() if "lora_" in n)
    summary = trainable_parameter_summary(prepared)
    assert f"trainable parameters: {n_lora:,} of" in summary and f"lora {n_lora:,}" in summary


# -- the loss: no full-vocabulary logits ----------------------------------------------------


def _gradients(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


# The chunked loss and the model's own cross-entropy are different computations (logits at label
# positions only, in chunks, summed then divided), so in float32 they agree only up to summation
# order, which differs between CPUs (AVX2 and AVX-512 kernels block matrix products differently:
# 1.5e-5 of a tensor's largest gradient on an AMD EPYC). In float64 the same algebra agrees to
# ~1e-15 relative whatever the kernels; 1e-10 leaves five orders of magnitude for the sums over
# a few thousand terms here, while a wrong token, mask or normalisation is off by 1e-3 or more.
FLOAT64_RTOL, FLOAT64_ATOL = 1e-10, 1e-12


@pytest.mark.parametrize("policy", ["off", "full"])
@pytest.mark.parametrize("mode", ["full", "lora", "freeze-encoder"])
def test_training_loss_equals_the_models_own_loss_and_gradients(mode, policy, monkeypatch):
    """Logits only at label positions, in chunks (3 tokens here, so the 8 labels take three),
    recomputed in backward when checkpointing is on: the same loss and gradients as the
    model's full-vocabulary cross-entropy (in float64, so that only the algebra is compared)."""
    import whisper_train.memory.loss as loss

    monkeypatch.setattr(loss, "LOSS_CHUNK_TOKENS", 3)  # where training_loss reads it
    model = fresh_short_whisper().double()
    model = prepare_model(model, mode=mode, checkpointing=policy, lora=LORA).double().train()
    nonzero_lora_b(model)  # so that every LoRA matrix gets a gradient
    batch = tiny_batch()
    batch["input_features"] = batch["input_features"].double()
    ours = training_loss(model, batch)
    ours.backward()
    our_grads = _gradients(model)
    theirs = model(**batch).loss
    theirs.backward()
    their_grads = _gradients(model)

    assert ours.dtype == theirs.dtype == torch.float64
    torch.testing.assert_close(ours, theirs, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    assert our_grads.keys() == their_grads.keys() == trainable(model)
    for name, grad in our_grads.items():
        torch.testing.assert_close(
            grad, their_grads[name], rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL, msg=name
        )


def test_adapters_on_the_output_head_keep_their_gradient():
    """LoRA on proj_out changes the logits: the loss must come from the model, not the bare
    weight, or the head's adapters would silently get no gradient."""
    settings = LoraSettings(r=4, alpha=8, dropout=0.0, targets=("q_proj", "proj_out"))
    model = nonzero_lora_b(prepare_model(fresh_short_whisper(), mode="lora", lora=settings))
    model.train()
    batch = tiny_batch()
    torch.testing.assert_close(training_loss(model, batch), model(**batch).loss)
    training_loss(model, batch).backward()
    head = [p.grad for n, p in model.named_parameters() if "proj_out.lora" in n]
    assert head and all(grad is not None and grad.abs().sum() > 0 for grad in head)


def test_training_loss_from_cached_encoder_outputs_equals_the_loss_from_audio():
    model = prepare_model(fresh_short_whisper(), mode="freeze-encoder").train()
    batch = tiny_batch()
    with torch.no_grad():
        encoded = model.model.encoder(batch["input_features"]).last_hidden_state
    cached = {k: v for k, v in batch.items() if k != "input_features"}
    cached["encoder_hidden_states"] = encoded
    torch.testing.assert_close(training_loss(model, cached), training_loss(model, batch))


@pytest.mark.parametrize("policy", ["off", "full"])
def test_checkpointed_loss_keeps_no_full_vocabulary_tensor_for_backward(policy):
    """With checkpointing on, the largest tensor a decoder keeps otherwise, the log-softmax over
    the 51,865-token vocabulary at every label token, is recomputed in backward instead."""
    model = prepare_model(fresh_short_whisper(), mode="full", checkpointing=policy).train()
    vocab = model.config.vocab_size
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved_shapes = {}  # storage → shape: log_softmax and nll_loss save the same tensor

    def pack(tensor):
        storage = tensor.untyped_storage().data_ptr()
        if storage not in parameters:
            saved_shapes[storage] = tuple(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = training_loss(model, tiny_batch())
    vocabulary_sized = [s for s in saved_shapes.values() if s and s[-1] == vocab]
    if policy == "off":  # the contrast that shows the probe sees it: kept, one row per label
        assert vocabulary_sized == [(8, vocab)]
    else:
        assert vocabulary_sized == []
    loss.backward()  # and backward still runs: the chunks are recomputed
    assert model.proj_out.weight.grad is not None


# -- LoRA with the encoder cache: adapters on the decoder only. The cache computes
# each clip's encoder output once, without gradient: encoder adapters would never train.


@pytest.mark.compat  # adapters placed by name: peft 0.13 has no exclude_modules
def test_lora_on_cached_encoder_outputs_trains_every_trainable_parameter():
    from whisper_train.config import RunConfig

    config = RunConfig.from_flat({"mode": "lora", "cache_encoder": True, "lora_dropout": 0.0})
    lora = dataclasses.replace(record_of(config).model.lora, r=4, alpha=8)
    model = nonzero_lora_b(prepare_model(fresh_short_whisper(), mode="lora", lora=lora))
    names = trainable(model)
    assert names and not any(".encoder." in f".{n}" for n in names)
    # The decoder's cross-attention keeps its adapters: it is the decoder's.
    assert any(".encoder_attn.q_proj.lora_" in n for n in names)
    assert any(".self_attn.v_proj.lora_" in n for n in names)
    # A step on cached encoder outputs, as the training loop runs it (`loss_terms`).
    batch = tiny_batch()
    with torch.no_grad():
        cached = whisper_of(model).model.encoder(batch.pop("input_features")).last_hidden_state
    batch["encoder_hidden_states"] = cached.half()  # as the cache stores them
    training_loss(model, batch).backward()
    grads = trainable_gradients(model)
    assert [n for n, g in grads.items() if g is None or not g.abs().sum() > 0] == []
    # Without the cache, the adapters go on the encoder too.
    uncached = record_of(RunConfig.from_flat({"mode": "lora"})).model.lora
    assert uncached.decoder_only is False and uncached.targets == LoraSettings().targets
