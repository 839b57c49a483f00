"""On a CUDA device: checkpointing, precision, optimisers, offload, log-mel, compile and resume.

What the CPU suite proves on a CPU, proved again where training really runs: gradient
checkpointing gives the gradients of training without it (fp32 and bf16 autocast) for every mode
x policy; bf16 and fp16 runs train in their dtype, fp16 with its loss scaled; fused and 8-bit
AdamW step; activation offload moves what backward keeps to host memory without changing a
gradient; the batched log-mel path equals WhisperFeatureExtractor; a --compile run trains; a
resumed run repeats the losses of one that never stopped; and --fsdp's sharded model (NCCL) gives
the unsharded gradients. Every test is small (seconds, tiny
seeded models), and every comparison states its tolerance and why.

Run with `python -m pytest -m gpu tests/test_gpu.py` (the default run deselects `gpu`). Without
a GPU every test skips ("needs a CUDA device"), unless WHISPER_TRAIN_TEST_DEVICE=cpu asks for a
dry run of the test code on the CPU: the same assertions with the same tolerances, except for
what exists only on CUDA (activation offload, fp16 loss scaling), which skips itself there and
says why. A dry run proves the tests are sound, not that CUDA is.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import re
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import (
    SAME_RUN_LOSS_ATOL,
    losses_and_evaluations,
    metric_rows,
    train_argv,
    train_in_subprocess,
    write_tone_dataset,
)
from safetensors.torch import load_file
from tiny_models import (
    LORA,
    cached_batch,
    fresh_short_whisper,
    nonzero_lora_b,
    tiny_batch,
    trainable_gradients,
)
from transformers import WhisperFeatureExtractor

import whisper_train.training.recipe as recipe_module
from whisper_train.data.features import LogMel
from whisper_train.memory import (
    activation_offload,
    build_optimizer,
    checkpointing_state,
    cross_attention,
    prepare_model,
    training_loss,
    unwrapped,
    whisper_of,
)
from whisper_train.training import checkpoints
from whisper_train.training.train import train

pytestmark = pytest.mark.gpu

DRY_RUN_VARIABLE = "WHISPER_TRAIN_TEST_DEVICE"


@pytest.fixture(scope="module")
def device():
    """CUDA when there is one; the CPU only for a dry run asked for by name; else skip."""
    if torch.cuda.is_available():
        with pytest.MonkeyPatch.context() as patch:
            # cuBLAS is deterministic only with a fixed workspace, and torch's deterministic
            # mode (the resume test) refuses cuBLAS calls without this set. Set before any test
            # here makes the first cuBLAS call; a value the user chose is kept.
            if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
                patch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            yield torch.device("cuda")
        return
    if os.environ.get(DRY_RUN_VARIABLE) == "cpu":
        yield torch.device("cpu")
        return
    pytest.skip("needs a CUDA device")


@pytest.fixture
def float32_math():
    """Matrix products and convolutions in full float32 while a test compares float32 numbers.

    cuDNN convolutions default to TF32 (10-bit mantissa) on Ampere and later: both sides of a
    comparison would use it, but any kernel-order difference would then show at 2^-11 instead
    of float32's 2^-24 and swamp a float32 tolerance. Restored afterwards.
    """
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def deterministic_algorithms():
    """torch's strict deterministic mode for the test, restored afterwards.

    Strict, not warn-only: in strict mode memory-efficient attention's backward runs with one key
    split (no atomic adds) and cuDNN picks deterministic convolution algorithms; warn-only would
    only warn and keep the atomics. An operation with no deterministic CUDA kernel raises,
    naming itself, instead of making the comparison flaky.
    """
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


def needs_bf16(device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")


def on_device(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


class TrainingForwards:
    """Wraps the recipe's loss (`recipe.loss_terms`, what every training forward calls): records
    the device of each batch and the dtype a decoder linear layer computed in, and can raise on
    the n-th call as a crash or power cut would."""

    def __init__(self, monkeypatch, *, crash_on_call: int | None = None):
        self.calls = 0
        self.devices: set[str] = set()
        self.dtypes: set[torch.dtype] = set()
        real = recipe_module.loss_terms

        def watched(model, batch, **kwargs):
            self.calls += 1
            if self.calls == crash_on_call:
                raise RuntimeError("simulated crash")
            self.devices.add(batch["decoder_input_ids"].device.type)
            fc1 = whisper_of(unwrapped(model)).model.decoder.layers[0].fc1
            handle = fc1.register_forward_hook(lambda _m, _i, out: self.dtypes.add(out.dtype))
            try:
                return real(model, batch, **kwargs)
            finally:
                handle.remove()

        monkeypatch.setattr(recipe_module, "loss_terms", watched)


# -- 1. checkpointing parity on the device ----------------------------------------------------

MODES = ("full", "lora", "freeze-encoder")
POLICIES = ("full", "encoder", "every-2")
AUTOCAST_DTYPE = {"fp32": None, "bf16": torch.bfloat16}

# How far a checkpointed step's gradients may lie from the step without checkpointing, as a
# fraction of each tensor's largest reference gradient (and of the loss, for the loss).
# fp32: both steps run the same kernels on the same inputs, but CUDA kernels that accumulate
# with atomic adds (memory-efficient attention's backward over key splits, embedding and index
# backward, some cuBLAS / cuDNN algorithms) add in an order that changes from run to run.
# Reordering a float32 sum of the <= ~100 terms accumulated here moves it by a few ulps of its
# partial sums, ~1e-6 of the tensor's scale; 1e-5 x scale (~80 ulps of the largest entry) sits
# above that, and far below a checkpointing fault (a doubled, lost or stale contribution is
# 10-100% of the scale).
# bf16 autocast: activations are rounded to bfloat16 (eps 2^-8). The same reordering noise, on
# a value next to a rounding boundary, flips it by one bf16 ulp (2^-8 of it), and the layers
# above carry that into the gradients; 2^-6 x scale allows four such ulps at the tensor's
# scale, still several times below the faults above.
PARITY_TOLERANCE = {"fp32": 1e-5, "bf16": 2**-6}


def prepared_for_parity(mode: str, policy: str, device: torch.device) -> torch.nn.Module:
    """The CPU parity test's model: the seeded 1-second tiny Whisper prepared for `mode`, LoRA
    A seeded and B made non-zero (so the A matrices get gradients too), then moved."""
    model = fresh_short_whisper()
    torch.manual_seed(1)  # LoRA A initialisation
    model = prepare_model(model, mode=mode, checkpointing=policy, lora=LORA)
    return nonzero_lora_b(model).to(device).train()


_LAYER = re.compile(r"(en|de)coder\.layers\.\d+$")


def backward_once(model: torch.nn.Module, device: torch.device, precision: str) -> dict:
    """One forward (under autocast for bf16) and backward of the training loss on `tiny_batch`;
    counts each layer's fc1 forwards, which run again when the layer is recomputed."""
    fc1_forwards: Counter[str] = Counter()
    handles = [
        layer.fc1.register_forward_hook(lambda *_, name=name: fc1_forwards.update([name]))
        for name, layer in model.named_modules()
        if _LAYER.search(name)
    ]
    dtype = AUTOCAST_DTYPE[precision]
    autocast = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
    with autocast:
        loss = training_loss(model, on_device(tiny_batch(), device))
    loss.backward()
    for handle in handles:
        handle.remove()
    grads = trainable_gradients(model)
    return {"loss": loss.detach().float(), "grads": grads, "fc1_forwards": fc1_forwards}


@functools.cache
def parity_reference(mode: str, precision: str, device: torch.device) -> dict:
    """The same step without checkpointing."""
    return backward_once(prepared_for_parity(mode, "off", device), device, precision)


def far_apart(run: dict, ref: dict, relative: float) -> list[str]:
    """Names (with numbers) of the tensors whose largest difference exceeds `relative` x the
    reference tensor's largest absolute value."""
    report = []
    for name, grad in run.items():
        expected = ref[name]
        scale = expected.abs().max().item()
        diff = (grad - expected).abs().max().item()
        if not diff <= relative * scale:  # `not <=`: a NaN difference is reported too
            report.append(f"{name}: max |diff| {diff:.3g} > {relative:.3g} x {scale:.3g}")
    return report


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", MODES)
def test_checkpointing_gives_the_reference_gradients_on_the_device(
    device, float32_math, mode, policy, precision
):
    if precision == "bf16":
        needs_bf16(device)
    model = prepared_for_parity(mode, policy, device)
    state = checkpointing_state(model)
    assert all(reentrant is False for reentrant in state["use_reentrant"].values()), state
    run = backward_once(model, device, precision)
    ref = parity_reference(mode, precision, device)

    # Every trainable parameter got a gradient (None is the silent failure), non-zero where the
    # reference's is.
    missing = [name for name, grad in run["grads"].items() if grad is None]
    assert not missing, f"no gradient for {missing[:5]}"
    assert run["grads"].keys() == ref["grads"].keys()
    nonzero = {name for name, grad in run["grads"].items() if grad.abs().sum() > 0}
    assert nonzero == {name for name, grad in ref["grads"].items() if grad.abs().sum() > 0}
    if mode == "lora":
        assert any("lora_A" in n for n in nonzero) and any("lora_B" in n for n in nonzero)

    relative = PARITY_TOLERANCE[precision]
    loss, ref_loss = run["loss"].item(), ref["loss"].item()
    assert math.isfinite(loss) and abs(loss - ref_loss) <= relative * abs(ref_loss)
    unequal = far_apart(run["grads"], ref["grads"], relative)
    assert not unequal, f"{precision} gradients differ from no-checkpointing: {unequal[:5]}"

    # Recompute happened on the device, on exactly the checkpointed layers.
    assert run["fc1_forwards"].keys() == ref["fc1_forwards"].keys() and run["fc1_forwards"]
    for name, count in run["fc1_forwards"].items():
        assert count == (2 if name in state["modules"] else 1), name
    if not (mode == "freeze-encoder" and policy == "encoder"):
        assert state["modules"], "the policy checkpointed nothing"


# -- 2. bf16 and fp16 training steps ------------------------------------------------------------


def trained_weights_changed(result, tiny_whisper_dir) -> bool:
    """Whether final/ holds weights other than the starting model's."""
    start = load_file(tiny_whisper_dir / "model.safetensors")
    final = load_file(result.final_dir / "model.safetensors")
    shared = start.keys() & final.keys()
    assert shared
    return any(not torch.equal(start[name], final[name]) for name in shared)


def test_a_bf16_run_trains_in_bfloat16_on_the_device(
    device, tiny_run_config, tiny_whisper_dir, monkeypatch
):
    """The real training step (recipe: resolve_precision, accelerate's autocast,
    build_optimizer), in bf16."""
    needs_bf16(device)
    forwards = TrainingForwards(monkeypatch)
    result = train(tiny_run_config(precision="bf16", max_steps=2, save_steps=1))
    assert forwards.devices == {device.type}
    assert forwards.dtypes == {torch.bfloat16}
    # bf16 has float32's exponent range: no loss scaling, and no step is skipped.
    rows = metric_rows(result.output_dir)
    assert result.steps == 2 and result.skipped_steps == 0
    assert all(math.isfinite(row["loss"]) for row in rows)
    assert not (checkpoints.list_checkpoints(result.output_dir)[-1] / "scaler.pt").exists()
    assert trained_weights_changed(result, tiny_whisper_dir)


def test_an_fp16_run_trains_in_float16_with_its_loss_scaled(
    device, tiny_run_config, tiny_whisper_dir, monkeypatch
):
    """The real training step in fp16: accelerate's GradScaler scales the loss, unscales the
    gradients and steps (or skips an overflowing step and halves the scale)."""
    if device.type != "cuda":
        pytest.skip(
            "fp16 needs CUDA: whisper-train refuses it on a CPU, where autocast has no loss scaling"
        )
    forwards = TrainingForwards(monkeypatch)
    result = train(tiny_run_config(precision="fp16", max_steps=3, save_steps=1))
    assert forwards.devices == {"cuda"}
    assert forwards.dtypes == {torch.float16}
    # The scaler may skip a step whose scaled gradients overflowed (common at the first steps,
    # from its 2^16 start): such a step logs no loss. At least one of three must have trained.
    rows = metric_rows(result.output_dir)
    assert result.steps == 3 and result.skipped_steps < 3
    assert all(math.isfinite(row["loss"]) for row in rows if "skipped" not in row)
    # The scaler's state after the last step (saved with the end-of-training checkpoint): a
    # finite positive scale, and it has been stepped: grown its tracker on steps that trained,
    # or lowered the scale from 2^16 on one that overflowed.
    scaler = torch.load(
        checkpoints.list_checkpoints(result.output_dir)[-1] / "scaler.pt", weights_only=True
    )
    scale = float(scaler["scale"])
    assert math.isfinite(scale) and scale > 0
    assert scaler["_growth_tracker"] > 0 or scale < 2.0**16, scaler
    assert trained_weights_changed(result, tiny_whisper_dir)


# -- 3. fused and 8-bit AdamW ---------------------------------------------------------------

LR = 1e-2


def model_after_one_backward(device: torch.device) -> tuple[torch.nn.Module, torch.Tensor]:
    model = prepare_model(fresh_short_whisper(), mode="full").to(device).train()
    loss = training_loss(model, on_device(tiny_batch(), device))
    loss.backward()
    return model, loss.detach()


def trainable_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_fused_adamw_steps_to_the_weights_plain_adamw_steps_to(device, float32_math):
    model, loss = model_after_one_backward(device)
    twin = copy.deepcopy(model)
    for theirs, ours in zip(twin.parameters(), model.parameters(), strict=True):
        theirs.grad = None if ours.grad is None else ours.grad.clone()  # the very same gradient
    before = trainable_copy(model)
    # torch's own AdamW without the fused kernel (foreach on CUDA), grouped as build_optimizer
    # groups: `--optim adamw` itself now takes the fused kernel where it can.
    trained = [p for p in model.parameters() if p.requires_grad]
    torch.optim.AdamW(
        [
            {"params": [p for p in trained if p.ndim >= 2], "weight_decay": 0.01},
            {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=LR,
    ).step()
    build_optimizer(twin, name="adamw-fused", lr=LR, weight_decay=0.01).step()
    plain, fused = trainable_copy(model), trainable_copy(twin)

    assert math.isfinite(loss.item())
    assert any(not torch.equal(before[n], plain[n]) for n in before), "AdamW changed no weight"
    # One float32 step: p(1 - lr wd) - lr m^/(sqrt(v^) + eps), each implementation rounding its
    # few operations in its own order. The update is below lr in size (at step 1 it is
    # lr g / (|g| + eps)), so the two results differ by a few ulps of max(|p|, lr): 16 float32
    # epsilons of that is the bound. A wrong bias correction, decay or moment is off by ~lr.
    eps = torch.finfo(torch.float32).eps
    unequal = []
    for name, expected in plain.items():
        assert torch.isfinite(fused[name]).all(), name
        bound = 16 * eps * max(expected.abs().max().item(), LR)
        diff = (fused[name] - expected).abs().max().item()
        if not diff <= bound:
            unequal.append(f"{name}: {diff:.3g} > {bound:.3g}")
    assert not unequal, f"fused AdamW differs from AdamW: {unequal[:5]}"


def test_adamw8bit_trains_on_the_device(device):
    pytest.importorskip("bitsandbytes")
    model, loss = model_after_one_backward(device)
    before = trainable_copy(model)
    build_optimizer(model, name="adamw8bit", lr=LR).step()
    after = trainable_copy(model)
    assert math.isfinite(loss.item())
    assert any(not torch.equal(before[n], after[n]) for n in before), "the step changed nothing"
    assert all(torch.isfinite(weight).all() for weight in after.values())
    with torch.no_grad():
        assert math.isfinite(training_loss(model, on_device(tiny_batch(), device)).item())


# -- 4. activation offload ----------------------------------------------------------------------


def test_activation_offload_keeps_saved_tensors_off_the_device_and_changes_no_gradient(
    device, float32_math
):
    if device.type != "cuda":
        pytest.skip("offload is a no-op on a CPU")
    # Offload is for checkpointed training (config refuses it without): the layer inputs, and
    # everything else saved for backward, go to pinned host memory.
    model = prepare_model(fresh_short_whisper(), mode="full", checkpointing="full")
    model = model.to(device).train()
    batch = on_device(tiny_batch(), device)

    def step(offload: bool) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        start = torch.cuda.memory_allocated(device)
        with activation_offload(offload, device):
            loss = training_loss(model, batch)
        held = torch.cuda.memory_allocated(device) - start  # what the forward leaves for backward
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return loss.detach(), held, grads

    step(False)  # warm-up: cuBLAS / cuDNN workspaces are allocated once, on first use
    plain_loss, plain_held, plain_grads = step(False)
    offload_loss, offload_held, offload_grads = step(True)

    # Everything saved for backward went to the host: what stays on the device is the loss and
    # allocator rounding, well under half of what the plain forward keeps.
    assert plain_held > 0 and offload_held < plain_held / 2, (offload_held, plain_held)
    # A copy to the host and back changes no bit; only CUDA's run-to-run kernel order remains,
    # hence the float32 parity tolerance (see PARITY_TOLERANCE).
    relative = PARITY_TOLERANCE["fp32"]
    assert abs(offload_loss.item() - plain_loss.item()) <= relative * abs(plain_loss.item())
    unequal = far_apart(offload_grads, plain_grads, relative)
    assert not unequal, f"offload changed gradients: {unequal[:5]}"


# -- 5. log-mel on the device -----------------------------------------------------------------


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_on_the_device_matches_whisper_feature_extractor(device, n_mels):
    """On CUDA, LogMel runs the whole batch as one STFT, padding and all (on a CPU dry run it
    takes its per-clip path: the same comparison, another code path)."""
    rng = np.random.default_rng(0)
    clips = [
        (0.3 * rng.standard_normal(n)).astype(np.float32)
        # short, with trailing silence, medium, exactly 30 s, too long (cut)
        for n in (16_000, 5 * 16_000, 30 * 16_000, 31 * 16_000)
    ]
    clips.insert(1, np.concatenate([clips[0], np.zeros(32_000, np.float32)]))
    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    expected = extractor(clips, sampling_rate=16_000, return_tensors="np").input_features
    features = LogMel(extractor, device=device)(clips)
    assert features.device.type == device.type
    ours = features.cpu().numpy()
    assert ours.shape == expected.shape == (5, n_mels, 3000)
    # The bound: 1e-3 on features scaled to about [-1, 1] (cuFFT and the extractor's
    # numpy FFT agree to ~1e-6 relative in power, ~1e-5 after the log).
    assert np.abs(ours - expected).max() <= 1e-3


# -- 6. --compile ---------------------------------------------------------------------------


def test_compiled_training_runs_a_step_on_the_device(device, tiny_run_config, monkeypatch):
    real_compile = torch.compile
    compiled = []

    def compile_and_record(model, **kwargs):
        compiled.append(model)
        if device.type == "cpu":
            # Dry run only: Inductor's C++ code generation takes minutes on a busy CPU;
            # aot_eager traces the same graph through dynamo and AOT autograd (tests/test_ddp.py
            # does the same). On CUDA, --compile's own backend (Inductor, Triton) runs.
            kwargs = {**kwargs, "backend": "aot_eager"}
        return real_compile(model, **kwargs)

    monkeypatch.setattr(torch, "compile", compile_and_record)
    # Precision and checkpointing are the device's defaults: bf16 and full on a GPU.
    result = train(tiny_run_config(max_steps=1, compile=True))
    assert len(compiled) == 1
    assert {p.device.type for p in compiled[0].parameters()} == {device.type}
    rows = metric_rows(result.output_dir)
    assert result.steps == 1 and result.skipped_steps == 0
    assert len(rows) == 1 and math.isfinite(rows[0]["loss"])
    assert (result.final_dir / "model.safetensors").is_file()


# -- 7. resume ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_a_run_resumed_on_the_device_repeats_the_uninterrupted_losses(
    device, tmp_path, tiny_run_config, monkeypatch, deterministic_algorithms, float32_math, mode
):
    """Like tests/test_resume.py, on the device. LoRA's adapter dropout draws from the CUDA
    generator there: equal losses also need the checkpoint to restore CUDA's random state.

    SAME_RUN_LOSS_ATOL (1e-4) holds on CUDA because the runs are made the same computation:
    fp32 with TF32 off (`float32_math`), and torch's strict deterministic mode with a fixed
    cuBLAS workspace, so that no kernel adds with atomics (memory-efficient attention's backward
    uses one key split; cuDNN deterministic algorithms). Then one GPU repeats a run bit for bit
    and the resumed losses equal the uninterrupted ones exactly; the tolerance only keeps the
    CPU suite's bound. Without determinism it would still be the wrong test to loosen: AdamW
    turns run-to-run noise in near-zero gradients into whole lr-sized steps. A resume fault
    (another batch, lost optimiser or random state) moves a loss by 6.5e-3 or more (conftest).
    """
    settings = {"max_steps": 5, "mode": mode, "precision": "fp32"}
    with monkeypatch.context() as patch:
        uninterrupted = TrainingForwards(patch)
        reference = train(tiny_run_config(output_dir=str(tmp_path / "ref" / "out"), **settings))
    reference_rows = metric_rows(reference.output_dir)

    config = tiny_run_config(**settings, save_steps=1, save_total_limit=1)
    with monkeypatch.context() as patch:
        crashing = TrainingForwards(patch, crash_on_call=3)  # during step 3, after checkpoint-2
        with pytest.raises(RuntimeError, match="simulated crash"):
            train(config)
    out = tmp_path / "out"
    assert [p.name for p in checkpoints.list_checkpoints(out)] == ["checkpoint-2"]

    config.update({"resume": "latest"})
    with monkeypatch.context() as patch:
        resuming = TrainingForwards(patch)
        resumed = train(config)
    assert uninterrupted.devices == crashing.devices == resuming.devices == {device.type}
    assert resumed.steps == 5
    rows = metric_rows(out)
    assert (
        [row["step"] for row in rows] == [row["step"] for row in reference_rows] == [1, 2, 3, 4, 5]
    )
    assert [row["lr"] for row in rows] == [row["lr"] for row in reference_rows]
    assert all(row["loss"] is not None for row in rows + reference_rows)
    np.testing.assert_allclose(
        [row["loss"] for row in rows],
        [row["loss"] for row in reference_rows],
        rtol=0,
        atol=SAME_RUN_LOSS_ATOL,
    )


# -- 8. sharded training (--fsdp) ---------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_sharded_gradients_on_the_device_equal_the_unsharded_ones(
    device, tmp_path, float32_math, mode, precision
):
    """--fsdp's sharding (`memory.shard_model`) on the device, in a process group of this one
    process (NCCL on CUDA; gloo for a dry run): each layer's weights are all-gathered and its
    gradients reduce-scattered through the backend, with checkpointing's recompute gathering
    them again in backward, and the loss reads the tied projection from the gathered root. The
    loss and every gradient equal the unsharded model's within the parity tolerance (a shard in
    the wrong place, a gradient left out of the reduce-scatter or a projection read as a shard
    would not)."""
    from whisper_train.memory import shard_model

    if precision == "bf16":
        needs_bf16(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(
        backend, init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1
    )
    try:
        reference = prepared_for_parity(mode, "full", device)
        sharded = shard_model(copy.deepcopy(reference), device)
        assert type(whisper_of(sharded).model.decoder.layers[0].fc1.weight).__name__ == "DTensor"
        ref = backward_once(reference, device, precision)
        run = backward_once(sharded, device, precision)
    finally:
        torch.distributed.destroy_process_group()
    grads = {
        name: grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        for name, grad in run["grads"].items()
    }
    missing = [name for name, grad in grads.items() if grad is None]
    assert not missing, f"no gradient for {missing[:5]}"
    assert grads.keys() == ref["grads"].keys()
    relative = PARITY_TOLERANCE[precision]
    loss, ref_loss = run["loss"].item(), ref["loss"].item()
    assert math.isfinite(loss) and abs(loss - ref_loss) <= relative * abs(ref_loss)
    unequal = far_apart(grads, ref["grads"], relative)
    assert not unequal, f"{precision} sharded gradients differ: {unequal[:5]}"


def test_two_gpus_train_sharded_in_bf16_resume_and_save_a_whole_model(
    device, tmp_path, tone_dataset, tiny_whisper_dir
):
    """`--nproc 2 --fsdp` over NCCL on two GPUs, bf16: trains, writes each process's shard,
    resumes, and final/ is a whole model. Needs 2 GPUs (NCCL refuses two ranks on one)."""
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    out = tmp_path / "out"
    argv = train_argv(tone_dataset, tiny_whisper_dir, out, "--nproc=2", "--fsdp")[1:]
    argv += ["--precision=bf16", "--batch-size=2", "--generation-max-length=4", "--temperatures=0"]
    train_in_subprocess([*argv, "--max-steps=2", "--save-steps=2"])
    assert len(list((out / "checkpoint-2" / "sharded").glob("*.distcp"))) == 2
    train_in_subprocess([*argv, "--max-steps=4", "--save-steps=4", "--resume=latest"])
    losses = [row["loss"] for row in metric_rows(out) if "loss" in row]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    final = load_file(out / "final" / "model.safetensors")
    assert final and all(tensor.dtype == torch.float32 for tensor in final.values())


# -- 9. the folded cross-attention under bf16 autocast -------------------------------------------


@pytest.mark.parametrize("mode", ["freeze-encoder", "full"])
def test_folded_cross_attention_gives_the_layers_own_gradients_under_bf16_autocast(
    device, monkeypatch, mode
):
    """On cached encoder outputs the decoder's cross-attention runs in its folded order
    (`memory.cross_attention`); the CPU suite proves it in float64. Here under bf16 autocast on
    the device, against the layers' own attention on the same cached outputs: the two orders
    round at other places, so the bf16 parity tolerance applies (one bf16 ulp carried upward),
    several times below a real fault (a wrong head split or a lost scale moves the loss by
    1e-3 relative and gradients by their whole size)."""
    needs_bf16(device)
    model = prepared_for_parity(mode, "off", device)
    batch = {k: v for k, v in cached_batch(model).items() if k != "input_features"}
    folds: list[int] = []
    real_folded = cross_attention._folded

    def counted(attention, hidden_states, encoder_states):
        folds.append(hidden_states.shape[1])
        return real_folded(attention, hidden_states, encoder_states)

    monkeypatch.setattr(cross_attention, "_folded", counted)

    def step() -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = training_loss(model, batch)
        loss.backward()
        grads = {n: g for n, g in trainable_gradients(model).items() if g is not None}
        return loss.detach().float().item(), grads

    loss, grads = step()
    assert folds == [5] * model.config.decoder_layers  # every layer folded, 5 decoder inputs
    monkeypatch.setattr(cross_attention, "folded_cost_is_lower", lambda *_: False)
    reference_loss, reference = step()
    assert len(folds) == model.config.decoder_layers  # the reference did not fold

    relative = PARITY_TOLERANCE["bf16"]
    assert math.isfinite(loss) and abs(loss - reference_loss) <= relative * abs(reference_loss)
    assert grads.keys() == reference.keys() and grads  # the decoder's, both ways
    unequal = far_apart(grads, reference, relative)
    assert not unequal, f"folded bf16 gradients differ: {unequal[:5]}"


# -- 10. packed windows ----------------------------------------------------------------------


def test_packed_windows_on_the_device_accumulate_to_the_token_mean_and_train_in_bf16(
    device, tmp_path, tiny_run_config, float32_math, deterministic_algorithms
):
    """--packing on the device: packed windows of several clips each, batch 2 against batch 1 x
    accumulation 2 in fp32 (the same token mean per step: equal within the suite's same-run
    bound, as on the CPU), then a bf16 packed run whose steps are all finite and applied."""
    data = write_tone_dataset(tmp_path / "many", n=48)  # 1.2 s tones: a handful of windows
    common = {
        "data": str(data),
        "packing": "on",
        "eval_split": 0.0,
        "max_steps": 3,
        "lr_scheduler": "constant_with_warmup",
    }
    two = train(
        tiny_run_config(output_dir=str(tmp_path / "b2"), batch_size=2, precision="fp32", **common)
    )
    one_by_two = train(
        tiny_run_config(
            output_dir=str(tmp_path / "b1x2"),
            batch_size=1,
            gradient_accumulation=2,
            precision="fp32",
            **common,
        )
    )
    losses = losses_and_evaluations(two.output_dir)[0]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    np.testing.assert_allclose(
        losses_and_evaluations(one_by_two.output_dir)[0], losses, rtol=0, atol=SAME_RUN_LOSS_ATOL
    )
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return
    half = train(
        tiny_run_config(output_dir=str(tmp_path / "bf16"), batch_size=2, precision="bf16", **common)
    )
    rows = metric_rows(half.output_dir)
    assert half.steps == 3 and half.skipped_steps == 0
    assert all(math.isfinite(row["loss"]) for row in rows)


@pytest.mark.parametrize(
    "context",
    [
        "block-restart-pad",
        "block-restart-silence",
        "block-restart-silence-detached",
        "block-restart-ownpad-sampled",
    ],
)
def test_per_clip_packing_on_the_device_recomputes_each_layer_with_its_mask(
    context, device, tmp_path, tiny_run_config, float32_math, deterministic_algorithms, monkeypatch
):
    """--packing per-clip under full checkpointing (the CUDA default): in fp32 the losses of
    checkpointing off, and of a bf16 run whose steps are all finite and applied. Found on an
    H200 (transformers 5.17): a layer recomputed without its block mask runs another attention
    kernel and backward failed, "A different number of tensors was saved"."""
    monkeypatch.setenv("WHISPER_TRAIN_PER_CLIP_ENCODER", context)
    data = write_tone_dataset(tmp_path / "many", n=48)  # 1.2 s tones: a handful of windows
    common = {"data": str(data), "packing": "per-clip", "batch_size": 1, "eval_split": 0.0,
              "max_steps": 3, "lr_scheduler": "constant_with_warmup"}  # fmt: skip
    runs = {
        policy: train(
            tiny_run_config(
                output_dir=str(tmp_path / policy),
                gradient_checkpointing=policy,
                precision="fp32",
                **common,
            )
        )
        for policy in ("off", "full")
    }
    losses = losses_and_evaluations(runs["off"].output_dir)[0]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    np.testing.assert_allclose(
        losses_and_evaluations(runs["full"].output_dir)[0], losses, rtol=0, atol=SAME_RUN_LOSS_ATOL
    )
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return
    half = train(
        tiny_run_config(
            output_dir=str(tmp_path / "bf16"), gradient_checkpointing="full", precision="bf16",
            **common,
        )
    )  # fmt: skip
    assert half.steps == 3 and half.skipped_steps == 0
    assert all(math.isfinite(row["loss"]) for row in metric_rows(half.output_dir))


# -- 11. data parallelism with gradient accumulation on two GPUs --------------------------------


def test_two_gpus_with_accumulation_equal_one_process_with_the_whole_batch(
    tmp_path, tiny_whisper_dir, monkeypatch
):
    """The run users start most (`--nproc 2 --gradient-accumulation 2`, which crashed at its
    first backward under DDP's static graph): 2 GPUs x batch 1 x accumulation 2 give the losses
    of one process with batch 4, in fp32 without TF32, with one unreadable clip in the data."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    data = write_tone_dataset(tmp_path / "tones", n=16)
    # One missing clip: with batch 1 a process's micro-batch can hold nothing usable, and its
    # process must still run the same collectives (a stand-in row of zero weight).
    metadata = data / "metadata.csv"
    metadata.write_text(metadata.read_text() + "missing.wav,alpha bravo charlie\n")
    flags = (
        "--learning-rate=1e-3",
        "--seed=0",
        "--eval-split=0",
        "--only-train",
        "--lr-scheduler=constant_with_warmup",
        "--max-steps=3",
        "--precision=fp32",
    )
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")  # cuBLAS and cuDNN in full float32
    one, two = tmp_path / "one", tmp_path / "two"
    train_in_subprocess(train_argv(data, tiny_whisper_dir, one, *flags, "--batch-size=4")[1:])
    train_in_subprocess(
        train_argv(
            data,
            tiny_whisper_dir,
            two,
            *flags,
            "--nproc=2",
            "--batch-size=1",
            "--gradient-accumulation=2",
        )[1:]
    )
    one_losses = losses_and_evaluations(one)[0]
    assert len(one_losses) == 3
    np.testing.assert_allclose(
        losses_and_evaluations(two)[0], one_losses, rtol=0, atol=SAME_RUN_LOSS_ATOL
    )
