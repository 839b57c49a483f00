"""Gradient checkpointing changes memory, never gradients: the parity matrix.

For every training mode (full, LoRA wrapped by prepare_model, LoRA wrapped by the caller first,
frozen encoder) x checkpointing policy (full, encoder, every-2) x attention (sdpa, eager), one
backward on a seeded tiny Whisper must give exactly the gradients of the same step without
checkpointing; recomputation must really have happened; forward hooks must not replay; and a
training step and generate() must work afterwards. `make test-compat` runs this module again on
transformers 4.56.2, the release where the stock recipe fails (docs/checkpointing.md, T1/T2).
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from tiny_models import (
    LORA,
    fresh_short_whisper,
    nonzero_lora_b,
    short_tiny_whisper,
    tiny_batch,
    trainable_gradients,
)

from whisper_train.doctor import hooks_replay_on_recompute
from whisper_train.memory import (
    build_optimizer,
    checkpointing_state,
    prepare_model,
    training_loss,
)

pytestmark = pytest.mark.compat


def build(variant: str, policy: str, attn: str) -> torch.nn.Module:
    """A seeded tiny Whisper prepared for `variant`; LoRA B matrices made non-zero so that the
    A matrices get non-zero gradients too (peft initialises B to zero)."""
    model = fresh_short_whisper(attn)
    torch.manual_seed(1)  # LoRA A initialisation
    if variant == "lora-before":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=LORA.r,
                lora_alpha=LORA.alpha,
                lora_dropout=LORA.dropout,
                target_modules=list(LORA.targets),
            ),
        )
        model = prepare_model(model, mode="lora", checkpointing=policy)
    else:
        mode = "lora" if variant == "lora-after" else variant
        model = prepare_model(model, mode=mode, checkpointing=policy, lora=LORA)
    return nonzero_lora_b(model).train()


def layer_stacks(model):
    whisper = model.get_base_model() if hasattr(model, "get_base_model") else model
    return whisper.model.encoder.layers, whisper.model.decoder.layers


def backward_once(model: torch.nn.Module, batch) -> dict:
    """One forward + backward; counts each layer's forward pre-hooks and forward hooks, and the
    forwards of a linear inside it (which runs again when the layer is recomputed)."""
    counts: dict[str, dict[int, int]] = {"pre": {}, "post": {}, "inner": {}}

    def count(kind, key, *_):
        counts[kind][key] = counts[kind].get(key, 0) + 1

    handles = []
    for stack in layer_stacks(model):
        for layer in stack:
            key = id(layer)
            handles += [
                layer.register_forward_pre_hook(functools.partial(count, "pre", key)),
                layer.register_forward_hook(functools.partial(count, "post", key)),
                layer.fc1.register_forward_hook(functools.partial(count, "inner", key)),
            ]
    loss = training_loss(model, batch)  # what training runs: the loss is recomputed too
    loss.backward()
    for handle in handles:
        handle.remove()
    grads = trainable_gradients(model)
    return {"loss": loss.detach(), "grads": grads, **counts}


@functools.cache
def reference(variant: str, attn: str) -> dict:
    """The same step without checkpointing."""
    return backward_once(build(variant, "off", attn), tiny_batch())


VARIANTS = ("full", "lora-after", "lora-before", "freeze-encoder")
POLICIES = ("full", "encoder", "every-2")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpointing_gives_the_reference_gradients(variant, policy, attn):
    model = build(variant, policy, attn)
    state = checkpointing_state(model)
    assert all(reentrant is False for reentrant in state["use_reentrant"].values()), state
    run = backward_once(model, tiny_batch())
    ref = reference(variant, attn)

    # Every trainable parameter got a gradient; None would be the silent T2 failure.
    missing = [name for name, grad in run["grads"].items() if grad is None]
    assert not missing, f"no gradient for {missing[:5]}"
    nonzero = {name for name, grad in run["grads"].items() if grad.abs().sum() > 0}
    ref_nonzero = {name for name, grad in ref["grads"].items() if grad.abs().sum() > 0}
    assert nonzero == ref_nonzero
    if variant.startswith("lora"):
        assert any("lora_A" in n for n in nonzero) and any("lora_B" in n for n in nonzero)
    # Bitwise on any CPU: both runs use this machine's kernels, and the recompute runs the same
    # ops on the same inputs in the same order, so not even summation order can differ.
    assert torch.equal(run["loss"], ref["loss"])
    unequal = [n for n, g in run["grads"].items() if not torch.equal(g, ref["grads"][n])]
    assert not unequal, f"gradients differ from no-checkpointing for {unequal[:5]}"

    # Recompute really happened on exactly the checkpointed layers, and nowhere else.
    checkpointed = {
        id(module) for name, module in model.named_modules() if name in state["modules"]
    }
    encoder_layers, decoder_layers = layer_stacks(model)
    for layer in [*encoder_layers, *decoder_layers]:
        expected = 2 if id(layer) in checkpointed else 1
        assert run["inner"][id(layer)] == expected
        # Forward hooks run once per call. transformers >= 5 checkpoints `forward`, leaving a
        # layer's hooks outside; 4.x checkpoints `__call__`, so pre-hooks replay on recompute
        # (T8, which doctor reports); torch's early stop ends the recompute before post-hooks.
        replays = hooks_replay_on_recompute() and id(layer) in checkpointed
        assert run["post"][id(layer)] == 1
        assert run["pre"][id(layer)] == (2 if replays else 1)
    if not (variant == "freeze-encoder" and policy == "encoder"):
        assert checkpointed, "the policy checkpointed nothing"


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_training_step_and_generate_work_after_a_checkpointed_backward(variant):
    model = build(variant, "every-2", "sdpa")
    backward_once(model, tiny_batch())
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    build_optimizer(model, lr=1e-2).step()
    changed = [
        n for n, p in model.named_parameters() if n in before and not torch.equal(before[n], p)
    ]
    assert changed, "the optimizer step changed no weight"
    if variant == "freeze-encoder":
        assert not any(".encoder." in n for n in changed)
    model.eval()
    with torch.no_grad():
        generated = model.generate(input_features=tiny_batch()["input_features"], max_new_tokens=3)
    # A decoder start token plus up to 3 new tokens per utterance.
    assert generated.shape[0] == 2 and 2 <= generated.shape[1] <= 4


@pytest.mark.parametrize("variant", ["full", "lora-after"])
def test_every_policy_checkpoints_what_it_names(variant):
    """3+3 layers: full → all six, encoder → the encoder's three, every-2 → layers 0 and 2."""
    expected = {
        "full": {
            "encoder.layers.0",
            "encoder.layers.1",
            "encoder.layers.2",
            "decoder.layers.0",
            "decoder.layers.1",
            "decoder.layers.2",
        },
        "encoder": {"encoder.layers.0", "encoder.layers.1", "encoder.layers.2"},
        "every-2": {"encoder.layers.0", "encoder.layers.2", "decoder.layers.0", "decoder.layers.2"},
    }
    for policy, names in expected.items():
        model, _ = short_tiny_whisper(encoder_layers=3, decoder_layers=3)
        mode = "lora" if variant == "lora-after" else "full"
        model = prepare_model(model, mode=mode, checkpointing=policy, lora=LORA)
        got = {
            re.search(r"(en|de)coder\.layers\.\d+$", name).group(0)
            for name in checkpointing_state(model)["modules"]
        }
        assert got == names, policy
