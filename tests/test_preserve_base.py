"""`--preserve-base WEIGHT`: KL(p_base || p_trained) at label positions, added to the loss.

The starting model is the teacher: a frozen copy for full fine-tuning (the decoder and head only
with a frozen encoder), the same weights with adapters disabled for LoRA. Weight 0 must leave the
loss and gradients bit-identical; the term must be zero where nothing has trained yet, equal the
naive full-vocabulary computation elsewhere, and keep the loss's memory discipline (no
(tokens x vocabulary) tensor kept for backward under checkpointing).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import metric_rows
from tiny_models import LORA, fresh_short_whisper, nonzero_lora_b, pristine, tiny_batch

from whisper_train.data.collate import IGNORE_INDEX
from whisper_train.errors import UserError
from whisper_train.memory import (
    BasePreservation,
    LoraSettings,
    loss_terms,
    prepare_model,
    training_loss,
    whisper_of,
)

MODES = ("full", "lora", "freeze-encoder")
WEIGHT = 0.7  # not 1: a loss that forgot the weight, or applied it twice, is caught
# LoRA on the output head too: the loss cannot defer the projection and takes full logits.
HEAD_LORA = LoraSettings(r=4, alpha=8, dropout=0.0, targets=("q_proj", "proj_out"))

# As in test_memory.py: in float64 the chunked computation and the naive one agree to ~1e-15
# relative whatever the CPU's kernels; 1e-10 leaves five orders of magnitude for sums over a few
# thousand terms, while a wrong token, mask, direction or normalisation is off by 1e-3 or more.
FLOAT64_RTOL, FLOAT64_ATOL = 1e-10, 1e-12


def prepared(mode: str, policy: str = "off", *, dtype=torch.float32, lora=LORA):
    """(model prepared for `mode`, in training mode; its BasePreservation at WEIGHT), built as
    the recipe builds them: preservation right after prepare_model, before any training."""
    model = fresh_short_whisper().to(dtype)
    torch.manual_seed(1)  # LoRA A initialisation: two builds are the same model
    model = prepare_model(model, mode=mode, checkpointing=policy, lora=lora).to(dtype).train()
    return model, BasePreservation.from_model(model, WEIGHT)


def trained_away(model: torch.nn.Module, *, seed: int = 3) -> torch.nn.Module:
    """Move the trained weights off the starting ones, as some training steps would: non-zero
    LoRA B matrices, or seeded noise on every trainable weight."""
    if any("lora_" in name for name, _ in model.named_parameters()):
        return nonzero_lora_b(model, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float64)
                param.add_(0.05 * noise.to(param.dtype))
    return model


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def trainable(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def modes_of(model: torch.nn.Module) -> list[bool]:
    return [module.training for module in model.modules()]


@pytest.mark.parametrize("policy", ["off", "full"])
@pytest.mark.parametrize("mode", MODES)
def test_weight_zero_is_the_plain_loss_bit_for_bit(mode, policy):
    """Weight 0 takes the plain path: the same loss and gradients, to the bit, and no copy."""
    model, _ = prepared(mode, policy)
    trained_away(model)
    batch = tiny_batch()
    plain = training_loss(model, batch)
    plain.backward()
    plain_grads = gradients(model)
    zero = BasePreservation.from_model(model, 0.0)
    assert zero.reference is None and zero.extra_bytes == 0
    terms = loss_terms(model, batch, preserve=zero)
    assert terms.divergence is None and terms.loss is terms.cross_entropy
    with_zero = training_loss(model, batch, preserve=zero)
    with_zero.backward()
    zero_grads = gradients(model)

    assert torch.equal(with_zero, plain) and torch.equal(terms.loss, plain)
    assert zero_grads.keys() == plain_grads.keys() == trainable(model)
    unequal = [n for n, g in zero_grads.items() if not torch.equal(g, plain_grads[n])]
    assert not unequal, unequal[:5]


@pytest.mark.parametrize("mode", MODES)
def test_nothing_trained_yet_means_no_divergence_and_no_gradient_from_it(mode):
    """At step 0 the trained model is the base: KL 0, and a gradient of (rounding) zero."""
    model, preserve = prepared(mode, "full")
    terms = loss_terms(model, tiny_batch(), preserve=preserve)
    # Both sides run the same float32 kernels on the same weights and inputs, so the log-
    # probabilities are equal and the KL is exactly 0 here; 1e-6 allows another kernel order
    # for a side (a rounding of 1e-7 relative in log-probabilities of magnitude ~11 gives a
    # KL of ~1e-12 at most), while the smallest perturbation below gives ~1e-2.
    assert abs(terms.divergence.item()) <= 1e-6
    torch.testing.assert_close(terms.loss, terms.cross_entropy, rtol=0, atol=1e-6)
    terms.divergence.backward(retain_graph=True)
    divergence_grads = gradients(model)
    terms.cross_entropy.backward()
    scale = max(g.abs().max() for g in gradients(model).values())
    # The KL's gradient on the logits is p_trained - p_base * sum(p_base), where the sum is 1 to
    # within float32 rounding (1.2e-7 an ulp, a few ulps over the vocabulary): what reaches the
    # weights is rounding, 1e-6 of the cross-entropy's own gradient at most (measured: 2e-9).
    assert divergence_grads.keys() == trainable(model)
    for name, grad in divergence_grads.items():
        assert grad.abs().max() <= 1e-6 * scale, name


@pytest.mark.parametrize(
    ("mode", "policy", "lora"),
    [
        ("full", "off", LORA),
        ("full", "full", LORA),
        ("lora", "off", LORA),
        ("lora", "full", LORA),
        ("freeze-encoder", "off", LORA),
        ("freeze-encoder", "full", LORA),
        ("lora", "off", HEAD_LORA),  # full-vocabulary logits: adapters on the head
    ],
    ids=["full", "full-checkpointed", "lora", "lora-checkpointed", "freeze-encoder",
         "freeze-encoder-checkpointed", "lora-on-the-head"],
)  # fmt: skip
def test_the_divergence_equals_the_naive_full_vocabulary_one(mode, policy, lora, monkeypatch):
    """Once trained away from the base, the KL is positive and, with the cross-entropy, the loss
    and every gradient equal those computed naively from full-vocabulary logits of the model and
    an untouched copy of the starting model (in float64, so that only the algebra is compared).
    Chunks of 3 tokens, so the 8 labels take three."""
    import whisper_train.memory.loss as loss

    monkeypatch.setattr(loss, "LOSS_CHUNK_TOKENS", 3)  # where the loss reads it
    model, preserve = prepared(mode, policy, dtype=torch.float64, lora=lora)
    trained_away(model)
    batch = tiny_batch()
    batch["input_features"] = batch["input_features"].double()
    terms = loss_terms(model, batch, preserve=preserve)
    terms.loss.backward()
    our_grads = gradients(model)

    base = copy.deepcopy(pristine()).double().eval()
    with torch.no_grad():
        base_logits = base(**batch).logits
    output = model(**batch)
    keep = batch["labels"] != IGNORE_INDEX
    log_q = torch.log_softmax(output.logits[keep], dim=-1)  # trained
    log_p = torch.log_softmax(base_logits[keep], dim=-1)  # base: the teacher
    naive_divergence = (log_p.exp() * (log_p - log_q)).sum(dim=-1).mean()
    naive_loss = output.loss + WEIGHT * naive_divergence
    naive_loss.backward()
    naive_grads = gradients(model)

    assert terms.loss.dtype == torch.float64
    assert terms.divergence > 1e-3  # a real divergence, far from rounding
    for ours, theirs in [
        (terms.divergence, naive_divergence),
        (terms.cross_entropy, output.loss),
        (terms.loss, naive_loss),
    ]:
        torch.testing.assert_close(ours, theirs, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    assert our_grads.keys() == naive_grads.keys() == trainable(model)
    for name, grad in our_grads.items():
        torch.testing.assert_close(
            grad, naive_grads[name], rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL, msg=name
        )


def test_lora_uses_its_own_weights_with_adapters_disabled_not_a_copy():
    """For LoRA the base is the model itself with the adapters off: nothing is copied, and the
    result is that of a deep-copied base. The model comes back as it went in: adapters on and
    trainable, every module in its own training mode."""
    model, preserve = prepared("lora")
    trained_away(model)
    assert preserve.reference is None and preserve.extra_bytes == 0
    # The object holds a float and flags: no module, no tensor, so no second set of weights.
    held = list(vars(preserve).values())
    assert not any(isinstance(value, (torch.nn.Module, torch.Tensor)) for value in held), held

    before = (trainable(model), modes_of(model))
    batch = tiny_batch()
    ours = loss_terms(model, batch, preserve=preserve)
    ours.loss.backward()
    our_grads = gradients(model)
    assert (trainable(model), modes_of(model)) == before

    copied = BasePreservation.from_model(fresh_short_whisper(), WEIGHT)  # a frozen full copy
    assert copied.reference is not None and copied.extra_bytes > 0
    theirs = loss_terms(model, batch, preserve=copied)
    theirs.loss.backward()
    their_grads = gradients(model)

    # The base layers run the same kernels on the same weights either way: equal to the bit.
    assert ours.divergence > 1e-3
    assert torch.equal(ours.divergence, theirs.divergence)
    assert torch.equal(ours.loss, theirs.loss)
    assert our_grads.keys() == their_grads.keys() == trainable(model)
    assert all(torch.equal(g, their_grads[n]) for n, g in our_grads.items())


@pytest.mark.parametrize("mode", MODES)
def test_checkpointing_changes_memory_not_gradients(mode):
    """Under the "full" policy the loss chunks (both models' logits) are recomputed in backward:
    the same loss and gradients as without checkpointing, to the bit (the same kernels in the
    same order on one machine)."""
    runs = {}
    for policy in ("off", "full"):
        model, preserve = prepared(mode, policy)
        trained_away(model)
        loss = training_loss(model, tiny_batch(), preserve=preserve)
        loss.backward()
        runs[policy] = loss.detach(), gradients(model)
    (loss_off, grads_off), (loss_full, grads_full) = runs["off"], runs["full"]
    assert torch.equal(loss_off, loss_full)
    assert grads_off.keys() == grads_full.keys()
    unequal = [n for n, g in grads_full.items() if not torch.equal(g, grads_off[n])]
    assert not unequal, unequal[:5]


@pytest.mark.parametrize("policy", ["off", "full"])
@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_preservation_keeps_no_full_vocabulary_tensor_for_backward(mode, policy):
    """The base's logits too exist one chunk at a time and are never kept: with checkpointing
    on, nothing of the vocabulary's size is saved for backward (the probe of test_memory.py)."""
    model, preserve = prepared(mode, policy)
    trained_away(model)
    vocab = model.config.vocab_size
    weights = [*model.parameters()]
    if preserve.reference is not None:
        weights += [*preserve.reference.parameters()]
    parameters = {p.untyped_storage().data_ptr() for p in weights}
    saved_shapes = {}  # storage → shape: log_softmax and nll_loss save the same tensor

    def pack(tensor):
        storage = tensor.untyped_storage().data_ptr()
        if storage not in parameters:
            saved_shapes[storage] = tuple(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = training_loss(model, tiny_batch(), preserve=preserve)
    vocabulary_sized = [s for s in saved_shapes.values() if s and s[-1] == vocab]
    if policy == "off":  # the contrast that shows the probe sees them: one row per label
        assert vocabulary_sized and set(vocabulary_sized) == {(8, vocab)}
    else:
        assert vocabulary_sized == []
    loss.backward()  # and backward still runs: the chunks are recomputed
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_frozen_encoder_is_shared_and_its_cached_outputs_reused():
    """With the encoder frozen the reference copies the decoder and head only, shares the
    encoder, and with cached encoder outputs runs no encoder at all: the same terms as from
    audio. The trained model's modules keep their training mode."""
    model, preserve = prepared("freeze-encoder")
    trained_away(model)
    whisper, reference = whisper_of(model), preserve.reference
    assert reference.model.encoder is whisper.model.encoder
    decoder = {id(p) for p in whisper.model.decoder.parameters()}
    assert not decoder & {id(p) for p in reference.parameters()}
    full_copy = BasePreservation.from_model(prepare_model(fresh_short_whisper()), WEIGHT)
    encoder_bytes = sum(p.numel() * p.element_size() for p in whisper.model.encoder.parameters())
    assert preserve.extra_bytes == full_copy.extra_bytes - encoder_bytes

    encoder_runs = []
    hook = whisper.model.encoder.register_forward_hook(lambda *_: encoder_runs.append(1))
    batch = tiny_batch()
    modes = modes_of(model)
    from_audio = loss_terms(model, batch, preserve=preserve)
    # One encoder pass: the base's decoder reads the trained side's outputs of the shared encoder.
    assert len(encoder_runs) == 1 and modes_of(model) == modes
    with torch.no_grad():
        encoded = whisper.model.encoder(batch["input_features"]).last_hidden_state
    cached = {k: v for k, v in batch.items() if k != "input_features"}
    cached["encoder_hidden_states"] = encoded
    encoder_runs.clear()
    from_cache = loss_terms(model, cached, preserve=preserve)
    hook.remove()
    assert encoder_runs == []
    for ours, theirs in zip(from_cache, from_audio, strict=True):
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("mode", MODES)
def test_the_base_runs_in_the_trained_forwards_autocast(mode):
    """Mixed precision as accelerate does it: the prepared model's forward runs under autocast
    and hands back float32 (the wrapping below is accelerate's `prepare_model`'s). A copy is
    not wrapped, so it takes the dtype from `autocast_dtype`; LoRA's base runs through the
    wrapped forward itself. Same dtype, same kernels: at step 0 the KL is exactly 0, where a
    float32 teacher differs from the bf16 student by rounding alone."""
    from accelerate.utils import convert_outputs_to_fp32

    divergences = {}
    for autocast_dtype in (None, torch.bfloat16):
        model = prepared(mode, "full")[0]
        preserve = BasePreservation.from_model(model, WEIGHT, autocast_dtype=autocast_dtype)
        bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
        model.forward = convert_outputs_to_fp32(bf16(model.forward))
        terms = loss_terms(model, tiny_batch(), preserve=preserve)
        terms.loss.backward()  # and the mixed-dtype chunks backpropagate
        divergences[autocast_dtype] = terms.divergence.item()
    assert divergences[torch.bfloat16] == 0.0
    if mode == "lora":
        assert divergences[None] == 0.0
    else:
        # Not the exact zero of matched kernels. Its sign is not asserted: for this near-uniform
        # random model the KL is as small as float32's rounding of its sum over 51,865 tokens
        # (an AMD EPYC with native bf16 dot products, AVX512-BF16, gave -1.3e-7 nats).
        assert divergences[None] != 0.0


def test_the_reference_follows_the_model_to_its_dtype():
    """Built before the model moved or was cast (accelerator.prepare comes later), the copy
    follows it on first use."""
    model, preserve = prepared("full")
    model.double()
    batch = tiny_batch()
    batch["input_features"] = batch["input_features"].double()
    terms = loss_terms(model, batch, preserve=preserve)
    assert preserve.reference.proj_out.weight.dtype == torch.float64
    assert terms.divergence.dtype == torch.float64 and terms.divergence.item() == 0.0


def test_a_copy_is_made_before_accelerate_wraps_the_forward():
    """After accelerator.prepare the forward is accelerate's, bound to the original model: a
    copy would run the original. Refused with the order to follow."""
    from accelerate.utils import convert_outputs_to_fp32

    model = prepared("full")[0]
    model.forward = convert_outputs_to_fp32(model.forward)
    with pytest.raises(ValueError, match="before accelerator.prepare"):
        BasePreservation.from_model(model, WEIGHT)


@pytest.mark.parametrize("weight", [-0.1, float("nan"), float("inf")])
def test_a_weight_must_be_finite_and_not_negative(weight):
    with pytest.raises(UserError, match="--preserve-base"):
        BasePreservation.from_model(pristine(), weight)


# -- through `whisper-train train` -----------------------------------------------------------


@pytest.mark.long
def test_preserve_base_zero_trains_bit_identically_and_a_weight_changes_training(
    tmp_path, tiny_run_config
):
    from safetensors.torch import load_file

    from whisper_train.training.train import train

    def run(name, **overrides):
        # Unpacked, as --packing auto trains --preserve-base (its frozen copy decodes windows).
        config = tiny_run_config(output_dir=str(tmp_path / name), packing="off", **overrides)
        result = train(config)
        losses = [row["loss"] for row in metric_rows(result.output_dir) if "loss" in row]
        return losses, load_file(result.final_dir / "model.safetensors")

    plain_losses, plain = run("plain")
    zero_losses, zero = run("zero", preserve_base=0.0)
    kept_losses, kept = run("kept", preserve_base=1.0)
    assert zero_losses == plain_losses
    assert all(torch.equal(zero[name], tensor) for name, tensor in plain.items())
    # At step 1 the model is the base (KL 0, the same cross-entropy); the update differs.
    assert kept_losses[0] == plain_losses[0] and kept_losses[1:] != plain_losses[1:]
    assert any(not torch.equal(kept[name], tensor) for name, tensor in plain.items())
