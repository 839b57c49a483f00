"""Freezing, LoRA and gradient checkpointing: the one place that sets a model's checkpointing.

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

Which layers a policy recomputes is decided once, in `checkpointed_layers`: `prepare_model`, the
planner's estimate (`memory.estimate`) and its probe's temporary `checkpointing_policy` all ask
it.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from whisper_train.choices import LORA_VARIANTS, MODES
from whisper_train.errors import UserError
from whisper_train.memory.quantize import (
    peft_sees_quantized,
    quantize_base,
    quantized_as,
    weights_held,
)
from whisper_train.memory.wrappers import is_peft_model, whisper_of

CHECKPOINT_POLICIES = "off, on, full, encoder, every-N (e.g. every-2)"
_EVERY_N = re.compile(r"every-([1-9][0-9]*)")


@dataclass(frozen=True)
class LoraSettings:
    """Low-rank adapters (peft) on the named linear layers of encoder and decoder, or of the
    decoder (and output head) only."""

    r: int = 32  # rank of the A·B update
    alpha: int = 64  # scale of the update is alpha / r
    dropout: float = 0.05  # dropout on the adapter path only
    # Module names that get adapters: every linear layer, as the CLI's default
    # (`config.options.LORA_TARGETS`; config sits above memory and stays torch-free).
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
    # No adapters inside the encoder: set when its outputs are cached (`config.record.ModelRecord.lora`),
    # which are computed once, without gradient, so encoder adapters could never train.
    decoder_only: bool = False
    # lora, dora (peft's use_dora: a magnitude vector per adapted layer, trained with A and B)
    # or rslora (peft's use_rslora: the update scaled by alpha / sqrt(r), not alpha / r).
    variant: str = "lora"
    # Language tokens a run added (--new-language): their embedding rows train beside the
    # adapters (peft's trainable_token_indices, tied to the output projection as Whisper ties
    # it), the rest of the vocabulary frozen as LoRA leaves it.
    new_languages: tuple[str, ...] = ()
    # How the frozen base is held under the adapters (`memory.quantize`): none, int8 or nf4.
    quantize_base: str = "none"


# -- policies -------------------------------------------------------------------------------


def parse_every_n(policy: str) -> int | None:
    """N for an `every-N` policy (N >= 1, written without a leading zero); None otherwise.

    The one reader of the every-N spelling: the planner, `prepare_model` and config validation
    all go through it, so they cannot disagree on what is a policy.
    """
    match = _EVERY_N.fullmatch(policy)
    return int(match.group(1)) if match else None


def resolve_checkpointing(policy: str | None, device: torch.device) -> str:
    """The policy to pass to `prepare_model`: None → full on CUDA, off elsewhere; on → full.

    `auto` stays `auto`: it is chosen by `prepare_model_within_budget` once the model, the
    batch size and the longest label are known.
    """
    if policy is None:
        return "full" if torch.device(device).type == "cuda" else "off"
    if policy == "auto":
        return "auto"
    return normalise_policy(policy)


def normalise_policy(policy: str) -> str:
    """`on` → `full`; off, full, encoder and every-N unchanged; anything else is a UserError."""
    if policy == "on":
        return "full"
    if policy in ("off", "full", "encoder") or parse_every_n(policy) is not None:
        return policy
    raise UserError(f"--gradient-checkpointing {policy}: expected {CHECKPOINT_POLICIES}")


def checkpointed_layers(whisper: nn.Module, policy: str) -> set[tuple[str, int]]:
    """(stack, index) of the layers `policy` recomputes, stack being "encoder" or "decoder".

    every-N counts within each stack: layers 0, N, 2N, ... of the encoder and of the decoder;
    `encoder` takes the encoder's layers only. A layer that no gradient reaches (nothing at or
    below it trains, e.g. a frozen encoder) is never taken: it has no backward pass, so
    recomputing it would only cost time. Only shapes and `requires_grad` are read, so `whisper`
    may live on the meta device.
    """
    policy = normalise_policy(policy)
    if policy == "off":
        return set()
    every = parse_every_n(policy) or 1
    encoder = whisper.model.encoder
    # Does any parameter at or below this point train? If not, there is no backward pass here.
    grad_below = _trains(encoder.conv1) or _trains(encoder.conv2)
    encoder_trains = grad_below or _trains(encoder)
    chosen: set[tuple[str, int]] = set()
    for stack, layers in _layer_stacks(whisper).items():
        wanted_stack = policy != "encoder" or stack == "encoder"
        if stack == "decoder":
            grad_below = encoder_trains or _trains(whisper.model.decoder.embed_tokens)
        for index, layer in enumerate(layers):
            grad_below = grad_below or _trains(layer)
            if wanted_stack and grad_below and index % every == 0:
                chosen.add((stack, index))
    return chosen


@contextlib.contextmanager
def checkpointing_policy(model: nn.Module, policy: str) -> Iterator[None]:
    """Temporarily set each layer's checkpointing flag as `policy` would (transformers >= 4.53).

    The model must have checkpointing enabled (any policy) for a policy other than off to act;
    `prepare_model(..., checkpointing="full")` does that. The planner measures policies this way.
    """
    whisper = whisper_of(model)
    stacks = _layer_stacks(whisper)
    before = {
        (stack, index): layer.gradient_checkpointing
        for stack, layers in stacks.items()
        for index, layer in enumerate(layers)
    }
    _set_layer_flags(whisper, checkpointed_layers(whisper, policy))
    try:
        yield
    finally:
        for (stack, index), flag in before.items():
            stacks[stack][index].gradient_checkpointing = flag


# -- the model ------------------------------------------------------------------------------


def prepare_model(
    model: nn.Module,
    *,
    mode: str = "full",
    checkpointing: str = "off",
    lora: LoraSettings | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Freeze, checkpoint (non-reentrant) and wrap LoRA in the one order that works.

    `model` is a `WhisperForConditionalGeneration`, or a peft model around one (a caller who
    wrapped LoRA first). `checkpointing` is a resolved policy: off | on | full | encoder | every-N
    (`resolve_checkpointing` turns None/auto into one). Returns the model to train: the peft
    model for mode="lora", else the same object. Training mode (`model.train()`) stays the
    caller's job; checkpointing only acts in training mode. With `lora.quantize_base` int8 or
    nf4 the frozen base's linear layers are quantized first (`memory.quantize`), computing in
    `compute_dtype` (the run's precision).
    """
    if mode not in MODES:
        raise UserError(f"--mode {mode}: expected one of {', '.join(MODES)}")
    policy = normalise_policy(checkpointing)
    already_peft = is_peft_model(model)
    if already_peft and mode != "lora":
        raise UserError(
            f"--mode {mode}: the model is already wrapped with PEFT adapters; use --mode lora"
        )
    whisper = whisper_of(model)
    quantize = lora.quantize_base if lora is not None else "none"
    if quantize != "none" and mode != "lora":
        raise UserError(f"--quantize-base {quantize} with --mode {mode}: use --mode lora")
    if already_peft and quantize not in ("none", quantized_as(whisper)):
        raise UserError(
            f"--quantize-base {quantize}: the model was wrapped with adapters before its base "
            "was quantized; pass the unwrapped model"
        )

    # 1. Freezing. The encoder's positions are fixed sinusoids; transformers 5.x from_pretrained
    # leaves them trainable, so full fine-tuning would otherwise drift them.
    whisper.model.encoder.embed_positions.requires_grad_(False)
    if mode == "freeze-encoder":
        whisper.model.encoder.requires_grad_(False)
    # A cache written inside a checkpointed region would be written again on recompute (T7).
    whisper.config.use_cache = False
    # The frozen base in 8 or 4 bits, before peft wraps it: its adapters then go around the
    # quantized layers (peft's bnb LoRA layers).
    if quantize != "none" and not already_peft:
        quantize_base(whisper, quantize, compute_dtype=compute_dtype)

    # 2. Checkpointing, through the model's own API so its layers get the partial function.
    if policy == "off":
        _disable_checkpointing(whisper)
    else:
        _enable_checkpointing(whisper)

    # 3. LoRA after checkpointing: peft then sees checkpointing on and hooks input grads itself
    # (needed only for reentrant checkpointing, harmless otherwise).
    if mode == "lora" and not already_peft:
        with peft_sees_quantized(whisper, quantize):
            model = _wrap_lora(whisper, lora or LoraSettings())

    # 4. Narrow to the policy; never recompute where no gradient flows.
    if policy != "off":
        _narrow_checkpointing(whisper, policy)
    # Lets `doctor` tell this setting from checkpointing switched on by hand (T9).
    whisper._whisper_train_checkpointing = policy
    return model


def adapters_on_full_precision(trained: nn.Module, base: nn.Module, lora) -> nn.Module:
    """The adapters `trained` learnt on its quantized base, on `base` instead: the same model
    loaded again in full precision (with any language row the run added). Returns `base`
    wrapped with the same adapters (`lora`, quantize_base none) holding `trained`'s trainable
    weights, ready for peft's merge into the original weights (final/, `average`)."""
    full = prepare_model(
        base, mode="lora", checkpointing="off", lora=replace(lora, quantize_base="none")
    )
    adapters = {
        name: param.detach().to("cpu")
        for name, param in trained.named_parameters()
        if param.requires_grad
    }
    expected = {name for name, param in full.named_parameters() if param.requires_grad}
    if set(adapters) != expected:  # a programming error, not a user's: the layouts differ
        raise RuntimeError(
            f"adapters differ: {sorted(set(adapters) ^ expected)[:3]} (trained vs full base)"
        )
    with torch.no_grad():
        params = dict(full.named_parameters())
        for name, value in adapters.items():
            params[name].copy_(value)
    trained_whisper, whole = whisper_of(trained), whisper_of(full)
    whole.config, whole.generation_config = (
        trained_whisper.config,
        trained_whisper.generation_config,
    )
    return full


def activation_offload(enabled: bool, device: torch.device):
    """Keep the tensors saved for backward (with checkpointing: the layer inputs) in pinned host
    memory during the forward pass, and bring them back for backward. On a CPU they already are
    in host memory, so this is a no-op there."""
    if not enabled or torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=True)


def trainable_parameter_summary(model: nn.Module) -> str:
    """One line: trainable / total parameters, split into encoder, decoder and LoRA."""
    total = trainable = 0
    parts = {"encoder": 0, "decoder": 0, "lora": 0}
    for name, param in model.named_parameters():
        total += weights_held(param)  # a 4-bit base packs two weights a byte
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
    targets = list(settings.targets)
    if settings.decoder_only:
        # Every targeted module outside the encoder, by its whole name (peft's `exclude_modules`
        # is newer than the oldest peft supported). The decoder's cross-attention
        # (`model.decoder.layers.N.encoder_attn`) is the decoder's, and keeps its adapters.
        targets = [
            name
            for name, _ in whisper.named_modules()
            if name.rsplit(".", 1)[-1] in settings.targets and ".encoder." not in f".{name}."
        ] or targets  # none: peft's own message names the targets
    if settings.variant not in LORA_VARIANTS:
        raise UserError(
            f"--lora-variant {settings.variant}: expected one of {', '.join(LORA_VARIANTS)}"
        )
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        use_dora=settings.variant == "dora",
        use_rslora=settings.variant == "rslora",
        **_trainable_tokens(whisper, settings.new_languages),
    )
    try:
        return get_peft_model(whisper, config)
    except ValueError as exc:  # peft's message when no module matches the targets
        raise UserError(
            f"--lora-targets {','.join(settings.targets)}: {str(exc).splitlines()[0]} "
            "(Whisper's linear layers: q_proj, k_proj, v_proj, out_proj, fc1, fc2)"
        ) from None


def _trainable_tokens(whisper: nn.Module, languages: tuple[str, ...]) -> dict:
    """LoraConfig's `trainable_token_indices` for the rows of added language tokens (none:
    nothing, so a plain LoRA run's config is as it was)."""
    if not languages:
        return {}
    lang_to_id = whisper.generation_config.lang_to_id
    return {
        "trainable_token_indices": {"embed_tokens": [lang_to_id[f"<|{c}|>"] for c in languages]}
    }


def _narrow_checkpointing(whisper: nn.Module, policy: str) -> None:
    """Turn checkpointing off on layers the policy leaves out and on layers no gradient reaches.

    Releases before transformers 4.53 checkpoint whole stacks: a stack is on when any of its
    layers is chosen, and every-N (N > 1) cannot be expressed there.
    """
    if _per_layer_checkpointing(whisper):
        _set_layer_flags(whisper, checkpointed_layers(whisper, policy))
        return
    if (parse_every_n(policy) or 1) > 1:
        raise UserError(
            f"--gradient-checkpointing {policy}: this transformers release checkpoints whole "
            "stacks only; use full or encoder, or upgrade transformers to 4.53 or newer"
        )
    chosen_stacks = {stack for stack, _ in checkpointed_layers(whisper, policy)}
    whisper.model.encoder.gradient_checkpointing = "encoder" in chosen_stacks
    whisper.model.decoder.gradient_checkpointing = "decoder" in chosen_stacks


def _set_layer_flags(whisper: nn.Module, chosen: set[tuple[str, int]]) -> None:
    """Each layer's `gradient_checkpointing` flag: on exactly for the (stack, index) in `chosen`."""
    for stack, layers in _layer_stacks(whisper).items():
        for index, layer in enumerate(layers):
            layer.gradient_checkpointing = (stack, index) in chosen


def _layer_stacks(whisper: nn.Module) -> dict[str, nn.ModuleList]:
    return {"encoder": whisper.model.encoder.layers, "decoder": whisper.model.decoder.layers}


def _trains(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _per_layer_checkpointing(whisper: nn.Module) -> bool:
    """True where each layer decides for itself (transformers >= 4.53, GradientCheckpointingLayer);
    older releases checkpoint from the encoder/decoder stack's loop."""
    return hasattr(whisper.model.encoder.layers[0], "gradient_checkpointing")


# -- what is checkpointed and how -----------------------------------------------------------


def checkpointing_on(whisper: nn.Module) -> bool:
    """Whether any layer (transformers >= 4.53) or stack (older) recomputes in backward."""
    stacks = (whisper.model.encoder, whisper.model.decoder)
    if _per_layer_checkpointing(whisper):
        return any(layer.gradient_checkpointing for stack in stacks for layer in stack.layers)
    return any(getattr(stack, "gradient_checkpointing", False) for stack in stacks)


def recomputed_decoder_layers(whisper: nn.Module) -> set[int]:
    """Indices of the decoder layers whose forward runs again in backward (in training mode)."""
    layers = whisper.model.decoder.layers
    if _per_layer_checkpointing(whisper):
        return {index for index, layer in enumerate(layers) if layer.gradient_checkpointing}
    stack_on = getattr(whisper.model.decoder, "gradient_checkpointing", False)
    return set(range(len(layers))) if stack_on else set()


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


__all__ = [
    "CHECKPOINT_POLICIES",
    "MODES",
    "LoraSettings",
    "adapters_on_full_precision",
    "activation_offload",
    "checkpointed_layers",
    "checkpointing_on",
    "checkpointing_policy",
    "checkpointing_state",
    "checkpointing_units",
    "effective_use_reentrant",
    "normalise_policy",
    "parse_every_n",
    "prepare_model",
    "resolve_checkpointing",
    "trainable_parameter_summary",
]
