"""The cross-attention on cached encoder outputs in its folded order (`memory.cross_attention`)
gives the layer's own loss and gradients, and steps aside wherever it would not be cheaper."""

from __future__ import annotations

import pytest
import torch
from tiny_models import LORA, cached_batch, fresh_short_whisper

from whisper_train.memory import cross_attention, prepare_model, training_loss

# The folded order stands in for transformers' own attention module, whose forward's arguments
# differ between releases: checked on the lowest supported one too (`make test-compat`).
pytestmark = pytest.mark.compat


def _loss_and_gradients(model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = training_loss(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _spy_on_folding(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = cross_attention._folded

    def folded(attention, hidden_states, encoder_states):
        calls.append(hidden_states.shape[1])
        return real(attention, hidden_states, encoder_states)

    monkeypatch.setattr(cross_attention, "_folded", folded)
    return calls


@pytest.mark.parametrize("mode", ["freeze-encoder", "full"])
def test_folded_order_gives_the_layers_own_loss_and_gradients(monkeypatch, mode):
    # float64: the two orders differ only by rounding, ~1e-16 relative a product here; 1e-10 is
    # far above that and far below any difference in what is computed (a wrong head split, a
    # missing bias or scale moves losses and gradients by 1e-3 and more).
    model = prepare_model(fresh_short_whisper().double(), mode=mode).train()
    batch = cached_batch(model)
    calls = _spy_on_folding(monkeypatch)
    # The reference: the encoder runs (input features), so the layers' own forward attends.
    reference_loss, reference = _loss_and_gradients(
        model, {k: v for k, v in batch.items() if k != "encoder_hidden_states"}
    )
    assert calls == []
    cached = {k: v for k, v in batch.items() if k != "input_features"}
    loss, grads = _loss_and_gradients(model, cached)

    assert calls == [5] * model.config.decoder_layers  # every layer folded, 5 decoder inputs
    torch.testing.assert_close(loss, reference_loss, rtol=1e-10, atol=0)
    # Cached outputs are constants: the encoder gets no gradient from them.
    decoder_names = {
        n for n in reference if n.startswith("model.decoder.") or n == "proj_out.weight"
    }
    assert set(grads) == decoder_names
    for name in decoder_names:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-10, atol=1e-13, msg=name)


def test_layers_recomputed_under_checkpointing_keep_their_own_order(monkeypatch):
    # Checkpointing runs a layer's forward again in backward, after the loss's forward (and the
    # folding) is over: a folded forward then recomputed in the layer's own order saves other
    # tensors, which torch refuses. Recomputed layers are left whole; the rest still fold.
    calls = _spy_on_folding(monkeypatch)
    model = prepare_model(
        fresh_short_whisper().double(), mode="freeze-encoder", checkpointing="full"
    )
    batch = cached_batch(model.train())
    reference_loss, reference = _loss_and_gradients(
        model, {k: v for k, v in batch.items() if k != "encoder_hidden_states"}
    )
    loss, grads = _loss_and_gradients(
        model, {k: v for k, v in batch.items() if k != "input_features"}
    )

    assert calls == []
    torch.testing.assert_close(loss, reference_loss, rtol=1e-10, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-10, atol=1e-13, msg=name)
    with torch.no_grad():  # evaluation recomputes nothing: it folds
        training_loss(model, {k: v for k, v in batch.items() if k != "input_features"})
    assert calls == [5] * model.config.decoder_layers


def test_long_labels_and_adapters_keep_the_layers_own_order(monkeypatch):
    calls = _spy_on_folding(monkeypatch)
    model = prepare_model(fresh_short_whisper(), mode="freeze-encoder").train()
    # 50 encoder positions (the 1-second model), d_model 64, 4 heads: folding multiplies less
    # only below 50 * 64 / (64 + 3 * 50) = 14.9 label tokens.
    assert cross_attention.folded_cost_is_lower(14, 50, 64, 4)
    assert not cross_attention.folded_cost_is_lower(15, 50, 64, 4)
    training_loss(
        model, {k: v for k, v in cached_batch(model, tokens=20).items() if k != "input_features"}
    )
    assert calls == []
    # Adapters on the value projection: the layer's own forward, with its adapters.
    lora = prepare_model(fresh_short_whisper(), mode="lora", lora=LORA).train()
    training_loss(lora, {k: v for k, v in cached_batch(lora).items() if k != "input_features"})
    assert calls == []
    # After the forward, the layers are their own again.
    attention = model.model.decoder.layers[0].encoder_attn
    assert "forward" not in vars(attention)


@pytest.mark.parametrize(
    ("d_model", "heads", "largest_folded"),
    [(384, 6, 73), (768, 12, 66), (1280, 20, 64)],  # tiny, small, large-v3
)
def test_every_whisper_size_folds_labels_up_to_about_64_tokens(d_model, heads, largest_folded):
    assert cross_attention.folded_cost_is_lower(largest_folded, 1500, d_model, heads)
    assert not cross_attention.folded_cost_is_lower(largest_folded + 1, 1500, d_model, heads)
