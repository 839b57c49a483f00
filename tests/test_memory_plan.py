"""The memory estimate matches what autograd really keeps, and the planner picks what fits."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_whisper

from whisper_train import memory
from whisper_train.errors import UserError
from whisper_train.memory import plan as planner

LABEL_TOKENS = 20
POLICIES = ("off", "every-2", "encoder", "full")


def _prepared(mode: str, **dims):
    model, _ = make_tiny_whisper(**dims)
    # Checkpointing enabled once (as training does); each policy then narrows the layer flags.
    return memory.prepare_model(model, mode=mode, checkpointing="full")


def _batch(model, batch_size: int, label_tokens: int = LABEL_TOKENS):
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(batch_size, model.config.num_mel_bins, 3000, generator=generator)
    tokens = torch.randint(0, 50000, (batch_size, label_tokens), generator=generator)
    return features, tokens


@pytest.mark.parametrize(
    "mode, attention",
    [("full", "sdpa"), ("freeze-encoder", "sdpa"), ("lora", "sdpa"), ("full", "eager")],
)
def test_counted_activations_match_measured_saved_tensors_for_every_policy(mode, attention):
    model = _prepared(mode, attn_implementation=attention)
    features, tokens = _batch(model, batch_size=2)
    measured = {}
    policies = POLICIES if attention == "sdpa" else ("off", "full")
    for policy in policies:
        with memory.checkpointing_policy(model, policy):
            measured[policy] = planner.probe_saved_bytes(model, features, tokens)
        per_sample = planner.count_saved_bytes(model, policy=policy, label_tokens=LABEL_TOKENS)
        counted = 2 * per_sample["device"]
        assert counted == pytest.approx(measured[policy], rel=0.15), policy
    # The probe really saw checkpointing act: each stronger policy keeps less.
    if mode != "freeze-encoder" and attention == "sdpa":  # a frozen encoder is never checkpointed
        assert measured["off"] > measured["every-2"] > measured["encoder"] > measured["full"]
    assert measured["full"] < measured["off"]


def test_the_encoders_share_of_the_count_matches_what_its_forward_saves():
    """The part of a sample's count that a second encoder sequence adds (`--packing per-clip`'s
    silence window beside each window) is what the encoder's own forward saves."""
    model = _prepared("full")
    features, _ = _batch(model, batch_size=2)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer and pointer not in parameters:
            kept.setdefault(pointer, tensor.untyped_storage().nbytes())
        return tensor

    with (
        memory.checkpointing_policy(model, "off"),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
    ):
        memory.whisper_of(model).model.encoder(features)
    per_sample = planner.count_saved_bytes(model, policy="off", label_tokens=LABEL_TOKENS)
    assert 0 < per_sample["encoder"] < per_sample["device"]
    assert 2 * per_sample["encoder"] == pytest.approx(sum(kept.values()), rel=0.15)
    # The estimate counts it once more per extra encoder sequence, and only it.
    one = planner.estimate_memory(model, batch_size=1)
    two_encoders = planner.estimate_memory(model, batch_size=1, encoder_rows=2)
    assert two_encoders.activations - one.activations == per_sample["encoder"]
    assert planner.estimate_memory(model, batch_size=2, encoder_rows=2) == (
        planner.estimate_memory(model, batch_size=2)
    )


def test_estimate_terms_follow_mode_and_optimizer():
    full = _prepared("full")
    frozen = _prepared("freeze-encoder")
    adamw = planner.estimate_memory(full, optimizer="adamw")
    eight_bit = planner.estimate_memory(full, optimizer="adamw8bit")
    trainable = sum(p.numel() for p in full.parameters() if p.requires_grad)
    assert adamw.gradients == 4 * trainable
    assert adamw.optimizer == 2 * 4 * trainable  # two float32 moments
    assert eight_bit.optimizer == adamw.optimizer // 4  # two uint8 moments
    assert planner.estimate_memory(frozen).optimizer < adamw.optimizer
    # Activations grow linearly with the batch.
    one = planner.estimate_memory(full, batch_size=1).activations
    four = planner.estimate_memory(full, batch_size=4).activations
    assert four == pytest.approx(4 * one, rel=1e-6)


def test_16_bit_copies_of_frozen_weights_count_only_where_backward_keeps_them():
    """Autocast caches a 16-bit copy of each trained weight for the step; a frozen one (LoRA's
    base) is kept only by a layer backward does not recompute. On an H200, counting every
    frozen copy put large-v3 LoRA under full checkpointing 40% over its measured peak."""
    lora = _prepared("lora")
    matrices = [p for p in lora.parameters() if p.ndim >= 2]
    trained = 2 * sum(p.numel() for p in matrices if p.requires_grad)
    frozen = 2 * sum(p.numel() for p in matrices if not p.requires_grad)
    assert trained and frozen

    def working(policy: str, precision: str) -> int:
        return planner.estimate_memory(lora, policy=policy, precision=precision).working

    def saved_working(policy: str, half: bool) -> int:
        return planner.count_saved_bytes(
            lora, policy=policy, label_tokens=planner.MAX_DECODER_TOKENS, half=half
        )["working"]

    # Each 16-bit working set is its saved-working term plus the copies it keeps.
    assert working("full", "bf16") - saved_working("full", True) == trained
    assert working("off", "bf16") - saved_working("off", True) == trained + frozen
    assert working("encoder", "bf16") - saved_working("encoder", True) == trained + frozen
    assert working("full", "fp32") == saved_working("full", False)  # no autocast, no copies


def test_probe_calibration_is_close_to_one_for_whisper_layers():
    model = _prepared("full")
    assert planner.calibrate(model, label_tokens=16) == pytest.approx(1.0, abs=0.15)


def test_planner_picks_off_when_the_budget_is_huge():
    plan = planner.plan_checkpointing(
        _prepared("full"),
        mode="full",
        batch_size=4,
        max_memory_bytes=64 * 2**30,
        label_tokens=LABEL_TOKENS,
    )
    assert (plan.policy, plan.offload) == ("off", False)
    assert "-> off" in plan.table


def test_planner_checkpoints_everything_when_the_budget_is_tight():
    model = _prepared("full")
    kwargs = dict(batch_size=4, label_tokens=LABEL_TOKENS)
    full = planner.estimate_memory(model, policy="full", **kwargs).total
    encoder_only = planner.estimate_memory(model, policy="encoder", **kwargs).total
    budget = (full + encoder_only) // 2  # fits full checkpointing, not encoder-only
    plan = planner.plan_checkpointing(
        model, mode="full", max_memory_bytes=budget, probe=False, **kwargs
    )
    assert plan.policy == "full" and plan.estimate_bytes <= budget
    # And what training would really keep under that policy fits the budget too.
    features, tokens = _batch(model, batch_size=4)
    with memory.checkpointing_policy(model, plan.policy):
        saved = planner.probe_saved_bytes(model, features, tokens)
    fixed = plan.estimates["full"]
    assert fixed.weights + fixed.gradients + fixed.optimizer + saved <= budget


def test_planner_refuses_when_nothing_fits_and_says_what_would():
    with pytest.raises(UserError) as caught:
        planner.plan_checkpointing(
            _prepared("full"),
            mode="full",
            batch_size=2,
            max_memory_bytes=2**20,
            label_tokens=LABEL_TOKENS,
            probe=False,
        )
    message = str(caught.value)
    assert "--max-memory" in message and "needs" in message and "--batch-size" in message
    assert "\n" not in message


def test_flop_formula_matches_the_published_figure_for_whisper_small():
    from transformers import WhisperConfig

    small = WhisperConfig(d_model=768, encoder_layers=12, decoder_layers=12, vocab_size=51865)
    # docs/compute.md: ~1.2 TFLOP per training sample at T = 64 (3 x forward), by 2 FLOPs
    # per weight and position plus attention
    assert 3 * planner.model_flops_per_sample(small, 64) == pytest.approx(1.2e12, rel=0.1)


# -- one micro-batch on the device at a time -------------------------------------------------
def test_the_plan_counts_the_running_micro_batchs_inputs():
    frozen = _prepared("freeze-encoder")  # the stem saves nothing: its inputs are not activations
    config = frozen.config
    counted = planner.count_saved_bytes(frozen, policy="off", label_tokens=LABEL_TOKENS)
    logits = 4 * LABEL_TOKENS * config.vocab_size  # one chunk's: LABEL_TOKENS < a chunk
    features = 4 * config.num_mel_bins * 3000  # float32 log-mel of one row
    assert counted["working"] == logits + features + 2 * 8 * LABEL_TOKENS  # + ids and labels


def test_a_steps_micro_batches_stay_in_host_memory_until_run(tmp_path):
    from types import SimpleNamespace

    from conftest import write_tone_dataset
    from tiny_models import english_tokenizer

    from whisper_train.checkdata import label_encoder_for
    from whisper_train.data.collate import SpeechCollator
    from whisper_train.data.features import SpeechDataset
    from whisper_train.data.layouts import load_examples
    from whisper_train.data.source import WholeData
    from whisper_train.data.step_plan import WholePlan
    from whisper_train.training.checkpoints import TrainerState

    examples = load_examples(write_tone_dataset(tmp_path / "data", n=6))
    dataset = SpeechDataset(examples, label_encoder_for(english_tokenizer()))
    # A device the test can tell from host memory: a micro-batch moved there has meta tensors.
    accelerator = SimpleNamespace(device=torch.device("meta"), process_index=0, num_processes=1)
    plan = WholePlan(len(dataset), batch_size=2, accumulation=3, processes=1, seed=0)
    data = WholeData(
        plan,
        dataset,
        SpeechCollator(50256),
        accelerator=accelerator,
        num_workers=0,
        data_spec="tones",
    )
    step = next(data.steps(TrainerState()))

    assert len(step) == 3
    assert {batch["labels"].device.type for batch in step} == {"cpu"}


def test_the_step_loop_moves_each_micro_batch_to_the_device_as_it_runs_it(
    tiny_run_config, monkeypatch
):
    from accelerate.utils import send_to_device

    import whisper_train.training.recipe as recipe_module
    from whisper_train.training.train import train

    events = []
    real_move, real_loss = send_to_device, recipe_module.loss_terms

    def move(batch, device, **kwargs):
        events.append("move")
        return real_move(batch, device, **kwargs)

    def loss(model, batch, **kwargs):
        events.append("forward")
        return real_loss(model, batch, **kwargs)

    monkeypatch.setattr(recipe_module, "send_to_device", move, raising=False)
    monkeypatch.setattr(recipe_module, "loss_terms", loss)
    # Clips one by one: 6 micro-batches of 2 clips (packed, 9 clips fill fewer windows).
    train(tiny_run_config(max_steps=2, batch_size=2, gradient_accumulation=3, packing="off"))

    assert events == ["move", "forward"] * 6  # never a step's micro-batches moved together
