"""The peak-memory estimate of one training step, counted from the model's shapes, by term:

    weights      every parameter, float32 (the precision policy keeps master weights fp32);
                 with --quantize-base, the base's linear layers as bitsandbytes stores them
                 (int8: a byte a weight and a scale a row; nf4: half a byte a weight, the
                 double-quantized absmax of each block of 64) plus, in the working set, the
                 largest one's weights dequantized for its matmul
    gradients    one float32 gradient per trainable parameter
    optimiser    AdamW: two float32 moments per trainable parameter (2x the trainable
                 weights); bitsandbytes AdamW8bit: two uint8 moments (~0.5x)
    activations  tensors autograd saves for backward, counted layer by layer below, plus a
                 working set (the gradient of the logits, one checkpointed layer recomputed,
                 the inputs of the one micro-batch on the device: the step loop moves each
                 micro-batch there as it runs it, so accumulation adds nothing)

Activations are counted the way autograd keeps them (one unique storage each, parameters
excluded), for Whisper's layers as transformers implements them with sdpa attention:

    encoder layer (n = 1500 positions, d = width, f = ffn width, h = heads), in elements:
        residual input + residual after attention        2nd
        LayerNorm mean and rstd (two norms)              4n
        q, k, v, attention output, log-sum-exp           4nd + hn
        inputs of linears whose weights train            nd (q/k/v share one), nd (out_proj),
                                                         nd (fc1), nf (fc2)
        fc1 output (the GELU's input)                    nf
    decoder layer (T label tokens): the same with T, plus cross-attention, whose keys and
    values span the encoder's 1500 positions (2 x 1500 x d per layer, whatever T is).
    A LoRA adapter saves its dropout's output, the dropout mask and A's output
    instead of the frozen linear's input.

A checkpointed layer (non-reentrant) keeps only its inputs; `every-N` checkpoints layers 0, N,
2N, ... of each stack; `encoder` only the encoder's. Which layers a policy checkpoints comes from
`checkpointing.checkpointed_layers`, the function `prepare_model` sets the flags with, so the
count describes the model training will run. probe.py measures the same quantity on the real
model; plan.py chooses a policy with both.

`model_flops_per_sample` counts the other cost of a step from the same shapes: its FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from whisper_train.audio import ENCODER_POSITIONS, N_FRAMES
from whisper_train.data.labels import MAX_DECODER_TOKENS
from whisper_train.errors import UserError
from whisper_train.memory.checkpointing import checkpointed_layers
from whisper_train.memory.loss import LOSS_CHUNK_TOKENS
from whisper_train.memory.quantize import base_linears, quantized_as, quantized_bytes
from whisper_train.memory.wrappers import whisper_of

_HALF_PRECISIONS = ("bf16", "fp16")


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak device memory of one training step, in bytes, by term."""

    weights: int
    gradients: int
    optimizer: int
    activations: int  # saved for backward, summed over the batch
    # transient at the peak: logits gradient, one recomputed layer, autocast copies, the running
    # micro-batch's inputs
    working: int
    offloaded: int = 0  # activations kept in host memory instead (not part of `total`)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.working


# -- counting saved activations ---------------------------------------------------------------


def estimate_memory(
    model: nn.Module,
    *,
    policy: str = "off",
    batch_size: int = 1,
    label_tokens: int = MAX_DECODER_TOKENS,
    precision: str = "fp32",
    optimizer: str = "adamw",
    offload: bool = False,
    activation_scale: float = 1.0,
    encoder_rows: int | None = None,
    quantize_base: str | None = None,
) -> MemoryEstimate:
    """Peak training memory of `model` as prepared (frozen parts, LoRA) under `policy`.

    `model` is a `WhisperForConditionalGeneration` or a peft model around one, already through
    `memory.prepare_model` for its mode (the checkpointing flags on it are ignored: `policy`
    decides). It may live on the meta device: only shapes and `requires_grad` are read.
    `label_tokens` is the longest decoder input in a batch (labels are padded per batch).
    `activation_scale` is the probe's correction (measured / counted), 1.0 without a probe.
    `encoder_rows` is the encoder's batch where it is not `batch_size`: a packed per-clip
    micro-batch of W windows encodes 2W where a silence window goes beside each in its batch
    (`clip_attention.encoder_rows_per_window`). `quantize_base` is how the base's linear
    layers are held (none, int8, nf4); None: as `model` holds them (`quantize.quantized_as`),
    which a model on the meta device cannot be quantized to, so the planner of a large model
    names it.
    """
    half = precision in _HALF_PRECISIONS
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    held = quantize_base or quantized_as(whisper_of(model))
    quantized = {id(linear.weight): linear for linear in base_linears(whisper_of(model))}
    if held == "none":
        quantized = {}
    weights = sum(
        quantized_bytes(quantized[id(p)].in_features, quantized[id(p)].out_features, held)
        if id(p) in quantized
        else p.numel() * p.element_size()
        for p in params
    )
    gradients = 4 * trainable
    optimizer_bytes = {"adamw": 8, "adamw-fused": 8, "adamw8bit": 2}.get(optimizer)
    if optimizer_bytes is None:
        raise UserError(f"--optim {optimizer}: expected one of adamw, adamw-fused, adamw8bit")
    per_sample = count_saved_bytes(model, policy=policy, label_tokens=label_tokens, half=half)
    encoder_rows = batch_size if encoder_rows is None else encoder_rows
    decoder_side = per_sample["device"] - per_sample["encoder"]
    kept = (decoder_side * batch_size + per_sample["encoder"] * encoder_rows) * activation_scale
    offloaded = 0
    if offload:  # checkpoint inputs go to host memory; the rest stays on the device
        offloaded = int(per_sample["checkpoint_inputs"] * batch_size * activation_scale)
        kept -= offloaded
    # Autocast keeps a half-precision copy of each trained weight it casts for the whole
    # forward (its cast cache holds leaves that require grad). A frozen weight (LoRA's base) is
    # cast at each use and the copy freed, unless backward keeps it, which it does in a layer
    # that is not recomputed: not counted under full checkpointing, counted in full otherwise
    # (a partial policy's recomputed layers free theirs: an overestimate, the safe side).
    # Measured on an H200: large-v3 LoRA r=64 under full checkpointing peaks at 7.03 GiB, which
    # counting every frozen copy overestimated by 40% (BENCHMARKS.md).
    autocast_copies = 0
    if half:
        # A quantized weight is not autocast: bitsandbytes dequantizes it for each matmul.
        cast = [
            p
            for p in params
            if p.ndim >= 2 and (p.requires_grad or policy != "full") and id(p) not in quantized
        ]
        autocast_copies = 2 * sum(p.numel() for p in cast)
    # One layer's weights dequantized at a time (forward, and backward's input gradient).
    dequantized = max(
        (linear.in_features * linear.out_features for linear in quantized.values()), default=0
    ) * (2 if half else 4)
    working = (per_sample["working"] * batch_size) + autocast_copies + dequantized
    return MemoryEstimate(
        weights=weights,
        gradients=gradients,
        optimizer=optimizer_bytes * trainable,
        activations=int(kept),
        working=int(working),
        offloaded=offloaded,
    )


def count_saved_bytes(
    model: nn.Module, *, policy: str, label_tokens: int, half: bool = False
) -> dict[str, int]:
    """Bytes saved for backward for ONE sample, counted from the model's shapes.

    Returns {"device": all saved bytes, "encoder": the encoder's part of them, "checkpoint_inputs":
    the part that checkpointed layers keep (their inputs), "working": transient bytes at the
    peak}.
    """
    whisper = whisper_of(model)
    config = whisper.config
    d, vocab = config.d_model, config.vocab_size
    n_enc = config.max_source_positions  # encoder positions (1500 for real models)
    n_frames = 2 * n_enc  # log-mel frames (3000)
    n_dec = label_tokens
    # Element sizes: the residual stream, LayerNorm statistics and the log-softmax stay float32
    # under autocast; what feeds a linear layer, attention and GELU is the half-precision copy.
    full_bytes, compute_bytes = 4, (2 if half else 4)
    checkpointed = checkpointed_layers(whisper, policy)

    encoder = whisper.model.encoder
    stem_trains = any(
        p.requires_grad for m in (encoder.conv1, encoder.conv2) for p in m.parameters()
    )
    saved = 0
    checkpoint_inputs = 0
    largest_layer = 0
    # peft's "input require grads" hook (registered when checkpointing is on before LoRA wraps
    # the model) makes conv1's output require grad, so the stem's GELUs save their inputs.
    stem_grad = stem_trains or bool(encoder.conv1._forward_hooks)
    grad_path = stem_grad
    if stem_trains:  # the input features, for the conv1 weight's gradient
        saved += compute_bytes * config.num_mel_bins * n_frames
    if stem_grad:  # conv1 output, GELU output, conv2 output
        saved += compute_bytes * (2 * d * n_frames + d * n_enc)
    for index, layer in enumerate(encoder.layers):
        grad_path = grad_path or _trains(layer)
        if not grad_path:
            continue  # frozen and nothing below trains: no backward pass through this layer
        inside = _layer_bytes(layer, n_enc, None, full_bytes, compute_bytes)
        largest_layer = max(largest_layer, inside)
        if ("encoder", index) in checkpointed:
            saved += full_bytes * n_enc * d
            checkpoint_inputs += full_bytes * n_enc * d
        else:
            saved += inside
    encoder_output = full_bytes * n_enc * d
    if grad_path:  # the final LayerNorm: its input (the last residual) and statistics
        saved += full_bytes * (n_enc * d + 2 * n_enc)
    encoder_saved = saved  # per encoder sequence (a packed per-clip window may run two)
    # The encoder output is kept whenever the decoder's cross-attention trains or is checkpointed.
    decoder = whisper.model.decoder
    keeps_encoder_output = False
    for index, layer in enumerate(decoder.layers):
        inside = _layer_bytes(layer, n_dec, n_enc, full_bytes, compute_bytes)
        largest_layer = max(largest_layer, inside)
        if ("decoder", index) in checkpointed:
            saved += full_bytes * n_dec * d
            checkpoint_inputs += full_bytes * n_dec * d
            keeps_encoder_output = True
        else:
            saved += inside
            keeps_encoder_output = keeps_encoder_output or _saves_cross_input(layer)
    if keeps_encoder_output:
        saved += encoder_output
    # The loss (memory.training_loss): the final LayerNorm's input and statistics, and the
    # label positions picked out of its output.
    saved += full_bytes * (n_dec * d + 2 * n_dec)
    logits = 4 * min(n_dec, LOSS_CHUNK_TOKENS) * vocab  # one chunk's
    if checkpointed:  # chunks keep their inputs; their logits are recomputed in backward
        saved += full_bytes * n_dec * d
        working = logits + largest_layer  # plus one checkpointed layer recomputed
    else:  # the output head's input if it trains, and every chunk's log-softmax
        if any(p.requires_grad for p in whisper.proj_out.parameters()):
            saved += compute_bytes * n_dec * d
        saved += 4 * n_dec * vocab
        working = logits
    # The running micro-batch's inputs (the only one on the device: see the module's doc):
    # int64 decoder input ids and labels, and the float32 log-mel features, unless the stem
    # trains in float32 and so saved that very tensor (counted above).
    working += 2 * 8 * n_dec
    if not (stem_trains and not half):
        working += 4 * config.num_mel_bins * n_frames
    return {
        "device": saved,
        "encoder": encoder_saved,
        "checkpoint_inputs": checkpoint_inputs,
        "working": working,
    }


def _layer_bytes(layer: nn.Module, n: int, n_cross: int | None, full: int, compute: int) -> int:
    """Bytes one encoder (n_cross None) or decoder layer saves for backward, per sample."""
    attention = layer.self_attn
    d = _linear(attention.q_proj).in_features
    ffn = _linear(layer.fc1).out_features
    heads = attention.num_heads
    residuals = 2 if n_cross is None else 3
    total = full * (residuals * n * d + 2 * residuals * n)  # LayerNorm inputs and mean/rstd
    implementation = getattr(getattr(attention, "config", None), "_attn_implementation", "sdpa")
    eager = implementation == "eager"
    total += _attention_bytes(attention, n, None, heads, d, compute, eager)
    if n_cross is not None:
        total += _attention_bytes(layer.encoder_attn, n, n_cross, heads, d, compute, eager)
    total += compute * n * ffn  # fc1 output, the GELU's input
    total += _linear_input_bytes(layer.fc1, n * d, compute)
    total += _linear_input_bytes(layer.fc2, n * ffn, compute)
    return total


def _attention_bytes(
    attention: nn.Module, n_q: int, n_cross: int | None, heads: int, d: int, size: int, eager: bool
) -> int:
    """sdpa saves q, k, v, its output and log-sum-exp; plus the inputs of linears that train.

    Eager attention keeps the softmax output instead: quadratic in positions (1500^2 x heads
    per encoder layer), which is why whisper-train defaults to sdpa.

    Self-attention (n_cross None): q, k and v read one tensor. Cross-attention: k and v read the
    encoder output (n_cross positions), which is counted once for the whole decoder.
    """
    n_kv = n_q if n_cross is None else n_cross
    if eager:  # q, k, v and the softmax output (heads x n_q x n_kv), not sdpa's output and LSE
        total = size * (n_q * d + 2 * n_kv * d + heads * n_q * n_kv)
    else:
        total = size * (2 * n_q * d + 2 * n_kv * d) + 4 * heads * n_q
    if n_cross is None:
        total += _shared_input_bytes(
            (attention.q_proj, attention.k_proj, attention.v_proj), n_q * d, size
        )
    else:
        total += _linear_input_bytes(attention.q_proj, n_q * d, size)
        total += _adapter_bytes(attention.k_proj, n_kv * d, size)
        total += _adapter_bytes(attention.v_proj, n_kv * d, size)
    total += _linear_input_bytes(attention.out_proj, n_q * d, size)
    return total


def _saves_cross_input(layer: nn.Module) -> bool:
    """Does the layer's cross-attention keep the encoder output (its k/v projections' input)?"""
    attention = layer.encoder_attn
    return any(_input_needed(proj) for proj in (attention.k_proj, attention.v_proj))


def _shared_input_bytes(linears: tuple[nn.Module, ...], elements: int, size: int) -> int:
    """Several linears reading one tensor: it is stored once, adapters' copies each."""
    shared = any(_input_needed(linear) for linear in linears)
    return size * elements * shared + sum(_adapter_bytes(one, elements, size) for one in linears)


def _linear_input_bytes(linear: nn.Module, elements: int, size: int) -> int:
    return size * elements * _input_needed(linear) + _adapter_bytes(linear, elements, size)


def _input_needed(linear: nn.Module) -> bool:
    """The linear's own input is saved when its weight trains, or by a LoRA without dropout."""
    base = _linear(linear)
    if base.weight.requires_grad:
        return True
    return _lora_parts(linear) is not None and not _lora_parts(linear)[1]


def _adapter_bytes(linear: nn.Module, elements: int, size: int) -> int:
    """A LoRA adapter with dropout saves the dropout output, its mask and A's output."""
    parts = _lora_parts(linear)
    if parts is None:
        return 0
    rank, has_dropout = parts
    rows = elements // _linear(linear).in_features
    extra = size * rows * rank
    if has_dropout:
        # Dropout output, and its mask: float on a CPU (1 byte on CUDA; counted as float).
        extra += 2 * size * elements
    if _dora(linear):
        # DoRA scales the base output and the adapter's by magnitude / norm: both outputs are
        # kept for the magnitude's gradient (measured on the tiny model: 2.03 outputs a layer).
        extra += 2 * size * rows * _linear(linear).out_features
    return extra


def _dora(linear: nn.Module) -> bool:
    """Whether the linear's adapter is DoRA's (peft's use_dora)."""
    return any(getattr(linear, "use_dora", {}).values())


def _lora_parts(linear: nn.Module) -> tuple[int, bool] | None:
    """(rank, has dropout) of an active peft LoRA adapter on this linear, else None."""
    lora_a = getattr(linear, "lora_A", None)
    if not lora_a:
        return None
    name = next(iter(lora_a.keys()))
    dropout = linear.lora_dropout[name]
    return lora_a[name].out_features, not isinstance(dropout, nn.Identity)


def _linear(module: nn.Module) -> nn.Linear:
    return getattr(module, "base_layer", module)


def _trains(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


# -- counting FLOPs ---------------------------------------------------------------------------


def model_flops_per_sample(config, label_tokens: int) -> float:
    """Forward FLOPs of one sample (2 per multiply-add), derived in docs/compute.md.

    Training counts 3x this (forward + backward); recompute under checkpointing is not counted.
    """
    s, t, d = ENCODER_POSITIONS, label_tokens, config.d_model
    encoder = config.encoder_layers * (24 * s * d**2 + 4 * s**2 * d)
    convolutions = 2 * N_FRAMES * 3 * config.num_mel_bins * d + 2 * s * 3 * d**2
    decoder = config.decoder_layers * (28 * t * d**2 + 4 * s * d**2 + 4 * t**2 * d + 4 * t * s * d)
    head = 2 * t * d * config.vocab_size
    return float(encoder + convolutions + decoder + head)
