"""LoRA on a base held in 8 or 4 bits (`--quantize-base int8 | nf4`, `memory.quantize`).

What a user relies on: the frozen base really is bitsandbytes' layers (the conv front end,
embeddings, layer norms and tied head as loaded), only the adapters train and every one of them
gets a gradient, checkpointing (non-reentrant, every policy, packed per clip or not) changes
memory and never those gradients, the model learns, the memory plan counts the quantized
weights as bitsandbytes stores them, final/ is the adapters merged into the ORIGINAL
full-precision weights, a resume continues, and what cannot work is refused in one line.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from conftest import train_argv
from tiny_models import (
    LORA,
    fresh_short_whisper,
    nonzero_lora_b,
    pristine,
    tiny_batch,
    trainable_gradients,
)

from whisper_train import cli
from whisper_train.config import RunConfig
from whisper_train.errors import UserError
from whisper_train.memory import (
    checkpointing_state,
    effective_use_reentrant,
    loss_terms,
    prepare_model,
    quantize,
    whisper_of,
)

bnb = pytest.importorskip("bitsandbytes")  # the `bnb` extra; its absence is tested below

KINDS = ("int8", "nf4")
# Every policy but off (the reference), as `memory.CHECKPOINT_POLICIES` names them.
POLICIES = ("full", "encoder", "every-2")
PACKINGS = ("unpacked", "per-clip")
BNB_LAYER = {"int8": "Linear8bitLt", "nf4": "Linear4bit"}


def lora_on(kind: str, **changes):
    from dataclasses import replace

    return replace(LORA, quantize_base=kind, **changes)


def build(kind: str, policy: str) -> torch.nn.Module:
    """The seeded 1-second model, its base quantized as `kind`, LoRA on q/v with B non-zero
    (peft starts B at zero, which would leave every A without gradient)."""
    model = fresh_short_whisper()
    torch.manual_seed(1)  # LoRA A initialisation
    model = prepare_model(model, mode="lora", checkpointing=policy, lora=lora_on(kind))
    return nonzero_lora_b(model).train()


def per_clip_batch() -> dict:
    """tiny_batch's two windows packed with three clips (`--packing per-clip`'s batch)."""
    from test_clip_attention import packed_batch

    batch = packed_batch()
    return {**batch, "input_features": batch["input_features"].float()}


def batch_of(packing: str) -> dict:
    return tiny_batch() if packing == "unpacked" else per_clip_batch()


def backward_once(model: torch.nn.Module, batch: dict) -> dict:
    """Loss and adapter gradients of one step, with the forwards of the quantized layers
    counted (a checkpointed layer's run again in backward)."""
    calls = {"n": 0}

    def count(*_):
        calls["n"] += 1

    handles = [
        module.register_forward_hook(count)
        for module in model.modules()
        if isinstance(module, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit))
    ]
    torch.manual_seed(0)  # per-clip packing samples each clip's padding
    loss = loss_terms(model, batch).loss
    loss.backward()
    for handle in handles:
        handle.remove()
    return {"loss": loss.detach(), "grads": trainable_gradients(model), "calls": calls["n"]}


@functools.cache
def reference(kind: str, packing: str) -> dict:
    return backward_once(build(kind, "off"), batch_of(packing))


# -- what is held how ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_the_base_linear_layers_are_bitsandbytes_and_only_adapters_train(kind):
    model = build(kind, "full")
    whisper = whisper_of(model)
    layers = [*whisper.model.encoder.layers, *whisper.model.decoder.layers]
    for layer in layers:
        for name in ("q_proj", "v_proj"):  # LoRA's targets: peft's bnb LoRA layer around bnb's
            wrapped = getattr(layer.self_attn, name)
            assert type(wrapped).__module__ == "peft.tuners.lora.bnb", type(wrapped)
            assert isinstance(wrapped.base_layer, getattr(bnb.nn, BNB_LAYER[kind]))
        for name in ("k_proj", "out_proj"):  # frozen, not targeted: quantized too
            assert isinstance(getattr(layer.self_attn, name), getattr(bnb.nn, BNB_LAYER[kind]))
        assert all(
            isinstance(fc, getattr(bnb.nn, BNB_LAYER[kind])) for fc in (layer.fc1, layer.fc2)
        )
    # As loaded: the conv front end, embeddings, layer norms and the tied output head.
    original = pristine()
    for name in (
        "model.encoder.conv1.weight",
        "model.encoder.conv2.weight",
        "model.encoder.embed_positions.weight",
        "model.decoder.embed_tokens.weight",
        "model.encoder.layers.0.self_attn_layer_norm.weight",
        "model.decoder.layer_norm.weight",
    ):
        kept = whisper.get_parameter(name)
        assert kept.dtype == torch.float32 and torch.equal(kept, original.get_parameter(name))
    assert whisper.proj_out.weight is whisper.model.decoder.embed_tokens.weight
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # Integer weights never train; the adapters are float32 (the run's precision on a CPU).
    assert not any(p.requires_grad for p in model.parameters() if not p.is_floating_point())
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
    # No plain torch Linear left in the layers, the adapters' own A and B aside.
    assert quantize.quantizable_linears(whisper) == []


# -- checkpointing: memory, never gradients -----------------------------------------------


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", KINDS)
def test_checkpointing_gives_every_adapter_the_reference_gradient(kind, policy, packing):
    model = build(kind, policy)
    state = checkpointing_state(model)
    assert state["modules"] and all(r is False for r in state["use_reentrant"].values()), state
    run, ref = backward_once(model, batch_of(packing)), reference(kind, packing)

    # Every adapter matrix got a non-zero gradient (None or zero: the silent T2 failure).
    assert run["grads"].keys() == ref["grads"].keys()
    assert {n.split(".")[-3] for n in run["grads"]} == {"lora_A", "lora_B"}
    dead = [n for n, g in run["grads"].items() if g is None or not g.abs().sum() > 0]
    assert not dead, dead[:5]
    # The recompute ran the quantized layers again: more forwards than without checkpointing.
    assert run["calls"] > ref["calls"]
    # Bitwise: the recompute runs bitsandbytes' same CPU kernels on the same inputs in the same
    # order (dequantize, then a float32 matmul; int8: the same row-wise quantized matmul).
    assert torch.equal(run["loss"], ref["loss"])
    unequal = [n for n, g in run["grads"].items() if not torch.equal(g, ref["grads"][n])]
    assert not unequal, f"gradients differ from no-checkpointing for {unequal[:5]}"


@pytest.mark.parametrize("kind", KINDS)
def test_use_reentrant_is_false_on_every_checkpointed_module_and_the_planner_keeps_it(kind):
    from whisper_train.memory import prepare_model_within_budget

    model, plan = prepare_model_within_budget(
        fresh_short_whisper(),
        mode="lora",
        lora=lora_on(kind),
        batch_size=2,
        # Over the plan with every-2 checkpointing, under the plan without checkpointing.
        max_memory_bytes=16 << 20,
        label_tokens=5,
        precision="fp32",
        optimizer="adamw",
    )
    checkpointed = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    assert plan.policy != "off" and checkpointed
    assert all(effective_use_reentrant(m) is False for m in checkpointed)
    assert quantize.quantized_as(whisper_of(model)) == kind  # quantized once, not twice
    # peft's kbit-training flags are gone after wrapping: nothing else reads them.
    assert not hasattr(whisper_of(model), "is_loaded_in_4bit")
    assert not hasattr(whisper_of(model), "is_loaded_in_8bit")


@pytest.mark.parametrize("kind", KINDS)
def test_the_base_gets_no_gradient_and_the_model_learns(kind):
    model = build(kind, "full")
    batch = tiny_batch()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = loss_terms(model, batch).loss
        loss.backward()
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        optimizer.step()
        losses.append(float(loss))
    # The same batch five times: a model that learns lowers its loss each step.
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], before) for n, before in frozen.items())


def inputs_held_after_forward(kind: str, policy: str) -> tuple[int, int]:
    """Of the base linear layers' inputs in one forward, how many are still alive when the
    forward is done (held for backward), and how many there were."""
    import gc
    import weakref

    model = build(kind, policy)
    seen: list[weakref.ref] = []
    hooks = [
        layer.register_forward_pre_hook(lambda _, args: seen.append(weakref.ref(args[0])))
        for layer in quantize.base_linears(whisper_of(model))
    ]
    torch.manual_seed(0)
    loss = loss_terms(model, tiny_batch()).loss
    for hook in hooks:
        hook.remove()
    gc.collect()
    held = sum(ref() is not None for ref in seen)
    loss.backward()
    return held, len(seen)


@pytest.mark.parametrize("kind", KINDS)
def test_under_checkpointing_a_quantized_layer_keeps_no_more_of_its_input_than_a_full_one(kind):
    """Checkpointing frees a layer's activations and recomputes them in backward. bitsandbytes'
    own int8 autograd keeps each layer's input on its context, out of checkpointing's reach,
    so every 8-bit layer's input stayed held to backward; a base in 8 or 4 bits holds what the
    full-precision base holds (the cross-attention's keys and values read the encoder's
    output, which checkpointing keeps as the decoder layers' input)."""
    held, total = inputs_held_after_forward(kind, "full")
    full_precision, _ = inputs_held_after_forward("none", "full")
    without_checkpointing, _ = inputs_held_after_forward(kind, "off")
    assert held == full_precision < without_checkpointing <= total


def test_the_8bit_product_and_its_gradients_are_the_dequantized_weights_own():
    """`Int8WeightsLinear`: the output and the input's and bias's gradients are those of a plain
    linear layer holding the dequantized weight."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 24)
    layer = quantize.quantized_linear(linear, "int8", compute_dtype=torch.float32)
    layer.bias.requires_grad_()  # a trained bias (peft's bias="all")
    dequantized = layer.weight.data.float() * layer.state.SCB.float()[:, None] / 127.0
    x = torch.randn(3, 5, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    bias_ref = linear.bias.detach().clone().requires_grad_()
    out = layer(x)
    ref = torch.nn.functional.linear(x_ref, dequantized, bias_ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    # float32 products of the same operands, summed in possibly another order: a few ulps of
    # outputs of magnitude ~1
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.bias.grad, bias_ref.grad, rtol=1e-6, atol=1e-6)
    assert (dequantized - linear.weight).abs().max() <= linear.weight.abs().max() / 127


@pytest.mark.parametrize("kind", KINDS)
def test_dora_on_a_quantized_base_trains_every_magnitude_and_checkpointing_keeps_its_gradients(
    kind,
):
    """DoRA reads the base weight's norm through bitsandbytes' state (peft dequantizes it):
    every magnitude gets a gradient, and checkpointing's recompute finds the state as the
    first forward left it (on 8 bits, an emptied state once failed the recompute)."""

    def dora(policy: str) -> dict:
        model = fresh_short_whisper()
        torch.manual_seed(1)
        model = prepare_model(
            model, mode="lora", checkpointing=policy, lora=lora_on(kind, variant="dora")
        )
        return backward_once(nonzero_lora_b(model).train(), tiny_batch())

    run, reference_run = dora("full"), dora("off")
    magnitudes = [g for n, g in run["grads"].items() if "magnitude" in n]
    assert magnitudes and all(g is not None and g.abs().sum() > 0 for g in magnitudes)
    assert torch.equal(run["loss"], reference_run["loss"])
    assert all(torch.equal(g, reference_run["grads"][n]) for n, g in run["grads"].items())


# -- the memory plan --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_the_estimates_weight_bytes_are_what_bitsandbytes_stores(kind):
    whisper = fresh_short_whisper()
    linears = [linear for _, _, linear in quantize.quantizable_linears(whisper)]
    shapes = [(linear.in_features, linear.out_features) for linear in linears]
    quantize.quantize_base(whisper, kind, compute_dtype=torch.float32)
    counted = sum(quantize.quantized_bytes(i, o, kind) for i, o in shapes)
    assert counted == quantize.quantized_module_bytes(whisper)
    full = sum(quantize.quantized_bytes(i, o, "none") for i, o in shapes)
    assert counted < full / (3 if kind == "int8" else 4)


@pytest.mark.parametrize("kind", KINDS)
def test_the_plan_counts_the_quantized_weights_as_held(kind):
    from whisper_train.memory import estimate_memory

    held = build(kind, "full")
    whisper = whisper_of(held)
    stored = quantize.quantized_module_bytes(whisper)
    bnb_weights = {id(linear.weight) for linear in quantize.base_linears(whisper)}
    rest = sum(p.numel() * p.element_size() for p in held.parameters() if id(p) not in bnb_weights)
    assert estimate_memory(held, policy="full").weights == stored + rest
    # A model not yet quantized (the planner's large models, on the meta device) named `kind`:
    # its weights are planned as the quantized model holds them, its dequantization buffer too.
    plain = prepare_model(fresh_short_whisper(), mode="lora", checkpointing="full", lora=LORA)
    named, real = estimate_memory(plain, quantize_base=kind), estimate_memory(held)
    assert named.weights == real.weights
    unquantized = estimate_memory(plain)
    assert unquantized.weights > 3 * stored
    largest = max(linear.weight.numel() for linear in quantize.base_linears(whisper_of(plain)))
    assert named.working - unquantized.working == 4 * largest


# -- refused in one line ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ({"mode": "full"}, "--mode full: quantized weights cannot train; use --mode lora"),
        ({"mode": "freeze-encoder"}, "use --mode lora"),
        ({"mode": "lora", "fsdp": True, "nproc": 2}, "--fsdp"),
        ({"mode": "lora", "cache_encoder": True}, "add --no-cache-encoder"),
        ({"mode": "lora", "compile": True}, "drop --compile"),
    ],
)
def test_what_cannot_meet_a_quantized_base_is_refused_in_one_line(flags, said):
    config = RunConfig.from_flat({"data": "data", "quantize_base": "nf4", **flags})
    with pytest.raises(UserError) as refused:
        config.validate()
    assert said in str(refused.value) and "\n" not in str(refused.value)
    assert str(refused.value).startswith("--quantize-base ")


def test_without_bitsandbytes_the_option_names_the_extra_and_exits_2(
    monkeypatch, capsys, tone_dataset, tiny_whisper_dir, tmp_path
):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a),
    )
    argv = train_argv(tone_dataset, tiny_whisper_dir, tmp_path / "out", "--mode", "lora")
    assert cli.main([*argv, "--quantize-base", "int8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: --quantize-base int8 needs bitsandbytes: pip install 'whisper-train[bnb]', "
        "or drop --quantize-base"
    )
    assert not (tmp_path / "out").exists()


def test_a_device_bitsandbytes_does_not_run_on_is_refused():
    with pytest.raises(UserError, match="bitsandbytes does not run on mps"):
        quantize.check_device("nf4", torch.device("mps"))
    quantize.check_device("none", torch.device("mps"))  # nothing quantized: nothing to refuse


# -- final/ and resume ------------------------------------------------------------------------


def merged_in_full_precision(base_dir, checkpoint, lora) -> torch.nn.Module:
    """The base loaded in float32, the checkpoint's adapters on it, merged by peft."""
    from dataclasses import replace

    from safetensors.torch import load_file
    from transformers import WhisperForConditionalGeneration

    base = WhisperForConditionalGeneration.from_pretrained(base_dir)
    model = prepare_model(base, mode="lora", lora=replace(lora, quantize_base="none"))
    missing, unexpected = model.load_state_dict(
        load_file(checkpoint / "trainable.safetensors"), strict=False
    )
    assert not unexpected and not [n for n in missing if "lora_" in n]
    return model.merge_and_unload().eval()


def test_final_is_the_adapters_merged_into_the_original_weights_and_a_resume_continues(
    tiny_run_config, tiny_whisper_dir, tmp_path
):
    from transformers import WhisperForConditionalGeneration

    from whisper_train.config.record import RunRecord
    from whisper_train.training import checkpoints
    from whisper_train.training.train import train

    config = tiny_run_config(
        mode="lora", quantize_base="nf4", max_steps=2, save_steps=2, gradient_checkpointing="full"
    )
    result = train(config)
    out = tmp_path / "out"
    record = RunRecord.from_yaml((out / "whisper-train.yaml").read_text())
    assert record.model.quantize_base == "nf4"
    assert "4-bit NF4" in (result.final_dir / "README.md").read_text()
    (checkpoint,) = checkpoints.list_checkpoints(out)

    final = WhisperForConditionalGeneration.from_pretrained(result.final_dir).eval()
    expected = merged_in_full_precision(tiny_whisper_dir, checkpoint, record.model.lora)
    weights, want = final.state_dict(), expected.state_dict()
    assert weights.keys() == want.keys()
    assert all(weights[n].dtype == torch.float32 for n in weights)
    unequal = [n for n in weights if not torch.equal(weights[n], want[n])]
    assert not unequal, unequal[:5]
    batch = tiny_batch()
    features = torch.randn(2, 80, 3000, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = final(input_features=features, decoder_input_ids=batch["decoder_input_ids"])
        reference_logits = expected(
            input_features=features, decoder_input_ids=batch["decoder_input_ids"]
        )
    assert torch.equal(logits.logits, reference_logits.logits)
    # The adapters changed the model, on the original weights: what they added to a layer is
    # small beside the NF4 rounding error that merging into the dequantized weights would add.
    base = WhisperForConditionalGeneration.from_pretrained(tiny_whisper_dir).state_dict()
    name = "model.encoder.layers.0.self_attn.q_proj.weight"
    nf4 = bnb.nn.Params4bit(base[name].clone(), requires_grad=False, quant_type="nf4").to("cpu")
    dequantized = bnb.functional.dequantize_4bit(nf4.data, nf4.quant_state)
    assert not torch.equal(weights[name], base[name])
    assert (dequantized - base[name]).abs().max() > (weights[name] - base[name]).abs().max()

    resumed = train(
        tiny_run_config(
            mode="lora",
            quantize_base="nf4",
            max_steps=3,
            save_steps=2,
            gradient_checkpointing="full",
            resume="latest",
        )
    )
    steps = [checkpoints.TrainerState.read(c).step for c in checkpoints.list_checkpoints(out)]
    assert max(steps) == 3 and resumed.final_dir.is_dir()


# -- doctor ---------------------------------------------------------------------------------


def test_doctor_names_peft_kbit_preparation_and_passes_whisper_trains_own():
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    from whisper_train import doctor

    def quantized_base_check(model):
        checks = doctor.static_checks(model, refuse=False)
        return next(c for c in checks if c.id == "quantized base")

    # The common recipe: a 4-bit base, peft's kbit preparation, then LoRA. peft up to 0.21
    # passed `gradient_checkpointing_kwargs={}` by default, so torch's reentrant default ran;
    # 0.22 leaves transformers' non-reentrant one. Asked for here, so the test holds on both.
    model = fresh_short_whisper()
    quantize.quantize_base(model, "nf4", compute_dtype=torch.float32)
    model.is_loaded_in_4bit = True  # as transformers marks a model it quantized at load
    model = prepare_model_for_kbit_training(
        model, gradient_checkpointing_kwargs={"use_reentrant": True}
    )
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    check = quantized_base_check(model)
    assert check.status == "fail" and check.trigger == "T9"
    assert "prepare_model_for_kbit_training" in check.message
    assert '"use_reentrant": False' in check.remedy and "--quantize-base" in check.remedy
    with pytest.raises(UserError, match="under reentrant checkpointing"):
        doctor.static_checks(model)  # what `train` runs before step 1: refused

    check = quantized_base_check(build("nf4", "full"))
    assert check.status == "pass" and "32 bitsandbytes layers" in check.message


@pytest.mark.parametrize("kind", KINDS)
def test_an_evaluation_between_steps_leaves_training_as_it_was(kind):
    """Evaluation runs the layers in eval mode without gradients (generate, as during a run):
    the next training step gives the gradients a model that never evaluated gives (on CPUs
    with AVX512-BF16, bitsandbytes' inference kernel once repacked the 4-bit weights in place,
    and the next step failed)."""
    evaluated, fresh = build(kind, "full"), build(kind, "full")
    evaluated.eval()
    with torch.no_grad():
        evaluated.generate(input_features=tiny_batch()["input_features"], max_new_tokens=3)
    evaluated.train()
    run, ref = backward_once(evaluated, tiny_batch()), backward_once(fresh, tiny_batch())
    assert torch.equal(run["loss"], ref["loss"])
    assert all(torch.equal(g, ref["grads"][n]) for n, g in run["grads"].items())


# -- the merged export in every runtime -------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_en_nf4_final(tmp_path_factory):
    """final/ of the real tiny.en after LoRA on its base held in NF4: 3 steps (batch 2, the
    adapters at 1e-3, so that merging them moves the weights) on 8 synthesised sentences."""
    from whisper_train.data import synth
    from whisper_train.training.train import train

    folder = tmp_path_factory.mktemp("nf4-final")
    config = RunConfig()
    config.update(
        {
            "data": str(synth.make_speech_dataset(folder / "clips", n_utterances=8, seed=0)),
            "model": "tiny.en",
            "mode": "lora",
            "quantize_base": "nf4",
            "output_dir": str(folder / "run"),
            "max_steps": 3,
            "batch_size": 2,
            "learning_rate": 1e-3,
            "seed": 0,
            "only_train": True,
            "nonspeech": "none",
        }
    )
    return train(config).final_dir


@pytest.mark.speech
@pytest.mark.long
@pytest.mark.parametrize(
    ("format", "quantization"),
    [("hf", "float32"), ("ct2", "float32"), ("ggml", "float16"), ("openai", "float16")],
)
def test_a_quantized_runs_final_passes_the_export_check_in_every_runtime(
    tiny_en_nf4_final, format, quantization, tmp_path
):
    """What a user deploys after --quantize-base: final/ (the adapters merged into the original
    weights) exported to each runtime, and the runtime's transcripts held to the export
    check's threshold against final/ itself."""
    from whisper_train.deploy.export import save_export
    from whisper_train.deploy.parity import check_clips, check_export, score_source
    from whisper_train.models import load_model

    model, processor = load_model(str(tiny_en_nf4_final))
    shipped, _ = load_model("tiny.en")
    name = "model.decoder.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(model.state_dict()[name], shipped.state_dict()[name])  # trained
    source = score_source(model, processor, check_clips(None, n_clips=4), None)
    save_export(model, processor, tmp_path, format=format, quantization=quantization)
    check = check_export(source, format, tmp_path, quantization)
    assert check.tokens > 30  # over real transcripts, not empty strings
    assert check.passed, check.summary()
