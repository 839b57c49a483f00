"""What fits: the cheapest checkpointing whose estimated peak training memory fits a budget.

Out-of-memory is the first complaint of people fine-tuning Whisper (transformers #20348 and
many more), and nothing tells them in advance what would fit. `plan_checkpointing` answers
before the first step: one small probe batch calibrates the count of saved activations
(probe.py), each policy's peak is estimated (estimate.py), and the cheapest of off → every-N →
encoder → full → full + offload that fits is chosen, with a table of them all
(`format_plan_table`).

`prepare_model_within_budget` is `--gradient-checkpointing auto`: it prepares the model, plans,
and narrows the model to the plan's policy. The estimate's and the probe's names import from
here too, as they did before those modules held them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from whisper_train.audio import ENCODER_POSITIONS
from whisper_train.data.labels import MAX_DECODER_TOKENS
from whisper_train.errors import UserError
from whisper_train.memory.checkpointing import LoraSettings, prepare_model
from whisper_train.memory.estimate import (
    MemoryEstimate,
    count_saved_bytes,
    estimate_memory,
    model_flops_per_sample,
)
from whisper_train.memory.probe import calibrate, probe_saved_bytes
from whisper_train.memory.wrappers import whisper_of
from whisper_train.units import format_bytes


@dataclass(frozen=True)
class Plan:
    """The checkpointing `plan_checkpointing` chose, and why (`table` is printable)."""

    policy: str  # off | every-N | encoder | full: pass to memory.prepare_model(checkpointing=)
    offload: bool  # keep checkpoint inputs in host memory (--offload-activations)
    estimate_bytes: int
    table: str
    estimates: dict[str, MemoryEstimate] = field(default_factory=dict)


# -- choosing a policy ------------------------------------------------------------------------


def plan_checkpointing(
    model: nn.Module,
    *,
    mode: str,
    batch_size: int,
    max_memory_bytes: int,
    label_tokens: int = MAX_DECODER_TOKENS,
    precision: str = "fp32",
    optimizer: str = "adamw",
    every_n: int = 2,
    probe: bool = True,
    encoder_rows: int | None = None,
) -> Plan:
    """The cheapest of off → every-N → encoder → full → full + offload whose estimate fits.

    `model` is prepared for `mode` (frozen parts, LoRA) by `memory.prepare_model`. With `probe`,
    one batch-1 forward pass calibrates the activation count (`calibrate`). Raises UserError
    naming --max-memory and the smallest budget that would fit when nothing does.
    """
    scale = _probe_scale(model, min(label_tokens, 32)) if probe else 1.0
    candidates = [
        ("off", False),
        (f"every-{every_n}", False),
        ("encoder", False),
        ("full", False),
        ("full", True),
    ]
    estimates: dict[str, MemoryEstimate] = {}
    chosen: tuple[str, bool] | None = None
    for policy, offload in candidates:
        name = policy + (" + offload" if offload else "")
        estimate = estimate_memory(
            model,
            policy=policy,
            batch_size=batch_size,
            label_tokens=label_tokens,
            precision=precision,
            optimizer=optimizer,
            offload=offload,
            activation_scale=scale,
            encoder_rows=encoder_rows,
        )
        estimates[name] = estimate
        if chosen is None and estimate.total <= max_memory_bytes:
            chosen = (policy, offload)
    table = format_plan_table(
        estimates,
        chosen=chosen,
        max_memory_bytes=max_memory_bytes,
        header=f"mode {mode}, batch {batch_size}"
        + (f" (encoder {encoder_rows})" if encoder_rows not in (None, batch_size) else "")
        + f", labels <= {label_tokens} "
        f"tokens, {precision}, {optimizer}, probe scale {scale:.2f}",
    )
    if chosen is None:
        smallest = min(estimates.values(), key=lambda e: e.total)
        raise UserError(
            f"--max-memory {format_bytes(max_memory_bytes)}: nothing fits at batch {batch_size} (smallest: "
            f"full checkpointing + offload needs {format_bytes(smallest.total)}); raise --max-memory, "
            f"lower --batch-size, or use --mode lora / freeze-encoder / --optim adamw8bit"
        )
    name = chosen[0] + (" + offload" if chosen[1] else "")
    return Plan(
        policy=chosen[0],
        offload=chosen[1],
        estimate_bytes=estimates[name].total,
        table=table,
        estimates=estimates,
    )


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
    encoder_rows: int | None = None,
) -> tuple[nn.Module, Plan]:
    """`--gradient-checkpointing auto`: the cheapest policy whose estimated peak fits.

    The model is prepared once with full checkpointing (so frozen parts, adapters and peft's
    hooks are what training will see), the planner measures one batch-1 forward pass to
    calibrate its estimate, and the model is narrowed to the chosen policy. Returns the model
    and the `Plan` (its `table` says what was considered and why).
    """
    compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    model = prepare_model(
        model, mode=mode, checkpointing="full", lora=lora, compute_dtype=compute_dtype
    )
    plan = plan_checkpointing(
        model,
        mode=mode,
        batch_size=batch_size,
        max_memory_bytes=max_memory_bytes,
        label_tokens=label_tokens,
        precision=precision,
        optimizer=optimizer,
        encoder_rows=encoder_rows,
    )
    return prepare_model(model, mode=mode, checkpointing=plan.policy, lora=lora), plan


def _probe_scale(model: nn.Module, label_tokens: int) -> float:
    """`calibrate` without checkpointing, or with it where one sample's activations do not fit;
    1.0 (the count alone) when neither fits or checkpointing is not enabled on the model."""
    checkpointable = getattr(
        whisper_of(model).model.encoder.layers[0], "_gradient_checkpointing_func", None
    )
    for policy in ("off", "full") if checkpointable else ("off",):
        try:
            return calibrate(model, label_tokens=label_tokens, policy=policy)
        except torch.OutOfMemoryError:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return 1.0


def format_plan_table(
    estimates: dict[str, MemoryEstimate],
    *,
    chosen: tuple[str, bool] | None,
    max_memory_bytes: int,
    header: str = "",
) -> str:
    """A fixed-width table, one row per policy, GiB per term; the chosen row is marked."""
    chosen_name = None if chosen is None else chosen[0] + (" + offload" if chosen[1] else "")
    lines = [f"memory plan ({header}); budget {format_bytes(max_memory_bytes)}"] if header else []
    lines.append(
        f"   {'policy':<17}{'weights':>9}{'grads':>9}{'optim':>9}{'activ.':>9}"
        f"{'working':>9}{'total':>9}  fits"
    )
    for name, e in estimates.items():
        fits = "yes" if e.total <= max_memory_bytes else "no"
        marker = "->" if name == chosen_name else "  "
        cells = (e.weights, e.gradients, e.optimizer, e.activations, e.working, e.total)
        lines.append(
            f"{marker} {name:<17}" + "".join(f"{c / 2**30:>9.2f}" for c in cells) + f"  {fits}"
        )
    lines.append(
        "  (GiB; activations include the whole batch; working = logits gradient, one "
        "recomputed layer, autocast weight copies)"
    )
    return "\n".join(lines)


def encoder_cache_line(
    config, *, n_clips: int, folder: str, limit_bytes: int, storage_bits: int = 16
) -> str:
    """The plan's line for a frozen encoder's cached outputs: disk, not device memory, so
    outside the budget above, but sized here with the rest (1500 x d_model values a clip)."""
    clip_bytes = ENCODER_POSITIONS * config.d_model * storage_bits // 8
    return (
        f"   encoder cache (disk, not device memory): {n_clips} clips x "
        f"{format_bytes(clip_bytes)} = {format_bytes(n_clips * clip_bytes)} at most, in {folder} "
        f"(limit {format_bytes(limit_bytes)})"
    )


__all__ = [
    "MemoryEstimate",
    "Plan",
    "calibrate",
    "count_saved_bytes",
    "encoder_cache_line",
    "estimate_memory",
    "format_plan_table",
    "model_flops_per_sample",
    "plan_checkpointing",
    "prepare_model_within_budget",
    "probe_saved_bytes",
]
