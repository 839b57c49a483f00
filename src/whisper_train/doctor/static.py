"""Static checks: versions, flags and the model's checkpointing state, read without running it
(cheap enough for `train` to run before step 1)."""

from __future__ import annotations

import functools
import importlib.util

import torch
import transformers
from packaging.version import Version
from transformers.modeling_layers import GradientCheckpointingLayer

from whisper_train.doctor.report import NON_REENTRANT_REMEDY, Check
from whisper_train.doctor.trainer import trainer_checkpointing
from whisper_train.memory import (
    checkpointing_state,
    whisper_or_none,
)

# transformers releases whose Whisper decoder passes encoder_hidden_states by keyword into a
# checkpointed layer: reentrant checkpointing then breaks full fine-tuning (T1).
T1_AFFECTED = (Version("4.53.0"), Version("4.58.0"))

# -- static checks -----------------------------------------------------------------------------


def check_statically(model, *, trainer_args, ddp, compile, hand_enabled) -> list[Check]:
    state = checkpointing_state(model)
    checks = [
        _check_versions(model, state),
        _check_reentrant(state),
        _check_peft_order(model, state),
        _check_quantized_base(model, state),
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


# bitsandbytes' quantized linear layers, by class name, theirs or a base class's (bitsandbytes
# itself is optional; peft's LoRA layers around them share the names, not the module).
QUANTIZED_LAYERS = ("Linear8bitLt", "Linear4bit")


def _check_quantized_base(model, state) -> Check | None:
    """A base held in 8 or 4 bits (bitsandbytes) under reentrant checkpointing: what peft's
    `prepare_model_for_kbit_training` leaves, since it enables checkpointing without
    use_reentrant (and casts every 16-bit parameter to 32 bits)."""
    quantized = [
        m
        for m in model.modules()
        if any(
            c.__name__ in QUANTIZED_LAYERS and c.__module__.startswith("bitsandbytes")
            for c in type(m).__mro__
        )
    ]
    if not quantized:
        return None
    if state["reentrant"]:
        return Check(
            "quantized base",
            "fail",
            f"{len(quantized)} bitsandbytes layers under reentrant checkpointing, as peft's "
            "prepare_model_for_kbit_training leaves them (peft <= 0.21 by default, or asked "
            "use_reentrant=True): the adapters get no gradient, or "
            "backward fails with 'element 0 of tensors does not require grad'",
            "whisper-train train --mode lora --quantize-base nf4|int8 (no kbit preparation), or "
            'prepare_model_for_kbit_training(model, gradient_checkpointing_kwargs={"use_reentrant": '
            "False})",
            "T9",
        )
    return Check(
        "quantized base",
        "pass",
        f"{len(quantized)} bitsandbytes layers, checkpointing non-reentrant or off",
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


def hooks_replay_on_recompute() -> bool:
    """True on transformers releases that checkpoint a layer's `__call__` (4.x): forward
    pre-hooks registered on a checkpointed layer then run again during recompute (T8), and so
    do forward hooks when torch's checkpoint early stop is off. 5.x checkpoints `forward`,
    leaving the layer's hooks outside."""
    return "__call__" in GradientCheckpointingLayer.__dict__
