"""Every memory decision whisper-train makes lives in this package; nothing else sets them.

    wrappers       find the Whisper model inside peft, DDP and torch.compile wrappers; DDP's settings
    quantize       --quantize-base: LoRA's frozen base in bitsandbytes' 8- or 4-bit layers, and
                   the trained adapters moved onto the full-precision base for merging
    checkpointing  freezing, LoRA and checkpointing in the one order that works (`prepare_model`),
                   the checkpointing policies and which layers each recomputes, activation offload
    sharding       --fsdp: FSDP2 sharding of the layers and the model, gathering for evaluation,
                   saving
    loss           the training loss without full-vocabulary logits (`training_loss`)
    cross_attention  the decoder's cross-attention on cached encoder outputs in its cheaper
                   order (`folded_cross_attention`, used by the loss)
    precision      the autocast dtype and loss scaling (`resolve_precision`)
    optim          AdamW, fused or 8-bit, weight decay on matrices only (`build_optimizer`)
    estimate       the peak-memory estimate of a training step, counted from the model's shapes
                   (`estimate_memory`), and its FLOPs (`model_flops_per_sample`)
    probe          saved activations measured on the real model, calibrating the estimate
    plan           `--gradient-checkpointing auto`: the cheapest policy whose estimate fits
                   (`plan_checkpointing`, `prepare_model_within_budget`) and its table
    host           after the last step: the optimizer's state dropped and the steps' freed
                   memory handed back before final/ (`release_training_state`)

The submodules import downwards only: wrappers <- quantize <- checkpointing, sharding <- loss <- estimate
<- probe <- plan; cross_attention <- loss; precision, optim and host stand alone (quantize hands
back through host what it frees). The names below are
re-exported so `from whisper_train.memory import X` works for the public API.
`LOSS_CHUNK_TOKENS` is deliberately not: `training_loss` reads it from
`whisper_train.memory.loss`, so that is the module to patch.
"""

from __future__ import annotations

from whisper_train.memory import quantize
from whisper_train.memory.checkpointing import (
    CHECKPOINT_POLICIES,
    MODES,
    LoraSettings,
    activation_offload,
    checkpointed_layers,
    checkpointing_policy,
    checkpointing_state,
    checkpointing_units,
    effective_use_reentrant,
    parse_every_n,
    prepare_model,
    resolve_checkpointing,
    trainable_parameter_summary,
)
from whisper_train.memory.host import release_training_state, return_freed_memory
from whisper_train.memory.loss import BasePreservation, LossTerms, loss_terms, training_loss
from whisper_train.memory.optim import OPTIMIZERS, build_optimizer
from whisper_train.memory.plan import (
    MemoryEstimate,
    Plan,
    estimate_memory,
    model_flops_per_sample,
    plan_checkpointing,
    prepare_model_within_budget,
)
from whisper_train.memory.precision import Precision, resolve_precision
from whisper_train.memory.sharding import full_state_dict, gathered, is_sharded, shard_model
from whisper_train.memory.wrappers import unwrapped, whisper_of, whisper_or_none

__all__ = [
    "CHECKPOINT_POLICIES",
    "BasePreservation",
    "MODES",
    "OPTIMIZERS",
    "LoraSettings",
    "LossTerms",
    "MemoryEstimate",
    "Plan",
    "Precision",
    "activation_offload",
    "build_optimizer",
    "checkpointed_layers",
    "checkpointing_policy",
    "checkpointing_state",
    "checkpointing_units",
    "effective_use_reentrant",
    "estimate_memory",
    "full_state_dict",
    "gathered",
    "is_sharded",
    "loss_terms",
    "model_flops_per_sample",
    "parse_every_n",
    "plan_checkpointing",
    "prepare_model",
    "prepare_model_within_budget",
    "quantize",
    "release_training_state",
    "resolve_checkpointing",
    "resolve_precision",
    "return_freed_memory",
    "shard_model",
    "trainable_parameter_summary",
    "training_loss",
    "unwrapped",
    "whisper_of",
    "whisper_or_none",
]
