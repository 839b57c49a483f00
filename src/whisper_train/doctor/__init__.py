"""`whisper-train doctor`: prove a training configuration's gradient checkpointing is sound.

Two kinds of check, each tied to a trigger in docs/checkpointing.md (T1-T10):

* static checks read versions, flags and the model's checkpointing state: cheap enough for
  `train` to run before step 1 (`static_checks`, which refuses a known failure);
* dynamic checks run one forward + backward on a real batch twice, on deep copies of the model,
  with and without checkpointing (dropout off, same seed), and compare: every trainable
  parameter has a gradient, the set of non-zero gradients matches, the largest difference, and
  that the checkpointed layers really were recomputed. One instrumented forward also looks at
  what each checkpointed layer receives: a tensor that needs grad passed by keyword (T1) or no
  positional input that needs grad around trainable weights (T2) under reentrant checkpointing.

The model is checked the way it will train: if Hugging Face `Seq2SeqTrainingArguments` are
given, the copy first gets the checkpointing the Trainer would switch on.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import transformers
from packaging.version import Version
from torch import nn

from whisper_train.config import RunConfig
from whisper_train.errors import UserError
from whisper_train.memory import (
    LoraSettings,
    checkpointing_state,
    checkpointing_units,
    prepare_model,
    training_loss,
    whisper_or_none,
)

# transformers releases whose Whisper decoder passes encoder_hidden_states by keyword into a
# checkpointed layer: reentrant checkpointing then breaks full fine-tuning (T1).
T1_AFFECTED = (Version("4.53.0"), Version("4.58.0"))
# The forward keyword arguments a Whisper training step takes from a batch.
MODEL_INPUTS = (
    "input_features",
    "labels",
    "decoder_input_ids",
    "attention_mask",
    "decoder_attention_mask",
    "encoder_outputs",
)
NON_REENTRANT_REMEDY = (
    "use whisper_train.prepare_model (non-reentrant), or pass "
    'gradient_checkpointing_kwargs={"use_reentrant": False}'
)


@dataclass
class Check:
    id: str  # short name, e.g. "reentrant", "parity"
    status: str  # pass | warn | fail
    message: str
    remedy: str = ""
    trigger: str = ""  # T1..T10 from docs/checkpointing.md, or "" for a general check


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings allowed)."""
        return not any(check.status == "fail" for check in self.checks)

    def failed(self) -> list[Check]:
        return [check for check in self.checks if check.status == "fail"]

    def to_json(self) -> dict[str, Any]:
        keys = ("id", "status", "message", "remedy", "trigger")
        return {
            "checks": [{k: asdict(c)[k] for k in keys} for c in self.checks],
            "ok": self.ok,
        }


def format_report(report: DoctorReport) -> str:
    """One line per check: status, id, trigger, message; the remedy on the next line."""
    lines = []
    for check in report.checks:
        trigger = f" [{check.trigger}]" if check.trigger else ""
        lines.append(f"{check.status.upper():4}  {check.id}{trigger}: {check.message}")
        if check.remedy and check.status != "pass":
            lines.append(f"      remedy: {check.remedy}")
    verdict = "ok: nothing failed" if report.ok else f"{len(report.failed())} check(s) failed"
    lines.append(verdict)
    return "\n".join(lines)


# -- entry points ------------------------------------------------------------------------------


def run(
    model: nn.Module,
    batch: dict[str, Any],
    *,
    mode: str | None = None,
    checkpointing: str | None = None,
    lora: LoraSettings | None = None,
    trainer_args: Any = None,
    ddp: dict[str, Any] | None = None,
    compile: bool | None = None,
) -> DoctorReport:
    """All checks for `model` trained on `batch` ({"input_features": (B, n_mels, frames),
    "labels": (B, T), ...}).

    With `mode` given, a copy of the model is first prepared by `prepare_model(mode,
    checkpointing, lora)`: the check of a whisper-train configuration. Without it the model is
    checked as it is (a hand-made setup). `trainer_args` are Seq2SeqTrainingArguments the model
    will be trained with; `ddp` is {"world_size", "find_unused_parameters", "static_graph",
    "gradient_accumulation"}.
    The caller's model is never modified.
    """
    model = copy.deepcopy(model)
    if mode is not None:
        model = prepare_model(model, mode=mode, checkpointing=checkpointing or "off", lora=lora)
    model, hand_enabled = _as_trainer_will_run(model, trainer_args)
    model.train()  # checkpointing acts only in training mode
    report = DoctorReport(
        _static(
            model, trainer_args=trainer_args, ddp=ddp, compile=compile, hand_enabled=hand_enabled
        )
    )
    inputs = {k: v for k, v in batch.items() if k in MODEL_INPUTS and v is not None}
    if "labels" not in inputs:
        raise UserError("doctor: the batch needs labels (token ids) to compute a training loss")
    # A whisper-train configuration is checked with the loss `train` computes (chunked, and
    # recomputed under checkpointing); a hand-made setup with the model's own loss.
    ours = mode is not None and "decoder_input_ids" in inputs
    report.checks.extend(_dynamic(model, inputs, loss_of=training_loss if ours else _model_loss))
    return report


def static_checks(
    model: nn.Module,
    *,
    trainer_args: Any = None,
    ddp: dict[str, Any] | None = None,
    compile: bool | None = None,
    refuse: bool = True,
) -> list[Check]:
    """The cheap checks (no forward pass). With `refuse`, a failed check raises `UserError`
    naming the trigger and the remedy, so `train` stops before step 1."""
    if trainer_checkpointing(trainer_args)[0]:
        model = copy.deepcopy(model)  # the Trainer's setting is tried on a copy
    model, hand_enabled = _as_trainer_will_run(model, trainer_args)
    checks = _static(
        model, trainer_args=trainer_args, ddp=ddp, compile=compile, hand_enabled=hand_enabled
    )
    for check in checks:
        if refuse and check.status == "fail":
            raise UserError(f"{check.message} ({check.trigger}); {check.remedy}")
    return checks


def hooks_replay_on_recompute() -> bool:
    """True on transformers releases that checkpoint a layer's `__call__` (4.x): forward
    pre-hooks registered on a checkpointed layer then run again during recompute (T8), and so
    do forward hooks when torch's checkpoint early stop is off. 5.x checkpoints `forward`,
    leaving the layer's hooks outside."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # before 4.52 the stacks call the checkpoint function on __call__
        return True
    return "__call__" in GradientCheckpointingLayer.__dict__


# -- the model as it will train ---------------------------------------------------------


def _as_trainer_will_run(model: nn.Module, trainer_args: Any) -> tuple[nn.Module, bool]:
    """`model` (modified in place) with the checkpointing a Hugging Face Trainer would switch
    on; and whether checkpointing was already on by hand before that."""
    hand_enabled = _is_hand_enabled(model)
    flag, kwargs = trainer_checkpointing(trainer_args)
    if flag:
        _enable_like_trainer(model, kwargs)
    return model, hand_enabled


def trainer_checkpointing(trainer_args: Any) -> tuple[bool, dict | None]:
    """(flag, kwargs) from Seq2SeqTrainingArguments (5.x names first, then 4.x names)."""
    if trainer_args is None:
        return False, None
    flag = getattr(trainer_args, "activation_checkpointing", None)
    if flag is None:
        flag = getattr(trainer_args, "gradient_checkpointing", False)
    kwargs = getattr(trainer_args, "activation_checkpointing_kwargs", None)
    if kwargs is None:
        kwargs = getattr(trainer_args, "gradient_checkpointing_kwargs", None)
    if isinstance(kwargs, str):  # the Trainer accepts a JSON string from the command line
        kwargs = json.loads(kwargs)
    return bool(flag), kwargs


def _enable_like_trainer(model: nn.Module, kwargs: dict | None) -> None:
    """What `Trainer.train()` does with gradient_checkpointing=True, on this transformers."""
    if hasattr(model, "activation_checkpointing_enable"):  # 5.x: {} and None both mean default
        kwargs = dict(kwargs or {})
        every = kwargs.pop("every_n_layers", 1)
        offload = kwargs.pop("offload", False)
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs or None, every_n_layers=every, offload=offload
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _is_hand_enabled(model: nn.Module) -> bool:
    """Checkpointing is on but was not set by prepare_model (which marks the model)."""
    whisper = whisper_or_none(model)
    marked = whisper is not None and getattr(whisper, "_whisper_train_checkpointing", None)
    return checkpointing_state(model)["enabled"] and not marked


# -- static checks -----------------------------------------------------------------------------


def _static(model, *, trainer_args, ddp, compile, hand_enabled) -> list[Check]:
    state = checkpointing_state(model)
    checks = [
        _check_versions(model, state),
        _check_reentrant(state),
        _check_peft_order(model, state),
        _check_trainer(model, state, trainer_args, hand_enabled),
        _check_ddp(model, state, trainer_args, ddp),
        _check_compile(state, compile),
        _check_hooks(model, state),
        _check_generate_patch(model),
    ]
    return [check for check in checks if check is not None]


def _check_versions(model, state) -> Check:
    version = Version(transformers.__version__)
    affected = T1_AFFECTED[0] <= version < T1_AFFECTED[1]
    whisper = whisper_or_none(model)
    if affected and state["reentrant"] and whisper is not None:
        encoder_trains = _encoder_output_needs_grad(model, whisper, state)
        decoder_checkpointed = any(".decoder." in f".{n}." for n in state["reentrant"])
        if encoder_trains and decoder_checkpointed and len(whisper.model.decoder.layers) >= 2:
            return Check(
                "versions",
                "fail",
                f"transformers {version} passes encoder_hidden_states by keyword into reentrant "
                "checkpointed decoder layers while the encoder trains: backward fails with "
                "'Trying to backward through the graph a second time'",
                NON_REENTRANT_REMEDY,
                "T1",
            )
        return Check(
            "versions",
            "warn",
            f"transformers {version} is in the affected range 4.53-4.57 with reentrant "
            "checkpointing",
            NON_REENTRANT_REMEDY,
            "T1",
        )
    if importlib.util.find_spec("unsloth") is not None:
        return Check(
            "versions",
            "warn",
            "Unsloth is installed: its offloaded checkpoint function is reentrant "
            "underneath before its 2025.11.4 release",
            "upgrade unsloth to 2025.11.4 or newer, or freeze the encoder",
            "T5",
        )
    where = "affected range 4.53-4.57" if affected else "outside the affected range 4.53-4.57"
    return Check("versions", "pass", f"transformers {version}, torch {torch.__version__} ({where})")


def _encoder_output_needs_grad(model, whisper, state) -> bool:
    """Whether the encoder's output needs grad under this checkpointing: a reentrant
    checkpointed layer's output needs grad only if its positional input does (T2)."""
    modules = dict(model.named_modules())
    reentrant = {id(modules[name]) for name in state["reentrant"]}
    encoder = whisper.model.encoder

    def trains(module):
        return any(p.requires_grad for p in module.parameters())

    needs_grad = trains(encoder.conv1) or trains(encoder.conv2)
    for layer in encoder.layers:
        if id(layer) not in reentrant:
            needs_grad = needs_grad or trains(layer)
    return needs_grad or trains(encoder.layer_norm)


def _check_reentrant(state) -> Check:
    if not state["enabled"]:
        return Check("reentrant", "pass", "gradient checkpointing is off")
    unknown = [n for n, r in state["use_reentrant"].items() if r is None]
    reentrant = [n for n, r in state["use_reentrant"].items() if r]
    if reentrant:
        return Check(
            "reentrant",
            "warn",
            f"{len(reentrant)} of {len(state['modules'])} checkpointed modules run "
            f"reentrant (e.g. {reentrant[0]}; torch {torch.__version__} runs reentrant when "
            "use_reentrant is not given)",
            NON_REENTRANT_REMEDY,
            "T9",
        )
    if unknown:
        return Check(
            "reentrant",
            "warn",
            f"{unknown[0]} uses a replacement checkpoint function; whether it is "
            "reentrant cannot be read",
            "validate with the parity probe below",
            "T5",
        )
    return Check(
        "reentrant",
        "pass",
        f"{len(state['modules'])} checkpointed modules, all use_reentrant=False",
    )


def _check_peft_order(model, state) -> Check | None:
    if not hasattr(model, "peft_config"):
        return None
    whisper = whisper_or_none(model)
    hooked = whisper is not None and bool(getattr(whisper, "_require_grads_hook", None))
    if not state["reentrant"]:
        return Check(
            "peft",
            "pass",
            "PEFT adapters with non-reentrant checkpointing: the wrapping order and "
            f"input-grad hooks do not matter (hooks {'present' if hooked else 'absent'})",
        )
    detail = (
        "input-grad hooks present, but the encoder's input (log-mel features) never needs "
        "grad, so encoder adapters still get none"
        if hooked
        else "PEFT was wrapped before checkpointing was enabled, so no input-grad hooks exist"
    )
    return Check(
        "peft",
        "fail",
        f"PEFT adapters under reentrant checkpointing: {detail}",
        NON_REENTRANT_REMEDY,
        "T2",
    )


def _check_trainer(model, state, trainer_args, hand_enabled) -> Check | None:
    if trainer_args is None:
        return None
    flag, kwargs = trainer_checkpointing(trainer_args)
    if flag:
        if not kwargs or "use_reentrant" not in kwargs:
            effective = "reentrant" if state["reentrant"] else "non-reentrant"
            status = "fail" if state["reentrant"] else "warn"
            return Check(
                "trainer",
                status,
                f"Trainer gradient_checkpointing=True with gradient_checkpointing_kwargs="
                f"{kwargs!r}: use_reentrant is left to a default ({effective} on "
                f"transformers {transformers.__version__})",
                'pass gradient_checkpointing_kwargs={"use_reentrant": False}, or leave the '
                "flag False and let whisper_train.prepare_model own checkpointing",
                "T9",
            )
        return Check(
            "trainer",
            "pass",
            f"Trainer enables checkpointing with use_reentrant={kwargs['use_reentrant']}",
        )
    if hand_enabled:
        status = "fail" if state["reentrant"] else "warn"
        return Check(
            "trainer",
            status,
            "checkpointing was enabled on the model by hand while the Trainer's "
            "gradient_checkpointing is False: the Trainer ignores its "
            "gradient_checkpointing_kwargs and the model runs "
            f"{'reentrant' if state['reentrant'] else 'non-reentrant'}",
            "let one place own the setting: whisper_train.prepare_model(model, "
            'checkpointing="full") with the Trainer flag False',
            "T9",
        )
    return Check(
        "trainer",
        "pass",
        "Trainer's gradient_checkpointing is False; "
        + (
            "whisper_train.prepare_model owns checkpointing"
            if state["enabled"]
            else "checkpointing is off"
        ),
    )


def _check_ddp(model, state, trainer_args, ddp) -> Check:
    ddp = dict(ddp or {})
    if trainer_args is not None:
        ddp.setdefault("world_size", getattr(trainer_args, "world_size", 1))
        ddp.setdefault(
            "find_unused_parameters", getattr(trainer_args, "ddp_find_unused_parameters", None)
        )
        ddp.setdefault(
            "gradient_accumulation", getattr(trainer_args, "gradient_accumulation_steps", 1)
        )
    world = int(ddp.get("world_size") or 1)
    if world <= 1:
        return Check("ddp", "pass", "single process: DDP triggers T3/T4 do not apply")
    find_unused = ddp.get("find_unused_parameters")
    if find_unused is None:  # the Trainer's default: on unless checkpointing
        find_unused = not state["enabled"]
    whisper = whisper_or_none(model)
    layerdrop = (
        0.0
        if whisper is None
        else max(
            getattr(whisper.config, "encoder_layerdrop", 0.0),
            getattr(whisper.config, "decoder_layerdrop", 0.0),
        )
    )
    if find_unused and state["reentrant"] and not ddp.get("static_graph"):
        return Check(
            "ddp",
            "fail",
            f"DDP over {world} processes with find_unused_parameters=True and reentrant "
            "checkpointing: 'Expected to mark a variable ready only once'",
            "non-reentrant checkpointing, or find_unused_parameters=False / static_graph",
            "T3",
        )
    accumulation = int(ddp.get("gradient_accumulation") or 1)
    if ddp.get("static_graph") and accumulation > 1:
        return Check(
            "ddp",
            "fail",
            f"DDP over {world} processes with static_graph=True and gradient accumulation "
            f"{accumulation}: no_sync on a static graph fails at the first backward "
            "('expect_autograd_hooks_ INTERNAL ASSERT FAILED', pytorch#143580)",
            "static_graph=False (non-reentrant checkpointing does not need it)",
        )
    if layerdrop > 0 and not find_unused:
        return Check(
            "ddp",
            "fail",
            f"layerdrop {layerdrop} skips layers, leaving unused parameters, but DDP's "
            "find_unused_parameters is False",
            "set encoder_layerdrop and decoder_layerdrop to 0, or find_unused_parameters="
            "True with non-reentrant checkpointing",
            "T4",
        )
    return Check(
        "ddp",
        "pass",
        f"DDP over {world} processes: find_unused_parameters={find_unused}, layerdrop {layerdrop}",
    )


def _check_compile(state, compile) -> Check | None:
    if not compile:
        return None
    if state["reentrant"]:
        return Check(
            "compile",
            "fail",
            "torch.compile with reentrant checkpointing: compiled autograd does not support it",
            NON_REENTRANT_REMEDY,
            "T6",
        )
    return Check(
        "compile",
        "warn",
        "torch.compile can hide or reveal checkpointing faults depending on mode; the "
        "parity probe here runs uncompiled",
        "run one real training step in the same compile mode before a long run",
        "T6",
    )


def _check_hooks(model, state) -> Check:
    modules = dict(model.named_modules())
    hooked = [
        n for n in state["modules"] if modules[n]._forward_hooks or modules[n]._forward_pre_hooks
    ]
    if hooked and hooks_replay_on_recompute():
        return Check(
            "hooks",
            "warn",
            f"{len(hooked)} checkpointed layers carry forward hooks (e.g. {hooked[0]}); "
            f"transformers {transformers.__version__} checkpoints __call__, so they run "
            "again during recompute",
            "keep those hooks stateless, or upgrade to transformers 5",
            "T8",
        )
    return Check("hooks", "pass", "no forward hook replays on recompute")


def _check_generate_patch(model) -> Check | None:
    generate = model.__dict__.get("generate")
    if not isinstance(generate, functools.partial):
        return None
    return Check(
        "generate",
        "pass",
        f"model.generate is wrapped in functools.partial({generate.keywords}); this does "
        "not affect training or checkpointing (prefer generation_config.language/task)",
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


def _dynamic(model: nn.Module, inputs: dict[str, Any], *, loss_of) -> list[Check]:
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


def _model_loss(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
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
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return set()
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


# -- a training configuration, as `whisper-train doctor` checks it ------------------------------


def check_config(config: RunConfig, *, probe_batch_size: int = 2) -> DoctorReport:
    """Every check for the model, mode and memory options of `config`, as `train` would set
    them up: load the model, probe `probe_batch_size` utterances (--data's first, or a
    synthetic batch without --data) and `run` the static and dynamic checks on it."""
    from whisper_train.memory import resolve_checkpointing
    from whisper_train.models import load_model

    model, processor = load_model(
        config.model.model, attn_implementation=config.model.attn_implementation
    )
    batch = probe_batch(model, processor, config, size=probe_batch_size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m = config.model
    return run(
        model.to(device),
        {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()},
        mode=m.mode,
        checkpointing=resolve_checkpointing(config.memory.gradient_checkpointing, device),
        lora=LoraSettings(m.lora_r, m.lora_alpha, m.lora_dropout, tuple(m.lora_targets)),
        ddp={
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "find_unused_parameters": False,
        },  # as `train` configures DDP
        compile=config.memory.compile,
    )


def probe_batch(model, processor, config, *, size: int = 2) -> dict[str, torch.Tensor]:
    """The first `size` utterances of --data through the training pipeline, or, without
    --data, `size` rows of noise features with a short transcript: the shapes are what matter."""
    from whisper_train.data.collate import SpeechCollator
    from whisper_train.data.features import LogMel, SpeechDataset
    from whisper_train.data.labels import LabelEncoder
    from whisper_train.models import is_multilingual

    encoder = LabelEncoder(
        processor.tokenizer,
        language=config.data.language,
        task=config.data.task,
        multilingual=is_multilingual(model),
    )
    collator = SpeechCollator(
        processor.tokenizer.pad_token_id, log_mel=LogMel(processor.feature_extractor)
    )
    if config.data.data:
        from whisper_train.data.layouts import load_examples

        examples = load_examples(config.data.data, data_format=config.data.data_format)[:size]
        batch = collator([SpeechDataset(examples, encoder)[i] for i in range(len(examples))])
        if not batch.get("size"):
            raise UserError(
                f"--data {config.data.data}: none of the first {size} clips could be "
                "read; run `whisper-train check-data` on it"
            )
    else:
        from whisper_train.data.examples import Example

        tokens = [encoder.encode(Example(audio="", text="hello world"))] * size
        batch = collator.pad_labels([t for t, _ in tokens], [n for _, n in tokens])
        generator = torch.Generator().manual_seed(0)
        frames = 2 * model.config.max_source_positions
        batch["input_features"] = torch.randn(
            size, model.config.num_mel_bins, frames, generator=generator
        )
    return batch
