"""Every memory decision in one place: freezing, LoRA, gradient checkpointing, precision, optimiser.

`prepare_model` is the only function in whisper-train that touches a model's checkpointing
setting, and it always asks for *non-reentrant* checkpointing with `use_reentrant=False` spelled
out. Reentrant checkpointing is what breaks Whisper training on transformers 4.53-4.57 ("Trying to
backward through the graph a second time", trigger T1 in docs/checkpointing.md) and what silently
leaves LoRA weights without gradients (T2); an empty kwargs dict falls back to torch's default,
which is still reentrant in torch 2.13 (T9).

The order inside `prepare_model` matters and is fixed here:
  1. freeze what must never train (`encoder.embed_positions`, and the encoder for freeze-encoder);
  2. switch checkpointing on through the model's own API, non-reentrant;
  3. wrap LoRA adapters (peft), or keep the adapters of a model the caller wrapped already;
  4. narrow checkpointing to the policy, and switch it off where nothing below a layer trains
     (a frozen encoder has no backward pass, so recomputing it only costs time).

`--gradient-checkpointing auto` is decided here too (`prepare_model_within_budget`), from the
estimate in `memory_plan.py`; so is activation offload (`activation_offload`), and how the loss
is computed without the full-vocabulary logits (`training_loss`).
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from whisper_train.collate import IGNORE_INDEX
from whisper_train.errors import UserError

MODES = ("full", "lora", "freeze-encoder")
CHECKPOINT_POLICIES = "off, on, full, encoder, every-N (e.g. every-2)"
_EVERY_N = re.compile(r"^every-([1-9][0-9]*)$")


@dataclass(frozen=True)
class LoraSettings:
    """Low-rank adapters (peft) on the named linear layers of encoder and decoder."""

    r: int = 32  # rank of the A·B update
    alpha: int = 64  # scale of the update is alpha / r
    dropout: float = 0.05  # dropout on the adapter path only
    targets: tuple[str, ...] = ("q_proj", "v_proj")  # module names that get adapters


# -- the model ------------------------------------------------------------------------------


def prepare_model(
    model: nn.Module,
    *,
    mode: str = "full",
    checkpointing: str = "off",
    lora: LoraSettings | None = None,
) -> nn.Module:
    """Freeze, checkpoint (non-reentrant) and wrap LoRA in the one order that works.

    `model` is a `WhisperForConditionalGeneration`, or a peft model around one (a caller who
    wrapped LoRA first). `checkpointing` is a resolved policy: off | on | full | encoder | every-N
    (`resolve_checkpointing` turns None/auto into one). Returns the model to train: the peft
    model for mode="lora", else the same object. Training mode (`model.train()`) stays the
    caller's job; checkpointing only acts in training mode.
    """
    if mode not in MODES:
        raise UserError(f"--mode {mode}: expected one of {', '.join(MODES)}")
    policy = _normalise_policy(checkpointing)
    already_peft = _is_peft_model(model)
    if already_peft and mode != "lora":
        raise UserError(
            f"--mode {mode}: the model is already wrapped with PEFT adapters; use --mode lora"
        )
    whisper = whisper_of(model)

    # 1. Freezing. The encoder's positions are fixed sinusoids; transformers 5.x from_pretrained
    # leaves them trainable, so full fine-tuning would otherwise drift them.
    whisper.model.encoder.embed_positions.requires_grad_(False)
    if mode == "freeze-encoder":
        whisper.model.encoder.requires_grad_(False)
    # A cache written inside a checkpointed region would be written again on recompute (T7).
    whisper.config.use_cache = False

    # 2. Checkpointing, through the model's own API so its layers get the partial function.
    if policy == "off":
        _disable_checkpointing(whisper)
    else:
        _enable_checkpointing(whisper)

    # 3. LoRA after checkpointing: peft then sees checkpointing on and hooks input grads itself
    # (needed only for reentrant checkpointing, harmless otherwise).
    if mode == "lora" and not already_peft:
        model = _wrap_lora(whisper, lora or LoraSettings())

    # 4. Narrow to the policy; never recompute where no gradient flows.
    if policy != "off":
        _narrow_checkpointing(whisper, policy)
    # Lets `doctor` tell this setting from checkpointing switched on by hand (T9).
    whisper._whisper_train_checkpointing = policy
    return model


def resolve_checkpointing(policy: str | None, device: torch.device) -> str:
    """The policy to pass to `prepare_model`: None → full on CUDA, off elsewhere; on → full.

    `auto` stays `auto`: it is chosen by `prepare_model_within_budget` once the model, the
    batch size and the longest label are known.
    """
    if policy is None:
        return "full" if torch.device(device).type == "cuda" else "off"
    if policy == "auto":
        return "auto"
    return _normalise_policy(policy)


def prepare_model_within_budget(
    model: nn.Module,
    *,
    mode: str,
    lora: LoraSettings | None,
    batch_size: int,
    max_memory_bytes: int,
    label_tokens: int,
    precision: str,
    optimizer: str,
) -> tuple[nn.Module, Any]:
    """`--gradient-checkpointing auto`: the cheapest policy whose estimated peak fits.

    The model is prepared once with full checkpointing (so frozen parts, adapters and peft's
    hooks are what training will see), the planner measures one batch-1 forward pass to
    calibrate its estimate, and the model is narrowed to the chosen policy. Returns the model
    and the `memory_plan.Plan` (its `table` says what was considered and why).
    """
    from whisper_train.memory_plan import plan_checkpointing

    model = prepare_model(model, mode=mode, checkpointing="full", lora=lora)
    plan = plan_checkpointing(
        model,
        mode=mode,
        batch_size=batch_size,
        max_memory_bytes=max_memory_bytes,
        label_tokens=label_tokens,
        precision=precision,
        optimizer=optimizer,
    )
    return prepare_model(model, mode=mode, checkpointing=plan.policy, lora=lora), plan


def activation_offload(enabled: bool, device: torch.device):
    """Keep the tensors saved for backward (with checkpointing: the layer inputs) in pinned host
    memory during the forward pass, and bring them back for backward. On a CPU they already are
    in host memory, so this is a no-op there."""
    import contextlib

    if not enabled or torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=True)


def _normalise_policy(policy: str) -> str:
    if policy == "on":
        return "full"
    if policy in ("off", "full", "encoder") or _EVERY_N.match(policy):
        return policy
    raise UserError(f"--gradient-checkpointing {policy}: expected {CHECKPOINT_POLICIES}")


def _is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft is a dependency, but a user's own model needs no peft to check
        return False
    return isinstance(model, PeftModel)


def whisper_of(model: nn.Module) -> nn.Module:
    """The `WhisperForConditionalGeneration` inside `model` (itself, or under a peft wrapper)."""
    base = model.get_base_model() if _is_peft_model(model) else model
    if not (hasattr(base, "model") and hasattr(base.model, "encoder")):
        raise UserError(
            f"{type(base).__name__}: not a Whisper encoder-decoder; load the model with "
            "whisper_train.models.load_model"
        )
    return base


def _enable_checkpointing(whisper: nn.Module) -> None:
    # Explicit: an empty or missing kwargs dict means reentrant on transformers 4.x, and on 5.x
    # whenever any other kwarg is given (T9).
    kwargs = {"use_reentrant": False}
    if hasattr(whisper, "activation_checkpointing_enable"):  # transformers >= 5
        whisper.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        whisper.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _disable_checkpointing(whisper: nn.Module) -> None:
    if not checkpointing_state(whisper)["enabled"]:
        return
    if hasattr(whisper, "activation_checkpointing_disable"):
        whisper.activation_checkpointing_disable()
    else:
        whisper.gradient_checkpointing_disable()


def _wrap_lora(whisper: nn.Module, settings: LoraSettings) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.targets),
    )
    try:
        return get_peft_model(whisper, config)
    except ValueError as exc:  # peft's message when no module matches the targets
        raise UserError(
            f"--lora-targets {','.join(settings.targets)}: {str(exc).splitlines()[0]} "
            "(Whisper's linear layers: q_proj, k_proj, v_proj, out_proj, fc1, fc2)"
        ) from None


def _layer_stacks(whisper: nn.Module) -> dict[str, nn.ModuleList]:
    return {"encoder": whisper.model.encoder.layers, "decoder": whisper.model.decoder.layers}


def _per_layer_checkpointing(whisper: nn.Module) -> bool:
    """True where each layer decides for itself (transformers >= 4.53, GradientCheckpointingLayer);
    older releases checkpoint from the encoder/decoder stack's loop."""
    return hasattr(whisper.model.encoder.layers[0], "gradient_checkpointing")


def _narrow_checkpointing(whisper: nn.Module, policy: str) -> None:
    """Turn checkpointing off on layers the policy leaves out and on layers no gradient reaches.

    every-N counts within each stack: layers 0, N, 2N, ... of the encoder and of the decoder.
    """
    every = int(_EVERY_N.match(policy).group(1)) if _EVERY_N.match(policy) else 1
    per_layer = _per_layer_checkpointing(whisper)
    if not per_layer and every > 1:
        raise UserError(
            f"--gradient-checkpointing {policy}: this transformers release checkpoints whole "
            "stacks only; use full or encoder, or upgrade transformers to 4.53 or newer"
        )
    encoder = whisper.model.encoder
    # Does any parameter at or below this point train? If not, there is no backward pass here.
    grad_below = any(
        p.requires_grad for part in (encoder.conv1, encoder.conv2) for p in part.parameters()
    )
    encoder_trains = grad_below or any(p.requires_grad for p in encoder.parameters())
    for stack_name, layers in _layer_stacks(whisper).items():
        wanted_stack = policy != "encoder" or stack_name == "encoder"
        if stack_name == "decoder":
            grad_below = encoder_trains or any(
                p.requires_grad for p in whisper.model.decoder.embed_tokens.parameters()
            )
        for index, layer in enumerate(layers):
            grad_below = grad_below or any(p.requires_grad for p in layer.parameters())
            if per_layer:
                layer.gradient_checkpointing = wanted_stack and index % every == 0 and grad_below
        if not per_layer:
            stack = whisper.model.encoder if stack_name == "encoder" else whisper.model.decoder
            stack.gradient_checkpointing = wanted_stack and grad_below


# -- the loss ------------------------------------------------------------------------------

# Label tokens whose logits exist at once. 51,866 logits a token: 256 tokens are 53 MB in fp32,
# where a batch of 16 x 448-token labels would be 1.5 GB, kept until backward.
LOSS_CHUNK_TOKENS = 256


def training_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Teacher-forced cross-entropy, the mean over label tokens, without full-vocabulary logits.

    `batch` holds `decoder_input_ids`, `labels` (-100 where there is no loss) and either
    `input_features` or `encoder_hidden_states` (cached encoder outputs). The model's own
    forward runs (through any DDP, compile or peft wrapper, so gradients synchronise) with its
    output projection left out; the logits are then computed only where a label is, not for
    the prompt prefix or padding, `LOSS_CHUNK_TOKENS` at a time. With checkpointing on, each
    chunk's logits are recomputed in backward instead of kept: the log-softmax of every label
    token is the largest tensor a decoder keeps otherwise.
    """
    whisper = whisper_of(_unwrapped(model))
    inputs = {"decoder_input_ids": batch["decoder_input_ids"]}
    if "encoder_hidden_states" in batch:
        from transformers.modeling_outputs import BaseModelOutput

        hidden = batch["encoder_hidden_states"].to(whisper.proj_out.weight.dtype)
        inputs["encoder_outputs"] = BaseModelOutput(last_hidden_state=hidden)
    else:
        inputs["input_features"] = batch["input_features"]
    if type(whisper.proj_out) is not nn.Linear:
        # Adapters on the output head (peft wraps it): only the model knows its logits.
        return model(**inputs, labels=batch["labels"]).loss
    with _projection_deferred(whisper):
        decoder_states = model(**inputs).logits  # (batch, T, d_model): hidden states here
    labels = batch["labels"].to(decoder_states.device)
    keep = labels != IGNORE_INDEX
    states, targets = decoder_states[keep], labels[keep]
    if len(targets) == 0:  # nothing to learn; a zero that still reaches every parameter
        return decoder_states.sum() * 0.0
    recompute = torch.is_grad_enabled() and _checkpointing_on(whisper)
    weight = whisper.proj_out.weight
    # Summed in float32 at least (16-bit logits under autocast); a float64 model stays float64.
    total = states.new_zeros((), dtype=torch.promote_types(states.dtype, torch.float32))
    for start in range(0, len(targets), LOSS_CHUNK_TOKENS):
        chunk = slice(start, start + LOSS_CHUNK_TOKENS)
        if recompute:
            total = total + torch.utils.checkpoint.checkpoint(
                _summed_cross_entropy, states[chunk], weight, targets[chunk], use_reentrant=False
            )
        else:
            total = total + _summed_cross_entropy(states[chunk], weight, targets[chunk])
    return total / len(targets)


def _summed_cross_entropy(
    states: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    logits = torch.nn.functional.linear(states, weight)  # half precision under autocast
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")


@contextlib.contextmanager
def _projection_deferred(whisper: nn.Module) -> Iterator[None]:
    """Inside, the model's `logits` output is the decoder's hidden states: the output projection
    (`proj_out`, tied to the token embedding) passes its input through. Only this instance's
    forward is shadowed: weights, state dict and tying are untouched."""
    projection = whisper.proj_out
    projection.forward = _pass_through
    try:
        yield
    finally:
        del projection.forward


def _pass_through(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _checkpointing_on(whisper: nn.Module) -> bool:
    """Whether any layer (transformers >= 4.53) or stack (older) recomputes in backward."""
    stacks = (whisper.model.encoder, whisper.model.decoder)
    if _per_layer_checkpointing(whisper):
        return any(layer.gradient_checkpointing for stack in stacks for layer in stack.layers)
    return any(getattr(stack, "gradient_checkpointing", False) for stack in stacks)


# -- what is checkpointed and how -----------------------------------------------------------


def effective_use_reentrant(module: nn.Module) -> bool | None:
    """Whether `module`'s checkpoint function runs reentrant: True, False, or None (unknown).

    transformers stores `functools.partial(checkpoint, **kwargs)` on each module; a partial
    without `use_reentrant` runs torch's default, which is reentrant on torch 2.13.
    """
    func = getattr(module, "_gradient_checkpointing_func", None)
    if func is None:
        return None
    if isinstance(func, functools.partial):
        if func.keywords.get("use_reentrant") is not None:
            return bool(func.keywords["use_reentrant"])
        func = func.func
    if func is torch.utils.checkpoint.checkpoint:
        return True  # torch's default for a missing use_reentrant
    return None  # a replacement checkpoint function (e.g. Unsloth's): cannot tell (T5)


def checkpointing_state(model: nn.Module) -> dict[str, Any]:
    """Which modules are checkpointed and whether each is reentrant.

    Returns {"enabled": bool, "modules": [qualified names], "use_reentrant": {name: bool|None},
    "reentrant": [names that run reentrant or unknown]}. Works on a peft wrapper too.
    """
    reentrant = {
        name: effective_use_reentrant(module)
        for name, module in checkpointing_units(model)
        if module.gradient_checkpointing is True
    }
    return {
        "enabled": bool(reentrant),
        "modules": list(reentrant),
        "use_reentrant": reentrant,
        "reentrant": [n for n, r in reentrant.items() if r is not False],
    }


def checkpointing_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules whose `gradient_checkpointing` flag decides what is recomputed.

    transformers sets the flag on the model, the encoder/decoder stacks and (>= 4.53) on each
    layer; only the innermost flags act: the layers on >= 4.53, the stacks on older releases.
    """
    flagged = [(n, m) for n, m in model.named_modules() if hasattr(m, "gradient_checkpointing")]
    flagged_names = [n for n, _ in flagged]
    return [
        (name, module)
        for name, module in flagged
        if not any(
            other != name and other.startswith(f"{name}." if name else "")
            for other in flagged_names
        )
    ]


def trainable_parameter_summary(model: nn.Module) -> str:
    """One line: trainable / total parameters, split into encoder, decoder and LoRA."""
    total = trainable = 0
    parts = {"encoder": 0, "decoder": 0, "lora": 0}
    for name, param in model.named_parameters():
        total += param.numel()
        if not param.requires_grad:
            continue
        trainable += param.numel()
        if "lora_" in name:
            parts["lora"] += param.numel()
        elif ".encoder." in f".{name}":
            parts["encoder"] += param.numel()
        else:
            parts["decoder"] += param.numel()
    share = 100.0 * trainable / max(total, 1)
    split = ", ".join(f"{k} {v:,}" for k, v in parts.items() if v)
    return f"trainable parameters: {trainable:,} of {total:,} ({share:.2f}%)" + (
        f": {split}" if split else ""
    )


# -- precision ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    """How to run the forward pass. Weights and optimiser state stay float32 in every case."""

    mixed_precision: str  # for accelerate: "no" | "bf16" | "fp16"
    dtype: torch.dtype  # the autocast compute dtype
    needs_scaler: bool  # fp16 needs loss scaling; bf16 has fp32's exponent range and does not


_FP32 = Precision("no", torch.float32, False)
_BF16 = Precision("bf16", torch.bfloat16, False)
_FP16 = Precision("fp16", torch.float16, True)


def resolve_precision(name: str, device: torch.device) -> Precision:
    """auto → bf16 on GPUs that support it, fp16 with loss scaling on older CUDA, fp32 elsewhere.

    An explicit bf16 is allowed on a CPU (autocast supports it; useful to check a bf16 run
    before renting a GPU); fp16 on a CPU is refused: CPU autocast has no fp16 loss scaling.
    """
    device_type = torch.device(device).type
    on_cuda = device_type == "cuda"
    bf16_ok = not on_cuda or torch.cuda.is_bf16_supported()
    if name == "auto":
        if not on_cuda:
            return _FP32
        return _BF16 if bf16_ok else _FP16
    if name == "fp32":
        return _FP32
    if name == "bf16":
        if not bf16_ok:
            raise UserError(
                "--precision bf16: this GPU has no bfloat16 support; use --precision fp16 or auto"
            )
        return _BF16
    if name == "fp16":
        if not on_cuda:
            raise UserError(
                f"--precision fp16 needs a CUDA GPU (this run is on {device_type}); "
                "use --precision bf16 or fp32"
            )
        return _FP16
    raise UserError(f"--precision {name}: expected one of auto, fp32, bf16, fp16")


# -- optimiser ----------------------------------------------------------------------------

OPTIMIZERS = ("adamw", "adamw-fused", "adamw8bit")


def build_optimizer(
    parameters: nn.Module | Iterable[tuple[str, nn.Parameter]],
    *,
    name: str = "adamw",
    lr: float,
    weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, weight decay only on matrices.

    `parameters` is a model or its `named_parameters()`. Biases and LayerNorm weights (every
    tensor with fewer than 2 dimensions) get no weight decay: shrinking a norm's gain or a bias
    towards zero is not regularisation, it changes the layer's output scale.
    """
    named = parameters.named_parameters() if isinstance(parameters, nn.Module) else parameters
    decay, no_decay = _split_by_decay(named)
    if not decay and not no_decay:
        raise UserError("the model has no trainable parameters: check --mode and --lora-targets")
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    if name == "adamw-fused":
        try:
            return torch.optim.AdamW(groups, lr=lr, fused=True)
        except RuntimeError as exc:  # a device without a fused kernel
            raise UserError(
                f"--optim adamw-fused: {str(exc).splitlines()[0]}; use --optim adamw"
            ) from None
    if name == "adamw8bit":
        try:
            import bitsandbytes
        except ImportError:
            raise UserError(
                "--optim adamw8bit needs bitsandbytes: pip install 'whisper-train[bnb]', "
                "or use --optim adamw"
            ) from None
        return bitsandbytes.optim.AdamW8bit(groups, lr=lr)
    raise UserError(f"--optim {name}: expected one of {', '.join(OPTIMIZERS)}")


def _split_by_decay(
    named: Iterator[tuple[str, nn.Parameter]],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, param in named:
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return decay, no_decay
