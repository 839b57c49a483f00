"""The dynamic check: one forward and backward with and without checkpointing on copies of the
model, compared gradient by gradient, with the checkpointed layers' recompute observed."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from whisper_train.doctor.report import NON_REENTRANT_REMEDY, Check
from whisper_train.memory import (
    checkpointing_state,
    checkpointing_units,
)

# -- dynamic checks ----------------------------------------------------------------------------


@dataclass
class _Probe:
    """What one instrumented step saw at each checkpointed module."""

    calls: dict[str, int] = field(default_factory=dict)  # runs of the wrapped function
    keyword_grad: dict[str, list[str]] = field(default_factory=dict)  # T1 evidence
    no_positional_grad: list[str] = field(default_factory=list)  # T2 evidence


@contextlib.contextmanager
def _instrument(model: nn.Module) -> Iterator[_Probe]:
    """Wrap every checkpointed module's checkpoint function to record its inputs and count how
    often the checkpointed function runs (forward + recompute)."""
    probe = _Probe()
    originals = {}
    for name, module in checkpointing_units(model):
        if not module.gradient_checkpointing or not hasattr(module, "_gradient_checkpointing_func"):
            continue
        originals[name] = (
            module,
            module.__dict__.get("_gradient_checkpointing_func"),
            module._gradient_checkpointing_func,
        )
        module._gradient_checkpointing_func = _spy(
            name, module, module._gradient_checkpointing_func, probe
        )
    try:
        yield probe
    finally:
        for module, own, _ in originals.values():
            if own is None:
                del module._gradient_checkpointing_func
            else:
                module._gradient_checkpointing_func = own


def _spy(name: str, module: nn.Module, checkpoint_func, probe: _Probe):
    trains = any(p.requires_grad for p in module.parameters())

    def spied(function, *args, **kwargs):
        keywords = dict(getattr(function, "keywords", {}) or {}) | kwargs
        grad_keywords = [
            k for k, v in keywords.items() if isinstance(v, torch.Tensor) and v.requires_grad
        ]
        if grad_keywords:
            probe.keyword_grad[name] = grad_keywords
        positional_grad = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        if trains and not positional_grad:
            probe.no_positional_grad.append(name)

        def counted(*inner_args, **inner_kwargs):
            probe.calls[name] = probe.calls.get(name, 0) + 1
            return function(*inner_args, **inner_kwargs)

        return checkpoint_func(counted, *args, **kwargs)

    return spied


def compare_with_and_without_checkpointing(
    model: nn.Module, inputs: dict[str, Any], *, loss_of
) -> list[Check]:
    state = checkpointing_state(model)
    reentrant = {n for n, r in state["use_reentrant"].items() if r is not False}
    _dropout_off(model)
    reference = copy.deepcopy(model)
    for _, module in checkpointing_units(reference):
        module.gradient_checkpointing = False

    checks: list[Check] = []
    torch.manual_seed(0)
    with _instrument(model) as probe:
        error = _backward(model, inputs, loss_of)
    torch.manual_seed(0)
    ref_error = _backward(reference, inputs, loss_of)

    t1 = sorted(n for n in probe.keyword_grad if n in reentrant)
    if t1:
        checks.append(
            Check(
                "keyword-grad",
                "fail",
                f"{len(t1)} reentrant checkpointed layers get tensors that need grad by "
                f"keyword (e.g. {t1[0]}: {', '.join(probe.keyword_grad[t1[0]])})",
                NON_REENTRANT_REMEDY,
                "T1",
            )
        )
    elif state["enabled"]:
        checks.append(
            Check(
                "keyword-grad",
                "pass",
                "no tensor that needs grad reaches a reentrant checkpointed layer by keyword",
            )
        )
    t2 = sorted({n for n in probe.no_positional_grad if n in reentrant})
    if t2:
        checks.append(
            Check(
                "frozen-input",
                "fail",
                f"{len(t2)} reentrant checkpointed layers hold trainable weights but no "
                f"positional input needs grad (e.g. {t2[0]}): their weights get no "
                "gradient",
                NON_REENTRANT_REMEDY,
                "T2",
            )
        )

    if ref_error is not None:
        checks.append(
            Check(
                "parity",
                "fail",
                f"the step without checkpointing fails too: {ref_error}",
                "fix the model or batch first (this is not a checkpointing fault)",
            )
        )
        return checks
    if error is not None:
        trigger = (
            "T1" if "second time" in error else "T2" if "does not require grad" in error else ""
        )
        checks.append(
            Check(
                "parity",
                "fail",
                f"backward with checkpointing fails: {error}",
                NON_REENTRANT_REMEDY,
                trigger,
            )
        )
        return checks
    checks.append(_compare(model, reference, state, probe))
    checks.append(_check_stale_graph(model))
    return checks


def _dropout_off(model: nn.Module) -> None:
    """Dropout and layerdrop off, so the two steps see identical computations."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for attribute in ("dropout", "activation_dropout", "attention_dropout", "layerdrop"):
            if isinstance(getattr(module, attribute, None), float):
                setattr(module, attribute, 0.0)


def model_loss(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    return model(**inputs).loss


def _backward(model: nn.Module, inputs: dict[str, Any], loss_of) -> str | None:
    model.zero_grad(set_to_none=True)
    try:
        loss_of(model, inputs).backward()
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None


def _compare(model, reference, state, probe: _Probe) -> Check:
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    ref_params = dict(reference.named_parameters())
    missing = [n for n, p in trained.items() if p.grad is None and ref_params[n].grad is not None]
    if missing:
        return Check(
            "parity",
            "fail",
            f"{len(missing)} trainable parameters get no gradient with checkpointing "
            f"(e.g. {missing[0]}) but do without",
            NON_REENTRANT_REMEDY,
            "T2",
        )
    unreached = [n for n, p in trained.items() if p.grad is None]
    if unreached:
        return Check(
            "parity",
            "fail",
            f"{len(unreached)} trainable parameters get no gradient, with or without "
            f"checkpointing (e.g. {unreached[0]}): the loss does not depend on them",
            "freeze them (requires_grad=False), or check that the forward pass uses them",
        )
    nonzero = {n for n, p in trained.items() if p.grad.abs().sum() > 0}
    ref_nonzero = {
        n
        for n, p in ref_params.items()
        if p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0
    }
    if nonzero != ref_nonzero:
        diff = sorted(nonzero ^ ref_nonzero)
        return Check(
            "parity",
            "fail",
            f"{len(diff)} parameters differ in whether they get a gradient (e.g. {diff[0]})",
            NON_REENTRANT_REMEDY,
            "T2",
        )
    max_diff, scale = 0.0, 0.0
    for n, p in trained.items():
        if p.grad is not None:
            max_diff = max(max_diff, (p.grad - ref_params[n].grad).abs().max().item())
            scale = max(scale, ref_params[n].grad.abs().max().item())
    # Recompute runs the same kernels on the same inputs: equal on a CPU; GPU kernels may pick
    # other algorithms, hence a relative tolerance rather than bitwise equality.
    tolerance = 1e-6 * max(scale, 1.0)
    not_recomputed = [n for n in state["modules"] if probe.calls.get(n, 0) < 2]
    if max_diff > tolerance:
        return Check(
            "parity",
            "fail",
            f"gradients differ from no-checkpointing by up to {max_diff:.3g} "
            f"(tolerance {tolerance:.1g})",
            "look for stateful layers or caches inside checkpointed calls",
            "T7",
        )
    if state["enabled"] and not_recomputed:
        return Check(
            "parity",
            "fail",
            f"checkpointing is configured but {not_recomputed[0]} was not recomputed",
            "the model must be in training mode; check the checkpoint function",
            "T5",
        )
    # LoRA B starts at zero, so at step 0 the gradient reaching every A matrix is zero (it is
    # B's transpose times the upstream gradient): expected, and non-zero after one update.
    zero = sorted(set(trained) - nonzero)
    lora_a = _lora_a_behind_zero_b(model)
    unexplained = [n for n in zero if n not in lora_a]
    if unexplained:
        return Check(
            "parity",
            "fail",
            f"{len(unexplained)} trainable tensors get an all-zero gradient (e.g. "
            f"{unexplained[0]}), with or without checkpointing",
            "freeze them (requires_grad=False), or check what cuts them off from the loss",
        )
    recomputed = (
        f"{len(state['modules'])} layers recomputed" if state["enabled"] else "checkpointing off"
    )
    explained = (
        f"; the other {len(zero)} are LoRA A matrices, zero at step 0 by design because LoRA B "
        "starts at zero"
        if zero
        else ""
    )
    return Check(
        "parity",
        "pass",
        f"all {len(trained)} trainable tensors get a gradient, {len(nonzero)} non-zero"
        f"{explained}; the same as without checkpointing; max abs difference {max_diff:.3g}; "
        f"{recomputed}",
    )


def _lora_a_behind_zero_b(model: nn.Module) -> set[str]:
    """Names of the LoRA A weights whose B partner is all zero (PEFT's initialisation)."""
    names = {id(p): n for n, p in model.named_parameters()}
    found = set()
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter, b in module.lora_B.items():
            if adapter in module.lora_A and not any(w.any() for w in b.parameters()):
                found.update(names[id(w)] for w in module.lora_A[adapter].parameters())
    return found


def _check_stale_graph(model: nn.Module) -> Check:
    """A tensor attribute that still holds a graph after the step leaks into the next (T7)."""
    for name, module in model.named_modules():
        for attribute, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                return Check(
                    "state",
                    "warn",
                    f"{name}.{attribute} keeps a tensor with a grad_fn across steps",
                    "detach cached tensors; nothing stateful inside checkpointed calls",
                    "T7",
                )
    return Check("state", "pass", "no module keeps a graph between steps")
